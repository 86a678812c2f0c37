"""The quantisation schemes we serve: `QuantScheme` is the vocabulary of names users see (in
manifests, URLs and tuned-file names); each name has one frozen description, `SchemeSpec`, which
the quantiser, the layer-file layout and the Triton experts read.

Weight layouts (E experts, N output rows, K input columns of one GEMM weight [E, N, K]):

| scheme        | weight                     | weight scale                   | activations       |
| ------------- | -------------------------- | ------------------------------ | ----------------- |
| none          | dtype of the layer         | -                              | as is             |
| fp8-tensor    | float8_e4m3fn              | [E] float32                    | fp8, one scale    |
| fp8-token     | float8_e4m3fn              | [E, N] float32 (per channel)   | fp8, per token    |
| fp8-block     | float8_e4m3fn              | [E, ceil(N/128), ceil(K/128)]* | fp8, 1x128 groups |
| int8-w8a16    | int8                       | [E, N] float32                 | as is             |
| int4-w4a16    | uint8 [E, N, K/2], 2 per B | [E, N, K/group] float32        | as is             |
| mxfp4         | uint8 [E, N, K/2] e2m1     | [E, N, K/32] uint8 e8m0        | as is             |

Activation scales are dynamic: computed per call from the tensor being quantised.

* A w13 of split gate/up rows is two matrices stacked, gate [I, H] then up [I, H], each grouped
on its own (`parts=2`): [E, 2 * ceil(I/128), ceil(H/128)], as transformers' fine-grained fp8
stores gate_proj and up_proj; where 128 divides I this is the plain layout. Partial last blocks
(H or I not a multiple of 128) have a scale of their own.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from enum import StrEnum

import torch

from .arith import ceil_div

FP8 = torch.float8_e4m3fn
E8M0 = torch.uint8  # a power-of-two scale stored as its biased exponent e: 2**(e - 127)
FP8_BLOCK = 128  # DeepSeek-V3 weight tiles are 128 x 128; activations use 1 x 128 groups
MXFP4_GROUP = 32  # OCP microscaling: one e8m0 scale per 32 values
GROUP_SIZE = 0  # a scale group set per layer, by QuantConfig.group_size (int4-w4a16)


class ActQuant(StrEnum):
    """How activations are quantised to fp8 before a GEMM."""

    TENSOR = "tensor"  # one scale for the whole [M, K]
    TOKEN = "token"  # one scale per row: [M, 1]
    GROUP = "group"  # one scale per row and 128 columns: [M, ceil(K/128)]


@dataclass(frozen=True)
class ValueType:
    """What one stored weight element holds (as triton_kernels' `FloatType` in tensor.py)."""

    name: str
    storage: torch.dtype | None  # None: the layer's own dtype, unquantised
    per_byte: int = 1  # 2: two 4-bit values per uint8, element 2j in the low nibble


NATIVE = ValueType("native", None)
FP8_E4M3 = ValueType("fp8-e4m3", FP8)
INT8 = ValueType("int8", torch.int8)  # symmetric: round(w / scale) in [-128, 127]
INT4 = ValueType("int4", torch.uint8, per_byte=2)  # symmetric [-8, 7], stored as code + 8
E2M1 = ValueType("e2m1", torch.uint8, per_byte=2)  # fp4: sign bit 3, exponent 1-2, mantissa 0


@dataclass(frozen=True)
class ScaleGroups:
    """One scale per `n` rows and `k` columns of a weight [E, N, K]. None: one scale for the
    whole axis, which the scale's shape then leaves out (fp8-tensor: [E]; per channel: [E, N])."""

    dtype: torch.dtype  # float32 multipliers, or E8M0 exponents
    n: int | None
    k: int | None
    ragged: bool = False  # a partial last group has a scale of its own; else groups divide K

    def shape(self, experts: int, n: int, k: int, parts: int = 1) -> tuple[int, ...]:
        """The scale tensor's shape for a weight [experts, n, k] of `parts` matrices stacked
        along N, each grouped on its own."""
        return (
            experts,
            *(() if self.n is None else (parts * ceil_div(n // parts, self.n),)),
            *(() if self.k is None else (ceil_div(k, self.k),)),
        )

    def splits_parts(self) -> bool:
        """Whether stacked matrices (w13's gate and up) group their rows apart: groups of
        several rows (fp8-block); per-row and whole-tensor scales are the same either way."""
        return self.n not in (None, 1)

    @property
    def n_dim(self) -> int:
        """The scale tensor's axis of row groups (negative; it exists where n is not None)."""
        return -1 if self.k is None else -2


@dataclass(frozen=True)
class SchemeSpec:
    """How a scheme stores one GEMM weight and what its GEMMs take as input."""

    values: ValueType
    scales: ScaleGroups | None = None  # None: the weight is used as stored
    act_quant: ActQuant | None = None  # fp8 quantisation of the GEMM inputs; None: 16-bit

    @property
    def k_group(self) -> int | None:
        """K columns sharing one weight scale; None where the scales do not vary along K."""
        return None if self.scales is None else self.scales.k


_F32 = torch.float32


class QuantScheme(StrEnum):
    NONE = "none"
    FP8_TENSOR = "fp8-tensor"
    FP8_TOKEN = "fp8-token"
    FP8_BLOCK = "fp8-block"
    INT8_W8A16 = "int8-w8a16"
    INT4_W4A16 = "int4-w4a16"
    MXFP4 = "mxfp4"

    @property
    def spec(self) -> SchemeSpec:
        """This scheme's layout; int4-w4a16's K group is per layer (`QuantConfig.spec` has it)."""
        return SCHEMES[self]


SCHEMES: dict[QuantScheme, SchemeSpec] = {
    QuantScheme.NONE: SchemeSpec(NATIVE),
    QuantScheme.FP8_TENSOR: SchemeSpec(FP8_E4M3, ScaleGroups(_F32, None, None), ActQuant.TENSOR),
    QuantScheme.FP8_TOKEN: SchemeSpec(FP8_E4M3, ScaleGroups(_F32, 1, None), ActQuant.TOKEN),
    QuantScheme.FP8_BLOCK: SchemeSpec(
        FP8_E4M3, ScaleGroups(_F32, FP8_BLOCK, FP8_BLOCK, ragged=True), ActQuant.GROUP
    ),
    QuantScheme.INT8_W8A16: SchemeSpec(INT8, ScaleGroups(_F32, 1, None)),
    QuantScheme.INT4_W4A16: SchemeSpec(INT4, ScaleGroups(_F32, 1, GROUP_SIZE)),
    QuantScheme.MXFP4: SchemeSpec(E2M1, ScaleGroups(E8M0, 1, MXFP4_GROUP)),
}


@dataclass(frozen=True)
class QuantConfig:
    scheme: QuantScheme = QuantScheme.NONE
    group_size: int = 128  # int4-w4a16 only: K columns sharing one scale

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "scheme", QuantScheme(self.scheme))
        except ValueError as err:
            names = ", ".join(s.value for s in QuantScheme)
            raise ValueError(
                f"unknown quant scheme {self.scheme!r}; expected one of {names}"
            ) from err
        if self.group_size < 2 or self.group_size % 2:
            raise ValueError(f"group_size must be an even number >= 2, got {self.group_size}")

    @functools.cached_property
    def spec(self) -> SchemeSpec:
        """The scheme's layout, with this layer's group size where the scheme takes one."""
        spec = self.scheme.spec
        if spec.k_group != GROUP_SIZE:
            return spec
        return dataclasses.replace(spec, scales=dataclasses.replace(spec.scales, k=self.group_size))

    def check_shape(self, hidden_size: int, intermediate_size: int) -> None:
        """Raise if a GEMM's K (H for GEMM1, I for GEMM2) does not fit the packed layout."""
        group = self.spec.k_group
        if group is None or self.spec.scales.ragged:
            return
        for name, k in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if k % group:
                raise ValueError(f"{self.scheme} needs {name} to be a multiple of {group}, got {k}")
