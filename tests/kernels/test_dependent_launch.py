"""kernels/dependent_launch.py: the triton experts' kernels launched as programmatic dependents
answer bit for bit as launched one after the other, eager and replayed from a whole-layer graph
(its router, routing and the stats pass after the experts too), over many batches (a kernel
that read before its wait would read its predecessor's output half-written, differently from
one run to the next)."""

from __future__ import annotations

import pytest
import torch

import moe_serve.kernels.dependent_launch as dependent_launch_module
from moe_serve.bench.random_layer import random_layer
from moe_serve.kernels.config import MoEConfig, RoutingConfig, Scoring
from moe_serve.kernels.dependent_launch import dependent_launch
from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.layer_graphs import LayerGraphs
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.tensors import ForwardInputs

CUDA = torch.device("cuda")
MAX_TOKENS = 64
LAYERS = {
    "bf16": MoEConfig(8, 256, 512, RoutingConfig(top_k=2)),
    "fp8-block": MoEConfig(
        16,
        256,
        384,
        RoutingConfig(top_k=4, scoring=Scoring.SIGMOID),
        quant=QuantConfig(QuantScheme.FP8_BLOCK),
    ),
    "fp8-tensor": MoEConfig(
        8, 256, 256, RoutingConfig(top_k=2), quant=QuantConfig(QuantScheme.FP8_TENSOR)
    ),
}
# 1 and 13: decode (the one-program align, graph-replayed); 300: the three-kernel align, eager
SIZES = (1, 13, 300)
ROUNDS = 10


def test_kernels_off_the_gpu_do_not_launch_as_dependents() -> None:
    assert dependent_launch(torch.device("cpu")) is False


def test_the_interpreter_never_launches_as_dependents(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton's CPU interpreter has no grid dependency control, whatever device a tensor names."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(dependent_launch_module, "_capable", lambda _index: True)
    assert dependent_launch(torch.device("cuda", 0)) is False
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert dependent_launch(torch.device("cuda", 0)) is True


def _outputs(layer, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=False)
    graphs.capture()
    outputs = []
    for x in batches:
        outputs.append(layer.forward(ForwardInputs(x)).output)
        if len(x) <= MAX_TOKENS:
            replay = graphs.forward(ForwardInputs(x))
            outputs.append(replay.output.output.clone())
            outputs.append(replay.stats.clone())  # tokens per expert, both finite flags
    return outputs


@pytest.mark.gpu
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_dependent_launches_answer_as_ordered_ones(
    layer_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    assert dependent_launch(CUDA)
    cfg = LAYERS[layer_name]
    weights = random_layer(cfg, CUDA, seed=5, router=True, shared_intermediate=512)
    gen = torch.Generator(CUDA).manual_seed(6)
    batches = [
        torch.randn(m, cfg.hidden_size, device=CUDA, generator=gen).to(cfg.dtype)
        for _ in range(ROUNDS)
        for m in SIZES
    ]
    with torch.inference_mode():
        layer, _ = build_layer(cfg, weights, CUDA, "triton")
        dependent = _outputs(layer, batches)
        monkeypatch.setattr(dependent_launch_module, "_capable", lambda _index: False)
        assert not dependent_launch(CUDA)
        layer, _ = build_layer(cfg, weights, CUDA, "triton")
        ordered = _outputs(layer, batches)
    assert len(dependent) == len(ordered) == ROUNDS * (len(SIZES) + 4)
    for i, (a, b) in enumerate(zip(dependent, ordered, strict=True)):
        assert torch.isfinite(a).all()
        assert torch.equal(a, b), f"{layer_name} output {i}"
    stats = dependent[2]  # the first one-token replay's
    assert stats[:-2].sum() == LAYERS[layer_name].routing.top_k and stats[-2:].tolist() == [1, 1]
