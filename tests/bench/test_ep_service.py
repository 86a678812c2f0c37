"""`moe-serve bench ep` end to end on the CPU (gloo, a small layer): the GPU run's code works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.bench import ep_service
from moe_serve.service.cli import main


def test_the_ep_service_benchmark_writes_its_table_and_matches_one_process(tmp_path: Path) -> None:
    argv = ["bench", "ep", "--out", str(tmp_path), "--commit", "test", "--device", "cpu"]
    argv += ["--shape", "tiny", "--tokens", "1,5", "--backend", "reference"]
    argv += ["--duration", "0.2", "--redundant", "2", "--profile"]
    assert main(argv) == 0
    (path,) = tmp_path.glob("cpu/ep2-*-test.json")
    report = json.loads(path.read_text())
    assert report["environment"]["gpus"] == 2
    assert [p["one_gpu"]["M"] for p in report["points"]] == [1, 5]
    assert all(p["rel_err"] < 1e-2 and p["ep"]["batches"] > 0 for p in report["points"])
    # batches in flight answered bit for bit as alone
    assert all(p[e]["unlike_alone"] == 0 for p in report["points"] for e in ("one_gpu", "ep"))
    assert 0 < report["last_balancedness"] <= 1
    assert "speedup" in path.with_suffix(".md").read_text()
    tmp_path = path.with_suffix("")  # the profiles, beside the result
    for engine in ("1gpu", "ep"):  # rank 0's kernels (here the CPU's ops) at the largest M
        assert "batches of M=5" in (tmp_path / f"profile-{engine}.txt").read_text()
    rank1 = (tmp_path / "profile-ep-rank1.txt").read_text()  # the same forwards on rank 1
    header = f"{ep_service.PROFILED_BATCHES} batches of M=5 on EPEngine (+1), rank 1\n"
    assert rank1.startswith(header)  # and the one that waited for its profiler to start
    assert "aten::" in rank1  # its ops were recorded
    for trace in ("profile-ep.trace.json", "profile-ep-rank1.trace.json"):
        events = json.loads((tmp_path / trace).read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)


def test_the_ep_engine_gets_the_backend_asked_for_not_what_it_resolved_to(
    tmp_path: Path, monkeypatch
) -> None:
    """`--backend auto` (the default) reaches the ranks as "auto", as `serve --ep N` hands it
    over: the name auto resolved to on one GPU (on a GPU, the token switch's
    "triton<1024<=deep-gemm") is no backend a rank can build."""
    handed = []

    class Stop(Exception):
        pass

    def ep_engine(settings, layers):
        handed.append(settings.backend)
        raise Stop

    monkeypatch.setattr(ep_service, "EPEngine", ep_engine)
    argv = ["bench", "ep", "--out", str(tmp_path), "--commit", "test", "--device", "cpu"]
    argv += ["--shape", "deepseek-v3-small", "--tokens", "1", "--duration", "0.05"]
    with pytest.raises(Stop):
        main(argv)
    assert handed == ["auto"]
