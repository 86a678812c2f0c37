"""A request's body as the app reads it: whole, within its size limit, in time, its
Content-Encoding undone; and a JSON body as a pydantic model."""

from __future__ import annotations

import asyncio
import zlib
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from ..codecs.body_limit import HEADER_LENGTH, body_limit, body_too_large
from ..core.runtime import Runtime
from ..errors import (
    BadInput,
    PayloadTooLarge,
    UnsupportedMediaType,
    body_cut,
    body_stalled,
    describe_validation_error,
)
from ..settings import Settings

Body = TypeVar("Body", bound=BaseModel)
# Content-Encoding -> zlib window bits (None: not compressed)
_ZLIB_WBITS = {"identity": None, "gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


# The request headers read_body needs, found in one pass over the request's raw headers (a
# lookup each in starlette's Headers scans and decodes them every time)
_FIELDS = (b"content-length", b"content-type", b"content-encoding", HEADER_LENGTH.lower().encode())


def _fields(request: Request) -> dict[bytes, str]:
    """The first value of each of _FIELDS the request has (names in ASGI are lowercase)."""
    found: dict[bytes, str] = {}
    for name, value in request.scope["headers"]:
        if name in _FIELDS and name not in found:
            found[name] = value.decode("latin-1")
    return found


def _body_limit(fields: dict[bytes, str], settings: Settings) -> tuple[int, str]:
    media = fields.get(b"content-type", "").split(";")[0].strip().lower()
    json_part = fields.get(_FIELDS[3])
    return body_limit(media, json_part, settings.max_json_bytes, settings.max_body_bytes)


async def read_body(request: Request, runtime: Runtime) -> bytes:
    """The request body (gzip/deflate undone), refused with 413 once it passes its limit.

    It takes the ASGI messages itself: starlette's `Request.stream` would add an async
    generator's steps per message to every request; no caller has read the body before."""
    fields = _fields(request)
    limit, what = _body_limit(fields, runtime.settings)
    declared = fields.get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(what, int(declared))
    chunks, size = [], 0
    timeout_s = runtime.settings.read_timeout_s
    receive = request.receive
    try:
        async with asyncio.timeout(timeout_s):  # a client that stalls mid-body holds nothing long
            more = True
            while more:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise body_cut(size)
                if message["type"] != "http.request":
                    continue
                more = message.get("more_body", False)
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limit:
                        raise body_too_large(what)
                    chunks.append(chunk)
    except TimeoutError:
        raise body_stalled(timeout_s, size) from None
    encoding = fields.get(b"content-encoding", "identity")
    return _decode(b"".join(chunks), encoding, limit, what)


def _decode(body: bytes, encoding: str, limit: int, what: str) -> bytes:
    """Undo Content-Encoding (tritonclient can gzip or deflate), never inflating past `limit`."""
    encoding = encoding.strip().lower()
    if encoding not in _ZLIB_WBITS:
        accepted = ", ".join(_ZLIB_WBITS)
        raise UnsupportedMediaType(f"content encoding {encoding!r} is not accepted: {accepted}")
    if encoding == "identity":
        return body
    inflate = zlib.decompressobj(_ZLIB_WBITS[encoding])
    try:
        plain = inflate.decompress(body, limit + 1)
    except zlib.error as err:
        raise BadInput(f"body is not valid {encoding} data: {err}") from None
    if len(plain) > limit:
        raise PayloadTooLarge(f"request body inflates past {what}")
    if not inflate.eof:  # zlib returns what it could of a cut stream without complaint
        raise BadInput(f"body is truncated {encoding} data: the compressed stream ends early")
    return plain


def parse_body(model: type[Body], body: bytes) -> Body:
    """A JSON body as `model` (tritonclient sends no Content-Type), or a 400 naming the field."""
    try:
        return model.model_validate_json(body or b"{}")
    except ValidationError as err:
        raise BadInput(f"request body: {describe_validation_error(err, 'body')}") from None
