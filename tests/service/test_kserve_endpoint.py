"""KServe v2 inference over HTTP is one endpoint (service/http/routes/kserve.py), answered
before FastAPI's routing: every request to either infer route takes it, and gets the answer,
error body, token check, limit and request metrics of a route."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
import torch

from moe_serve.service.codecs.kserve import HEADER_LENGTH
from moe_serve.service.http.routes import kserve as kserve_route
from tests.service.layers import NO_ROUTER, TINY, H, reference_forward

TOKEN = "endpoint-token-0123456789abcdef0"


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Paths of the requests the endpoint took (it reads their bodies)."""
    seen: list[str] = []
    real = kserve_route.read_body

    async def spy(request, runtime):
        seen.append(request.url.path)
        return await real(request, runtime)

    monkeypatch.setattr(kserve_route, "read_body", spy)
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
    "timeout of 10^400": (f"/v2/models/{TINY}/infer", *_json(1, parameters={"timeout": 10**400})),
    "priority of 2^64": (f"/v2/models/{TINY}/infer", *_json(1, parameters={"priority": 2**64})),
    "largest schedule values": (
        f"/v2/models/{TINY}/infer",
        *_json(1, parameters={"priority": 2**64 - 1, "timeout": 2**64 - 1}),
    ),
    "unknown region": (f"/v2/models/{TINY}/infer", *_shm("nowhere")),
    "gzip that is not": (f"/v2/models/{TINY}/infer", b"{}", {"Content-Encoding": "gzip"}),
    "query string": (f"/v2/models/{TINY}/infer?x=1", *_json(1)),
    "trailing slash": (f"/v2/models/{TINY}/infer/", *_json(1)),
}


# case -> status, content type (None: no body), and what the body says (an error's words, or the
# rows whose output it holds)
EXPECTED = {
    "binary": (200, "application/octet-stream", 3),
    "binary in, json out": (200, "application/json", 2),
    "json": (200, "application/json", 2),
    "version 1": (200, "application/json", 1),
    "version 2": (404, "application/json", "model 'tiny' has version 1 only, not '2'"),
    "unknown model": (404, "application/json", "no layer named 'nope'"),
    "no router": (400, "application/json", "has no stored router: send router_logits"),
    "wrong width": (400, "application/json", "hidden_states has 65 columns"),
    "bad header length": (400, "application/json", f"{HEADER_LENGTH} must be a byte count"),
    "not json": (400, "application/json", "inference request: body: Invalid JSON"),
    "bad priority": (400, "application/json", "parameters.priority must be an integer >= 0"),
    "timeout of 10^400": (
        400,
        "application/json",
        "parameters.timeout is out of range: an integer from 0 to 2^64 - 1",
    ),
    "priority of 2^64": (
        400,
        "application/json",
        "parameters.priority is out of range: an integer from 0 to 2^64 - 1",
    ),
    "largest schedule values": (200, "application/json", 1),
    "unknown region": (400, "application/json", "no shared-memory region named 'nowhere'"),
    "gzip that is not": (400, "application/json", "body is not valid gzip data"),
    "query string": (200, "application/json", 1),
    "trailing slash": (307, None, None),  # FastAPI redirects it to the route
}


def _output(r, rows: int) -> torch.Tensor:
    """The reply's output tensor, [rows, H] float32, from a binary or a JSON reply."""
    if r.headers["content-type"] == "application/octet-stream":
        length = int(r.headers[HEADER_LENGTH])
        return torch.frombuffer(bytearray(r.content[length:]), dtype=torch.float32).view(rows, H)
    (output,) = r.json()["outputs"]
    return torch.tensor(output["data"], dtype=torch.float32).view(rows, H)


@pytest.mark.parametrize("case", list(CASES))
def test_each_request_is_answered_as_its_route(make_client, taken, case) -> None:
    client = make_client(allow_shared_memory=True)
    path, body, headers = CASES[case]
    r = client.post(path, content=body, headers=headers, follow_redirects=False)
    status, media, says = EXPECTED[case]
    assert r.status_code == status, r.text
    assert r.headers.get("content-type") == media
    if status == 200:
        x = torch.from_numpy(np.random.default_rng(says).standard_normal((says, H)))
        layer = NO_ROUTER if NO_ROUTER in path else TINY
        expected = reference_forward(layer, x.float())
        torch.testing.assert_close(_output(r, says), expected, rtol=1e-4, atol=1e-5)
    elif status == 307:
        assert r.headers["location"].endswith(path.rstrip("/"))
    else:
        assert says in r.json()["error"]
    assert taken == ([] if path.endswith("/") else [path.split("?")[0]])  # not the redirect


