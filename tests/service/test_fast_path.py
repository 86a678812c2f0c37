"""The fast path's CPU-checkable parts: replies written without the library, the finite check on
the bits, batches of parts in mixed wire dtypes, padded rows routed nowhere, the router and
shared expert math off the GPU, the schedule-policy parameters over HTTP and the per-stage
metrics."""

from __future__ import annotations

import safetensors
import safetensors.torch
import torch
from fastapi.testclient import TestClient

from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.input_checks import all_finite
from moe_serve.kernels.layer import (
    LayerWeights,
    RouterWeights,
    SharedExpert,
    build_layer,
    expert_tokens,
    matmul_f32,
)
from moe_serve.kernels.layer_graphs import can_capture, token_buckets
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.codecs.safetensors_wire import encode_safetensors
from moe_serve.service.engine.engine import Engine
from tests.service.layers import TINY, E, H, reference_forward, tiny_layers

BINARY = {"Content-Type": "application/octet-stream"}
CPU = torch.device("cpu")


def test_a_reply_blob_reads_back_with_the_library_tensors_and_metadata(tmp_path) -> None:
    tensors = {
        "output": torch.randn(3, 5).bfloat16(),
        "topk_ids": torch.tensor([[1, 2], [0, 3], [2, 2]], dtype=torch.int32),
        "topk_weights": torch.rand(3, 2),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    blob = encode_safetensors(tensors, {"layer": "x", "tokens": "3"})
    back = safetensors.torch.load(blob)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    (tmp_path / "r.safetensors").write_bytes(blob)
    with safetensors.safe_open(tmp_path / "r.safetensors", "pt") as f:
        assert f.metadata() == {"layer": "x", "tokens": "3"}


def test_the_finite_check_finds_nan_and_inf_in_every_wire_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(4, 6).to(dtype)
        x[0, 0] = torch.finfo(dtype).max
        x[1, 1] = torch.finfo(dtype).min
        assert all_finite(x), dtype
        for bad in (float("nan"), float("inf"), -float("inf")):
            y = x.clone()
            y[3, 5] = bad
            assert not all_finite(y), (dtype, bad)
            assert not all_finite(y.t()), "a transposed view is checked too"


def test_a_batch_of_parts_in_mixed_wire_dtypes_answers_each_part_in_the_layer_dtype() -> None:
    engine = Engine([CPU])
    for layer in tiny_layers():
        engine.add(layer)
    parts = [
        torch.randn(3, H).bfloat16(),
        torch.randn(1, H),
        torch.randn(2, H).half(),
    ]
    result = engine.start(TINY, [ForwardInputs(p) for p in parts]).result()
    assert [o.output.shape[0] for o in result.outputs] == [3, 1, 2]
    for part, out in zip(parts, result.outputs, strict=True):
        assert out.output.dtype == torch.float32  # the tiny layer's dtype
        torch.testing.assert_close(out.output, reference_forward(TINY, part.float()))
    assert int(result.expert_tokens.sum()) == 6 * 2 and result.expert_tokens.shape == (E,)
    assert result.times.forward_s > 0 and result.times.h2d_s is None


def test_padded_rows_are_routed_nowhere_and_leave_the_valid_rows_unchanged() -> None:
    (tiny, _) = tiny_layers()
    layer, _ = build_layer(tiny.config, tiny.weights, CPU, "reference")
    x = torch.randn(7, H)
    x[5:] = 0  # padding
    plain = layer.forward(ForwardInputs(x[:5]))
    padded = layer.forward(ForwardInputs(x), valid_rows=torch.tensor(5))
    assert (padded.routing.topk_ids[5:] == -1).all()
    assert torch.equal(padded.routing.topk_ids[:5], plain.routing.topk_ids)
    torch.testing.assert_close(padded.output[:5], plain.output)
    assert torch.equal(
        expert_tokens(padded.routing.topk_ids, E), expert_tokens(plain.routing.topk_ids, E)
    )


def test_expert_tokens_counts_pairs_and_skips_ids_of_minus_one() -> None:
    ids = torch.tensor([[0, 3], [3, -1], [-1, -1]], dtype=torch.int32)
    assert expert_tokens(ids, 4).tolist() == [1, 0, 0, 2]


def test_off_the_gpu_router_and_shared_expert_multiply_in_float32() -> None:
    a, b = torch.randn(4, 8).bfloat16(), torch.randn(8, 3).bfloat16()
    got = matmul_f32(a, b)
    assert got.dtype == torch.float32
    assert torch.equal(got, a.float() @ b.float())
    cfg = MoEConfig(E, H, 128, RoutingConfig(top_k=2), dtype=torch.bfloat16)
    shared = SharedExpert(torch.randn(64, H).bfloat16(), torch.randn(H, 32).bfloat16())
    weights = LayerWeights(random_expert_weights(cfg), RouterWeights(torch.randn(E, H)), shared)
    x = torch.randn(3, H).bfloat16()
    h = torch.nn.functional.silu(x.float() @ shared.w13.float()[:32].T)
    h = h * (x.float() @ shared.w13.float()[32:].T)
    torch.testing.assert_close(weights.shared.forward(x), h @ shared.w2.float().T)


def test_token_buckets_double_to_64_then_grow_by_a_quarter_in_steps_of_64() -> None:
    assert token_buckets(1024) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 320, 448, 576, 768,
                                   960, 1024)  # fmt: skip
    assert token_buckets(300) == (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 300)
    assert token_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert token_buckets(1) == (1,)


