"""bench/request_timeline.py on the CPU: every point of the path is stamped, in the path's order,
in one process and behind a front end, for binary and JSON bodies."""

from __future__ import annotations

import json
from pathlib import Path

from moe_serve.bench import request_timeline


def _order(run: dict) -> list[str]:
    return [row["label"] for row in run["timeline"]]


def test_a_request_is_stamped_at_every_point_in_order(tmp_path: Path) -> None:
    argv = ["--out", str(tmp_path), "--layers", "demo", "--tokens", "2", "--front-ends", "1",
            "--requests", "10"]  # fmt: skip
    assert request_timeline.main(argv) == 0
    report = json.loads((tmp_path / "timeline.json").read_text())
    assert report["missing"] == []  # a renamed function would show here
    alone, behind = report["runs"]
    assert (alone["front_ends"], behind["front_ends"]) == (0, 1)
    path = ["~sent", "engine:http_begin>", "engine:middleware>", "engine:fast_path>",
            "engine:decode>", "engine:submit>", "engine:launch>", "engine:submit<",
            "engine:encode>", "engine:http_send>", "~done"]  # fmt: skip
    assert [label for label in _order(alone) if label in path] == path
    via_front_end = ["fe:http_begin>", "fe:fe_forward>", "fe:body_read>",
                     "fe:fe_engine>", "engine:channel_forward>",
                     "engine:submit>", "engine:channel_forward<", "fe:fe_engine<",
                     "fe:http_send>", "~done"]  # fmt: skip
    assert [label for label in _order(behind) if label in via_front_end] == via_front_end
    # every request is stamped at every point before its reply (those after it, such as the
    # middleware's exit, may come once the client has its answer)
    counts = {(id(run), row["label"]): row["requests"] for run in (alone, behind)
              for row in run["timeline"]}  # fmt: skip
    assert {counts[id(alone), label] for label in path} == {10}
    assert {counts[id(behind), label] for label in via_front_end} == {10}
    assert "| point |" in (tmp_path / "timeline.md").read_text()


def test_a_json_request_is_stamped_at_every_point_of_the_json_path_in_order(
    tmp_path: Path,
) -> None:
    argv = ["--out", str(tmp_path), "--layers", "demo", "--tokens", "2", "--front-ends", "1",
            "--requests", "10", "--body", "json"]  # fmt: skip
    assert request_timeline.main(argv) == 0
    report = json.loads((tmp_path / "timeline.json").read_text())
    assert report["missing"] == []
    alone, behind = report["runs"]
    assert (alone["body"], behind["body"]) == ("json", "json")
    path = ["~sent", "engine:fast_path>", "engine:decode_json>", "engine:decode_json<",
            "engine:submit>", "engine:submit<", "engine:encode_json>", "engine:encode_json<",
            "engine:http_send>", "~done"]  # fmt: skip
    assert [label for label in _order(alone) if label in path] == path
    via_front_end = ["fe:fe_forward_json>", "fe:fe_read_body>", "fe:fe_decode_json>",
                     "fe:fe_decode_json<", "fe:fe_write_blob>", "fe:fe_engine>",
                     "engine:channel_forward>", "engine:channel_forward<", "fe:fe_engine<",
                     "fe:fe_encode_json>", "fe:fe_encode_json<", "fe:http_send>",
                     "~done"]  # fmt: skip
    assert [label for label in _order(behind) if label in via_front_end] == via_front_end
    assert "demo, 2 tokens, json, 1 front ends" in (tmp_path / "timeline.md").read_text()
