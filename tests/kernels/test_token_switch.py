"""Auto per token count: the plan from a rule table's served times, the choice it makes where a
backend is missing, and the switch's forward at the boundaries of its steps."""

from __future__ import annotations

from typing import ClassVar

import pytest
import torch

from moe_serve.kernels import registry, rules, selection
from moe_serve.kernels.accuracy import relative_error
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.experts.deep_gemm import DeepGemmExperts
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.token_switch import TokenSwitchExperts, TritonOrDeepGemmExperts
from moe_serve.kernels.layer import LayerWeights, RouterWeights, build_layer
from moe_serve.kernels.modular import ModularKernel
from moe_serve.kernels.prepare_finalize.no_ep import NoEP
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.quantize import dequantize_activation, quantize_activation
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing import route
from moe_serve.kernels.tensors import ForwardInputs, Routing
from moe_serve.kernels.tuned import TUNED_DIR
from moe_serve.kernels.workspace import Workspace

GPU = torch.device("cuda")
CPU = torch.device("cpu")
GPT_OSS_LIKE = MoEConfig(128, 2880, 2880, RoutingConfig(top_k=4), quant=QuantConfig("mxfp4"))
CAPTURED = frozenset({"triton", "oai-triton"})
STANDARD = frozenset({"triton", "oai-triton", "reference"})
# served times (us): triton wins decode, oai-triton from 64 on; triton-batched never
SERVED = {
    "1": {"triton": 90.0, "oai-triton": 180.0, "triton-batched": 900.0},
    "16": {"triton": 120.0, "oai-triton": 150.0, "triton-batched": 900.0},
    "64": {"triton": 400.0, "oai-triton": 200.0, "triton-batched": 950.0},
    "4096": {"triton": 8000.0, "oai-triton": 2400.0, "triton-batched": 9000.0},
}
BOTH = ["triton", "oai-triton", "triton-batched"]


def _plan(served: dict = SERVED, candidates: list[str] = BOTH) -> rules.Plan:
    return rules.token_plan(served, candidates, CAPTURED, STANDARD)


def test_the_plan_runs_the_fastest_per_count_from_the_first_count_it_wins() -> None:
    assert _plan() == ((1, "triton"), (64, "oai-triton"))


def test_one_backend_fastest_everywhere_runs_alone() -> None:
    close = {m: t | {"oai-triton": t["triton"] * 1.03} for m, t in SERVED.items()}
    assert _plan(close) == ((1, "triton"),)
    assert _plan(candidates=["oai-triton"]) == ((1, "oai-triton"),)


def test_below_the_smallest_measured_count_the_first_backend_runs() -> None:
    from16 = {m: t for m, t in SERVED.items() if m != "1"}
    assert _plan(from16) == ((1, "triton"), (64, "oai-triton"))  # 16 is the smallest measured


def test_a_backend_not_timed_at_every_count_is_no_option() -> None:
    partial = SERVED | {"4096": {"triton": 8000.0}}
    assert _plan(partial) == ((1, "triton"),)
    assert _plan(candidates=["reference"]) == ()  # never timed


def test_a_captured_and_an_uncaptured_backend_never_share_a_layer() -> None:
    # triton-batched, not in CAPTURED here: paired with triton every bucket would run uncaptured
    fast_prefill = SERVED | {"4096": {"triton": 8000.0, "triton-batched": 3000.0}}
    composable = STANDARD | {"triton-batched"}
    plan = rules.token_plan(fast_prefill, ["triton", "triton-batched"], CAPTURED, composable)
    assert plan == ((1, "triton"),)


def test_with_more_than_two_winners_the_closest_pair_runs() -> None:
    three = {
        "1": {"a": 10.0, "b": 30.0, "c": 30.0},
        "16": {"a": 30.0, "b": 10.0, "c": 30.0},
        "64": {"a": 31.0, "b": 30.0, "c": 11.0},
    }
    abc = frozenset("abc")
    plan = rules.token_plan(three, ["a", "b", "c"], abc, abc)
    assert plan == ((1, "a"), (16, "b"))  # (a, b) is 2.7x off at 64; (a, c) or (b, c): 3x