def test_a_cpu_layer_is_not_captured_and_says_why() -> None:
    (tiny, _) = tiny_layers()
    layer, _ = build_layer(tiny.config, tiny.weights, CPU, "reference")
    support = can_capture(layer, CPU, 1)
    assert not support and "CUDA" in support.reason


def test_schedule_policy_query_parameters_are_accepted(client: TestClient) -> None:
    x = torch.randn(2, H)
    url = f"/v1/layers/{TINY}/forward?priority=1&timeout=5000000"
    r = client.post(url, content=safetensors.torch.save({"hidden_states": x}), headers=BINARY)
    assert r.status_code == 200, r.text
    out = safetensors.torch.load(r.content)["output"]
    torch.testing.assert_close(out, reference_forward(TINY, x))


def test_a_negative_priority_is_refused_naming_it(client: TestClient) -> None:
    r = client.post(f"/v1/layers/{TINY}/forward?priority=-1", json={"hidden_states": [[0.0] * H]})
    assert r.status_code == 422 and "priority" in r.json()["error"]


def _infer(client: TestClient, parameters: dict):
    body = {
        "inputs": [{"name": "hidden_states", "shape": [1, H], "datatype": "FP32",
                    "data": [0.1] * H}],
        "parameters": parameters,
    }  # fmt: skip
    return client.post(f"/v2/models/{TINY}/infer", json=body)


def test_kserve_schedule_policy_parameters_are_accepted_and_listed(client: TestClient) -> None:
    assert _infer(client, {"priority": 2, "timeout": 10_000_000}).status_code == 200
    assert "schedule_policy" in client.get("/v2").json()["extensions"]


def test_a_kserve_priority_that_is_not_an_integer_is_refused(client: TestClient) -> None:
    r = _infer(client, {"priority": "high"})
    assert r.status_code == 400
    assert r.json()["error"] == "parameters.priority must be an integer >= 0, got 'high'"
    r = _infer(client, {"timeout": -5})
    assert r.status_code == 400 and "parameters.timeout" in r.json()["error"]


def test_metrics_show_the_time_of_each_stage(client: TestClient) -> None:
    x = torch.randn(3, H)
    r = client.post(
        f"/v1/layers/{TINY}/forward",
        content=safetensors.torch.save({"hidden_states": x}),
        headers=BINARY,
    )
    assert r.status_code == 200
    text = client.get("/metrics").text
    for stage in ("queue", "decode", "forward", "encode"):
        line = f'moe_serve_stage_seconds_count{{layer="{TINY}",stage="{stage}"}} 1.0'
        assert line in text, stage
