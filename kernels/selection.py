"""Which experts backend runs a layer: `select` (a forced `--backend NAME`, or `auto`).

`--backend auto` chooses among the available backends by measured rules.

A rule table (`kernels/tuned/auto_<gpu>.json`, written by `moe-serve bench tune --mode rules` from a
`moe-serve bench kernels` run: bench/auto_table.py) holds, per GPU, for each
`<scheme>/<shape class>` key every backend's median time at a few token counts in two modes:
served (`served_us`: the whole-layer forward, router and routing included, replayed from a CUDA
graph where the backend captures, uncaptured where it cannot; `captured` names the former) and
the modular forward uncaptured on fixed routing (`times_us`, its geometric-mean `order` and,
for fp8-block, the token count from which DeepGEMM beats our Triton experts). From the served
times it records the `plan`: per token count, which backend runs.

A layer with a served rule runs its plan (kernels/rules.py `token_plan`): the backend closest to
the fastest at every measured count, or a pair of backends (one below a measured count, the other
from it: kernels/experts/token_switch.py) where that lowers the worst ratio to the fastest by more
than SWITCH_MARGIN (1%); so a backend within 1% of the fastest everywhere runs alone. A rule may
also come from the service's self-calibration on this GPU (kernels/calibrate.py), in the same
form, passed in as `rules`. Where a
backend of the plan cannot run here the plan is made again among those that can, and the reason
says so. A rule without served times (an older table) takes the first available backend of its
order; any other layer the first available backend of `AUTO_ORDER`. The reason says which.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .config import MoEConfig
from .experts.token_switch import TokenSwitchExperts, TritonOrDeepGemmExperts
from .registry import experts_backends, prepare_finalize_backends
from .rules import COMPOSED, Plan, plan_text, token_plan
from .stages import Support
from .tensors import Format
from .tuned import TUNED_DIR

if TYPE_CHECKING:
    from .stages import Experts, PrepareFinalize

LARGE_LAYER = 1 << 22  # H * I from which a layer counts as full-size (DeepSeek-V3, gpt-oss)

# Without a rule for this GPU and layer, `auto` tries these in order and the first that supports
# the layer wins: fast GPU paths first, the exact torch reference last (it runs everywhere).
# Ordered by the served times (whole-layer CUDA graphs) of `moe-serve bench kernels` on the H100:
# oai-triton ahead of our triton on gpt-oss, our triton ahead of deep-gemm on DeepSeek-V3.
AUTO_ORDER: tuple[str, ...] = (
    "oai-triton",
    "triton",
    "triton-or-deep-gemm",
    "deep-gemm",
    "oai-triton-unfused",
    "reference",
)


MAX_BACKENDS = 2  # backends one layer holds under auto (a member may keep its own weight layout)


def shape_class(cfg: MoEConfig) -> str:
    return "large" if cfg.hidden_size * cfg.intermediate_size >= LARGE_LAYER else "small"


def rule_key(cfg: MoEConfig) -> str:
    return f"{cfg.quant.scheme}/{shape_class(cfg)}"


@dataclass(frozen=True)
class Rule:
    key: str  # "<scheme>/<shape class>"
    order: tuple[str, ...]  # backends, fastest first
    # tokens -> backend -> median microseconds of the modular forward; empty in a calibrated rule
    # (its order is by served times)
    times_us: dict[str, dict[str, float]]
    # from here on deep-gemm beats triton; None: measured, never; 0: not measured (no triton
    # timings), so deep-gemm runs every size, as vLLM's TritonOrDeepGemm does where it applies
    deep_gemm_min_tokens: int | None = 0
    # served mode: tokens -> backend -> median us of the whole-layer forward, replayed from a
    # CUDA graph for the backends in `captured`, uncaptured for the others; empty in old tables
    served_us: dict[str, dict[str, float]] = field(default_factory=dict)
    captured: frozenset[str] = frozenset()
    plan: Plan = ()  # what auto runs when every backend of it is available
    commit: str = ""  # where measured, when a merged table's rule names it (else the table's)

    @classmethod
    def from_json(cls, key: str, body: dict) -> Rule:
        return cls(
            key,
            tuple(body["order"]),
            body.get("times_us", {}),
            body.get("deep_gemm_min_tokens", 0),
            body.get("served_us", {}),
            frozenset(body.get("captured", ())),
            tuple((int(m), name) for m, name in body.get("plan", ())),
            body.get("commit", ""),
        )


@dataclass(frozen=True)
class RuleTable:
    device: str  # torch.cuda.get_device_name() of the GPU measured
    commit: str
    source: str  # the file, for reasons
    rules: dict[str, Rule]

    @classmethod
    def from_json(cls, path: Path) -> RuleTable:
        return cls.from_body(json.loads(path.read_text()), path.name)

    @classmethod
    def from_body(cls, raw: dict, source: str) -> RuleTable:
        rules = {key: Rule.from_json(key, body) for key, body in raw["rules"].items()}
        return cls(raw["device"], raw["commit"], source, rules)


@functools.cache
def _tables() -> tuple[RuleTable, ...]:
    return tuple(RuleTable.from_json(p) for p in sorted(TUNED_DIR.glob("auto_*.json")))


def rule_table(device: torch.device) -> RuleTable | None:
    """The table measured on this GPU model, if any."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    return next((t for t in _tables() if t.device == name), None)


