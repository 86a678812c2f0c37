"""Self-calibration on the CPU, with given timings: the rule they make, the budget, the cache and
the modes (kernels/calibrate.py)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moe_serve.kernels import calibrate
from moe_serve.kernels.calibrate import (
    CacheKey,
    Calibration,
    Mode,
    NotRanked,
    cache_path,
    measure,
    read_cached,
    rule_table,
    write_cached,
)
from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.layer import LayerWeights, RouterWeights
from moe_serve.kernels.layer_graphs import token_buckets
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.selection import Rule, RuleTable, rule_key, select
from moe_serve.kernels.timing import TimingPlan

CPU = torch.device("cpu")
GPU = torch.device("cuda")
GPU_NAME = "NVIDIA Test GPU"
CFG = MoEConfig(8, 64, 128, RoutingConfig(top_k=2), dtype=torch.float32)
BUCKETS = (1, 64, 512)
# triton wins decode, deep-gemm from 512 tokens
TIMES_US = {
    "triton": {1: 10.0, 64: 50.0, 512: 400.0},
    "deep-gemm": {1: 30.0, 64: 80.0, 512: 200.0},
}
QUICK = TimingPlan(warmup=1, min_iters=2, max_iters=3, budget_s=0.001)


class Clock:
    """Time that passes only when a candidate is timed: one second a point."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Fake:
    times_us: dict[int, float]
    clock: Clock
    captured: bool = True
    rel_error: float = 0.0
    fails_at: int | None = None
    closed: bool = False

    def time_us(self, tokens: int) -> float:
        self.clock.now += 1.0
        if tokens == self.fails_at:
            raise RuntimeError("illegal memory access")
        return self.times_us[tokens]

    def error(self) -> float:
        return self.rel_error

    def close(self) -> None:
        self.closed = True


def _measure(fakes: dict[str, Fake | Exception], clock: Clock, budget_s: float = 100.0):
    progress: list[tuple[int, int]] = []

    def open_candidate(name: str) -> Fake:
        fake = fakes[name]
        if isinstance(fake, Exception):
            raise fake
        return fake

    measured = measure(
        list(fakes), BUCKETS, open_candidate, 0.01, budget_s, lambda *p: progress.append(p), clock
    )
    return measured, progress


def _fakes(clock: Clock) -> dict[str, Fake]:
    return {name: Fake(times, clock) for name, times in TIMES_US.items()}


def test_the_rule_runs_the_fastest_backend_per_bucket_from_the_given_timings() -> None:
    clock = Clock()
    measured, progress = _measure(_fakes(clock), clock)
    table = rule_table(CFG, GPU_NAME, measured, QUICK)
    body = table["rules"][rule_key(CFG)]
    assert body["plan"] == [[1, "triton"], [512, "deep-gemm"]]
    assert body["served_us"]["512"] == {"triton": 400.0, "deep-gemm": 200.0}
    assert body["captured"] == ["deep-gemm", "triton"]
    assert body["failed"] == {}
    assert progress[-1] == (6, 6)
    assert not measured.stopped


def test_the_calibrated_table_is_read_as_a_tuned_one_and_drives_select() -> None:
    clock = Clock()
    timed = {name: Fake({m: 1.0 for m in BUCKETS}, clock, captured=False) for name in ["reference"]}
    measured, _ = _measure(timed, clock)
    table = RuleTable.from_body(rule_table(CFG, "cpu", measured, QUICK), "a calibration")
    selection = select(CFG, CPU, rules=table)
    assert selection.experts.name == "reference"
    assert f"rule {rule_key(CFG)} of a calibration" in selection.reason


def test_a_failing_a_wrong_and_an_unbuildable_backend_are_not_ranked_with_why() -> None:
    clock = Clock()
    fakes = _fakes(clock) | {
        "oai-triton": Fake(TIMES_US["triton"], clock, fails_at=64),
        "triton-batched": Fake(TIMES_US["triton"], clock, rel_error=0.5),
        "deep-gemm-batched": NotRanked("syncs with the host above 256 tokens"),
        "oai-triton-unfused": RuntimeError("out of memory"),
    }
    measured, progress = _measure(fakes, clock)
    why = measured.not_ranked
    assert why["oai-triton"] == "failed at M=64: RuntimeError: illegal memory access"
    assert why["triton-batched"].startswith("wrong: relative error 0.5")
    assert why["deep-gemm-batched"] == "syncs with the host above 256 tokens"
    assert why["oai-triton-unfused"] == "cannot be built: RuntimeError: out of memory"
    assert set(measured.served_us["1"]) == {"triton", "deep-gemm"}
    assert all(f.closed for f in fakes.values() if isinstance(f, Fake))
    assert progress[-1] == (18, 18)


