"""Which requests are plain forwards: `POST /v1/layers/{name}/forward` with no query string and a
safetensors body (Content-Type application/octet-stream, a plain binary forward, the request a
client library sends in a loop) or a JSON one. A front-end process answers exactly these itself
(service/frontends/front_end.py) and relays the rest to the engine; in one process on a GPU, a
plain forward's body is read into memory of its own (service/http/forward_body.py).
"""

from __future__ import annotations

import re

from starlette.types import Scope

FORWARD_PATH = "/v1/layers/{name}/forward"
JSON = "application/json"
BINARY = "application/octet-stream"

_PATH = re.compile(r"/v1/layers/([^/]+)/forward")
_BINARY = BINARY.encode()
_JSON = JSON.encode()


def plain_forward(scope: Scope) -> tuple[str, str] | None:
    """The layer's name and the body's media type (BINARY or JSON) when `scope` is a plain
    forward, else None."""
    if scope["type"] != "http" or scope["method"] != "POST" or scope["query_string"]:
        return None
    matched = _PATH.fullmatch(scope["path"])
    if matched is None:
        return None
    media = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
    media = media.split(b";")[0].strip().lower()
    if media == _BINARY:
        return matched.group(1), BINARY
    return (matched.group(1), JSON) if media == _JSON else None