def rule_for(
    cfg: MoEConfig, device: torch.device, rules: RuleTable | None = None
) -> tuple[Rule | None, RuleTable | None]:
    """This layer's rule, from `rules` or else the table measured on this GPU."""
    table = rules or rule_table(device)
    return (None if table is None else table.rules.get(rule_key(cfg))), table


@dataclass(frozen=True)
class Choice:
    name: str
    reason: str
    plan: Plan = ()  # two or more steps: the backends switch by token count


def _source(rule: Rule, table: RuleTable) -> str:
    """Where a rule comes from, for auto's reasons: its table, GPU and commit."""
    commit = rule.commit or table.commit
    return f"rule {rule.key} of {table.source} (measured on {table.device} at commit {commit})"


def _planned(
    rule: Rule, table: RuleTable, available: list[str], rejected: dict[str, str], switch: bool
) -> Choice | None:
    """The rule's plan, or one made again among `available` where a backend of it is not
    (`switch=False`: one backend at every size)."""
    source = _source(rule, table)
    plan, why = rule.plan, ""
    missing = [name for name in dict.fromkeys(n for _, n in plan) if name not in available]
    if missing or not plan or (len(plan) > 1 and not switch):
        backends = experts_backends()
        composable = frozenset(
            n
            for n in available
            if switch and n in backends and backends[n].format == Format.STANDARD
        )
        candidates = [n for n in available if n not in COMPOSED]
        plan = token_plan(rule.served_us, candidates, rule.captured, composable)
        if not plan:
            return None
        notes = [f"{n} cannot run here ({rejected.get(n, 'not registered')})" for n in missing]
        notes += [] if switch else ["one backend at every size is asked for"]
        if notes:
            why = f"; {'; '.join(notes)}, so the plan was made again among the available backends"
    counts = ",".join(rule.served_us)
    served = "served (a whole-layer CUDA graph where the backend captures)"
    if len(plan) == 1:
        reason = f"auto: {source}: one backend at every size, by the {served} times of M={counts}"
        return Choice(plan[0][1], reason + why)
    steps = plan_text(plan)
    reason = f"auto: {source}: per token count, by the {served} times of M={counts}: {steps}"
    return Choice(plan[0][1], reason + why, plan)


def auto_choice(
    cfg: MoEConfig,
    device: torch.device,
    available: list[str],
    fallback: tuple[str, ...],
    rejected: dict[str, str] | None = None,
    per_tokens: bool = True,
    rules: RuleTable | None = None,
) -> Choice | None:
    """The backend `auto` runs, among `available` (those that support the layer here; the
    others are in `rejected`, with why). `per_tokens=False`: one backend, never a switch."""
    rule, table = rule_for(cfg, device, rules)
    if rule is not None and rule.served_us:
        choice = _planned(rule, table, available, rejected or {}, per_tokens)
        if choice is not None:
            return choice
    if rule is not None:
        for name in rule.order:
            if name in available:
                return Choice(
                    name,
                    f"auto: {_source(rule, table)}: fastest available at "
                    f"M={','.join(rule.times_us or rule.served_us)} "
                    "by geometric mean of median times",
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


def _bound(cls: type[Experts], cfg: MoEConfig, device: torch.device) -> type[Experts]:
    """`cls` as a layer builds it: triton-or-deep-gemm with the token count from which it runs
    deep-gemm, from this GPU's rule table."""
    if cls is TritonOrDeepGemmExperts:
        return cls.at(cfg, device, *deep_gemm_min_tokens(cfg, device))
    return cls


def select(
    cfg: MoEConfig,
    device: torch.device,
    requested: str = "auto",
    expert_parallel: bool = False,
    batch_invariant: bool = False,
    rules: RuleTable | None = None,
) -> Selection:
    """Choose the experts backend for one layer on `device`.

    `requested` is a backend name (forced: an error if it cannot run the layer) or "auto".
    `expert_parallel`: this rank holds a slice of the experts; the backend pairs with naive-ep.
    `batch_invariant`: only backends that can run each row independently of its batch (and one
    backend at every token count). `rules`: auto's table instead of this GPU's (benchmarks).
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
        cls = _bound(backends[requested], cfg, device)
        pf = _prepare_finalize_for(cls, device, expert_parallel)
        return Selection(cls, pf, "forced by --backend", rejected)
    available = [name for name in backends if name not in rejected]
    choice = auto_choice(cfg, device, available, AUTO_ORDER, rejected, not batch_invariant, rules)
    if choice is not None:
        if choice.plan:
            cls = TokenSwitchExperts.over(tuple((m, backends[n]) for m, n in choice.plan))
        else:
            cls = _bound(backends[choice.name], cfg, device)
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
