"""POST /v1/layers/{name}/forward is one endpoint (service/http/routes/forward.py), answered
before FastAPI's routing: every forward, with a query string or without, takes it and gets the
same reply; errors, limits, the token and readiness are the route's."""

from __future__ import annotations

import threading

import pytest
import safetensors.torch
import torch
from fastapi.testclient import TestClient

from moe_serve.service.http.app import create_app
from moe_serve.service.http.plain_forward import BINARY as BINARY_MEDIA
from moe_serve.service.http.plain_forward import JSON, plain_forward
from moe_serve.service.http.routes import forward as forward_route
from moe_serve.service.settings import Settings
from tests.service.layers import TINY, H, gated_loader
from tests.service.test_wire import HOSTILE_HEADERS

BINARY = {"Content-Type": "application/octet-stream"}
ROUTE = f"/v1/layers/{TINY}/forward"


def _blob(rows: int = 3, seed: int = 0) -> bytes:
    hidden = torch.randn(rows, H, generator=torch.Generator().manual_seed(seed))
    return safetensors.torch.save({"hidden_states": hidden})


def _layers_answered_by(monkeypatch: pytest.MonkeyPatch, handler: str) -> list[str]:
    """Layers of the forwards the endpoint answered through `handler` of the forward core."""
    seen: list[str] = []
    real = getattr(forward_route, handler)

    async def spy(call, *args, **kwargs):
        seen.append(call.served.name)
        return await real(call, *args, **kwargs)

    monkeypatch.setattr(forward_route, handler, spy)
    return seen