# served times (us): a and b tie at every count; each test slows one of them down somewhere
TIE = {"1": {"a": 100.0, "b": 100.0}, "16": {"a": 200.0, "b": 200.0},
       "256": {"a": 400.0, "b": 400.0}, "4096": {"a": 800.0, "b": 800.0}}  # fmt: skip
AB = frozenset({"a", "b"})


def _slower(times: dict, name: str, factors: dict[str, float]) -> dict:
    return {m: t | {name: t[name] * factors.get(m, 1.0)} for m, t in times.items()}


def test_a_backend_two_percent_off_at_one_count_gets_a_second_backend_there() -> None:
    # a alone is 2% off at 256, b alone 2% off below it: the pair meets each count's fastest
    served = _slower(_slower(TIE, "a", {"256": 1.02}), "b", {"1": 1.02, "16": 1.02})
    assert rules.token_plan(served, ["a", "b"], AB, AB) == ((1, "a"), (256, "b"))
    # b 2% off nowhere: it runs alone, no second layout
    assert rules.token_plan(_slower(TIE, "a", {"256": 1.02}), ["a", "b"], AB, AB) == ((1, "b"),)


def test_a_backend_within_half_a_percent_everywhere_runs_alone() -> None:
    served = _slower(_slower(TIE, "a", {"256": 1.005}), "b", {"1": 1.005, "16": 1.005})
    assert rules.token_plan(served, ["a", "b"], AB, AB) == ((1, "a"),)


def test_a_pair_must_gain_more_than_the_margin_over_the_best_alone() -> None:
    # c, timed at 4096 only (no option), is 5% faster there than a; b gains 0.5% on a there
    served = _slower(_slower(TIE, "a", {"4096": 1.05}), "b", {"1": 1.06, "4096": 1.045})
    served["4096"]["c"] = 800.0
    assert rules.token_plan(served, ["a", "b", "c"], AB, AB) == ((1, "a"),)
    served["4096"]["b"] = 800.0 * 1.02  # a gain of 3%: worth a second backend
    assert rules.token_plan(served, ["a", "b", "c"], AB, AB) == ((1, "a"), (4096, "b"))


def test_a_pair_switches_once_even_where_close_times_alternate() -> None:
    # fastest per count: a, b, a, b, by 0.2-0.3% in the middle: the pair switches once
    served = _slower(_slower(TIE, "a", {"16": 1.002, "4096": 1.05}), "b", {"1": 1.05, "256": 1.003})
    assert rules.token_plan(served, ["a", "b"], AB, AB) == ((1, "a"), (4096, "b"))


def _rule(plan: selection.Plan = ((1, "triton"), (64, "oai-triton"))) -> selection.Rule:
    return selection.Rule(
        "mxfp4/large", ("triton",), {m: {"triton": 1.0} for m in SERVED}, None, SERVED,
        CAPTURED, plan,
    )  # fmt: skip


def _table(rule: selection.Rule) -> selection.RuleTable:
    return selection.RuleTable(
        "NVIDIA H100 80GB HBM3", "abc1234", "auto_h100.json", {rule.key: rule}
    )


def test_auto_runs_the_tables_plan_and_names_every_step() -> None:
    choice = selection.auto_choice(GPT_OSS_LIKE, GPU, BOTH, (), rules=_table(_rule()))
    assert choice.plan == ((1, "triton"), (64, "oai-triton"))
    assert "triton from M=1, oai-triton from M=64" in choice.reason
    assert "rule mxfp4/large of auto_h100.json" in choice.reason and "abc1234" in choice.reason


def test_a_plan_naming_an_unavailable_backend_is_made_again_and_says_why() -> None:
    rejected = {"oai-triton": "triton_kernels not importable: no module"}
    choice = selection.auto_choice(
        GPT_OSS_LIKE, GPU, ["triton", "triton-batched"], (), rejected, rules=_table(_rule())
    )
    assert (choice.name, choice.plan) == ("triton", ())
    assert "oai-triton cannot run here (triton_kernels not importable: no module)" in choice.reason
    assert "plan was made again among the available backends" in choice.reason


