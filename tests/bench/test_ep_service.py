"""bench/ep_service.py end to end on the CPU (gloo, a small layer): the GPU run's script works."""

from __future__ import annotations

import json
from pathlib import Path

from moe_serve.bench import ep_service


def test_the_ep_service_benchmark_writes_its_table_and_matches_one_process(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path), "--device", "cpu", "--shape", "deepseek-v3-small"]
    argv += ["--tokens", "1,5", "--backend", "reference", "--seconds", "0.2", "--redundant", "2"]
    argv += ["--profile"]
    assert ep_service.main(argv) == 0
    report = json.loads((tmp_path / "ep_service.json").read_text())
    assert [p["one_gpu"]["M"] for p in report["points"]] == [1, 5]
    assert all(p["rel_err"] < 1e-2 and p["ep"]["batches"] > 0 for p in report["points"])
    # batches in flight answered bit for bit as alone
    assert all(p[e]["unlike_alone"] == 0 for p in report["points"] for e in ("one_gpu", "ep"))
    assert 0 < report["last_balancedness"] <= 1
    assert "speedup" in (tmp_path / "ep_service.md").read_text()
    for engine in ("1gpu", "ep"):  # rank 0's kernels (here the CPU's ops) at the largest M
        assert "batches of M=5" in (tmp_path / f"profile-{engine}.txt").read_text()
    rank1 = (tmp_path / "profile-ep-rank1.txt").read_text()  # the same forwards on rank 1
    header = f"{ep_service.PROFILED_BATCHES} batches of M=5 on EPEngine (+1), rank 1\n"
    assert rank1.startswith(header)  # and the one that waited for its profiler to start
    assert "aten::" in rank1  # its ops were recorded
    for trace in ("profile-ep.trace.json", "profile-ep-rank1.trace.json"):
        events = json.loads((tmp_path / trace).read_text())["traceEvents"]
        assert any(e.get("name", "").startswith("aten::") for e in events)
