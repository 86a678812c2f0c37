"""Auto's per-token-count switch: the plan from measurements, and the switch's forward."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from kernels import registry, selection
from kernels.config import MoEConfig, RoutingConfig
from kernels.experts.reference import ReferenceExperts
from kernels.experts.token_switch import TokenSwitchExperts
from kernels.modular import ModularKernel
from kernels.prepare_finalize.no_ep import NoEP
from kernels.quant_scheme import QuantConfig, QuantScheme
from kernels.routing import route
from kernels.testing import random_expert_weights, relative_error
from kernels.workspace import Workspace

GPU = torch.device("cuda")
GPT_OSS_LIKE = MoEConfig(128, 2880, 2880, RoutingConfig(top_k=4), quant=QuantConfig("mxfp4"))
# a small backend that wins decode and a large one that wins prefill
TIMES = {
    "1": {"small": 190.0, "large": 1475.0, "slow": 5000.0},
    "16": {"small": 1213.8, "large": 1221.8},
    "64": {"small": 2684.5, "large": 1174.6},
    "4096": {"small": 7987.7, "large": 2399.5},
}


def _rule(times: dict = TIMES) -> selection.Rule:
    return selection.Rule("mxfp4/large", selection.rank_backends(times), times, None)


def test_plan_switches_at_the_first_measured_count_a_new_backend_wins() -> None:
    assert selection.token_plan(_rule(), {"small", "large"}) == ((0, "small"), (64, "large"))


def test_no_plan_when_one_backend_is_within_three_percent_everywhere() -> None:
    close = {m: {"small": t["small"], "large": t["small"] * 1.02} for m, t in TIMES.items()}
    assert selection.token_plan(_rule(close), {"small", "large"}) is None
    assert selection.token_plan(_rule(), {"large"}) is None  # one candidate: nothing to switch


def test_no_plan_when_a_count_has_no_candidate_timed() -> None:
    assert selection.token_plan(_rule(), {"slow", "large"}) is None  # slow only timed at 1


def test_auto_returns_the_plan_and_names_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    table = selection.RuleTable("H100", "abc1234", "auto_h100.json", {"mxfp4/large": _rule()})
    monkeypatch.setattr(selection, "rule_table", lambda device: table)
    choice = selection.auto_choice(
        GPT_OSS_LIKE, GPU, ["small", "large"], (), frozenset({"small", "large"})
    )
    assert choice.plan == ((0, "small"), (64, "large"))
    assert "small from M=0, large from M=64" in choice.reason


class _Named(ReferenceExperts):
    """The reference under another name, remembering how many tokens it was given."""

    calls: ClassVar[list[int]]

    def apply(self, x, ws):
        type(self).calls.append(x.num_tokens)
        return super().apply(x, ws)


def _member(name: str) -> type[ReferenceExperts]:
    return type(name, (_Named,), {"name": name, "calls": []})


@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_TOKEN])
def test_switch_runs_the_planned_member_and_matches_the_reference(scheme: QuantScheme) -> None:
    cfg = MoEConfig(
        6, 64, 96, RoutingConfig(top_k=2), quant=QuantConfig(scheme), dtype=torch.float32
    )
    small, large = _member("small"), _member("large")
    switch = TokenSwitchExperts.over(((0, small), (8, large)))
    assert switch.name == "small<8<=large"
    weights = random_expert_weights(cfg, seed=7)
    kernel = ModularKernel(NoEP(), switch(cfg, weights), Workspace("cpu"))
    reference = ModularKernel(NoEP(), ReferenceExperts(cfg, weights), Workspace("cpu"))
    for tokens, ran in ((1, "small"), (7, "small"), (8, "large"), (40, "large")):
        hidden = torch.randn(tokens, 64)
        routing = route(torch.randn(tokens, 6), cfg.routing)
        out = kernel.forward(hidden, routing)
        assert kernel.experts.last_ran == ran
        assert relative_error(out, reference.forward(hidden, routing)) < 1e-6
    assert small.calls == [1, 7]
    assert large.calls == [8, 40]


def test_a_switch_must_start_at_zero_and_take_the_standard_format() -> None:
    with pytest.raises(ValueError, match="starts at 0"):
        TokenSwitchExperts.over(((4, ReferenceExperts),))
    batched = registry.experts_backends()["reference-batched"]
    with pytest.raises(ValueError, match="standard-format"):
        TokenSwitchExperts.over(((0, ReferenceExperts), (8, batched)))
