"""`moe-serve` command line: one subcommand per job, each defined beside the code it drives.

COMMANDS names each subcommand's module and one-line help. Only the module of the command being
run is imported (each has `register(subparsers)`, which adds its subcommand(s) with
`set_defaults(run=callable)`; `run(args) -> int` is the exit status), so `moe-serve --help`
answers without importing torch. A command's line of help is COMMANDS', its description the
module's.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

DESCRIPTION = """\
Mixture-of-Experts layers as an HTTP service. Start with `moe-serve serve`: it serves the
demo layers on http://127.0.0.1:8000 (API and examples at /docs); `moe-serve convert` turns one
layer of a Hugging Face checkpoint into a layer directory that `serve --weights` takes.
"""
EPILOG = "`moe-serve COMMAND --help` describes each command; README.md has the rest."
# command -> (the module that registers it, its one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("moe_serve.service.serve", "serve MoE layers over HTTP and gRPC"),
    "convert": (
        "moe_serve.weights.cli",
        "convert one MoE layer of a Hugging Face checkpoint into a layer directory",
    ),
    "inspect": (
        "moe_serve.weights.cli",
        "validate a layer directory and print its manifest and tensor shapes",
    ),
    "demo-weights": (
        "moe_serve.weights.cli",
        "write the seeded demo layers (demo, demo-fp8) under OUT_DIR",
    ),
    "ep-rank": (
        "moe_serve.service.ep.rank",
        "join a `serve --ep N` from another host as one of its expert-parallel ranks",
    ),
    "bench": ("moe_serve.bench.cli", "benchmarks, tuning for this GPU and the performance page"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser: `command`'s subcommand in full (its module imported), every other one as a
    name and a line of help (nothing imported); all in full when `command` is None."""
    parser = argparse.ArgumentParser(prog="moe-serve", description=DESCRIPTION, epilog=EPILOG)
    subparsers = _Subcommands(
        parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    )
    wanted = {module for name, (module, _) in COMMANDS.items() if command in (None, name)}
    for name, (module, _) in COMMANDS.items():
        if name in subparsers.choices:  # its module registered it already
            continue
        if module in wanted:
            importlib.import_module(module).register(subparsers)
        else:
            subparsers.add_parser(name)
    return parser


class _Subcommands:
    """The subparsers as a command module sees them: each subcommand gets its help line from
    COMMANDS."""

    def __init__(self, subparsers: argparse._SubParsersAction) -> None:
        self._subparsers = subparsers
        self.choices = subparsers.choices

    def add_parser(self, name: str, **kwargs: object) -> argparse.ArgumentParser:
        return self._subparsers.add_parser(name, help=COMMANDS[name][1], **kwargs)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), "")
    args = build_parser(command if command in COMMANDS else "").parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
