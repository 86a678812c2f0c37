"""`moe-serve bench tune` (`--mode tiles`): the tile search's rounds, its confirmation on fresh
routings, and resuming a tuned file (bench/tune.py)."""

from __future__ import annotations

import argparse
import json
import re
import sys

import pytest
import torch

from moe_serve.bench import environment
from moe_serve.bench.tune import (
    PREFILL_SMEM_BYTES,
    TuneRequest,
    buckets_to_search,
    candidates,
    confirmed,
    decode_choices,
    fastest,
    gemm2_choices,
    order_choices,
    parse_shape,
    per_pair_choices,
    prefill_choices,
    tune,
)
from moe_serve.kernels.experts import triton as triton_experts
from moe_serve.kernels.experts._triton import tiles
from moe_serve.kernels.experts.triton import TritonExperts
from moe_serve.kernels.quant_scheme import QuantScheme
from moe_serve.service.cli import main
from tests.kernels.triton_cases import Case

CPU = torch.device("cpu")


def test_tune_candidates_include_the_heuristic_and_respect_the_fp8_block() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK).config()
    found = candidates(cfg, 64)
    assert found[0] == tiles.heuristic_tiles(cfg, 64)
    assert len(set(found)) == len(found) > 3
    assert all(128 % t.gemm1.block_k == 0 and 128 % t.gemm2.block_k == 0 for t in found)


def test_tune_later_rounds_vary_gemm2_alone_then_the_program_order_of_both() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK).config()
    best = tiles.heuristic_tiles(cfg, 64)
    second = gemm2_choices(cfg, best)
    assert {t.gemm2.block_n for t in second} >= {64, 128, 256}
    assert all(t.gemm1 == best.gemm1 and t.block_m == best.block_m for t in second)
    assert all(128 % t.gemm2.block_k == 0 for t in second)
    third = order_choices(second[-1])
    assert sorted(t.gemm1.group_m for t in third) == sorted(t.gemm2.group_m for t in third)
    assert len({t.gemm1.group_m for t in third}) == len(third) == 4


def test_tune_decode_round_varies_one_gemm_past_four_stages_within_shared_memory() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK).config()
    best = tiles.heuristic_tiles(cfg, 1)
    for gemm, other in (("gemm1", "gemm2"), ("gemm2", "gemm1")):
        found = decode_choices(cfg, best, gemm)
        assert all(getattr(t, other) == getattr(best, other) for t in found)
        varied = [getattr(t, gemm) for t in found]
        assert max(t.num_stages for t in varied) > 4
        assert {t.block_n for t in varied} == {16, 32, 64, 128}
        b_tiles = 2 if gemm == "gemm1" else 1
        assert all(
            (best.block_m + b_tiles * t.block_n) * t.block_k * t.num_stages
            <= tiles.SMEM_BUDGET_BYTES
            for t in varied
        )
    # GEMM1's two weight tiles: its deepest 128-wide pipeline does not fit where GEMM2's does
    deepest = {g: max(getattr(t, g).num_stages for t in decode_choices(cfg, best, g)
                      if getattr(t, g).block_n == 128) for g in ("gemm1", "gemm2")}  # fmt: skip
    assert deepest["gemm1"] < deepest["gemm2"]


def test_tune_prefill_round_varies_one_gemm_within_all_of_the_shared_memory() -> None:
    """Past the heuristic's budget (its large tiles get 4 stages there at most), never past the
    block's, and within the fp8 scale blocks."""
    for scheme in (QuantScheme.NONE, QuantScheme.FP8_BLOCK):
        cfg = Case(scheme).config()
        best = tiles.heuristic_tiles(cfg, 4096)
        elem = 1 if cfg.quant.spec.act_quant else cfg.dtype.itemsize
        for gemm, other in (("gemm1", "gemm2"), ("gemm2", "gemm1")):
            found = prefill_choices(cfg, best, gemm)
            assert found and all(getattr(t, other) == getattr(best, other) for t in found)
            b_tiles = 2 if gemm == "gemm1" else 1
            smem = [(best.block_m + b_tiles * getattr(t, gemm).block_n) * getattr(t, gemm).block_k
                    * elem * getattr(t, gemm).num_stages for t in found]  # fmt: skip
            assert max(smem) <= PREFILL_SMEM_BYTES
            assert all(128 % getattr(t, gemm).block_k == 0 for t in found)
        if scheme == QuantScheme.NONE:  # 16-bit: deeper than the heuristic's budget allows
            assert max(smem) > tiles.SMEM_BUDGET_BYTES