def test_a_system_shared_memory_request_writes_the_layers_output(make_client) -> None:
    client = make_client(allow_shared_memory=True)
    rows, size = 2, 2 * H * 4
    x = np.random.default_rng(5).standard_normal((rows, H)).astype(np.float32)
    key = f"/moe-serve-endpoint-{os.getpid()}"
    with open(f"/dev/shm{key}", "wb+") as f:
        f.write(x.tobytes() + bytes(size))
    try:
        register = {"key": key, "offset": 0, "byte_size": 2 * size}
        r = client.post("/v2/systemsharedmemory/region/io/register", json=register)
        assert r.status_code == 200, r.text
        body, _ = _shm("io")
        assert client.post(f"/v2/models/{TINY}/infer", content=body).status_code == 200
        with open(f"/dev/shm{key}", "rb") as f:
            output = f.read()[size:]
    finally:
        os.unlink(f"/dev/shm{key}")
    written = torch.frombuffer(bytearray(output), dtype=torch.float32).view(rows, H)
    torch.testing.assert_close(written, reference_forward(TINY, torch.from_numpy(x)))


def test_metrics_token_and_413_are_the_routes(make_client) -> None:
    client = make_client(api_token=TOKEN, max_body_bytes=1024)
    path = f"/v2/models/{TINY}/infer"
    body, headers = _binary(8)  # 2 kB
    assert client.post(path, content=body, headers=headers).status_code == 401
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = client.post(path, content=body, headers=headers | auth)
    assert r.status_code == 413 and "1024-byte limit" in r.json()["error"]  # passes 1024 bytes
    small, small_headers = _binary(0)  # no rows: a 400 from the checks
    r = client.post(path, content=small, headers=small_headers | auth)
    assert r.status_code == 400 and "X-Request-ID" in r.headers
    metrics = client.get("/metrics").text
    assert 'moe_serve_requests_total{route="/v2/models/{name}/infer",status="413"} 1.0' in metrics
    assert 'moe_serve_requests_total{route="/v2/models/{name}/infer",status="400"} 1.0' in metrics


def test_a_json_output_over_the_json_limit_is_413_before_the_forward(
    make_client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A binary input of 2 rows asks for 2 x 64 numbers of JSON, about 2 kB: over a 1 kB limit.
    The message says how to ask for binary output; with it, the same request is served."""
    client = make_client(max_json_bytes=1024)
    ran = []
    infer = kserve_route.inference.infer
    monkeypatch.setattr(
        kserve_route.inference, "infer", lambda *a, **k: ran.append(1) or infer(*a, **k)
    )
    body, headers = _binary(2, binary_output=False)
    r = client.post(f"/v2/models/{TINY}/infer", content=body, headers=headers)
    assert r.status_code == 413
    assert "1024-byte limit of JSON (MOE_SERVE_MAX_JSON_BYTES)" in r.json()["error"]
    assert '"binary_data_output": true' in r.json()["error"]
    assert ran == []
    body, headers = _binary(2, binary_output=True)
    assert client.post(f"/v2/models/{TINY}/infer", content=body, headers=headers).status_code == 200
    assert ran == [1]


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize(
    ("rows", "binary_output", "expected"),
    [
        (2, False, {"decode": True, "encode": True}),  # small: on the loop
        (1024, False, {"decode": True, "encode": False}),  # about 1 MiB of JSON out
        (5000, True, {"decode": False, "encode": False}),  # 1.3 MB in and out
    ],
)
def test_large_bodies_and_replies_are_decoded_and_encoded_off_the_event_loop(
    make_client, monkeypatch: pytest.MonkeyPatch, rows, binary_output, expected
) -> None:
    on_loop = {}

    def spy(stage: str, real):
        def call(*args):
            on_loop[stage] = _on_loop()
            return real(*args)

        return call

    for name, stage in (("decode_request", "decode"), ("encode_response", "encode")):
        monkeypatch.setattr(kserve_route, name, spy(stage, getattr(kserve_route, name)))
    client = make_client()
    body, headers = _binary(rows, binary_output=binary_output)
    r = client.post(f"/v2/models/{TINY}/infer", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert on_loop == expected
