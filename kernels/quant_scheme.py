"""The quantisation schemes we serve, as one vocabulary of names users see.

Weight layouts (E experts, N output rows, K input columns of one GEMM weight [E, N, K]):

| scheme        | weight                     | weight scale                   | activations       |
| ------------- | -------------------------- | ------------------------------ | ----------------- |
| none          | dtype of the layer         | -                              | as is             |
| fp8-tensor    | float8_e4m3fn              | [E] float32                    | fp8, one scale    |
| fp8-token     | float8_e4m3fn              | [E, N] float32 (per channel)   | fp8, per token    |
| fp8-block     | float8_e4m3fn              | [E, ceil(N/128), ceil(K/128)]  | fp8, 1x128 groups |
| int8-w8a16    | int8                       | [E, N] float32                 | as is             |
| int4-w4a16    | uint8 [E, N, K/2], 2 per B | [E, N, K/group] float32        | as is             |
| mxfp4         | uint8 [E, N, K/2] e2m1     | [E, N, K/32] uint8 e8m0        | as is             |

Activation scales are dynamic: computed per call from the tensor being quantised.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

FP8 = torch.float8_e4m3fn
FP8_BLOCK = 128  # DeepSeek-V3 weight tiles are 128 x 128; activations use 1 x 128 groups
MXFP4_GROUP = 32  # OCP microscaling: one e8m0 scale per 32 values


class ActQuant(StrEnum):
    """How activations are quantised to fp8 before a GEMM."""

    TENSOR = "tensor"  # one scale for the whole [M, K]
    TOKEN = "token"  # one scale per row: [M, 1]
    GROUP = "group"  # one scale per row and 128 columns: [M, ceil(K/128)]


class QuantScheme(StrEnum):
    NONE = "none"
    FP8_TENSOR = "fp8-tensor"
    FP8_TOKEN = "fp8-token"
    FP8_BLOCK = "fp8-block"
    INT8_W8A16 = "int8-w8a16"
    INT4_W4A16 = "int4-w4a16"
    MXFP4 = "mxfp4"

    @property
    def act_quant(self) -> ActQuant | None:
        """The fp8 activation quantisation this scheme's GEMMs take, None for 16-bit inputs."""
        return {
            QuantScheme.FP8_TENSOR: ActQuant.TENSOR,
            QuantScheme.FP8_TOKEN: ActQuant.TOKEN,
            QuantScheme.FP8_BLOCK: ActQuant.GROUP,
        }.get(self)

    @property
    def packs_two_per_byte(self) -> bool:
        return self in (QuantScheme.INT4_W4A16, QuantScheme.MXFP4)


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

    def check_shape(self, hidden_size: int, intermediate_size: int) -> None:
        """Raise if a GEMM's K (H for GEMM1, I for GEMM2) does not fit the packed layout."""
        group = {QuantScheme.INT4_W4A16: self.group_size, QuantScheme.MXFP4: MXFP4_GROUP}.get(
            self.scheme
        )
        if group is None:
            return
        for name, k in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if k % group:
                raise ValueError(f"{self.scheme} needs {name} to be a multiple of {group}, got {k}")