def test_the_budget_stops_measuring_and_the_rule_ranks_what_was_timed_in_full() -> None:
    clock = Clock()
    fakes = _fakes(clock) | {"oai-triton": Fake(TIMES_US["triton"], clock)}
    measured, progress = _measure(fakes, clock, budget_s=4.5)  # triton's 3 points, 2 of the next
    assert set(measured.served_us["1"]) == {"triton"}
    spent = "the calibration budget of 4.5 s was spent"
    assert measured.not_ranked == {
        "deep-gemm": f"timed at 2 of 3 buckets: {spent}",
        "oai-triton": f"not measured: {spent}",
    }
    assert measured.stopped == spent
    assert [done for done, _ in progress] == sorted(done for done, _ in progress)
    assert progress[-1] == (9, 9)
    body = rule_table(CFG, GPU_NAME, measured, QUICK)["rules"][rule_key(CFG)]
    assert body["plan"] == [[1, "triton"]]


# ---- calibrated_rules: the modes and the cache, on a pretend GPU ------------------------------


@pytest.fixture
def gpu(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """A pretend GPU on which calibrating times the fakes; the list gets each run's budget."""
    runs: list[float] = []
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _device=None: GPU_NAME)
    monkeypatch.setattr(calibrate, "candidates", lambda _cfg, _device: tuple(TIMES_US))
    monkeypatch.setattr(calibrate, "rule_for", lambda _cfg, _device: (None, None))
    monkeypatch.setattr(calibrate, "code_version", lambda: "1.0+abc")

    def fake_calibrate(cfg, _weights, _device, _chunk_tokens, _captures, budget_s, timing,
                       progress):  # fmt: skip
        runs.append(budget_s)
        clock = Clock()
        fakes = _fakes(clock)
        measured = measure(list(fakes), BUCKETS, fakes.__getitem__, 0.01, budget_s, progress,
                           clock)  # fmt: skip
        return rule_table(cfg, GPU_NAME, measured, timing), measured

    monkeypatch.setattr(calibrate, "calibrate", fake_calibrate)
    return runs


def _rules(cache: Path | None, mode: Mode = Mode.ONCE, budget_s: float = 100.0):
    calibration = Calibration(mode, budget_s, cache, QUICK)
    return calibrate.calibrated_rules("layer0", CFG, None, GPU, calibration, 512)


def test_once_measures_on_a_miss_caches_and_then_follows_the_cache(gpu, tmp_path: Path) -> None:
    first = _rules(tmp_path)
    path = cache_path(tmp_path, GPU_NAME, CFG)
    assert path.exists() and path.is_relative_to(tmp_path / "calibration")
    assert first.rules[rule_key(CFG)].plan == ((1, "triton"), (512, "deep-gemm"))
    second = _rules(tmp_path)
    assert gpu == [100.0]  # measured once
    assert second.rules == first.rules
    assert second.source == f"the calibration cached in {path}"
    stored = json.loads(path.read_text())
    assert stored["key"] == {
        "device": GPU_NAME,
        "layer": repr(CFG),
        "buckets": list(token_buckets(512)),
        "candidates": list(TIMES_US),
        "version": "1.0+abc",
    }
    assert stored["device"] == GPU_NAME and stored["commit"] == "1.0+abc"


def test_a_new_code_version_invalidates_the_cached_rule(
    gpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    _rules(tmp_path)
    monkeypatch.setattr(calibrate, "code_version", lambda: "1.1+def")
    with caplog.at_level(logging.INFO, "moe_serve.kernels.calibrate"):
        _rules(tmp_path)
    assert gpu == [100.0, 100.0]
    assert "was measured for another version" in caplog.text
    path = cache_path(tmp_path, GPU_NAME, CFG)
    assert json.loads(path.read_text())["key"]["version"] == "1.1+def"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("device", "NVIDIA H200"),
        ("layer", repr(MoEConfig(8, 64, 256, RoutingConfig(top_k=2), dtype=torch.float32))),
        ("buckets", (1, 64)),
        ("candidates", ("triton",)),
        ("version", "0.9+abc"),
    ],
)
def test_a_cached_rule_holds_only_for_its_own_key(tmp_path: Path, field: str, value) -> None:
    key = CacheKey(GPU_NAME, repr(CFG), BUCKETS, tuple(TIMES_US), "1.0+abc")
    clock = Clock()
    measured, _ = _measure(_fakes(clock), clock)
    path = tmp_path / "rule.json"
    write_cached(path, key, rule_table(CFG, GPU_NAME, measured, QUICK))
    assert read_cached(path, key)[0] is not None
    other = CacheKey(**(key.to_json() | {field: value}))
    table, why = read_cached(path, other)
    assert table is None
    assert why == f"the calibration cached at {path} was measured for another {field}"


