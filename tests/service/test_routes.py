"""Health, readiness, introspection, metrics, docs, auth and request ids."""

from __future__ import annotations

import json
import threading
import time
from typing import ClassVar

import pytest
import safetensors.torch
import torch
from fastapi.testclient import TestClient

from moe_serve.kernels import registry, selection
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.service.core.runtime import warm_up_tokens
from moe_serve.service.engine.engine import Engine
from moe_serve.service.errors import error_response
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, E, H, gated_loader, tiny_loader

TOKEN = "s3cret-token-of-32-characters-xx"
BINARY = {"Content-Type": "application/octet-stream"}


def test_health_is_200_and_ready_is_503_with_the_reason_while_loading() -> None:
    release = threading.Event()
    with TestClient(create_app(Settings(device="cpu"), gated_loader(release))) as client:
        assert client.get("/health").status_code == 200
        r = client.get("/ready")
        assert (r.status_code, r.json()) == (503, {"ready": False, "reason": "loading layers"})
        assert client.get("/v2/health/ready").status_code == 503
        forward = client.post(f"/v1/layers/{TINY}/forward", json={"hidden_states": [[0.0] * H]})
        assert forward.status_code == 503
        assert forward.headers["Retry-After"] == "5"
        release.set()
        wait_ready(client.get)
        assert client.get("/ready").json() == {"ready": True, "reason": ""}


@pytest.mark.parametrize(("path", "status"), [("/health", 200), ("/ready", 200)])
def test_probes_answer_head_as_get_without_a_body(client: TestClient, path: str, status) -> None:
    r = client.head(path)
    assert r.status_code == status
    assert r.content == b""


def test_error_messages_are_capped(client: TestClient) -> None:
    r = client.get(f"/v1/layers/{'x' * 5000}")
    assert r.status_code == 404
    message = r.json()["error"]
    assert len(message) < 2100
    assert message.endswith(" more characters)")


def test_an_error_quoting_what_utf8_cannot_encode_is_still_sent() -> None:
    """A lone surrogate, from a client's JSON escape, quoted in a message is sent escaped."""
    r = error_response(400, "unknown tensor \ud800")
    assert json.loads(r.body) == {"error": "unknown tensor \\ud800"}


def test_ready_reports_why_loading_failed() -> None:
    def broken_loader(settings, devices):
        raise ValueError(
            "/w/layer0/experts.safetensors: tensor 'w13': shape [4, 8] expected [4, 9]"
        )

    with TestClient(create_app(Settings(device="cpu"), broken_loader)) as client:
        for _ in range(500):  # bounded: 5 s
            r = client.get("/ready")
            if "failed" in r.json()["reason"]:
                break
            time.sleep(0.01)
        assert r.status_code == 503
        assert (
            "loading the layers failed: /w/layer0/experts.safetensors: tensor 'w13'"
            in r.json()["reason"]
        )
        assert client.get("/health").status_code == 200


def test_layers_lists_every_layer_with_its_shape_and_numerics(client: TestClient) -> None:
    layers = client.get("/v1/layers").json()["layers"]
    assert [layer["name"] for layer in layers] == [TINY, NO_ROUTER]
    tiny = layers[0]
    assert tiny == client.get(f"/v1/layers/{TINY}").json()
    assert {k: tiny[k] for k in ("num_experts", "top_k", "hidden_size", "intermediate_size")} == {
        "num_experts": E,
        "top_k": 2,
        "hidden_size": H,
        "intermediate_size": 128,
    }
    assert tiny["quant"]["scheme"] == "none"
    assert tiny["dtype"] == "float32"
    assert tiny["activation"]["kind"] == "silu"
    assert tiny["routing"]["scoring"] == "softmax"
    assert tiny["shared_experts"] is False
    router_bytes = E * H * 4
    assert tiny["device_bytes"] == (E * 2 * 128 * H + E * H * 128) * 4 + router_bytes


def test_unknown_layer_info_returns_404(client: TestClient) -> None:
    r = client.get("/v1/layers/nope")
    assert r.status_code == 404
    assert "no layer named 'nope'" in r.json()["error"]