def test_batch_invariance_takes_one_backend_at_every_size() -> None:
    choice = selection.auto_choice(
        GPT_OSS_LIKE, GPU, BOTH, (), per_tokens=False, rules=_table(_rule())
    )
    assert (choice.name, choice.plan) == ("oai-triton", ())  # the better of the two alone
    assert "one backend at every size" in choice.reason


def test_a_rule_without_served_times_keeps_its_order() -> None:
    old = selection.Rule("mxfp4/large", ("oai-triton", "triton"), {"1": {"triton": 1.0}})
    choice = selection.auto_choice(GPT_OSS_LIKE, GPU, BOTH, (), rules=_table(old))
    assert (choice.name, choice.plan) == ("oai-triton", ())


def test_rule_from_json_reads_the_plan_and_the_served_times() -> None:
    body = {"order": ["triton"], "times_us": {}, "served_us": SERVED, "captured": ["triton"],
            "plan": [[1, "triton"], [64, "oai-triton"]]}  # fmt: skip
    rule = selection.Rule.from_json("mxfp4/large", body)
    assert rule.plan == ((1, "triton"), (64, "oai-triton"))
    assert rule.captured == frozenset({"triton"}) and rule.served_us == SERVED
    assert rule.commit == ""  # the table's commit stands for it
    own = selection.Rule.from_json("mxfp4/large", body | {"commit": "def5678"})  # merged
    choice = selection.auto_choice(GPT_OSS_LIKE, GPU, BOTH, (), rules=_table(own))
    assert "at commit def5678" in choice.reason


class _Named(ReferenceExperts):
    """The reference under another name, remembering how many tokens it was given."""

    calls: ClassVar[list[int]]

    def apply(self, x, ws):
        type(self).calls.append(x.num_tokens)
        return super().apply(x, ws)


def _member(name: str, quantized_input: bool = True) -> type[_Named]:
    attrs = {"name": name, "calls": [], "takes_quantized_input": quantized_input}
    return type(name, (_Named,), attrs)


def _config(scheme: QuantScheme) -> MoEConfig:
    return MoEConfig(
        6, 64, 96, RoutingConfig(top_k=2), quant=QuantConfig(scheme), dtype=torch.float32
    )


@pytest.mark.parametrize("scheme", [QuantScheme.NONE, QuantScheme.FP8_TOKEN])
def test_each_call_runs_the_member_of_its_step_and_matches_the_reference(
    scheme: QuantScheme,
) -> None:
    cfg = _config(scheme)
    small, large = _member("small"), _member("large")
    switch = TokenSwitchExperts.over(((1, small), (8, large), (32, small)))
    assert switch.name == "small<8<=large<32<=small"
    weights = random_expert_weights(cfg, seed=7)
    kernel = ModularKernel(NoEP(), switch(cfg, weights), Workspace(CPU))
    assert kernel.experts.by_tokens() == ((1, "small"), (8, "large"), (32, "small"))
    reference = ModularKernel(NoEP(), ReferenceExperts(cfg, weights), Workspace(CPU))
    # M=1, below a step, exactly at each step, above the largest
    ran = {1: "small", 7: "small", 8: "large", 31: "large", 32: "small", 100: "small"}
    for tokens, expected in ran.items():
        hidden = torch.randn(tokens, 64)
        routing = route(torch.randn(tokens, 6), cfg.routing)
        out = kernel.forward(hidden, routing)
        assert kernel.experts.last_ran == expected
        assert relative_error(out, reference.forward(hidden, routing)) < 1e-6
    assert small.calls == [1, 7, 32, 100]
    assert large.calls == [8, 31]


