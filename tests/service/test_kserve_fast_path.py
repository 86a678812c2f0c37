"""KServe v2 inference without FastAPI's routing (service/http/kserve_fast_path.py) answers every
request as the routes do: the same requests through an app without the fast path get the same
status, headers and body."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator

import numpy as np
import pytest
from fastapi.testclient import TestClient

from moe_serve.service.codecs.kserve import HEADER_LENGTH
from moe_serve.service.http import kserve_fast_path
from moe_serve.service.http.app import create_app
from moe_serve.service.http.kserve_fast_path import KServeInferFastPath
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, H, tiny_loader

TOKEN = "fast-path-token-0123456789abcdef"


def _app(fast: bool, **settings: object):
    app = create_app(Settings(device="cpu", **settings), tiny_loader)
    if not fast:  # the middleware stack is built at the first request: before, it can go
        app.user_middleware = [m for m in app.user_middleware if m.cls is not KServeInferFastPath]
    return app


@pytest.fixture
def pair() -> Iterator[Callable[..., tuple[TestClient, TestClient]]]:
    """pair(**settings) -> (client of the app with the fast path, client of one without)."""
    opened: list[TestClient] = []

    def make(**settings: object) -> tuple[TestClient, TestClient]:
        clients = tuple(TestClient(_app(fast, **settings)) for fast in (True, False))
        for client in clients:
            client.__enter__()
            opened.append(client)
            wait_ready(client.get)
        return clients

    yield make
    for client in opened:
        client.__exit__(None, None, None)


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of the requests the fast path took (the routes read the body through Depends)."""
    seen: list[str] = []
    real = kserve_fast_path.get_body

    async def spy(request, runtime):
        seen.append(request.url.path)
        return await real(request, runtime)

    monkeypatch.setattr(kserve_fast_path, "get_body", spy)
    return seen


def _binary(rows: int, width: int = H, *, binary_output: bool = True) -> tuple[bytes, dict]:
    x = np.random.default_rng(rows).standard_normal((rows, width)).astype(np.float32)
    entry = {"name": "hidden_states", "shape": [rows, width], "datatype": "FP32",
             "parameters": {"binary_data_size": x.nbytes}}  # fmt: skip
    header = json.dumps(
        {"id": "r1", "inputs": [entry],
         "outputs": [{"name": "output", "parameters": {"binary_data": binary_output}}]}
    ).encode()  # fmt: skip
    return header + x.tobytes(), {HEADER_LENGTH: str(len(header))}


def _json(rows: int, **extra: object) -> tuple[bytes, dict]:
    x = np.random.default_rng(rows).standard_normal((rows, H)).astype(np.float32)
    entry = {"name": "hidden_states", "shape": [rows, H], "datatype": "FP32",
             "data": x.flatten().tolist()}  # fmt: skip
    return json.dumps({"inputs": [entry], **extra}).encode(), {"Content-Type": "application/json"}


def _shm(region: str, rows: int = 2) -> tuple[bytes, dict]:
    size = rows * H * 4
    place = {"shared_memory_region": region, "shared_memory_byte_size": size}
    body = {
        "inputs": [{"name": "hidden_states", "shape": [rows, H], "datatype": "FP32",
                    "parameters": place}],
        "outputs": [{"name": "output", "parameters": place | {"shared_memory_offset": size}}],
    }  # fmt: skip
    return json.dumps(body).encode(), {}


