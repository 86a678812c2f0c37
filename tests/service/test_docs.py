"""/docs works without the internet, its examples run against the demo layer, and with a token
set it declares the bearer scheme (and still loads in a browser, which sends no token)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready

TOKEN = "t" * 32
OPEN = {"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready"}  # no token asked


@pytest.fixture(scope="module")
def demo_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    """The demo layers, as `moe-serve serve` without --weights serves them, with a token."""
    cache = tmp_path_factory.mktemp("cache")
    settings = Settings(device="cpu", cache_dir=Path(cache), api_token=TOKEN)
    with TestClient(create_app(settings)) as client:
        wait_ready(client.get)
        yield client


def _local_assets(page: str) -> list[str]:
    urls = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert urls
    assert all(url.startswith("/") for url in urls), urls  # nothing from a CDN
    return urls


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_docs_pages_and_their_assets_load_from_the_server_without_a_token(
    demo_client: TestClient, page: str
) -> None:
    html = demo_client.get(page)
    assert html.status_code == 200
    for url in _local_assets(html.text):
        asset = demo_client.get(url)
        assert asset.status_code == 200, url
        assert len(asset.content) > 1000, url
    assert demo_client.get("/openapi.json").status_code == 200


def test_openapi_declares_the_bearer_scheme_on_every_protected_route(
    demo_client: TestClient,
) -> None:
    schema = demo_client.get("/openapi.json").json()
    assert schema["components"]["securitySchemes"]["bearer"] == {
        "type": "http",
        "scheme": "bearer",
        "description": "MOE_SERVE_API_TOKEN",
    }
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            assert ("security" in operation) == (path not in OPEN), (method, path)
    assert demo_client.get("/backends").status_code == 401


def test_without_a_token_no_scheme_is_declared(make_client) -> None:
    schema = make_client().get("/openapi.json").json()
    assert "securitySchemes" not in schema.get("components", {})


def _examples(schema: dict) -> Iterator[tuple[str, str, dict]]:
    """(path, example name, body) of every JSON request body example."""
    for path, operations in schema["paths"].items():
        for operation in operations.values():
            content = operation.get("requestBody", {}).get("content", {})
            for name, example in content.get("application/json", {}).get("examples", {}).items():
                yield path, name, example["value"]


def test_every_request_example_runs_against_the_demo_layer(demo_client: TestClient) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    examples = list(_examples(demo_client.get("/openapi.json").json()))
    assert len(examples) >= 6  # forward (2), infer and versioned infer (2 each)
    for path, name, body in examples:
        url = path.format(name="demo", version="1")
        reply = demo_client.post(url, json=body, headers=auth)
        assert reply.status_code == 200, (path, name, reply.text)
