"""Compile recorded Triton launches for Hopper (sm_90) without a GPU, as the device would:
    TRITON_INTERPRET=0 python -m tests.kernels.hopper_compile LAUNCHES.json [--resources]
LAUNCHES.json (written by tests/kernels/test_hopper_compile.py): a list of
{"module", "kernel", "args": {name: value}, "options": {"num_warps", "num_stages"}}, where a
value is a number, string, bool or null, {"tensor": triton type, "aligned": bool} or
{"dtype": triton type}. Arguments are specialised as Triton's launcher does: an integer 1
becomes a constant, integers and tensor addresses divisible by 16 are marked so (the loads it
may then vectorise). Prints one line per launch that fails to compile and exits 1 if any did;
with --resources, also each compiled variant's registers and stack per thread (ptxas' figures
through cuobjdump: a spill shows as stack) and its shared memory per block.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
_DIVISIBLE = [["tt.divisibility", 16]]
_CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def _scalar_type(value: object) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def compile_launch(launch: dict) -> triton.compiler.CompiledKernel:
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature, constexprs, attrs = {}, {}, {}
    for index, param in enumerate(kernel.params):
        value = launch["args"].get(param.name)
        if isinstance(value, dict) and "dtype" in value:
            value = tl.dtype(value["dtype"])
        specialised_one = type(value) is int and value == 1
        if param.is_constexpr or value is None or specialised_one:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
            continue
        if isinstance(value, dict):
            signature[param.name] = "*" + value["tensor"]
            divisible = value["aligned"]
        else:
            signature[param.name] = _scalar_type(value)
            divisible = type(value) is int and value % 16 == 0
        if divisible:
            attrs[(index,)] = _DIVISIBLE
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=HOPPER, options=launch["options"])


def resources(compiled: triton.compiler.CompiledKernel) -> dict[str, int]:
    """Registers per thread, stack and local bytes per thread (ptxas'), and shared bytes per
    block (Triton's: the pipeline's buffers, allocated at launch; ptxas sees only a static
    1 KiB)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        dump = subprocess.run(
            [_CUOBJDUMP, "--dump-resource-usage", cubin.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    registers, stack, _, local = map(int, _RESOURCES.search(dump).groups())
    shared = compiled.metadata.shared
    return {"registers": registers, "stack": stack, "local": local, "shared": shared}


def _describe(launch: dict) -> str:
    blocks = {k: v for k, v in launch["args"].items() if k.startswith("BLOCK") or k == "KIND"}
    return f"{launch['module']}.{launch['kernel']} {blocks} {launch['options']}"


def main(argv: list[str]) -> int:
    failed = 0
    for launch in json.loads(Path(argv[0]).read_text()):
        try:
            compiled = compile_launch(launch)
        except Exception as err:  # every compiler error is a finding: report it and go on
            failed += 1
            root = err
            while root.__cause__ is not None:  # the compiler's own message, under the lines
                root = root.__cause__
            where = f"{launch['module']}.{launch['kernel']}"
            sys.stdout.write(f"{where}: {type(err).__name__}: {err}\n  {root!r}\n")
            continue
        if "--resources" in argv[1:]:
            sys.stdout.write(f"{_describe(launch)}: {resources(compiled)}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