def test_a_member_that_wants_fp8_gets_it_quantised_when_the_other_does_not() -> None:
    cfg = _config(QuantScheme.FP8_TOKEN)
    plain, fp8 = _member("plain", quantized_input=False), _member("fp8")
    switch = TokenSwitchExperts.over(((1, plain), (4, fp8)))
    assert not switch.takes_quantized_input  # prepare leaves the activations 16-bit
    weights = random_expert_weights(cfg, seed=3)
    kernel = ModularKernel(NoEP(), switch(cfg, weights), Workspace(CPU))
    reference = ModularKernel(NoEP(), ReferenceExperts(cfg, weights), Workspace(CPU))
    hidden = torch.randn(9, 64)
    routing = route(torch.randn(9, 6), cfg.routing)
    assert torch.equal(kernel.forward(hidden, routing), reference.forward(hidden, routing))
    few = torch.randn(2, 64)  # below 4: the member that takes the activations as they are
    routing = route(torch.randn(2, 6), cfg.routing)
    unquantized = ModularKernel(NoEP(), plain(cfg, weights), Workspace(CPU))
    assert torch.equal(kernel.forward(few, routing), unquantized.forward(few, routing))
    assert not torch.equal(kernel.forward(few, routing), reference.forward(few, routing))


def test_a_member_that_takes_16_bits_gets_the_fp8_input_of_the_switch_dequantised() -> None:
    """A switch that takes fp8 (triton-or-deep-gemm, as deep-gemm takes it) hands a member that
    takes 16 bits the input dequantised."""
    cfg = _config(QuantScheme.FP8_TOKEN)
    plain, fp8 = _member("plain", quantized_input=False), _member("fp8")
    pair = TokenSwitchExperts.over(((1, plain), (4, fp8)))
    switch = type("Fp8In", (pair,), {"takes_quantized_input": True})
    weights = random_expert_weights(cfg, seed=5)
    kernel = ModularKernel(NoEP(), switch(cfg, weights), Workspace(CPU))
    reference = ModularKernel(NoEP(), ReferenceExperts(cfg, weights), Workspace(CPU))
    unquantized = ModularKernel(NoEP(), plain(cfg, weights), Workspace(CPU))
    hidden = torch.randn(9, 64)
    routing = route(torch.randn(9, 6), cfg.routing)
    assert torch.equal(kernel.forward(hidden, routing), reference.forward(hidden, routing))
    few = hidden[:2]  # below 4: plain, on the numbers the fp8 input holds
    routing = Routing(routing.topk_ids[:2], routing.topk_weights[:2])
    how = cfg.quant.spec.act_quant
    fp8_values = dequantize_activation(*quantize_activation(few, how), how).to(cfg.dtype)
    assert torch.equal(kernel.forward(few, routing), unquantized.forward(fp8_values, routing))
    assert kernel.experts.last_ran == "plain"
    assert plain.calls == [2, 2] and fp8.calls == [9]


def test_workspace_holds_each_member_at_the_largest_call_it_runs() -> None:
    class Buffered(_Named):
        def workspace_shapes(self, num_tokens: int) -> dict:
            return {self.name: ((num_tokens,), torch.float32)}

    small = type("small", (Buffered,), {"name": "small", "calls": []})
    large = type("large", (Buffered,), {"name": "large", "calls": []})
    cfg = _config(QuantScheme.NONE)
    experts = TokenSwitchExperts.over(((1, small), (8, large)))(cfg, random_expert_weights(cfg))
    assert experts.workspace_shapes(100) == {"small": ((7,), torch.float32),
                                             "large": ((100,), torch.float32)}  # fmt: skip
    assert experts.workspace_shapes(5) == {"small": ((5,), torch.float32)}


def test_a_switch_takes_two_steps_from_one_of_standard_format_members() -> None:
    with pytest.raises(ValueError, match="from 1 token up"):
        TokenSwitchExperts.over(((4, ReferenceExperts), (8, _member("b"))))
    with pytest.raises(ValueError, match="from 1 token up"):
        TokenSwitchExperts.over(((1, ReferenceExperts),))
    with pytest.raises(ValueError, match="in a row"):
        TokenSwitchExperts.over(((1, ReferenceExperts), (8, ReferenceExperts)))
    batched = registry.experts_backends()["reference-batched"]
    with pytest.raises(ValueError, match="standard-format"):
        TokenSwitchExperts.over(((1, ReferenceExperts), (8, batched)))


