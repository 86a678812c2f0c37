"""The stored sample result validates against the documented schema; broken files do not."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from moe_serve.bench.schema import BenchRun
from tests.bench.sample import SAMPLE, sample_run


def test_stored_sample_validates_and_is_internally_consistent() -> None:
    run = sample_run()
    assert run.environment.device_type == "cpu"
    assert {p.tokens for p in run.points} == set(run.settings.tokens)
    assert {p.load for p in run.points} == set(run.settings.loads)
    for p in run.points:
        assert p.roofline_us == max(p.memory_us, p.compute_us)
        assert p.best is not None
        best = next(r for r in p.results if r.backend == p.best)
        assert best.ratio_to_best == 1.0
        assert all(r.ratio_to_best >= 1.0 for r in p.results if r.ratio_to_best is not None)


def test_result_missing_a_field_is_refused_naming_it() -> None:
    data = json.loads(SAMPLE.read_text())
    del data["ceilings"]["copy_bytes_per_s"]
    with pytest.raises(ValidationError, match="copy_bytes_per_s"):
        BenchRun.model_validate(data)


def test_result_with_an_unknown_field_is_refused() -> None:
    data = json.loads(SAMPLE.read_text())
    data["points"][0]["speedup"] = 9.9
    with pytest.raises(ValidationError, match="speedup"):
        BenchRun.model_validate(data)