def test_tune_searches_buckets_the_file_lacks_and_on_retune_each_named_one_with_its_tiles(
    tmp_path,
) -> None:
    cfg = Case(QuantScheme.FP8_BLOCK).config()
    kept = tiles.heuristic_tiles(cfg, 16)
    buckets = {"16": kept.to_json() | {"us": 1.0}, "64": kept.to_json() | {"us": 2.0}}
    out = tmp_path / "tuned.json"
    assert buckets_to_search(TuneRequest(cfg, (1, 16), out), buckets) == [(1, None)]
    again = TuneRequest(cfg, (1, 16), out, retune=True)
    assert buckets_to_search(again, buckets) == [(1, None), (16, kept)]  # 64: not named, kept


def test_tune_confirmation_keeps_the_fastest_on_average_not_on_one_routing() -> None:
    """A wins on the first routing by luck, B on average; each routing times every finalist."""
    cfg = Case().config()
    a, b = tiles.heuristic_tiles(cfg, 16), tiles.heuristic_tiles(cfg, 1024)
    assert a != b
    times = {(a, 0): 1.0, (a, 1): 3.0, (a, 2): 3.0, (b, 0): 2.0, (b, 1): 2.0, (b, 2): 2.0}
    calls = []

    def measure(tile, routing):
        calls.append((tile, routing))
        return times[tile, routing]

    assert confirmed([a, b], [0, 1, 2], measure) == (b, 2.0)
    assert calls == [(a, 0), (b, 0), (a, 1), (b, 1), (a, 2), (b, 2)]


def test_tune_shape_accepts_names_and_four_integers_and_names_the_format_on_error() -> None:
    assert parse_shape("qwen3").num_experts == 128
    cfg = parse_shape("16,256,512,4")
    assert (cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k) == (16, 256, 512, 4)
    with pytest.raises(argparse.ArgumentTypeError, match="E,H,I,top_k"):
        parse_shape("16,256")


def test_tune_resumes_without_retiming_buckets_already_in_the_file(tmp_path) -> None:
    cfg = Case().config()
    done = tiles.heuristic_tiles(cfg, 1).to_json() | {"us": 1.0}
    out = tmp_path / "t.json"
    out.write_text(json.dumps({"key": {}, "buckets": {"1": done}}))
    body = tune(TuneRequest(cfg, (1,), out), CPU)
    assert body["buckets"] == {"1": done}


def test_tune_writes_each_bucket_with_the_commit_date_and_command_that_searched_it(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The search itself runs against experts that return at once: only what is written counts."""

    class Instant(TritonExperts):
        def apply(self, x, ws, into=None):
            return x.hidden

    monkeypatch.setattr(triton_experts, "TritonExperts", Instant)
    monkeypatch.setattr(environment, "current_commit", lambda: "abc1234")
    argv = ["/venv/bin/moe-serve", "bench", "tune", "--shape", "8,64,96,2", "--tokens", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    cfg = Case().config()
    out = tmp_path / "t.json"
    body = tune(TuneRequest(cfg, (1,), out), CPU)
    entry = json.loads(out.read_text())["buckets"]["1"]
    assert entry == body["buckets"]["1"]
    assert tiles.LayerTiles.from_json(entry) and entry["us"] > 0
    assert (entry["commit"], entry["command"]) == (
        "abc1234",
        "moe-serve bench tune --shape 8,64,96,2 --tokens 1",
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"])


def test_tune_refuses_to_run_without_a_gpu() -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert main(["bench", "tune", "--shape", "8,64,96,2"]) == 2


def test_tiles_mode_needs_a_shape_and_rules_take_no_shape(capsys) -> None:
    assert main(["bench", "tune"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "tune", "--mode", "rules", "--shape", "qwen3"])
    assert "--shape does not apply to --mode rules" in capsys.readouterr().err


def test_tune_per_pair_round_varies_one_gemm_and_its_fp8_block_k_step() -> None:
    cfg = Case(QuantScheme.FP8_BLOCK, num_experts=256, top_k=8).config()
    assert not any(t.per_pair for t in candidates(cfg, 1))  # the grouped rounds stay grouped
    best = tiles.per_pair_tiles(cfg)
    for gemm, other in (("gemm1", "gemm2"), ("gemm2", "gemm1")):
        found = per_pair_choices(cfg, best, gemm)
        assert found and all(t.per_pair for t in found)
        assert all(getattr(t, other) == getattr(best, other) for t in found)
        assert {getattr(t, gemm).block_k for t in found} == {64, 128, 256, 512, 1024}
    timed = {best: 5.0, candidates(cfg, 1)[0]: 4.0, found[0]: 3.0}
    assert fastest(timed, per_pair=True) == found[0]
    assert fastest(timed, per_pair=False) == candidates(cfg, 1)[0]
