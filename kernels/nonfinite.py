"""The bits that make a floating-point value NaN or Inf, per format (torch-free: the HTTP
front-end processes check request bodies with numpy).

A value is NaN or Inf exactly when all of its format's mask bits are set: the exponent bits
(e4m3fn has no Inf, and its NaN sets the mantissa bits too). Keys are safetensors' dtype names.
"""

from __future__ import annotations

NONFINITE_MASKS = {
    "F64": 0x7FF0000000000000,
    "F32": 0x7F800000,
    "BF16": 0x7F80,
    "F16": 0x7C00,
    "F8_E4M3": 0x7F,
}