def test_backends_shows_each_backend_and_each_layers_choice(client: TestClient) -> None:
    body = client.get("/backends").json()
    assert body["device"]["type"] == "cpu"
    experts = {b["name"]: b for b in body["experts"]}
    assert experts["reference"]["available"] is True
    assert "fp8-block" in experts["reference"]["schemes"]
    assert "silu" in experts["reference"]["activations"]
    unavailable = [b for b in body["experts"] if not b["available"]]
    assert all(b["reason"] for b in unavailable)  # every refusal says why
    assert any(b["name"] == "no-ep" and b["available"] for b in body["prepare_finalize"])
    layer = body["layers"][0]
    assert (layer["layer"], layer["experts"], layer["prepare_finalize"]) == (
        TINY,
        "reference",
        "no-ep",
    )
    assert layer["reason"].startswith("auto")
    assert layer["workspace_bytes"] >= 0


def test_batch_invariant_layers_say_so_in_backends_and_layers(make_client, client) -> None:
    invariant = make_client(batch_invariant=True)
    body = invariant.get("/backends").json()
    assert all(layer["batch_invariant"] for layer in body["layers"])
    capable = {b["name"] for b in body["experts"] if b["batch_invariant"]}
    assert {"reference", "triton"} <= capable and "deep-gemm" not in capable
    assert all(layer["batch_invariant"] for layer in invariant.get("/v1/layers").json()["layers"])
    assert not any(layer["batch_invariant"] for layer in client.get("/v1/layers").json()["layers"])


def test_forced_backend_is_reported_as_forced(make_client) -> None:
    client = make_client(backend="reference")
    assert client.get("/backends").json()["layers"][0]["reason"] == "forced by --backend"


def test_metrics_count_requests_and_tokens_per_expert(client: TestClient) -> None:
    logits = torch.full((5, E), -5.0)
    logits[:, 1], logits[:, 3] = 5.0, 4.0  # every token to experts 1 and 3
    blob = safetensors.torch.save({"hidden_states": torch.randn(5, H), "router_logits": logits})
    assert (
        client.post(f"/v1/layers/{TINY}/forward", content=blob, headers=BINARY).status_code == 200
    )
    text = client.get("/metrics").text
    assert 'moe_serve_expert_tokens_total{expert="1",layer="tiny"} 5.0' in text
    assert 'moe_serve_expert_tokens_total{expert="3",layer="tiny"} 5.0' in text
    assert 'moe_serve_expert_tokens_total{expert="0",layer="tiny"} 0.0' in text
    assert 'moe_serve_tokens_total{layer="tiny"} 5.0' in text
    assert 'moe_serve_requests_total{route="/v1/layers/{name}/forward",status="200"} 1.0' in text
    assert 'moe_serve_forward_seconds_count{backend="reference",layer="tiny"}' in text
    assert 'moe_serve_queue_depth{layer="tiny"} 0.0' in text
    assert "moe_serve_batch_tokens_bucket" in text
    assert "moe_serve_request_seconds_bucket" in text


def test_docs_and_openapi_describe_every_route_with_examples(client: TestClient) -> None:
    assert client.get("/docs").status_code == 200
    spec = client.get("/openapi.json").json()
    paths = set(spec["paths"])
    assert {
        "/health",
        "/ready",
        "/metrics",
        "/backends",
        "/v1/layers",
        "/v1/layers/{name}",
        "/v1/layers/{name}/forward",
        "/v2",
        "/v2/health/live",
        "/v2/health/ready",
        "/v2/models/{name}",
        "/v2/models/{name}/ready",
        "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}",
        "/v2/models/{name}/versions/{version}/ready",
        "/v2/models/{name}/versions/{version}/infer",
    } <= paths
    body = spec["paths"]["/v1/layers/{name}/forward"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/octet-stream"}
    assert body["application/json"]["examples"]
    assert all(op.get("summary") for route in spec["paths"].values() for op in route.values())
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]
    assert infer["application/json"]["examples"]


