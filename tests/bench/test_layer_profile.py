"""The layer profile needs a GPU: without one it says so instead of profiling the CPU."""

from __future__ import annotations

import pytest
import torch

from moe_serve.service.cli import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_refuses_without_a_gpu_saying_why(tmp_path, caplog) -> None:
    argv = ["bench", "kernels", "--mode", "profile", "--shapes", "tiny", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "--mode profile runs on a CUDA GPU; none is visible here" in caplog.text
    assert not any(tmp_path.iterdir())
