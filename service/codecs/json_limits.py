"""The JSON numbers the device reads, by torch ops (json_device.py) or Triton kernels
(json_device_kernel.py); the host reads a body holding any other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class NumberLimits:
    """The numbers read on the device; the host reads a body holding any other."""

    token_bytes: int = 40  # float64's longest shortest form is 24 bytes
    significant_digits: int = 18  # int64 holds 10^18 - 1
    exponent_digits: int = 3
    exact_power: int = 22  # float64 holds 10^22 exactly, not 10^23; 10^±44 in two steps at most


LIMITS = NumberLimits()
