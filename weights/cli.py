"""`moe-serve convert | inspect | demo-weights`: Hugging Face layer -> layer dir, check and
describe a layer dir, write the demo layers."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

from ..kernels.quant_scheme import QuantConfig, QuantScheme
from .convert.pipeline import FAMILIES, convert_checkpoint
from .demo import ensure_demo_layers
from .errors import LayerFileError
from .layout import expected_tensors
from .load import verify_layer


def _fail(command: str, err: Exception | str, status: int = 1) -> int:
    sys.stderr.write(f"moe-serve {command}: error: {err}\n")
    return status


@contextlib.contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into SystemExit(143) meanwhile, so that it unwinds like Ctrl-C does and the
    writer removes its temp dir (the default action kills the process where it stands)."""

    def stop(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _quant(args: argparse.Namespace) -> QuantConfig | None:
    """--quant and --group-size as a QuantConfig; ValueError naming the option if they clash."""
    if args.group_size is not None and args.quant != QuantScheme.INT4_W4A16:
        raise ValueError(f"--group-size applies to --quant {QuantScheme.INT4_W4A16} only")
    if args.quant is None:
        return None
    sizes = {} if args.group_size is None else {"group_size": args.group_size}
    return QuantConfig(args.quant, **sizes)


def run_convert(args: argparse.Namespace) -> int:
    try:
        quant = _quant(args)
    except ValueError as err:
        return _fail("convert", err, status=2)  # a usage error, as argparse's own
    try:
        with _sigterm_raises():
            manifest = convert_checkpoint(args.src_dir, args.layer, args.out, quant, args.name)
    except (ValueError, OSError) as err:  # LayerFileError is a ValueError
        return _fail("convert", err)
    sys.stdout.write(f"{args.out}: layer {manifest.name!r}, {manifest.config.quant.scheme}\n")
    return 0


def run_demo_weights(args: argparse.Namespace) -> int:
    try:
        paths = ensure_demo_layers(args.out_dir)
    except (LayerFileError, OSError) as err:
        return _fail("demo-weights", err)
    sys.stdout.write("".join(f"{p}\n" for p in paths))
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    try:
        manifest = verify_layer(args.dir)
    except (LayerFileError, OSError) as err:
        return _fail("inspect", err)
    checked = "checksums and finite values" if manifest.tensors_xxh3 else "finite values"
    heading = f"tensors (shapes, dtypes, {checked} checked against the manifest):"
    lines = [manifest.model_dump_json(indent=2, exclude={"tensors_xxh3"}), "", heading]
    specs = expected_tensors(manifest)
    width = max(map(len, specs))
    for name, spec in specs.items():
        dtype = str(spec.dtype).removeprefix("torch.")
        lines.append(f"  {name:<{width}}  {dtype:<14} {list(spec.shape)}")
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    convert = subparsers.add_parser(
        "convert",
        description="Convert one MoE layer of a Hugging Face checkpoint into a layer directory "
        "(written atomically: nothing is left on failure). "
        f"Supported model_type values: {', '.join(FAMILIES)}. Exit status 2: a bad option; "
        "1: the checkpoint cannot be converted (the message names the file and tensor).",
    )
    convert.add_argument(
        "src_dir",
        type=Path,
        metavar="SRC_DIR",
        help="the checkpoint directory: config.json and *.safetensors (sharded or not)",
    )
    convert.add_argument(
        "--layer", type=int, required=True, metavar="N", help="the decoder layer to convert"
    )
    convert.add_argument(
        "--out",
        type=Path,
        required=True,
        metavar="OUT_DIR",
        help="the layer directory to write (an existing layer directory is replaced)",
    )
    convert.add_argument(
        "--quant",
        choices=[s.value for s in QuantScheme],
        help="quantise the experts to this scheme (default: keep the checkpoint's)",
    )
    convert.add_argument(
        "--group-size",
        type=int,
        metavar="N",
        help="int4-w4a16 only: input columns sharing one scale, even (default 128)",
    )
    convert.add_argument("--name", help="layer name (default: <model dir>-layer<N>)")
    convert.set_defaults(run=run_convert)

    demo = subparsers.add_parser(
        "demo-weights",
        description="Write the seeded demo layers (demo, demo-fp8) under OUT_DIR: E=8, H=256, "
        "I=512, top_k=2, with a router; the "
        "layers `moe-serve serve` serves when given no --weights. Current copies are kept.",
    )
    demo.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="where to write them")
    demo.set_defaults(run=run_demo_weights)

    inspect = subparsers.add_parser(
        "inspect",
        description="Validate a layer directory and print its manifest and tensor shapes. "
        "Every byte is read: names, shapes and dtypes against "
        "the manifest, each tensor's checksum, and every value finite. Exit status 1 with the "
        "file and tensor named when something does not check out.",
    )
    inspect.add_argument("dir", type=Path, metavar="DIR", help="the layer directory")
    inspect.set_defaults(run=run_inspect)
