"""Markers, devices and tiny configs shared by every test."""

from __future__ import annotations

import dataclasses
import os
import platform
import shutil
import threading

# Before numpy loads OpenBLAS (torch imports numpy): on a machine without a GPU, Triton's
# interpreter computes tl.dot with numpy's matmul, and OpenBLAS's Haswell kernel (chosen on AVX2
# hosts without AVX-512, such as CI's AMD EPYC) rounds a row differently by its position in the
# tile, which a GPU does not: the batch-invariance tests then fail on the CPU alone. The
# Sandybridge kernel computes every row alike.
if platform.machine() in ("x86_64", "AMD64"):
    os.environ.setdefault("OPENBLAS_CORETYPE", "Sandybridge")
# Before torch starts its OpenMP threads and numpy its OpenBLAS ones, on a machine without an
# NVIDIA driver (the Makefile's test): one thread a process. There the tests' tensors are a few
# KB, too small for a parallel region to pay, and this process shares the cores (CI has 2) with
# the servers and ranks the tests start (they inherit the setting): a region waits for each of
# its threads, and on a busy machine one of them is often descheduled.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads this when a kernel is decorated, so it must be set before any backend module
    # is imported (by any test): on a CPU machine every Triton kernel runs in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _lighten_the_interpreter() -> None:
    """Two chores of Triton's interpreter that change nothing here, skipped; together they took
    about two thirds of its time on our kernels.

    - It swaps triton.language's functions for interpreted ones when a launch starts (and back
      when it ends), and again at every call of a @triton.jit helper inside it, each time
      walking every member of the language's modules. Within a launch, a helper's swap of
      modules the launch has swapped already changes nothing, so it is skipped (per thread:
      launches on other threads keep their own account).
    - Every integer +, - and * under 64 bits is computed again in 64 bits and compared with its
      type's range for a device_assert, which does nothing unless the interpreter's options say
      debug: where they do not, the overflow check is off.

    Both reach into the interpreter's own names (Triton is not pinned here): a Triton without
    them runs its interpreter as it is, only slower."""
    import triton.language as tl
    from triton.runtime import interpreter

    names = ("_patch_lang", "_LangPatchScope", "GridExecutor", "interpreter_builder")
    if not all(hasattr(interpreter, name) for name in names):
        return
    builder = interpreter.interpreter_builder
    options = getattr(builder, "options", None)
    if hasattr(options, "sanitize_overflow") and not getattr(options, "debug", True):
        builder.options = dataclasses.replace(options, sanitize_overflow=False)

    patch_lang, launch = interpreter._patch_lang, interpreter.GridExecutor.__call__
    state = threading.local()  # .patched: ids of the modules this thread's launch has swapped
    langs_of: dict[object, set[int]] = {}  # a function -> ids of the language modules it sees

    def patch_once(fn: object) -> object:
        patched = getattr(state, "patched", None)
        langs = langs_of.get(fn)
        if langs is None:
            langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
            langs_of[fn] = langs
        if patched is None or not langs <= patched:  # outside a launch: as the interpreter does
            if patched is not None:
                patched |= langs
            return patch_lang(fn)
        return interpreter._LangPatchScope()  # nothing to swap, nothing to restore

    def launch_patching_once(self: object, *args: object, **kwargs: object) -> object:
        state.patched = set()
        try:
            return launch(self, *args, **kwargs)
        finally:
            state.patched = None

    interpreter._patch_lang = patch_once
    interpreter.GridExecutor.__call__ = launch_patching_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _lighten_the_interpreter()

# No gRPC or metrics listener unless a test asks for one (grpc_port=..., metrics_port=...): the
# servers that tests start, module-scoped ones included, would all claim the default ports.
os.environ["MOE_SERVE_GRPC_PORT"] = "0"
os.environ["MOE_SERVE_METRICS_PORT"] = "0"

import pytest  # noqa: E402

from moe_serve.kernels.config import MoEConfig, RoutingConfig  # noqa: E402


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; DEVELOPERS.md says how to run the GPU suite")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    """CUDA when present (and not forced off with MOE_SERVE_TEST_DEVICE=cpu), else CPU."""
    name = os.environ.get("MOE_SERVE_TEST_DEVICE") or ("cuda" if HAS_CUDA else "cpu")
    return torch.device(name)


@pytest.fixture
def tiny_config() -> MoEConfig:
    return MoEConfig(
        num_experts=4,
        hidden_size=64,
        intermediate_size=128,
        routing=RoutingConfig(top_k=2),
        dtype=torch.float32,
    )
