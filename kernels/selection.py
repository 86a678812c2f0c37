"""`--backend auto`: which available experts backend runs a layer, by measured rules.

A rule table (`kernels/tuned/auto_<gpu>.json`, written by the timing test in
tests/kernels/test_external_timing.py) holds, per GPU, for each `<scheme>/<shape class>` key the
median times of every backend at a few token counts, the order they rank in (geometric mean of
their times over those counts) and, for fp8-block, the token count from which DeepGEMM beats our
Triton experts. A layer with a rule takes the first available backend of its order; any other
layer takes the first available backend of `registry.AUTO_ORDER`. The reason says which.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.config import MoEConfig
from kernels.tuned import TUNED_DIR

LARGE_LAYER = 1 << 22  # H * I from which a layer counts as full-size (DeepSeek-V3, gpt-oss)


def shape_class(cfg: MoEConfig) -> str:
    return "large" if cfg.hidden_size * cfg.intermediate_size >= LARGE_LAYER else "small"


def rule_key(cfg: MoEConfig) -> str:
    return f"{cfg.quant.scheme}/{shape_class(cfg)}"


@dataclass(frozen=True)
class Rule:
    key: str  # "<scheme>/<shape class>"
    order: tuple[str, ...]  # backends, fastest first
    times_us: dict[str, dict[str, float]]  # tokens -> backend -> median microseconds
    # from here on deep-gemm beats triton; None: measured, never; 0: not measured (no triton
    # timings), so deep-gemm runs every size, as vLLM's TritonOrDeepGemm does where it applies
    deep_gemm_min_tokens: int | None = 0


@dataclass(frozen=True)
class RuleTable:
    device: str  # torch.cuda.get_device_name() of the GPU measured
    commit: str
    source: str  # the file, for reasons
    rules: dict[str, Rule]

    @classmethod
    def from_json(cls, path: Path) -> RuleTable:
        raw = json.loads(path.read_text())
        rules = {
            key: Rule(
                key, tuple(body["order"]), body["times_us"], body.get("deep_gemm_min_tokens", 0)
            )
            for key, body in raw["rules"].items()
        }
        return cls(raw["device"], raw["commit"], path.name, rules)


@functools.cache
def _tables() -> tuple[RuleTable, ...]:
    return tuple(RuleTable.from_json(p) for p in sorted(TUNED_DIR.glob("auto_*.json")))


def rule_table(device: torch.device) -> RuleTable | None:
    """The table measured on this GPU model, if any."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((t for t in _tables() if t.device == name), None)


def rule_for(cfg: MoEConfig, device: torch.device) -> tuple[Rule | None, RuleTable | None]:
    table = rule_table(device)
    return (None if table is None else table.rules.get(rule_key(cfg))), table


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str


def auto_choice(
    cfg: MoEConfig, device: torch.device, available: list[str], fallback: tuple[str, ...]
) -> Choice | None:
    """The backend `auto` runs, among `available` (those that support the layer here)."""
    rule, table = rule_for(cfg, device)
    if rule is not None:
        for name in rule.order:
            if name in available:
                return Choice(
                    name,
                    f"auto: rule {rule.key} of {table.source} (measured on {table.device} at "
                    f"commit {table.commit}): fastest available at "
                    f"M={','.join(rule.times_us)} by geometric mean of median times",
                )
    where = f"no measured rules for {device}" if table is None else f"no rule for {rule_key(cfg)}"
    order = tuple(dict.fromkeys((*fallback, "reference")))  # reference always last
    for name in order:
        if name in available:
            return Choice(name, f"auto: {where}; first available in order {', '.join(order)}")
    return None


def deep_gemm_min_tokens(cfg: MoEConfig, device: torch.device) -> tuple[int | None, str]:
    """From how many tokens DeepGEMM beats our Triton experts on this layer, and why.
    None: measured, and never faster. 0 (every size) where triton vs deep-gemm was not measured."""
    rule, table = rule_for(cfg, device)
    if rule is None:
        return 0, f"no measurement for {rule_key(cfg)} on this GPU: deep-gemm at every size"
    if rule.deep_gemm_min_tokens == 0:
        return (
            0,
            f"rule {rule.key} of {table.source} has no triton timings: deep-gemm at every size",
        )
    return rule.deep_gemm_min_tokens, f"rule {rule.key} of {table.source}"


def rank_backends(times_us: dict[str, dict[str, float]]) -> tuple[str, ...]:
    """Backends measured at every token count, by geometric mean of their times, fastest first."""
    counts = list(times_us)
    common = set.intersection(*(set(times_us[m]) for m in counts)) if counts else set()

    def geomean(name: str) -> float:
        return math.exp(sum(math.log(times_us[m][name]) for m in counts) / len(counts))

    return tuple(sorted(common, key=geomean))


def crossover_tokens(times_us: dict[str, dict[str, float]], fast: str, base: str) -> int | None:
    """The smallest measured token count from which `fast` beats `base` at every larger count."""
    counts = sorted((int(m) for m in times_us if {fast, base} <= set(times_us[m])), reverse=True)
    best = None
    for m in counts:
        if times_us[str(m)][fast] >= times_us[str(m)][base]:
            break
        best = m
    return best
