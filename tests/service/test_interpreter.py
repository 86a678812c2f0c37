"""The serving process's interpreter settings, in a process of their own (they are global)."""

from __future__ import annotations

import subprocess
import sys

from moe_serve.service.interpreter import GC_THRESHOLDS


def test_a_serving_process_freezes_what_it_started_with_and_collects_less_often() -> None:
    code = (
        "import gc; from service.interpreter import collect_less; frozen = gc.get_freeze_count(); "
        "collect_less(); print(gc.get_threshold(), frozen == 0 < gc.get_freeze_count())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[0] == f"{GC_THRESHOLDS} True"