CASES = {
    "binary": (f"/v2/models/{TINY}/infer", *_binary(3)),
    "binary in, json out": (f"/v2/models/{TINY}/infer", *_binary(2, binary_output=False)),
    "json": (f"/v2/models/{TINY}/infer", *_json(2)),
    "version 1": (f"/v2/models/{TINY}/versions/1/infer", *_json(1)),
    "version 2": (f"/v2/models/{TINY}/versions/2/infer", *_json(1)),
    "unknown model": ("/v2/models/nope/infer", *_json(1)),
    "no router": (f"/v2/models/{NO_ROUTER}/infer", *_json(1)),
    "wrong width": (f"/v2/models/{TINY}/infer", *_binary(2, H + 1)),
    "bad header length": (f"/v2/models/{TINY}/infer", b"{}", {HEADER_LENGTH: "x9"}),
    "not json": (f"/v2/models/{TINY}/infer", b"{nope", {}),
    "bad priority": (f"/v2/models/{TINY}/infer", *_json(1, parameters={"priority": -1})),
    "unknown region": (f"/v2/models/{TINY}/infer", *_shm("nowhere")),
    "gzip that is not": (f"/v2/models/{TINY}/infer", b"{}", {"Content-Encoding": "gzip"}),
    "query string": (f"/v2/models/{TINY}/infer?x=1", *_json(1)),
    "trailing slash": (f"/v2/models/{TINY}/infer/", *_json(1)),
}


def _same(fast, routed) -> None:
    assert fast.status_code == routed.status_code, (fast.text, routed.text)
    for header in ("content-type", HEADER_LENGTH.lower(), "retry-after", "location"):
        assert fast.headers.get(header) == routed.headers.get(header), header
    assert fast.content == routed.content


@pytest.mark.parametrize("case", list(CASES))
def test_each_request_is_answered_as_the_routes_answer_it(pair, taken, case) -> None:
    fast, routed = pair(allow_shared_memory=True)
    path, body, headers = CASES[case]
    kwargs = {"content": body, "headers": headers, "follow_redirects": False}
    _same(fast.post(path, **kwargs), routed.post(path, **kwargs))
    assert taken == ([] if path.endswith("/") else [path.split("?")[0]])  # not the redirect


def test_a_system_shared_memory_request_writes_the_routes_output(pair) -> None:
    fast, routed = pair(allow_shared_memory=True)
    rows, size = 2, 2 * H * 4
    x = np.random.default_rng(5).standard_normal((rows, H)).astype(np.float32)
    outputs = []
    for client in (fast, routed):
        key = f"/moe-serve-fast-path-{os.getpid()}-{len(outputs)}"
        with open(f"/dev/shm{key}", "wb+") as f:
            f.write(x.tobytes() + bytes(size))
        try:
            register = {"key": key, "offset": 0, "byte_size": 2 * size}
            r = client.post("/v2/systemsharedmemory/region/io/register", json=register)
            assert r.status_code == 200, r.text
            body, _ = _shm("io")
            assert client.post(f"/v2/models/{TINY}/infer", content=body).status_code == 200
            with open(f"/dev/shm{key}", "rb") as f:
                outputs.append(f.read()[size:])
        finally:
            os.unlink(f"/dev/shm{key}")
    assert outputs[0] == outputs[1] and any(outputs[0])


def test_metrics_token_and_413_are_the_routes(pair) -> None:
    fast, routed = pair(api_token=TOKEN, max_body_bytes=1024)
    path = f"/v2/models/{TINY}/infer"
    body, headers = _binary(8)  # 2 kB
    for client in (fast, routed):
        assert client.post(path, content=body, headers=headers).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    _same(
        fast.post(path, content=body, headers=headers | auth),
        routed.post(path, content=body, headers=headers | auth),
    )  # 413: the body passes 1024 bytes
    small, small_headers = _binary(0)  # no rows: a 400 from the checks
    for client in (fast, routed):
        r = client.post(path, content=small, headers=small_headers | auth)
        assert r.status_code == 400 and "X-Request-ID" in r.headers
        metrics = client.get("/metrics").text
        assert 'moe_serve_requests_total{route="/v2/models/{name}/infer",status="413"} 1.0' in (
            metrics
        )
        assert 'moe_serve_requests_total{route="/v2/models/{name}/infer",status="400"} 1.0' in (
            metrics
        )
