"""`moe-serve bench report --mode plot` and `--mode summary` on the stored sample."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moe_serve.service.cli import main
from tests.bench.sample import SAMPLE

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_plot_writes_time_and_roofline_pngs_beside_the_json(tmp_path: Path) -> None:
    result = tmp_path / "h100-2026-01-01.json"
    shutil.copy(SAMPLE, result)
    assert main(["bench", "report", "--mode", "plot", str(result)]) == 0
    for suffix in ("time", "roofline"):
        png = tmp_path / f"h100-2026-01-01-{suffix}.png"
        assert png.read_bytes()[:8] == PNG_MAGIC
        assert png.stat().st_size > 10_000  # axes, lines and labels, not an empty canvas


def test_plot_of_a_file_that_is_not_a_result_fails_naming_the_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bad = tmp_path / "notes.json"
    bad.write_text('{"hello": 1}')
    assert main(["bench", "report", "--mode", "plot", str(bad)]) == 2
    assert f"cannot read {bad}" in caplog.text
    assert not list(tmp_path.glob("*.png"))


def test_summary_prints_a_times_table_and_the_targets(capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "report", "--mode", "summary", str(SAMPLE)]) == 0
    text = capsys.readouterr().out
    assert "| shape | M | best (us) | roofline us | best / roofline | our Triton (us) |" in text
    assert "| shape | M | reference | reference-batched | roofline us |" in text
    assert "| tiny | 16 |" in text
    assert "prefill (M >= 4096)" in text and "not measured" in text