@pytest.fixture
def taken(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Layers of the binary forwards the endpoint answered."""
    return _layers_answered_by(monkeypatch, "serve_blob")


@pytest.fixture
def taken_json(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Layers of the JSON forwards the endpoint answered."""
    return _layers_answered_by(monkeypatch, "serve_json")


def test_a_binary_forward_with_or_without_a_query_takes_the_endpoint_and_gets_one_reply(
    client: TestClient, taken: list[str]
) -> None:
    plain = client.post(ROUTE, content=_blob(), headers=BINARY)
    queried = client.post(f"{ROUTE}?priority=0", content=_blob(), headers=BINARY)
    assert taken == [TINY, TINY]
    assert (plain.status_code, queried.status_code) == (200, 200)
    assert plain.headers["content-type"] == queried.headers["content-type"]
    assert plain.content == queried.content
    assert "X-Request-ID" in plain.headers  # RequestMiddleware wraps it
    counted = 'moe_serve_requests_total{route="/v1/layers/{name}/forward",status="200"} 2.0'
    assert counted in client.get("/metrics").text


@pytest.mark.parametrize(
    ("path", "headers", "body", "status", "error"),
    [
        (ROUTE, BINARY, b"not a blob", 400, "body is not a valid safetensors blob"),
        ("/v1/layers/nope/forward", BINARY, _blob(), 404, "nope"),
        (ROUTE, {"Content-Type": "text/plain"}, _blob(), 415, "text/plain"),
    ],
)
def test_errors_are_the_routes(client: TestClient, path, headers, body, status, error) -> None:
    r = client.post(path, content=body, headers=headers)
    assert r.status_code == status
    assert error in r.json()["error"]


@pytest.mark.parametrize("case", HOSTILE_HEADERS)
def test_hostile_blobs_are_a_json_400(client: TestClient, case: str) -> None:
    body, says = HOSTILE_HEADERS[case]
    r = client.post(ROUTE, content=body, headers=BINARY)
    assert r.status_code == 400
    assert says in r.json()["error"]


@pytest.mark.parametrize(
    "query", [f"timeout={10**400}", f"priority={2**64}"], ids=["timeout 10^400", "priority 2^64"]
)
def test_schedule_values_past_64_bits_are_refused_naming_the_range(
    client: TestClient, query: str
) -> None:
    r = client.post(f"{ROUTE}?{query}", content=_blob(), headers=BINARY)
    assert r.status_code == 422
    name = query.split("=")[0]
    assert f"query.{name}: Input should be less than or equal to {2**64 - 1}" in r.json()["error"]
    largest = f"{ROUTE}?timeout={2**64 - 1}&priority={2**64 - 1}"
    assert client.post(largest, content=_blob(), headers=BINARY).status_code == 200


def test_other_methods_and_a_trailing_slash_are_routed_by_fastapi(client: TestClient) -> None:
    assert client.get(ROUTE).status_code == 405  # the declared route allows POST only
    r = client.post(f"{ROUTE}/", content=_blob(), headers=BINARY, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"].endswith(ROUTE)


def test_a_body_over_the_limit_gets_413(make_client) -> None:
    client = make_client(max_body_bytes=1024)
    r = client.post(ROUTE, content=_blob(rows=64), headers=BINARY)
    assert r.status_code == 413
    assert "1024-byte limit" in r.json()["error"]


def test_the_token_is_required(make_client) -> None:
    client = make_client(api_token="s3cret-token-of-32-characters-xx")
    assert client.post(ROUTE, content=_blob(), headers=BINARY).status_code == 401


def test_not_ready_is_503_with_retry_after() -> None:
    release = threading.Event()
    with TestClient(create_app(Settings(device="cpu"), gated_loader(release))) as client:
        r = client.post(ROUTE, content=_blob(), headers=BINARY)
        release.set()
    assert r.status_code == 503
    assert r.headers["Retry-After"] == "5"


def test_only_plain_posts_to_the_forward_route_are_taken() -> None:
    def scope(method="POST", path=ROUTE, query=b"", media=b"application/octet-stream"):
        headers = [(b"content-type", media)] if media else []
        return {"type": "http", "method": method, "path": path, "query_string": query,
                "headers": headers}  # fmt: skip

    binary = (TINY, BINARY_MEDIA)
    assert plain_forward(scope()) == binary
    assert plain_forward(scope(media=b"Application/Octet-Stream; charset=x")) == binary
    assert plain_forward(scope(query=b"return_routing=true")) is None
    assert plain_forward(scope(media=b"application/json")) == (TINY, JSON)
    assert plain_forward(scope(media=None)) is None
    assert plain_forward(scope(method="GET")) is None
    assert plain_forward(scope(path="/v1/layers/a/b/forward")) is None
    assert plain_forward(scope(path=f"{ROUTE}/x")) is None


def test_a_json_forward_with_or_without_a_query_takes_the_endpoint_and_gets_one_reply(
    client: TestClient, taken_json: list[str]
) -> None:
    rows = torch.randn(3, H, generator=torch.Generator().manual_seed(0)).tolist()
    body = {"hidden_states": rows, "return_routing": True}
    plain = client.post(ROUTE, json=body)
    queried = client.post(f"{ROUTE}?priority=0", json=body)
    assert taken_json == [TINY, TINY]
    assert (plain.status_code, queried.status_code) == (200, 200)
    assert plain.headers["content-type"] == queried.headers["content-type"]
    assert plain.content == queried.content
    assert "X-Request-ID" in plain.headers
    assert client.post(ROUTE, json={"hidden_states": [[1.0, True]]}).json() == {
        "error": "hidden_states[0][1] is true; expected a number"
    }
    counted = 'moe_serve_requests_total{route="/v1/layers/{name}/forward",status="200"} 2.0'
    assert counted in client.get("/metrics").text


def test_a_json_body_over_its_limit_gets_413(make_client) -> None:
    client = make_client(max_json_bytes=1024)
    rows = torch.zeros(64, H).tolist()
    r = client.post(ROUTE, json={"hidden_states": rows})
    assert r.status_code == 413
    assert "MOE_SERVE_MAX_JSON_BYTES" in r.json()["error"]


def test_plain_forwards_are_named_with_their_media_type() -> None:
    def scope(query=b"", media=b"application/json"):
        return {"type": "http", "method": "POST", "path": ROUTE, "query_string": query,
                "headers": [(b"content-type", media)]}  # fmt: skip

    assert plain_forward(scope()) == (TINY, JSON)
    assert plain_forward(scope(media=b"Application/JSON; charset=utf-8")) == (TINY, JSON)
    assert plain_forward(scope(media=b"application/octet-stream")) == (TINY, BINARY_MEDIA)
    assert plain_forward(scope(query=b"return_routing=true")) is None
    assert plain_forward(scope(media=b"text/plain")) is None