def test_a_switch_is_never_built_batch_invariant() -> None:
    cfg = _config(QuantScheme.NONE)
    switch = TokenSwitchExperts.over(((1, _member("a")), (8, _member("b"))))
    with pytest.raises(ValueError, match="not batch-invariant"):
        switch(cfg, random_expert_weights(cfg), batch_invariant=True)


def test_triton_or_deep_gemm_is_built_only_with_the_count_selection_binds() -> None:
    cfg = _config(QuantScheme.FP8_BLOCK)
    with pytest.raises(ValueError, match=r"kernels\.selection\.select binds"):
        TritonOrDeepGemmExperts(cfg, random_expert_weights(cfg))
    plans = {  # the count deep-gemm runs from -> the plan; the reference stands in for triton
        None: ((1, ReferenceExperts),),
        0: ((1, DeepGemmExperts),),
        1: ((1, DeepGemmExperts),),
        64: ((1, ReferenceExperts), (64, DeepGemmExperts)),
    }
    for min_tokens, plan in plans.items():
        switch = TritonOrDeepGemmExperts.at(cfg, CPU, min_tokens, "test rule")
        assert (switch.name, switch.plan, switch.source) == (
            "triton-or-deep-gemm",
            plan,
            "test rule",
        )
        assert switch.takes_quantized_input  # fp8 in, as deep-gemm takes it


def test_build_layer_under_auto_holds_the_switch_the_table_plans(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU: a table whose plan pairs the reference with a second CPU backend."""
    second = _member("second")
    second.devices = frozenset({"cpu"})
    second.schemes = ReferenceExperts.schemes
    monkeypatch.setitem(registry.EXPERTS, "second", second)
    cfg = _config(QuantScheme.NONE)
    served = {"1": {"reference": 10.0, "second": 20.0}, "8": {"reference": 20.0, "second": 10.0}}
    rule = selection.Rule(
        selection.rule_key(cfg), ("reference",), served, None, served,
        frozenset(), ((1, "reference"), (8, "second")),
    )  # fmt: skip
    table = selection.RuleTable("cpu", "abc1234", "auto_cpu.json", {rule.key: rule})
    weights = LayerWeights(random_expert_weights(cfg, seed=1), RouterWeights())
    layer, choice = build_layer(cfg, weights, CPU, rules=table)
    assert choice.experts.name == "reference<8<=second"
    assert layer.kernel.experts.by_tokens() == ((1, "reference"), (8, "second"))
    for tokens, ran in ((1, "reference"), (8, "second"), (40, "second")):
        layer.forward(ForwardInputs(torch.randn(tokens, 64), torch.randn(tokens, 6)))
        assert layer.kernel.experts.last_ran == ran


def test_select_falls_back_from_a_plan_member_that_cannot_run_here_naming_why() -> None:
    cfg = _config(QuantScheme.NONE)
    served = {"1": {"triton": 1.0, "reference": 5.0}, "8": {"triton": 9.0, "reference": 5.0}}
    rule = selection.Rule(
        selection.rule_key(cfg), ("triton",), served, None, served,
        frozenset({"triton"}), ((1, "triton"), (8, "reference")),
    )  # fmt: skip
    table = selection.RuleTable("cpu", "abc1234", "auto_cpu.json", {rule.key: rule})
    choice = selection.select(cfg, CPU, rules=table)  # triton runs on CUDA only
    assert choice.experts is ReferenceExperts
    assert "triton cannot run here (runs on cuda, not cpu)" in choice.reason


@pytest.mark.parametrize("path", sorted(TUNED_DIR.glob("auto_*.json")), ids=str)
def test_shipped_plans_hold_at_most_two_registered_backends_from_one_token(path) -> None:
    backends = registry.experts_backends()
    for rule in selection.RuleTable.from_json(path).rules.values():
        names = {name for _, name in rule.plan}
        assert names <= set(backends) and len(names) <= selection.MAX_BACKENDS, rule.key
        assert not rule.plan or rule.plan[0][0] == 1, rule.key
        assert set(rule.served_us) == set(rule.times_us) or not rule.served_us, rule.key
