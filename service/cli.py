"""`moe-serve` command line: one subcommand per job, each defined beside the code it drives.

Every module in COMMAND_MODULES has `register(subparsers)`, which adds its subcommand(s) with
`set_defaults(run=callable)`; `run(args) -> int` is the exit status.
"""

from __future__ import annotations

import argparse
import importlib
import sys

DESCRIPTION = """\
Mixture-of-Experts layers as an HTTP service. Start with `moe-serve serve`: it serves the
demo layers on http://127.0.0.1:8000 (API and examples at /docs); `moe-serve convert` turns one
layer of a Hugging Face checkpoint into a layer directory that `serve --weights` takes.
"""
EPILOG = "`moe-serve COMMAND --help` describes each command; README.md has the rest."
COMMAND_MODULES: tuple[str, ...] = (
    "moe_serve.weights.cli",
    "moe_serve.service.serve",
    "moe_serve.service.ep.rank",
    "moe_serve.bench.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-serve", description=DESCRIPTION, epilog=EPILOG)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
