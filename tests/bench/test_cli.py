"""`moe-serve bench`'s commands: each option applies to some modes with a default per mode, an
option given to a mode that does not take it is refused, the run records the command as given,
and the bench command line in full loads no benchmark."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from moe_serve.service.cli import build_parser, main


def _resolved(*argv: str) -> argparse.Namespace:
    args = build_parser().parse_args(["bench", *argv])
    return args.spec.resolve(args)


def test_each_mode_gets_its_own_defaults() -> None:
    load = _resolved("service")
    assert (load.mode, load.clients, load.front_ends, load.duration) == (
        "load",
        [1, 16, 64, 256],
        8,
        4.0,
    )
    channel = _resolved("service", "--mode", "channel")
    assert (channel.clients, channel.front_ends, channel.duration) == ([64], 4, 5.0)
    assert channel.url is None and channel.out == Path("bench/results")
    assert _resolved("kernels", "--mode", "profile").backends == ["triton"]
    assert _resolved("kernels").tokens[-1] == 16384


def test_the_command_as_given_is_recorded_without_where_it_is_stored() -> None:
    args = _resolved("service", "--mode", "http", "--url", "http://h:1", "--clients", "1,4",
                     "--json", "--out", "/tmp/x", "--commit", "abc")  # fmt: skip
    assert (
        args.command == "moe-serve bench service --mode http --url http://h:1 --clients 1,4 --json"
    )


def test_an_option_the_mode_does_not_take_is_refused(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "service", "--mode", "json", "--url", "http://h:1"])
    assert exit_info.value.code == 2
    assert "--url does not apply to --mode json" in capsys.readouterr().err


def test_an_unknown_layer_is_refused_naming_the_known_ones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    argv = ["bench", "service", "--mode", "path", "--layers", "nope", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "unknown layers ['nope']: demo, mixtral" in caplog.text


def test_the_bench_command_line_in_full_loads_no_benchmark() -> None:
    code = (
        "import sys; from moe_serve.service.cli import build_parser; build_parser('bench'); "
        "print(sorted(m for m in sys.modules if m.startswith('moe_serve.bench')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['moe_serve.bench', 'moe_serve.bench.cli']"
