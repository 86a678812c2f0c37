"""Float32 math in Triton that rounds as torch's CUDA kernels do, for kernels whose results must
equal torch's bit for bit (routing's choice, the shared experts' activation).

torch's CUDA kernels call expf and divide with IEEE rounding; Triton's `tl.exp` takes the
approximate ex2 path and `/` may be approximate too. `exp` here is libdevice's expf where the
kernel is compiled; Triton's CPU interpreter has no libdevice and uses numpy's exp, which
torch's CPU exp differs from by an ulp now and then. Divide with `tl.math.div_rn`.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

try:  # the backend-dispatching libdevice (triton >= 3.2); compiled code only
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - older triton
    from triton.language.extra.cuda import libdevice


def interpreted() -> bool:
    """Whether Triton kernels run in its CPU interpreter (TRITON_INTERPRET)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def libdevice_here(on_gpu: bool) -> bool:
    """The `LIBDEVICE` argument of `exp` for a kernel launched on a GPU tensor or not."""
    return on_gpu and not interpreted()


@triton.jit
def exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:  # expf, as torch's CUDA kernels
        return libdevice.exp(x)
    else:  # the interpreter: numpy's exp
        return tl.exp(x)
