"""`--backend auto`: measured rules first, the fallback order otherwise, the reference last."""

from __future__ import annotations

import json
import re

import pytest
import torch

from moe_serve.kernels import registry, selection
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.experts.deep_gemm import DeepGemmExperts
from moe_serve.kernels.experts.reference import ReferenceExperts
from moe_serve.kernels.experts.token_switch import TritonOrDeepGemmExperts
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.kernels.stages import YES
from moe_serve.kernels.tuned import TUNED_DIR

GPU = torch.device("cuda")
LARGE = MoEConfig(256, 7168, 2048, RoutingConfig(top_k=8), quant=QuantConfig("fp8-block"))
SMALL = MoEConfig(16, 512, 256, RoutingConfig(top_k=4), quant=QuantConfig("fp8-block"))
TIMES = {
    "1": {"triton": 40.0, "deep-gemm": 90.0},
    "64": {"triton": 80.0, "deep-gemm": 85.0},
    "4096": {"triton": 900.0, "deep-gemm": 500.0},
}


def _table(**rules: selection.Rule) -> selection.RuleTable:
    return selection.RuleTable("NVIDIA H100 80GB HBM3", "abc1234", "auto_h100.json", rules)


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> None:
    rule = selection.Rule("fp8-block/large", ("deep-gemm", "triton", "reference"), TIMES, 4096)
    monkeypatch.setattr(selection, "rule_table", lambda device: _table(**{rule.key: rule}))


def test_shape_class_splits_full_size_layers_from_scaled_down_ones() -> None:
    assert selection.rule_key(LARGE) == "fp8-block/large"
    assert selection.rule_key(SMALL) == "fp8-block/small"


def test_a_rule_picks_its_fastest_available_backend_and_says_so(measured: None) -> None:
    choice = selection.auto_choice(LARGE, GPU, ["reference", "triton", "deep-gemm"], ())
    assert choice.name == "deep-gemm"
    assert "rule fp8-block/large of auto_h100.json" in choice.reason
    assert "abc1234" in choice.reason
    choice = selection.auto_choice(LARGE, GPU, ["reference", "triton"], ())
    assert choice.name == "triton"  # the winner is unavailable: the next in the rule's order


def test_without_a_rule_the_fallback_order_decides_and_reference_comes_last(
    measured: None,
) -> None:
    choice = selection.auto_choice(SMALL, GPU, ["reference", "triton"], ("deep-gemm", "triton"))
    assert choice.name == "triton"
    assert choice.reason.startswith("auto: no rule for fp8-block/small; first available in order")
    assert choice.reason.endswith("deep-gemm, triton, reference")
    only_reference = selection.auto_choice(SMALL, GPU, ["reference"], ("deep-gemm",))
    assert only_reference.name == "reference"
    assert selection.auto_choice(SMALL, GPU, [], ("reference",)) is None


def test_the_cpu_has_no_rules_and_auto_selects_the_reference() -> None:
    choice = selection.select(SMALL, torch.device("cpu"))
    assert choice.experts.name == "reference"
    assert choice.reason.startswith("auto: no measured rules for cpu")
    assert choice.rejected["deep-gemm"] == "runs on cuda, not cpu"


def test_deep_gemm_threshold_comes_from_the_rule(measured: None) -> None:
    assert selection.deep_gemm_min_tokens(LARGE, GPU) == (
        4096,
        "rule fp8-block/large of auto_h100.json",
    )
    threshold, why = selection.deep_gemm_min_tokens(SMALL, GPU)
    assert threshold == 0 and why.endswith("deep-gemm at every size")


def test_triton_or_deep_gemm_is_built_with_the_count_of_its_rule(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Selection binds the count from the rule table; here on the CPU, where the reference
    stands in for the Triton experts below it."""
    rule = selection.Rule("fp8-block/large", ("triton-or-deep-gemm",), TIMES, 4096)
    monkeypatch.setattr(selection, "rule_table", lambda device: _table(**{rule.key: rule}))
    monkeypatch.setattr(TritonOrDeepGemmExperts, "devices", frozenset({"cpu"}))
    monkeypatch.setattr(TritonOrDeepGemmExperts, "environment", classmethod(lambda cls, d: YES))
    for requested in ("triton-or-deep-gemm", "auto"):  # auto: the first of the rule's order
        experts = selection.select(LARGE, torch.device("cpu"), requested).experts
        assert experts.name == "triton-or-deep-gemm"
        assert experts.plan == ((1, ReferenceExperts), (4096, DeepGemmExperts))
        assert experts.source == "rule fp8-block/large of auto_h100.json"


def test_a_rule_without_triton_timings_loads_as_unmeasured(tmp_path) -> None:
    body = {"order": ["deep-gemm"], "times_us": {"1": {"deep-gemm": 5.0}}}
    path = tmp_path / "auto_x.json"
    path.write_text(json.dumps({"device": "X", "commit": "c", "rules": {"fp8-block/large": body}}))
    assert selection.RuleTable.from_json(path).rules["fp8-block/large"].deep_gemm_min_tokens == 0
    body["deep_gemm_min_tokens"] = None  # measured: deep-gemm never won
    path.write_text(json.dumps({"device": "X", "commit": "c", "rules": {"fp8-block/large": body}}))
    assert selection.RuleTable.from_json(path).rules["fp8-block/large"].deep_gemm_min_tokens is None


@pytest.mark.parametrize("path", sorted(TUNED_DIR.glob("auto_*.json")), ids=str)
def test_shipped_rule_tables_name_registered_backends(path) -> None:
    table = selection.RuleTable.from_json(path)
    backends = registry.experts_backends()
    assert table.rules, f"{path.name} holds no rules"
    for rule in table.rules.values():
        assert set(rule.order) <= set(backends), rule.key
        assert rule.key.split("/")[0] in {s.value for s in QuantScheme}
        assert list(rule.times_us) == sorted(rule.times_us, key=int)
    assert json.loads(path.read_text())["device"].startswith("NVIDIA")


@pytest.mark.parametrize("path", sorted(TUNED_DIR.glob("auto_*.json")), ids=str)
def test_shipped_rule_tables_say_what_measured_them_and_each_merged_rule(path) -> None:
    body = json.loads(path.read_text())
    for where in (body, *(rule for rule in body["rules"].values() if "commit" in rule)):
        assert re.fullmatch(r"[0-9a-f]{7,}(-dirty)?", where["commit"])
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", where["date"])
        assert where["command"].startswith("moe-serve bench kernels --shapes ")