def test_an_unreadable_cache_file_is_a_miss_saying_why(tmp_path: Path) -> None:
    key = CacheKey(GPU_NAME, repr(CFG), BUCKETS, tuple(TIMES_US), "1.0+abc")
    path = tmp_path / "rule.json"
    assert read_cached(path, key) == (None, f"no calibration cached at {path}")
    path.write_text("{not json")
    table, why = read_cached(path, key)
    assert table is None and why.startswith(f"the calibration cached at {path} cannot be read")


def test_always_measures_at_each_start_even_where_a_rule_is_cached_or_tuned(
    gpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _rules(tmp_path)
    tuned = Rule("none/small", ("triton",), {})
    monkeypatch.setattr(calibrate, "rule_for", lambda _cfg, _device: (tuned, None))
    assert _rules(tmp_path, Mode.ALWAYS) is not None
    assert _rules(tmp_path, Mode.ALWAYS) is not None
    assert gpu == [100.0, 100.0, 100.0]


def test_once_leaves_a_layer_a_tuned_rule_fits_to_the_tuned_table(
    gpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tuned = Rule("none/small", ("triton",), {})
    monkeypatch.setattr(calibrate, "rule_for", lambda _cfg, _device: (tuned, None))
    assert _rules(tmp_path) is None
    assert gpu == []


def test_off_and_the_cpu_never_calibrate(gpu, tmp_path: Path) -> None:
    assert _rules(tmp_path, Mode.OFF) is None
    calibration = Calibration(Mode.ALWAYS, 100.0, tmp_path, QUICK)
    assert calibrate.calibrated_rules("layer0", CFG, None, CPU, calibration, 512) is None
    assert gpu == []
    assert not (tmp_path / "calibration").exists()


def test_a_calibration_cut_short_is_used_for_this_start_but_not_cached(
    gpu, tmp_path: Path, caplog
) -> None:
    with caplog.at_level(logging.WARNING, "moe_serve.kernels.calibrate"):
        rules = _rules(tmp_path, budget_s=4.5)
    assert rules.rules[rule_key(CFG)].plan == ((1, "triton"),)
    assert rules.source == "this start's calibration (cut short: not cached)"
    assert not cache_path(tmp_path, GPU_NAME, CFG).exists()
    assert "the calibration budget of 4.5 s was spent after" in caplog.text
    assert "the rule ranks triton only" in caplog.text


def test_a_budget_too_small_for_any_backend_falls_back_to_the_fixed_order_saying_why(
    gpu, tmp_path: Path, caplog
) -> None:
    with caplog.at_level(logging.WARNING, "moe_serve.kernels.calibrate"):
        assert _rules(tmp_path, budget_s=0.5) is None
    assert "calibration timed no backend at every bucket" in caplog.text
    assert "auto falls back to its fixed order" in caplog.text
    assert "triton: timed at 1 of 3 buckets: the calibration budget of 0.5 s" in caplog.text


def test_code_version_is_the_package_version_and_a_hash_of_the_kernels() -> None:
    from moe_serve import __version__

    version = calibrate.code_version()
    assert version.startswith(f"{__version__}+")
    assert len(version.removeprefix(f"{__version__}+")) == 12


def test_candidates_leave_out_the_reference_and_the_composed_backend() -> None:
    names = calibrate.candidates(CFG, CPU)
    assert not set(names) & calibrate.LEFT_OUT
    assert {"reference", "reference-batched", "triton-or-deep-gemm"} <= calibrate.LEFT_OUT


def test_a_real_calibration_times_the_layer_as_served_and_checks_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The whole path on the CPU, with an exact backend as the candidate (uncaptured)."""
    monkeypatch.setattr(calibrate, "candidates", lambda _cfg, _device: ("reference-batched",))
    weights = LayerWeights(random_expert_weights(CFG, seed=0), RouterWeights())
    table, measured = calibrate.calibrate(CFG, weights, CPU, 4, budget_s=100.0, timing=QUICK)
    assert measured.not_ranked == {}
    body = table["rules"][rule_key(CFG)]
    assert body["plan"] == [[1, "reference-batched"]]
    assert list(body["served_us"]) == ["1", "2", "4"]
    assert body["captured"] == []
    assert table["device"] == "cpu"
