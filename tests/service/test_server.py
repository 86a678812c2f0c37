"""A real uvicorn server: many concurrent clients batched together, and the Python client."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import safetensors.torch
import torch
from prometheus_client.parser import text_string_to_metric_families

from moe_serve.service.client import Client, ClientError, RetryPolicy
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import (
    NO_ROUTER,
    TINY,
    E,
    H,
    reference_forward,
    running_server,
    tiny_loader,
)

CLIENTS = 48
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    settings = Settings(device="cpu", max_batch_delay_ms=20.0, max_batch_tokens=64)
    with running_server(create_app(settings, tiny_loader)) as url:
        with httpx.Client(base_url=url) as http:
            wait_ready(http.get)
        yield url


def _sample_count(url: str, metric: str, layer: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == metric and sample.labels.get("layer") == layer:
                return sample.value
    raise AssertionError(f"{metric} for {layer} not in /metrics")


def test_concurrent_clients_each_get_exactly_their_own_rows(server_url: str) -> None:
    generator = torch.Generator().manual_seed(0)
    requests = [torch.randn(1 + i % 7, H, generator=generator) for i in range(CLIENTS)]
    forwards_before = _sample_count(server_url, "moe_serve_batch_requests_count", TINY)

    async def one(http: httpx.AsyncClient, i: int, x: torch.Tensor) -> torch.Tensor:
        if i % 2:  # half JSON, half binary: both paths share the batcher
            r = await http.post(f"/v1/layers/{TINY}/forward", json={"hidden_states": x.tolist()})
            assert r.status_code == 200, r.text
            return torch.tensor(r.json()["output"])
        blob = safetensors.torch.save({"hidden_states": x})
        r = await http.post(
            f"/v1/layers/{TINY}/forward",
            content=blob,
            headers={"Content-Type": "application/octet-stream"},
        )
        assert r.status_code == 200, r.text
        return safetensors.torch.load(r.content)["output"]

    async def main() -> list[torch.Tensor]:
        limits = httpx.Limits(max_connections=CLIENTS)
        async with httpx.AsyncClient(base_url=server_url, limits=limits, timeout=TIMEOUT_S) as http:
            return await asyncio.gather(*(one(http, i, x) for i, x in enumerate(requests)))

    outputs = asyncio.run(main())
    for x, out in zip(requests, outputs, strict=True):
        torch.testing.assert_close(out, reference_forward(TINY, x))
    forwards = _sample_count(server_url, "moe_serve_batch_requests_count", TINY) - forwards_before
    assert forwards < CLIENTS  # requests were merged: fewer forwards than requests


def test_client_forward_matches_the_reference(server_url: str) -> None:
    x, logits = torch.randn(6, H), torch.randn(6, E)
    with Client(server_url) as client:
        torch.testing.assert_close(client.forward(TINY, x), reference_forward(TINY, x))
        out = client.forward(NO_ROUTER, x.bfloat16(), logits)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, reference_forward(NO_ROUTER, x.bfloat16(), logits).bfloat16())


def test_client_raises_the_servers_message_on_bad_input(server_url: str) -> None:
    with Client(server_url) as client, pytest.raises(ClientError, match="hidden_size is 64") as err:
        client.forward(TINY, torch.zeros(1, 3))
    assert err.value.status == 400


def _scripted(statuses: list[int], seen: list[int]) -> httpx.MockTransport:
    """A server answering with `statuses` in turn (then 200 with a valid blob)."""
    blob = safetensors.torch.save({"output": torch.ones(1, 2)})

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(len(seen))
        if len(seen) <= len(statuses):
            return httpx.Response(
                statuses[len(seen) - 1], json={"error": "busy"}, headers={"Retry-After": "0"}
            )
        return httpx.Response(200, content=blob)

    return httpx.MockTransport(handler)


def _client_on(transport: httpx.MockTransport, attempts: int) -> Client:
    client = Client("http://127.0.0.1:1", retry=RetryPolicy(attempts=attempts, backoff_s=0.0))
    client._http = httpx.Client(base_url="http://127.0.0.1:1", transport=transport)
    return client


def test_client_retries_429_and_503_then_succeeds() -> None:
    seen: list[int] = []
    with _client_on(_scripted([429, 503], seen), attempts=3) as client:
        assert torch.equal(client.forward("m", torch.zeros(1, 2)), torch.ones(1, 2))
    assert len(seen) == 3


def test_client_gives_up_after_its_attempts() -> None:
    seen: list[int] = []
    with (
        _client_on(_scripted([429] * 5, seen), attempts=2) as client,
        pytest.raises(ClientError, match="HTTP 429: busy"),
    ):
        client.forward("m", torch.zeros(1, 2))
    assert len(seen) == 2


def test_client_does_not_retry_bad_input() -> None:
    seen: list[int] = []
    with _client_on(_scripted([400], seen), attempts=5) as client, pytest.raises(ClientError):
        client.forward("m", torch.zeros(1, 2))
    assert len(seen) == 1


def test_client_sends_the_bearer_token() -> None:
    tokens: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        tokens.append(request.headers["authorization"])
        return httpx.Response(200, content=safetensors.torch.save({"output": torch.ones(1)}))

    client = Client("http://127.0.0.1:1", token="t0ken")
    client._http = httpx.Client(
        base_url="http://127.0.0.1:1",
        transport=httpx.MockTransport(handler),
        headers=client._http.headers,
    )
    with client:
        client.forward("m", torch.zeros(1, 2))
    assert tokens == ["Bearer t0ken"]
