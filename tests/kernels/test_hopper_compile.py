"""Every Triton kernel of ours compiles for Hopper (sm_90) on a machine without a GPU.

On a CPU the suite runs the kernels in Triton's interpreter, which accepts code the compiler
refuses: a module global that is not a constexpr, code after a compile-time branch's `return`
(which the compiler still builds); both would fail only on the device. Here tiny forwards and a
JSON body's reading launch every kernel in the interpreter while a hook records each launch's
arguments; a child process without the interpreter (tests/kernels/hopper_compile.py) then
compiles each recorded variant for sm_90 with the compiler and ptxas that ship with Triton, as
the GPU would, and reads back each one's registers, spills and shared memory.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import moe_serve.kernels
import moe_serve.service.codecs
from moe_serve.kernels.config import RoutingConfig
from moe_serve.kernels.experts._triton import psum_layout as psum
from moe_serve.kernels.experts._triton.act_quant import (
    MaskedRows,
    PairRows,
    act_quant,
    mn_major_scales,
)
from moe_serve.kernels.experts._triton.codes import WeightKind
from moe_serve.kernels.experts._triton.gemv import EachPair, SlotSum, pair_gemv
from moe_serve.kernels.experts._triton.grouped_gemm import (
    Activations,
    Epilogue,
    ExpertMatrix,
    GemmTile,
)
from moe_serve.kernels.experts._triton.quantize import quantize_into
from moe_serve.kernels.experts._triton.sort_pairs import sort_pairs
from moe_serve.kernels.experts._triton.tiles import LayerTiles
from moe_serve.kernels.input_checks import NONFINITE_BITS, bit_rows
from moe_serve.kernels.quant_scheme import FP8, ActQuant, QuantScheme
from moe_serve.kernels.quantize import quantize_activation
from moe_serve.kernels.random_weights import random_expert_weights
from moe_serve.kernels.routing_kernel import route_rows
from moe_serve.kernels.row_kernels import (
    batch_stats_into,
    nonfinite_into,
    router_logits_into,
    silu_and_mul,
    zero_rows_from,
)
from moe_serve.kernels.tensors import Format
from moe_serve.service.codecs import json_device
from moe_serve.service.codecs.json_device_kernel import read_rows
from moe_serve.service.codecs.json_limits import LIMITS
from moe_serve.service.codecs.json_print_kernel import write_rows
from tests.kernels.triton_cases import Case, random_routing, triton_vs_reference

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU suite compiles them")

CPU = torch.device("cpu")
_TRITON_TYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
    FP8: "fp8e4nv",
}  # fmt: skip
_LAUNCH_OPTIONS = ("num_warps", "num_stages")


def _encode(value: object) -> object:
    if isinstance(value, torch.Tensor):
        return {"tensor": _TRITON_TYPES[value.dtype], "aligned": value.data_ptr() % 16 == 0}
    if isinstance(value, tl.dtype):
        return {"dtype": value.name}
    return value


def _launchable_kernels() -> set[tuple[str, str]]:
    """(module, name) of every jit function in `kernels` and `service.codecs` that is launched:
    named *_kernel."""
    found = set()
    for package in (moe_serve.kernels, moe_serve.service.codecs):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            module = importlib.import_module(info.name)
            for name, value in vars(module).items():
                ours = isinstance(value, InterpretedFunction) and value.fn.__module__ == info.name
                if ours and name.endswith("_kernel"):
                    found.add((info.name, name))
    return found


def _launch_every_kernel() -> None:
    """Tiny calls that, between them, launch each kernel of `kernels` at least once."""
    forwards = [
        (QuantScheme.FP8_BLOCK, Format.STANDARD, 1),  # quantiser, one-program align, top-k sum
        (QuantScheme.FP8_TENSOR, Format.STANDARD, 80),  # amax, three-kernel align (160 pairs)
        (QuantScheme.FP8_TOKEN, Format.STANDARD, 3),
        (QuantScheme.MXFP4, Format.STANDARD, 2),
        (QuantScheme.INT4_W4A16, Format.BATCHED, 3),
    ]
    for scheme, fmt, m in forwards:
        cfg = Case(scheme).config()
        triton_vs_reference(cfg, random_routing(m, cfg.num_experts, cfg.top_k, seed=m), CPU, fmt)
    gemv = GemmTile(32, 128, 4, 2)
    for scheme in (QuantScheme.FP8_BLOCK, QuantScheme.MXFP4):  # per-pair GEMVs
        cfg = Case(scheme).config()
        per_pair = LayerTiles(16, gemv, gemv, per_pair=True)
        triton_vs_reference(cfg, random_routing(1, 4, 2, seed=1), CPU, tiles=per_pair)
    cfg = Case(QuantScheme.INT8_W8A16, has_bias=True).config()  # a summing GEMV2's every term
    w = random_expert_weights(cfg)
    ids = torch.tensor([0, -1, 3, 1], dtype=torch.int32)
    pair_gemv(Activations(torch.randn(4, 96).half()),
              ExpertMatrix(w.w2, w.w2_scale, w.w2_bias, cfg.quant), torch.empty(2, 64),
              EachPair(ids), Epilogue(row_weights=torch.rand(4)), gemv,
              SlotSum(2, torch.randn(2, 64)))  # fmt: skip
    ids = torch.tensor([[2, 0], [1, 2], [0, 3]], dtype=torch.int32)
    weights = torch.rand(3, 2)
    sort_pairs(ids, weights, 4)
    sort_pairs(torch.randint(0, 4, (33, 4), dtype=torch.int32), torch.rand(33, 4), 4)  # a grid
    route_rows(torch.randn(3, 8), RoutingConfig(top_k=2))
    x = torch.randn(3, 300)
    for how in ActQuant:  # the experts use the torch twin on a CPU: the kernel itself here
        scale = torch.empty(quantize_activation(x, how)[1].shape)
        quantize_into(x, torch.empty(3, 300, dtype=torch.uint8), scale, how)

    valid = torch.tensor(2)
    out = torch.randn(3, 64).bfloat16()
    zero_rows_from(out, valid)
    zero_rows_from(out, valid, torch.zeros(6, dtype=torch.int64))  # a replay's first kernel
    batch_stats_into(torch.tensor([0] * 4 + [1, 1]), ids, valid, bit_rows(out), [bit_rows(out)])
    bits_dtype, mask = NONFINITE_BITS[torch.float32]
    nonfinite_into(
        torch.randn(3, 64).view(bits_dtype), mask, torch.zeros(1, dtype=torch.int32), valid
    )
    silu_and_mul(torch.randn(3, 256), torch.float16)
    router = torch.randn(8, 64).bfloat16()
    router_logits_into(torch.empty(2, 8), torch.randn(2, 64).bfloat16(), router, torch.randn(8))

    read_rows(torch.frombuffer(bytearray(b"[[1, 2], [3, 4]]"), dtype=torch.uint8), LIMITS)
    write_rows(torch.randn(2, 3).bfloat16(), *json_device._number_table(torch.bfloat16, CPU))

    for repeats in (1, 1400):  # one program; three kernels (4200 pairs)
        psum.psum_layout(ids.repeat(repeats, 1), 4, 8)
    layout = psum.psum_layout(ids, 4, 8)
    a = torch.zeros(layout.capacity, 128, dtype=FP8)
    a_scale = mn_major_scales(layout.capacity, 1, CPU)
    psum.gather_rows(torch.randn(3, 128).to(FP8), torch.rand(3, 1), layout, a, a_scale)
    y = torch.randn(layout.capacity, 128).half()
    psum.weighted_sum(y, None, layout, ids, weights, torch.empty(3, 128))
    spec = Case().config().activation
    h = torch.randn(layout.capacity, 256).half()
    q = torch.empty(layout.capacity, 128, dtype=FP8)
    act_quant(h, None, spec, PairRows(layout.pair_row, ids.flatten()), q, a_scale)
    h = torch.randn(4, 16, 256).half()
    q = torch.empty(4, 16, 128, dtype=FP8)
    counts = torch.tensor([0, 3, 1, 2], dtype=torch.int32)
    act_quant(h, None, spec, MaskedRows(counts, 3), q, mn_major_scales(16, 1, CPU, batch=4))


def test_every_kernel_compiles_for_hopper(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    launches: dict[str, dict] = {}
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        values = dict(zip(names, args, strict=False)) | {
            k: v for k, v in kwargs.items() if k in names
        }
        launch = {
            "module": self.fn.__module__,
            "kernel": self.fn.__name__,
            "args": {name: _encode(value) for name, value in values.items()},
            "options": {k: kwargs[k] for k in _LAUNCH_OPTIONS if k in kwargs},
        }
        launches.setdefault(json.dumps(launch, sort_keys=True), launch)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recording_run)
    _launch_every_kernel()
    monkeypatch.undo()

    # the GPU alone decodes mxfp4 into bf16 dots (the interpreter's bf16 bit casts are wrong)
    grouped = [launch for launch in launches.values() if launch["kernel"] == "_grouped_gemm_kernel"]
    mxfp4 = next(launch for launch in grouped if launch["args"]["KIND"] == WeightKind.MXFP4)
    bf16 = json.loads(json.dumps(mxfp4))
    bf16["args"].update(BF16_CODES=True, DOT_DTYPE={"dtype": "bf16"})
    bf16["args"]["a_ptr"]["tensor"] = "bf16"
    launches[json.dumps(bf16, sort_keys=True)] = bf16

    launched = {(launch["module"], launch["kernel"]) for launch in launches.values()}
    missing = _launchable_kernels() - launched
    assert not missing, f"add a call that launches {sorted(missing)} to _launch_every_kernel"
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(list(launches.values())))
    env = os.environ | {"TRITON_INTERPRET": "0"}
    child = subprocess.run(
        [sys.executable, "-m", "tests.kernels.hopper_compile", str(path), "--resources"],
        env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stdout + child.stderr[-3000:]
    reports = [line for line in child.stdout.splitlines() if "'registers': " in line]
    assert len(reports) == len(launches)  # ptxas' resource figures read back for each variant
