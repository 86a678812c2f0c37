"""read_body against the ASGI messages it takes itself."""

from __future__ import annotations

import asyncio
import gzip
from types import SimpleNamespace

import pytest
from starlette.requests import Request

from moe_serve.service.errors import ClientDisconnected, PayloadTooLarge
from moe_serve.service.http.body import read_body
from moe_serve.service.settings import Settings

RUNTIME = SimpleNamespace(settings=Settings(device="cpu", max_body_bytes=1024))


def _request(headers: list[tuple[bytes, bytes]], messages: list[dict]) -> Request:
    queued = list(messages)

    async def receive() -> dict:
        return queued.pop(0)

    return Request({"type": "http", "method": "POST", "headers": headers}, receive)


def _chunk(body: bytes, more: bool) -> dict:
    return {"type": "http.request", "body": body, "more_body": more}


def test_a_body_in_several_messages_is_joined_and_its_encoding_undone() -> None:
    packed = gzip.compress(b"hello, body")
    # the first of two Content-Encoding headers counts, as in starlette's Headers
    headers = [(b"content-encoding", b"GZIP "), (b"content-encoding", b"br")]
    messages = [_chunk(packed[:5], True), _chunk(b"", True), _chunk(packed[5:], False)]
    assert asyncio.run(read_body(_request(headers, messages), RUNTIME)) == b"hello, body"
    assert asyncio.run(read_body(_request([], [{"type": "http.request"}]), RUNTIME)) == b""


def test_a_client_gone_mid_body_is_499_and_a_body_past_the_limit_413() -> None:
    cut = _request([], [_chunk(b"x" * 10, True), {"type": "http.disconnect"}])
    with pytest.raises(ClientDisconnected, match="after 10 bytes"):
        asyncio.run(read_body(cut, RUNTIME))
    over = _request([], [_chunk(b"x" * 1000, True), _chunk(b"x" * 100, False)])
    with pytest.raises(PayloadTooLarge, match="exceeds the 1024-byte limit"):
        asyncio.run(read_body(over, RUNTIME))
    declared = _request([(b"content-length", b"2048")], [])
    with pytest.raises(PayloadTooLarge, match="of 2048 bytes exceeds"):
        asyncio.run(read_body(declared, RUNTIME))
