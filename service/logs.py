"""Logging set-up: one line per record, text or JSON, each carrying the request id; and Triton's
log settings over it (`log_settings`, `update_log_settings`), which change the level and the
format while the server runs."""

from __future__ import annotations

import contextvars
import json
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from .errors import BadInput

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


def _formatter(fmt: str) -> logging.Formatter:
    return JsonFormatter() if fmt == "json" else logging.Formatter(_TEXT)


_format = {"current": "text"}  # the format of the handler `configure` installed


def configure(level: str, fmt: str) -> None:
    """Route every logger (ours and uvicorn's) through one handler on stderr."""
    handler = logging.StreamHandler()
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(_formatter(fmt))
    _format["current"] = fmt
    root = logging.getLogger()
    root.handlers = [handler]
    root.setLevel(level.upper())
    # Neither format names the record's caller, thread or process: records skip looking them
    # up (the logging HOWTO's optimizations), a good part of the cost of the line each
    # request logs, on the event loop
    logging._srcfile = None
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    for name in ("uvicorn", "uvicorn.error"):
        logging.getLogger(name).handlers = []
        logging.getLogger(name).propagate = True
    # Our middleware logs each request with its id and duration; uvicorn's access line would
    # repeat it without either.
    logging.getLogger("uvicorn.access").disabled = True


# Triton's log settings: each level's switch, lowest first (a logging level is a threshold, so a
# level on turns every level above it on)
_SWITCHES = {
    "log_verbose_level": logging.DEBUG,
    "log_info": logging.INFO,
    "log_warning": logging.WARNING,
    "log_error": logging.ERROR,
}
FORMATS = ("text", "json")


def log_settings() -> dict[str, Any]:
    """Triton's log settings, read from the root logger: log_verbose_level 1 is debug."""
    level = logging.getLogger().getEffectiveLevel()
    settings: dict[str, Any] = {"log_file": ""}
    for key, switch in _SWITCHES.items():
        settings[key] = int(level <= switch) if key == "log_verbose_level" else level <= switch
    return settings | {"log_format": _format["current"]}


def update_log_settings(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Apply Triton's log settings `changes`; the settings after. Levels are a threshold here:
    switching a level on switches on those above it, switching one off those below it (a
    request that does both at odds is refused). log_file stays "" (stderr); log_format is
    `text` or `json`."""
    unknown = sorted(set(changes) - {*_SWITCHES, "log_file", "log_format"})
    if unknown:
        known = ", ".join([*_SWITCHES, "log_file", "log_format"])
        raise BadInput(f"unknown log settings {unknown}; the settings are {known}")
    if changes.get("log_file") not in (None, ""):
        raise BadInput("log_file can only be '': the server logs to stderr")
    fmt = changes.get("log_format")
    if fmt is not None and fmt not in FORMATS:
        raise BadInput(f"log_format {fmt!r}: expected one of {', '.join(FORMATS)}")
    current = log_settings()
    keys = list(_SWITCHES)  # lowest level first
    given: dict[int, bool] = {}
    for key in keys:
        value = changes.get(key)
        if value is None:
            continue
        if isinstance(value, bool) == (key == "log_verbose_level") or not isinstance(value, int):
            kind = "an integer >= 0" if key == "log_verbose_level" else "true or false"
            raise BadInput(f"{key} must be {kind}, got {value!r}")
        given[keys.index(key)] = bool(value)
    # a level switched off takes those below it along; one switched on, those above it
    highest_off = max((i for i, on in given.items() if not on), default=-1)
    lowest_on = min((i for i, on in given.items() if on), default=len(keys))
    if lowest_on < highest_off:
        raise BadInput(
            f"log levels are a threshold here: {keys[lowest_on]} on shows "
            f"{keys[highest_off]}'s level too"
        )
    on = [i for i in range(highest_off + 1, len(keys)) if i >= lowest_on or current[keys[i]]]
    logging.getLogger().setLevel(_SWITCHES[keys[on[0]]] if on else logging.CRITICAL + 1)
    if fmt is not None:
        _format["current"] = fmt
        for handler in logging.getLogger().handlers:
            if any(isinstance(f, _RequestIdFilter) for f in handler.filters):  # ours
                handler.setFormatter(_formatter(fmt))
    return log_settings()
