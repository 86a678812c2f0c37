"""The request timeline from the service's spans: spans grouped into requests and laid against
the client's stamps (made-up stamps: no clock is read), and one short run on the CPU in which
every request's spans come back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_serve.bench.request_timeline import ROUTE, WARMUP, Sent, timeline, traces
from moe_serve.service.cli import main


def _request(trace: str, at: int) -> list[dict]:
    """One forward's spans as the service records them, from `at` (ns)."""
    spans = [
        (ROUTE, 0, 900),
        (f"{ROUTE} http receive", 10, 60),
        ("queue", 100, 200),
        ("forward", 200, 700),
        (f"{ROUTE} http send", 750, 760),
        (f"{ROUTE} http send", 770, 780),
    ]
    return [{"trace": trace, "name": name, "start_ns": at + start, "end_ns": at + end}
            for name, start, end in spans]  # fmt: skip


def test_spans_are_grouped_by_request_in_the_order_the_requests_came() -> None:
    spans = _request("b", 5_000) + _request("a", 1_000)
    spans.append({"trace": "c", "name": "GET /health", "start_ns": 3_000, "end_ns": 3_100})
    found = traces(spans)
    assert [r["request"] for r in found] == [(1_000, 1_900), (5_000, 5_900)]  # not /health
    assert set(found[0]) == {"request", "http receive", "queue", "forward", "http send",
                             "http send 2"}  # fmt: skip
    assert found[0]["http send 2"] == (1_770, 1_780)


def test_each_point_is_the_median_offset_from_the_clients_start() -> None:
    count = WARMUP + 3
    spans = [s for i in range(count) for s in _request(f"t{i}", 10_000 * i + 100)]
    sent = [Sent(10_000 * i, 10_000 * i + 50, 10_000 * i + 1_000 + 1_000 * (i % 3),
                 10_000 * i + 2_000) for i in range(count)]  # fmt: skip
    rows = {row["label"]: row for row in timeline(sent, traces(spans))}
    assert rows["forward>"]["median_us"] == pytest.approx(0.3)  # 100 + 200 ns
    assert rows["forward<"]["median_us"] == pytest.approx(0.8)
    assert rows["~first byte"]["median_us"] == pytest.approx(2.0)  # of 1, 2 and 3 us
    assert {row["requests"] for row in rows.values()} == {3}  # the warm-up left out
    assert set(rows) >= {"~sent", "~done", "request>", "request<", "queue>", "http send 2<"}


def test_requests_that_do_not_pair_with_traces_are_refused() -> None:
    sent = [Sent(0, 1, 2, 3)]
    with pytest.raises(ValueError, match="1 requests sent but 0 traced"):
        timeline(sent, [])


@pytest.mark.slow
@pytest.mark.parametrize("body", ["binary", "json"])
def test_every_request_comes_back_with_its_spans(tmp_path: Path, body: str) -> None:
    argv = ["bench", "service", "--mode", "timeline", "--layers", "demo", "--tokens", "2",
            "--requests", "5", "--out", str(tmp_path), "--commit", "test"]  # fmt: skip
    assert main(argv + (["--json"] if body == "json" else [])) == 0
    (path,) = tmp_path.glob("cpu/request-timeline-*-test.json")
    result = json.loads(path.read_text())
    assert [(run["tokens"], run["body"]) for run in result["runs"]] == [(1, body), (2, body)]
    for run in result["runs"]:
        counts = {row["label"]: row["requests"] for row in run["timeline"]}
        wanted = ["~sent", "~first byte", "~done", "request>", "request<", "queue>", "forward>",
                  "forward<", "http send>"]  # fmt: skip
        assert {counts.get(label) for label in wanted} == {5}, counts
    command = result["environment"]["command"]
    assert command.startswith("moe-serve bench service --mode timeline --layers demo")
    assert ("--json" in command) == (body == "json")
    assert "| point |" in path.with_suffix(".md").read_text()