def test_every_operation_of_the_api_description_has_an_id_of_its_own(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    ids = [op["operationId"] for route in spec["paths"].values() for op in route.values()]
    assert len(ids) == len(set(ids))
    assert client.head("/health").status_code == 200  # served, not described


def test_the_docs_routes_are_counted_under_their_own_paths(client: TestClient) -> None:
    asset = client.get("/docs").text.split('src="')[1].split('"')[0]  # a bundled script
    assert asset.startswith("/docs/static/")
    for path in ("/openapi.json", asset):
        assert client.get(path).status_code == 200
    text = client.get("/metrics").text
    for route in ("/openapi.json", "/docs", "/docs/static"):
        assert f'moe_serve_requests_total{{route="{route}",status="200"}} 1.0' in text
    assert 'route="unmatched"' not in text


def test_request_id_that_could_forge_log_lines_is_replaced(client: TestClient) -> None:
    r = client.get("/health", headers={"X-Request-ID": "abc\\n2026 INFO forged"})
    assert r.headers["X-Request-ID"] != "abc\\n2026 INFO forged"
    assert len(r.headers["X-Request-ID"]) == 32


def test_unexpected_error_is_a_json_500_with_the_request_id(
    client: TestClient, monkeypatch
) -> None:
    def broken(served):
        raise RuntimeError("bug")

    monkeypatch.setattr("moe_serve.service.http.routes.introspect.layer_info", broken)
    r = client.get("/v1/layers", headers={"X-Request-ID": "req-42"})
    assert r.status_code == 500
    assert r.json() == {"error": "internal error; request id req-42"}
    assert client.get("/health").status_code == 200


def test_request_id_is_echoed_or_made_up(client: TestClient) -> None:
    assert (
        client.get("/health", headers={"X-Request-ID": "abc-1"}).headers["X-Request-ID"] == "abc-1"
    )
    assert len(client.get("/health").headers["X-Request-ID"]) == 32


@pytest.fixture
def secured(make_client) -> TestClient:
    return make_client(api_token=TOKEN)


@pytest.mark.parametrize("path", ["/v1/layers", "/backends", "/v2/models/tiny"])
def test_token_is_required_on_api_routes(secured: TestClient, path: str) -> None:
    r = secured.get(path)
    assert r.status_code == 401
    assert r.headers["WWW-Authenticate"] == "Bearer"
    assert secured.get(path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert secured.get(path, headers={"Authorization": f"Bearer {TOKEN}"}).status_code == 200


@pytest.mark.parametrize(
    "path",
    # the docs too: a browser loading them sends no token (their Authorize button sends it)
    [
        "/health",
        "/ready",
        "/metrics",
        "/v2/health/live",
        "/v2/health/ready",
        "/docs",
        "/openapi.json",
    ],
)
def test_probes_metrics_and_docs_need_no_token(secured: TestClient, path: str) -> None:
    assert secured.get(path).status_code == 200


def test_forward_needs_the_token(secured: TestClient) -> None:
    body = {"hidden_states": [[0.0] * H]}
    assert secured.post(f"/v1/layers/{TINY}/forward", json=body).status_code == 401
    ok = secured.post(
        f"/v1/layers/{TINY}/forward", json=body, headers={"Authorization": f"Bearer {TOKEN}"}
    )
    assert ok.status_code == 200


def test_full_queue_returns_429_with_retry_after_and_drops_nothing(
    make_client, monkeypatch
) -> None:
    client = make_client(max_queue=1)
    engine = client.app.state.runtime.engine
    real, started, release = engine.forward, threading.Event(), threading.Event()

    def busy(name, inputs):
        started.set()
        release.wait(10)
        return real(name, inputs)

    monkeypatch.setattr(engine, "forward", busy)
    body = {"hidden_states": [[0.5] * H]}
    first: list = []
    waiting = threading.Thread(
        target=lambda: first.append(client.post(f"/v1/layers/{TINY}/forward", json=body))
    )
    waiting.start()
    assert started.wait(10)
    r = client.post(f"/v1/layers/{TINY}/forward", json=body)
    assert r.status_code == 429
    assert r.headers["Retry-After"] == "1"
    assert "already has 1 requests queued (max_queue=1)" in r.json()["error"]
    release.set()
    waiting.join(10)
    assert first[0].status_code == 200


@pytest.mark.parametrize(
    ("limit", "expected"), [(1, [1]), (16, [1, 2, 4, 8, 16]), (24, [1, 2, 4, 8, 16, 24])]
)
def test_gpu_warm_up_doubles_the_token_count_up_to_the_batch_limit(limit, expected) -> None:
    assert warm_up_tokens(limit, torch.device("cuda")) == expected


def test_cpu_warm_up_runs_one_token_since_nothing_compiles() -> None:
    assert warm_up_tokens(1024, torch.device("cpu")) == [1]


def test_warm_up_runs_each_layer_before_ready(make_client, monkeypatch) -> None:
    seen = []
    real = Engine.forward

    def recording(self, name, inputs):
        seen.append((name, inputs.hidden_states.shape[0]))
        return real(self, name, inputs)

    monkeypatch.setattr(Engine, "forward", recording)
    make_client()  # ready: warm-up done, no request sent yet
    assert sorted(seen) == sorted([(TINY, 1), (NO_ROUTER, 1)])


def test_every_reference_in_the_openapi_document_resolves(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    schemas = spec["components"]["schemas"]

    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return own + [r for value in node.values() for r in refs(value)]
        if isinstance(node, list):
            return [r for item in node for r in refs(item)]
        return []

    found = refs(spec)
    assert found  # the document does use references
    for ref in found:
        assert ref.startswith("#/components/schemas/"), ref
        assert ref.removeprefix("#/components/schemas/") in schemas, ref


def test_the_batcher_and_every_layer_kernel_share_max_batch_tokens(make_client) -> None:
    runtime = make_client(max_batch_tokens=48).app.state.runtime
    assert runtime.batcher.policy.max_batch_tokens == 48
    assert {served.layer.kernel.chunk_tokens for served in runtime.engine.layers.values()} == {48}


class _SecondReference(ReferenceExperts):
    name: ClassVar[str] = "test-second"


def test_backends_and_layers_say_which_backend_runs_at_which_token_count(
    make_client, client, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = [{"from_tokens": 1, "backend": "reference"}]
    assert client.get("/backends").json()["layers"][0]["by_tokens"] == one
    assert client.get(f"/v1/layers/{TINY}").json()["by_tokens"] == one
    # a measured table whose plan switches to a second CPU backend from 8 tokens
    monkeypatch.setitem(registry.EXPERTS, "test-second", _SecondReference)
    served = {
        "1": {"reference": 1.0, "test-second": 2.0},
        "8": {"reference": 2.0, "test-second": 1.0},
    }
    plan = ((1, "reference"), (8, "test-second"))
    rules = {
        key: selection.Rule(key, ("reference",), served, None, served, frozenset(), plan)
        for key in ("none/small", "none/large")
    }
    table = selection.RuleTable("cpu", "abc1234", "auto_cpu.json", rules)
    monkeypatch.setattr(selection, "rule_table", lambda device: table)
    switching = make_client()
    layer = switching.get("/backends").json()["layers"][0]
    assert layer["experts"] == "reference<8<=test-second"
    assert "reference from M=1, test-second from M=8" in layer["reason"]
    two = [{"from_tokens": 1, "backend": "reference"}, {"from_tokens": 8, "backend": "test-second"}]
    assert layer["by_tokens"] == two
    assert switching.get(f"/v1/layers/{TINY}").json()["by_tokens"] == two
    forward = switching.post(f"/v1/layers/{TINY}/forward", json={"hidden_states": [[0.1] * H] * 9})
    assert forward.status_code == 200, forward.text


def test_ready_says_which_layer_calibrates_and_how_far_and_auto_follows_its_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reached, release = threading.Event(), threading.Event()
    calls = []

    def calibrated(name, cfg, _weights, _device, calibration, _tokens, _captures, progress):
        calls.append((name, calibration.mode, calibration.budget_s))
        progress(3, 12)
        reached.set()
        release.wait(10)
        progress(12, 12)
        served = {"1": {"reference": 1.0}}
        key = selection.rule_key(cfg)
        rule = selection.Rule(key, ("reference",), {}, 0, served, frozenset(), ((1, "reference"),))
        return selection.RuleTable("cpu", "1.0+abc", "this start's calibration", {key: rule})

    monkeypatch.setattr("moe_serve.service.engine.engine.calibrated_rules", calibrated)
    settings = Settings(device="cpu", calibrate="always", calibrate_budget_s=5)
    with TestClient(create_app(settings, tiny_loader)) as client:
        assert reached.wait(10)
        r = client.get("/ready")
        assert (r.status_code, r.json()) == (
            503,
            {"ready": False, "reason": f"calibrating layer {TINY}: 3/12"},
        )
        release.set()
        wait_ready(client.get)
        layer = client.get("/backends").json()["layers"][0]
    assert calls == [(TINY, "always", 5.0), (NO_ROUTER, "always", 5.0)]
    assert "rule none/small of this start's calibration" in layer["reason"]


def test_a_forced_backend_is_never_calibrated(make_client, monkeypatch: pytest.MonkeyPatch) -> None:
    def calibrated(*_args):
        raise AssertionError("calibrated a forced backend")

    monkeypatch.setattr("moe_serve.service.engine.engine.calibrated_rules", calibrated)
    client = make_client(backend="reference", calibrate="always")
    assert client.get("/backends").json()["layers"][0]["reason"] == "forced by --backend"
