"""Auto per token count on the GPU: a layer whose rule table plans two backends runs the first
below the planned count and the second from it, matches the float32 reference on awkward shapes
(M = 1, either side of the switch, not a multiple of any block, every token on the same experts
and the rest empty), and its whole-layer CUDA graphs replay equal to its uncaptured forward at
every bucket, each bucket captured with the member of its own token count."""

from __future__ import annotations

import pytest
import torch

from moe_serve.bench.shapes import SHAPES
from moe_serve.kernels.accuracy import relative_error, tolerance
from moe_serve.kernels.layer import LayerWeights, MoELayer, RouterWeights, build_layer
from moe_serve.kernels.layer_graphs import LayerGraphs, can_capture, token_buckets
from moe_serve.kernels.registry import experts_backends
from moe_serve.kernels.selection import Rule, RuleTable, rule_key
from moe_serve.kernels.tensors import ForwardInputs
from tests.kernels.external_cases import layer_inputs, layer_weights, reference_output

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
PAIRS = [  # the pairs a measured table can plan for these schemes: (shape, (first, second))
    ("deepseek-v3-small", ("triton", "deep-gemm")),
    ("gpt-oss-small", ("triton", "oai-triton")),
    ("gpt-oss-bf16-small", ("oai-triton", "triton")),
    ("gpt-oss-bf16-small", ("triton", "oai-triton-unfused")),  # Mixtral's (bf16) from 256
]
IDS = [f"{name}:{first}<{second}" for name, (first, second) in PAIRS]
SWITCH_AT = 16
MAX_TOKENS = 96  # buckets 1, 2, 4, ..., 64, 96


def _layer(name: str, pair: tuple[str, str]) -> MoELayer:
    """The layer auto builds on `name` from a table planning `pair`, switching at 16."""
    cfg, (first, second) = SHAPES[name], pair
    for backend in (first, second):
        support = experts_backends()[backend].supports(cfg, CUDA)
        if not support:
            pytest.skip(f"{backend} does not run {name} here: {support.reason}")
    key = rule_key(cfg)
    served = {"1": {first: 1.0, second: 2.0}, str(SWITCH_AT): {first: 2.0, second: 1.0}}
    plan = ((1, first), (SWITCH_AT, second))
    rule = Rule(key, (first,), served, None, served, frozenset((first, second)), plan)
    table = RuleTable(torch.cuda.get_device_name(CUDA), "test", "test", {key: rule})
    weights = LayerWeights(layer_weights(name), RouterWeights())  # routed by client logits
    layer, choice = build_layer(cfg, weights, CUDA, rules=table)
    assert choice.experts.name == f"{first}<{SWITCH_AT}<={second}"
    assert layer.kernel.experts.by_tokens() == plan
    return layer


@pytest.mark.parametrize(("m", "crowded"), [(1, False), (15, False), (16, False), (17, False),
                                            (333, False), (1, True), (333, True)])  # fmt: skip
@pytest.mark.parametrize(("name", "pair"), PAIRS, ids=IDS)
def test_the_switch_matches_the_reference_either_side_of_its_step(
    name: str, pair: tuple[str, str], m: int, crowded: bool
) -> None:
    layer = _layer(name, pair)
    hidden, _, routing = layer_inputs(name, m, crowded)
    with torch.inference_mode():
        out = layer.kernel.forward(hidden, routing)
    err = relative_error(out, reference_output(name, m, crowded))
    ran = layer.kernel.experts.last_ran
    assert ran == pair[m >= SWITCH_AT]
    assert err < tolerance(SHAPES[name]), f"{name} M={m} ({ran}): {err:.3g}"


@pytest.mark.parametrize(("name", "pair"), PAIRS, ids=IDS)
def test_graphs_replay_equal_to_the_uncaptured_forward_at_every_bucket(
    name: str, pair: tuple[str, str]
) -> None:
    cfg, layer = SHAPES[name], _layer(name, pair)
    assert can_capture(layer, CUDA, MAX_TOKENS)
    graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=True)
    buckets = token_buckets(MAX_TOKENS)
    sizes = sorted({1, SWITCH_AT - 1, SWITCH_AT, MAX_TOKENS} | {b + 1 for b in buckets[:-1]})
    with torch.inference_mode():
        graphs.capture()
        assert graphs.captured_buckets() == list(buckets)
        for m in sizes:
            hidden, logits, _ = layer_inputs(name, m)
            eager = layer.forward(ForwardInputs(hidden, logits))
            replay = graphs.forward(ForwardInputs(hidden, logits)).output
            bucket = graphs.bucket(m)
            where = f"{name} m={m} (bucket {bucket}: {pair[bucket >= SWITCH_AT]})"
            assert torch.equal(replay.routing.topk_ids, eager.routing.topk_ids), where
            error = relative_error(replay.output, eager.output)
            assert error < tolerance(cfg), f"{where}: {error:.3g}"
            reference = relative_error(replay.output, reference_output(name, m))
            assert reference < tolerance(cfg), f"{where} against the reference: {reference:.3g}"
