"""The layer profile needs a GPU: without one it says so instead of profiling the CPU."""

from __future__ import annotations

import pytest
import torch

from moe_serve.bench import layer_profile


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_refuses_without_a_gpu_saying_why(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        layer_profile.main(["--out", str(tmp_path), "--shape", "tiny"])
    assert exit_info.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
