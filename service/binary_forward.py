"""Which requests are plain binary forwards: `POST /v1/layers/{name}/forward` with a safetensors
body (Content-Type application/octet-stream) and no query string, the request a client library
sends in a loop. Both of its fast paths take exactly these (`service/fast_path.py` in the engine
process, `service/front_end.py` in a front-end process); everything else takes the app's routes.
"""

from __future__ import annotations

import re

from starlette.types import Scope

FORWARD_PATH = "/v1/layers/{name}/forward"
JSON = "application/json"
BINARY = "application/octet-stream"

_PATH = re.compile(r"/v1/layers/([^/]+)/forward")
_BINARY = BINARY.encode()


def plain_binary_forward(scope: Scope) -> str | None:
    """The layer's name when `scope` is a plain binary forward, else None."""
    if scope["type"] != "http" or scope["method"] != "POST" or scope["query_string"]:
        return None
    matched = _PATH.fullmatch(scope["path"])
    if matched is None:
        return None
    media = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    return matched.group(1) if media.split(b";")[0].strip().lower() == _BINARY else None
