"""The byte limit of a request's body, and how a 413 names it: one rule for the engine process's
server and for the front ends, which read a relayed body before the engine sees it.

JSON has its own, lower limit: decoding it holds the GIL (the event loop waits) and costs a few
times its size in memory; binary bodies cost neither. Torch-free: the front ends use it.
"""

from __future__ import annotations

from ..errors import PayloadTooLarge

HEADER_LENGTH = "Inference-Header-Content-Length"  # KServe binary tensors: the JSON part's length
_BINARY_HINT = (
    "send larger requests in binary: a safetensors blob (Content-Type: "
    "application/octet-stream) on /v1, binary tensors on /v2"
)


def body_limit(
    media: str, json_part: str | None, max_json_bytes: int, max_body_bytes: int
) -> tuple[int, str]:
    """The limit of a body of media type `media` (lowercase, without parameters) whose KServe
    JSON part is `json_part` bytes long (the header's value; None without it), and how a 413
    names it; PayloadTooLarge at once for a JSON part over the JSON limit."""
    counted = json_part is not None and json_part.isascii() and json_part.isdigit()
    if counted and int(json_part) > max_json_bytes:
        raise PayloadTooLarge(
            f"the JSON part of {json_part} bytes exceeds the {max_json_bytes}-byte limit of "
            f"JSON (MOE_SERVE_MAX_JSON_BYTES); {_BINARY_HINT}"
        )
    if media == "application/json" and json_part is None and max_json_bytes < max_body_bytes:
        return max_json_bytes, (
            f"the {max_json_bytes}-byte limit of a JSON body (MOE_SERVE_MAX_JSON_BYTES); "
            f"{_BINARY_HINT}"
        )
    return max_body_bytes, f"the {max_body_bytes}-byte limit (MOE_SERVE_MAX_BODY_BYTES)"


def body_too_large(what: str, declared: int | None = None) -> PayloadTooLarge:
    """The 413 of a body past its limit (`what`, as `body_limit` names it), of `declared` bytes
    where its Content-Length says so."""
    size = "" if declared is None else f" of {declared} bytes"
    return PayloadTooLarge(f"request body{size} exceeds {what}")
