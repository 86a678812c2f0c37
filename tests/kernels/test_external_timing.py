"""Times every backend that can run the DeepSeek-V3 and gpt-oss layers, side by side in one
process, and writes the measured rule table `--backend auto` follows (kernels/selection.py):

    MOE_SERVE_AUTO_TABLE=$OUT/auto_h100.json MOE_SERVE_COMMIT=$(git rev-parse --short HEAD) \
        python -m pytest -m gpu tests/kernels/test_external_timing.py

Each time is the median of `triton.testing.do_bench` (CUDA events, after warm-up) over the whole
modular forward (prepare -> experts -> finalize) with routing fixed; every backend is checked
against the reference at that token count before it is timed. The reference backend (a Python
loop over experts) is timed up to 64 tokens only. A markdown summary lands beside the table.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path

import pytest
import torch
import triton

from kernels import registry, selection
from kernels.accuracy import relative_error
from kernels.experts.oai_triton import MonolithicOaiTritonExperts
from kernels.routing import route
from tests.kernels.external_cases import (
    LAYERS,
    TOLERANCE,
    layer_inputs,
    layer_weights,
    modular,
    reference_output,
)

pytestmark = [pytest.mark.gpu, pytest.mark.slow]
logger = logging.getLogger(__name__)
CUDA = torch.device("cuda")
TIMED_TOKENS = {"large": (1, 16, 64, 256, 1024, 4096), "small": (1, 64, 4096)}
REFERENCE_MAX_TOKENS = 64
TIMED_LAYERS = ("deepseek-small", "deepseek-full", "gpt-oss-small", "gpt-oss-full")
# not timed on their own: the monolithic variant's modular path is oai-triton's, and
# triton-or-deep-gemm runs one of the two it composes (its row is derived from theirs)
COMPOSED = {"oai-triton-monolithic", "triton-or-deep-gemm"}
EXTERNAL = {"deep-gemm", "deep-gemm-batched", "oai-triton", "oai-triton-unfused"}
RESULTS: dict[str, dict[str, dict[str, float]]] = {}  # layer -> tokens -> backend -> us
FAILED: dict[str, dict[str, str]] = {}  # layer -> backend -> why it was not timed


def _time_us(fn, *args: object) -> float:
    call = functools.partial(fn, *args)
    return triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median") * 1e3


def _root_cause(exc: BaseException) -> str:
    """The innermost exception of a chain, on one line (a Triton compile error wraps the cause)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _routed_forward(kernel, cfg, hidden: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    return kernel.forward(hidden, route(logits, cfg.routing))


def _candidates(name: str) -> dict:
    cfg = LAYERS[name]
    backends = registry.experts_backends()
    return {n: cls for n, cls in backends.items() if n not in COMPOSED and cls.supports(cfg, CUDA)}


@pytest.mark.parametrize("name", TIMED_LAYERS)
def test_time_backends(name: str) -> None:
    cfg = LAYERS[name]
    weights = layer_weights(name)
    kernels = {n: modular(cls(cfg, weights)) for n, cls in _candidates(name).items()}
    times: dict[str, dict[str, float]] = {}
    failed: dict[str, str] = {}  # backend -> why it was dropped (never timed again)
    for m in TIMED_TOKENS[selection.shape_class(cfg)]:
        hidden, logits, routing = layer_inputs(name, m)
        expected = reference_output(name, m)
        row = times.setdefault(str(m), {})
        for backend, kernel in kernels.items():
            if backend in failed or (backend.startswith("reference") and m > REFERENCE_MAX_TOKENS):
                continue
            try:
                err = relative_error(kernel.forward(hidden, routing), expected)
            except Exception as exc:  # another team's backend may not build yet: note it, go on
                failed[backend] = f"M={m}: {_root_cause(exc)}"
                continue
            if err >= TOLERANCE[cfg.quant.scheme]:
                failed[backend] = f"M={m}: relative error {err:.3g}"
                continue
            row[backend] = _time_us(kernel.forward, hidden, routing)
        if "oai-triton" in kernels:  # routing included on both sides
            mono = MonolithicOaiTritonExperts(cfg, weights)
            oai = kernels["oai-triton"]
            row["oai-triton-monolithic (with routing)"] = _time_us(
                mono.forward_logits, hidden, logits
            )
            row["oai-triton (with routing)"] = _time_us(_routed_forward, oai, cfg, hidden, logits)
        logger.info("%s M=%d: %s", name, m, row)
    RESULTS[name], FAILED[name] = times, failed
    assert not failed.keys() & EXTERNAL, failed


def _rule(times: dict[str, dict[str, float]], failed: dict[str, str]) -> dict:
    """Rank the backends; for fp8-block add where deep-gemm overtakes triton for good, and the
    composed triton-or-deep-gemm with, at each count, the time of the backend it runs there."""
    body: dict = {"times_us": times, "failed": failed}
    if all("deep-gemm" in row and "triton" in row for row in times.values()):
        threshold = selection.crossover_tokens(times, "deep-gemm", "triton")
        body["deep_gemm_min_tokens"] = threshold
        for m, row in times.items():
            pick = "deep-gemm" if threshold is not None and int(m) >= threshold else "triton"
            row["triton-or-deep-gemm"] = row[pick]
    ranked = selection.rank_backends(
        {m: {b: t for b, t in row.items() if "(" not in b} for m, row in times.items()}
    )
    body["order"] = list(ranked)
    return body


def test_write_rule_table() -> None:
    assert set(RESULTS) == set(TIMED_LAYERS), "run with the timing tests above"
    rules = {selection.rule_key(LAYERS[n]): _rule(RESULTS[n], FAILED[n]) for n in TIMED_LAYERS}
    table = {
        "device": torch.cuda.get_device_name(CUDA),
        "commit": os.environ.get("MOE_SERVE_COMMIT", "unknown"),
        "method": (
            "median of triton.testing.do_bench (warmup 25 ms, rep 100 ms) of the modular forward "
            "(prepare, experts, finalize) on fixed routing; layers from "
            "tests/kernels/external_cases.py; written by tests/kernels/test_external_timing.py"
        ),
        "rules": rules,
    }
    for key, rule in rules.items():
        assert rule["order"], f"{key}: no backend timed at every token count"
        logger.info(
            "%s: %s, deep-gemm from %s", key, rule["order"], rule.get("deep_gemm_min_tokens")
        )
    out = os.environ.get("MOE_SERVE_AUTO_TABLE")
    if out:
        Path(out).write_text(json.dumps(table, indent=1) + "\n")
        Path(out).with_suffix(".md").write_text(_summary(table))


def _summary(table: dict) -> str:
    lines = [f"# {table['device']} at {table['commit']}: median us per forward"]
    for name in TIMED_LAYERS:
        rule = table["rules"][selection.rule_key(LAYERS[name])]
        backends = sorted({b for row in rule["times_us"].values() for b in row})
        lines += ["", f"## {name} (order: {', '.join(rule['order'])})", ""]
        lines.append("| M | " + " | ".join(backends) + " |")
        lines.append("|---" * (len(backends) + 1) + "|")
        for m, row in rule["times_us"].items():
            cells = [f"{row[b]:.1f}" if b in row else "-" for b in backends]
            lines.append(f"| {m} | " + " | ".join(cells) + " |")
        lines += [f"- {b} not timed: {why}" for b, why in rule["failed"].items()]
    return "\n".join(lines) + "\n"
