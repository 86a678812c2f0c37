"""Which experts backend runs a layer: `select` (a forced `--backend NAME`, or `auto`).

`--backend auto` chooses among the available backends by measured rules.

A rule table (`kernels/tuned/auto_<gpu>.json`, written by `moe-serve bench auto-table` from a
`moe-serve bench kernels` run: bench/auto_table.py) holds, per GPU, for each
`<scheme>/<shape class>` key the median times of every backend at a few token counts, the order
they rank in (geometric mean of their times over those counts) and, for fp8-block, the token
count from which DeepGEMM beats our Triton experts. A layer with a rule takes the first
available backend of its order; any other layer takes the first available backend of
`AUTO_ORDER`. The reason says which.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kernels.config import MoEConfig
from kernels.registry import experts_backends, prepare_finalize_backends
from kernels.stages import Support
from kernels.tensors import Format
from kernels.tuned import TUNED_DIR

if TYPE_CHECKING:
    from kernels.stages import Experts, PrepareFinalize

LARGE_LAYER = 1 << 22  # H * I from which a layer counts as full-size (DeepSeek-V3, gpt-oss)

# Without a rule for this GPU and layer, `auto` tries these in order and the first that supports
# the layer wins: fast GPU paths first, the exact torch reference last (it runs everywhere).
# Ordered as the H100 measured them served (whole-layer CUDA graphs, bench/results): oai-triton
# beat our triton on gpt-oss at every M, and our triton beat deep-gemm (its torch glue and host
# syncs; it cannot be captured) at every M on DeepSeek-V3.
AUTO_ORDER: tuple[str, ...] = (
    "oai-triton",
    "triton",
    "triton-or-deep-gemm",
    "deep-gemm",
    "oai-triton-unfused",
    "reference",
)


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


@dataclass(frozen=True)
class Selection:
    experts: type[Experts]
    prepare_finalize: type[PrepareFinalize]
    reason: str  # why this pair
    rejected: dict[str, str] = field(default_factory=dict)  # backend name -> why not


def _prepare_finalize_for(
    experts: type[Experts], device: torch.device, expert_parallel: bool = False
) -> type[PrepareFinalize]:
    if expert_parallel:
        return prepare_finalize_backends()["naive-ep"]
    for pf in prepare_finalize_backends().values():
        if pf.format == experts.format and pf.supports(device) and pf.name != "naive-ep":
            return pf
    raise LookupError(f"no prepare/finalize stage for the {experts.format} format")


def _expert_parallel_problem(experts: type[Experts]) -> str:
    """Why `experts` cannot hold one rank's slice of a layer under naive-ep; "" if it can."""
    if experts.format != Format.STANDARD:
        return "expert parallelism (naive-ep) dispatches in the standard format"
    if not experts.supports_expert_map:
        return "takes no expert_map, so it cannot hold a slice of the experts"
    return ""


def select(
    cfg: MoEConfig,
    device: torch.device,
    requested: str = "auto",
    expert_parallel: bool = False,
    batch_invariant: bool = False,
) -> Selection:
    """Choose the experts backend for one layer on `device`.

    `requested` is a backend name (forced: an error if it cannot run the layer) or "auto".
    `expert_parallel`: this rank holds a slice of the experts; the backend pairs with naive-ep.
    `batch_invariant`: only backends that can run each row independently of its batch.
    """
    if expert_parallel and batch_invariant:
        raise ValueError(
            "batch invariance is not available with expert parallelism: the ranks' partial "
            "outputs are summed by NCCL, in an order that depends on the message size"
        )
    backends = experts_backends()
    rejected = {}
    for name, cls in backends.items():
        support = cls.supports(cfg, device)
        if support and batch_invariant:
            invariance = cls.batch_invariance(cfg)
            support = Support(invariance.ok, f"not batch-invariant: {invariance.reason}")
        if not support:
            rejected[name] = support.reason
        elif expert_parallel and _expert_parallel_problem(cls):
            rejected[name] = _expert_parallel_problem(cls)
    if requested != "auto":
        if requested not in backends:
            raise ValueError(f"unknown backend {requested!r}; registered: {', '.join(backends)}")
        if requested in rejected:
            raise ValueError(f"backend {requested!r} cannot run this layer: {rejected[requested]}")
        cls = backends[requested]
        pf = _prepare_finalize_for(cls, device, expert_parallel)
        return Selection(cls, pf, "forced by --backend", rejected)
    available = [name for name in backends if name not in rejected]
    choice = auto_choice(cfg, device, available, AUTO_ORDER)
    if choice is not None:
        cls = backends[choice.name]
        pf = _prepare_finalize_for(cls, device, expert_parallel)
        return Selection(cls, pf, choice.reason, rejected)
    details = "; ".join(f"{n}: {r}" for n, r in rejected.items())
    raise ValueError(f"no backend can run this layer on {device}: {details}")


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
