"""`moe-serve bench report`: the committed performance page and results index are exactly what the
stored results make, every time; each row comes from the newest result that measured it; and
every stored result names its provenance as its file name says."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from moe_serve.bench.json_bench import JsonBench
from moe_serve.bench.report import INDEX, load, performance_page, results_index, write_pages
from moe_serve.bench.schema import BenchRun
from moe_serve.bench.service_bench import ServiceBenchResult
from moe_serve.service.cli import main
from tests.bench.sample import SAMPLE

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"
MODELS = {"kernels": BenchRun, "service": ServiceBenchResult, "json": JsonBench}


def test_the_committed_page_and_index_are_what_the_stored_results_make(tmp_path: Path) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    page = tmp_path / "performance.md"
    for _ in range(2):  # and again: the same bytes
        assert main(["bench", "report", "--results", str(results), "--page", str(page)]) == 0
        assert page.read_text() == PAGE.read_text(), "run `moe-serve bench report`"
        assert (results / INDEX).read_text() == (RESULTS / INDEX).read_text()


def test_every_stored_result_holds_its_provenance_and_validates() -> None:
    stored = load(RESULTS)
    assert {s.gpu for s in stored} >= {"h100", "h200"}
    for result in stored:
        assert result.env.command and result.env.command.startswith("moe-serve bench ")
        model = MODELS.get(result.kind)
        if model is not None:
            model.model_validate(result.data)
    kinds = {(s.gpu, s.kind) for s in stored}
    assert {("h100", "kernels"), ("h200", "kernels"), ("h200", "ep")} <= kinds
    assert {("h100", k) for k in ("service", "transport", "json")} <= kinds


def _sample(results: Path, commit: str, created: str, tokens: set[int] | None = None) -> None:
    """The CPU sample stored as a run at `commit`, only its points at `tokens` where given."""
    data = json.loads(SAMPLE.read_text())
    data["environment"] |= {"commit": commit, "created": created, "command": "moe-serve bench"}
    if tokens is not None:
        data["points"] = [p for p in data["points"] if p["tokens"] in tokens]
    path = results / "cpu" / f"kernels-{created[:10]}-{commit}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


def test_each_row_comes_from_the_newest_result_that_measured_it(tmp_path: Path) -> None:
    tokens = sorted({p.tokens for p in BenchRun.model_validate_json(SAMPLE.read_text()).points})
    _sample(tmp_path, "aaaaaaa", "2026-01-01T00:00:00+00:00")
    _sample(tmp_path, "bbbbbbb", "2026-01-02T00:00:00+00:00", {tokens[-1]})
    page = performance_page(load(tmp_path))
    rows = [line for line in page.splitlines() if line.startswith("| tiny |")]
    assert [row.split(" | ")[1] for row in rows] == [str(t) for t in tokens]
    assert [row.split(" | ")[-1] for row in rows] == ["aaaaaaa |"] * (len(tokens) - 1) + [
        "bbbbbbb |"
    ]
    assert "| cpu | 2026-01-02 | bbbbbbb |" in rows[-1]
    assert "## CPU" in page and "How each figure is measured" in page
    index = results_index(load(tmp_path))
    assert "[cpu/kernels-2026-01-02-bbbbbbb.json](cpu/kernels-2026-01-02-bbbbbbb.json)" in index


def test_a_result_whose_name_disagrees_with_its_environment_is_refused(tmp_path: Path) -> None:
    _sample(tmp_path, "aaaaaaa", "2026-01-01T00:00:00+00:00")
    (tmp_path / "cpu" / "kernels-2026-01-01-aaaaaaa.json").rename(
        tmp_path / "cpu" / "kernels-2026-01-01-ccccccc.json"
    )
    with pytest.raises(ValueError, match=re.escape("names it cpu/<bench>-2026-01-01-aaaaaaa.json")):
        write_pages(tmp_path, tmp_path / "page.md")
