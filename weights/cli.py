"""`moe-serve demo-weights | inspect`: write the demo layers, check and describe a layer dir."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from weights.demo import ensure_demo_layers
from weights.errors import LayerFileError
from weights.layout import expected_tensors
from weights.load import inspect_layer


def _fail(command: str, err: Exception) -> int:
    sys.stderr.write(f"moe-serve {command}: error: {err}\n")
    return 1


def run_demo_weights(args: argparse.Namespace) -> int:
    try:
        paths = ensure_demo_layers(args.out_dir)
    except (LayerFileError, OSError) as err:
        return _fail("demo-weights", err)
    sys.stdout.write("".join(f"{p}\n" for p in paths))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    try:
        manifest = inspect_layer(args.dir)
    except (LayerFileError, OSError) as err:
        return _fail("inspect", err)
    lines = [manifest.model_dump_json(indent=2), "", "tensors (all checked against the manifest):"]
    specs = expected_tensors(manifest)
    width = max(map(len, specs))
    for name, spec in specs.items():
        dtype = str(spec.dtype).removeprefix("torch.")
        lines.append(f"  {name:<{width}}  {dtype:<14} {list(spec.shape)}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    demo = subparsers.add_parser(
        "demo-weights", help="write the seeded demo layers (demo, demo-fp8) under OUT_DIR"
    )
    demo.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    demo.set_defaults(run=run_demo_weights)

    inspect = subparsers.add_parser(
        "inspect", help="validate a layer directory and print its manifest and tensor shapes"
    )
    inspect.add_argument("dir", type=Path, metavar="DIR")
    inspect.set_defaults(run=run_inspect)
