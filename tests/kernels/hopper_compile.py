"""Compile recorded Triton launches for Hopper (sm_90) without a GPU, as the device would:
    TRITON_INTERPRET=0 python -m tests.kernels.hopper_compile LAUNCHES.json
LAUNCHES.json (written by tests/kernels/test_hopper_compile.py): a list of
{"module", "kernel", "args": {name: value}, "options": {"num_warps", "num_stages"}}, where a
value is a number, string, bool or null, {"tensor": triton type} or {"dtype": triton type}.
Prints one line per launch that fails to compile and exits 1 if any did."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def _scalar_type(value: object) -> str:
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    return "fp32"


def compile_launch(launch: dict) -> None:
    kernel = getattr(importlib.import_module(launch["module"]), launch["kernel"])
    signature, constexprs = {}, {}
    for param in kernel.params:
        value = launch["args"].get(param.name)
        if isinstance(value, dict) and "dtype" in value:
            value = tl.dtype(value["dtype"])
        if param.is_constexpr or value is None:
            signature[param.name] = "constexpr"
            constexprs[param.name] = value
        elif isinstance(value, dict):
            signature[param.name] = "*" + value["tensor"]
        else:
            signature[param.name] = _scalar_type(value)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    triton.compile(source, target=HOPPER, options=launch["options"])


def main(path: str) -> int:
    failed = 0
    for launch in json.loads(Path(path).read_text()):
        try:
            compile_launch(launch)
        except Exception as err:  # every compiler error is a finding: report it and go on
            failed += 1
            root = err
            while root.__cause__ is not None:  # the compiler's own message, under the lines
                root = root.__cause__
            where = f"{launch['module']}.{launch['kernel']}"
            sys.stdout.write(f"{where}: {type(err).__name__}: {err}\n  {root!r}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
