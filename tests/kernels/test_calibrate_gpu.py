"""Self-calibration on the GPU: a real calibration of a small layer times its candidates, caches
its rule, is followed from the cache at the next start, and the backends it chose serve the
reference's results at every token count of its plan, replayed from the layer's CUDA graphs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_serve.bench.shapes import SHAPES
from moe_serve.kernels import calibrate
from moe_serve.kernels.accuracy import relative_error, tolerance
from moe_serve.kernels.calibrate import Calibration, Mode, cache_path, calibrated_rules
from moe_serve.kernels.layer import LayerWeights, RouterWeights, build_layer
from moe_serve.kernels.layer_graphs import LayerGraphs, can_capture, token_buckets
from moe_serve.kernels.selection import rule_key
from moe_serve.kernels.tensors import ForwardInputs
from tests.kernels.external_cases import layer_inputs, layer_weights, reference_output

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
MAX_TOKENS = 96  # buckets 1, 2, 4, ..., 64, 96
SHAPE_NAMES = ["deepseek-v3-small", "gpt-oss-bf16-small"]


@pytest.mark.parametrize("name", SHAPE_NAMES)
def test_a_calibrated_rule_is_cached_followed_and_serves_the_reference_results(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = SHAPES[name]
    weights = LayerWeights(layer_weights(name), RouterWeights())  # routed by client logits
    calibration = Calibration(Mode.ALWAYS, 60.0, tmp_path)
    progress: list[tuple[int, int]] = []
    table = calibrated_rules(
        name, cfg, weights, CUDA, calibration, MAX_TOKENS, progress=lambda *p: progress.append(p)
    )
    assert table is not None
    rule = table.rules[rule_key(cfg)]
    assert rule.plan and set(rule.served_us) == {str(m) for m in token_buckets(MAX_TOKENS)}
    assert progress[-1][0] == progress[-1][1]
    path = cache_path(tmp_path, torch.cuda.get_device_name(CUDA), cfg)
    assert path.exists()

    def measured_again(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("a cached calibration was measured again")

    monkeypatch.setattr(calibrate, "calibrate", measured_again)
    monkeypatch.setattr(calibrate, "rule_for", lambda _cfg, _device: (None, None))  # no tuned
    cached = calibrated_rules(name, cfg, weights, CUDA, Calibration(Mode.ONCE, 60.0, tmp_path),
                              MAX_TOKENS)  # fmt: skip
    assert cached.rules[rule_key(cfg)].plan == rule.plan

    layer, choice = build_layer(cfg, weights, CUDA, chunk_tokens=MAX_TOKENS, rules=cached)
    assert str(path) in choice.reason
    graphs = None  # as the service runs it: from CUDA graphs where the layer can be captured
    if can_capture(layer, CUDA, MAX_TOKENS):
        graphs = LayerGraphs(layer, CUDA, MAX_TOKENS, with_logits=True)
    steps = {m for m, _ in rule.plan}
    sizes = sorted({1, MAX_TOKENS} | steps | {max(1, m - 1) for m in steps})
    with torch.inference_mode():
        for m in sizes:
            hidden, logits, _ = layer_inputs(name, m)
            inputs = ForwardInputs(hidden, logits)
            if graphs is None:
                out = layer.forward(inputs).output
            else:
                out = graphs.forward(inputs).output.output
            error = relative_error(out, reference_output(name, m))
            assert error < tolerance(cfg), f"{name} M={m} ({choice.experts.name}): {error:.3g}"
