"""Logging set-up: one line per record, text or JSON, each carrying the request id."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's id is echoed and logged

_TEXT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s"


def new_request_id(given: str) -> str:
    """The client's request id when it is safe to echo and log, else a fresh one."""
    if given and _REQUEST_ID.fullmatch(given):  # no log injection
        return given
    return os.urandom(16).hex()  # as random as uuid4().hex, in a quarter of its time


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, request_id, message (+ exception)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "logger": record.name,
            "request_id": getattr(record, "request_id", "-"),
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure(level: str, fmt: str) -> None:
    """Route every logger (ours and uvicorn's) through one handler on stderr."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT))
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
    # Our middleware logs each request with its id and duration; uvicorn's access line would
    # repeat it without either.
    logging.getLogger("uvicorn.access").disabled = True
