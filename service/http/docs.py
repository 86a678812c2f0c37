"""Interactive docs that need no internet: /docs and /redoc serve the Swagger UI and ReDoc assets
bundled in fastapi-offline (FastAPI's own pages load them from a CDN); and, where a token is
required, /openapi.json declares the bearer scheme, so that Swagger UI's Authorize button sends
it. Every example in the API description runs against the demo layer (`service/http/examples.py`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

ASSETS = "/docs/static"
# Open without the token: a browser cannot send one when it loads the page.
PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def is_docs(path: str) -> bool:
    return path in PATHS or path.startswith(f"{ASSETS}/")


def offline_app(**fields: Any) -> FastAPI:
    """FastAPI(**fields) with /docs and /redoc served from the bundled assets."""
    return FastAPIOffline(static_url=ASSETS, **fields)


def declare_bearer(app: FastAPI, open_paths: frozenset[str]) -> None:
    """/openapi.json says that every route but `open_paths` needs `Authorization: Bearer`."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            schema.setdefault("components", {})["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer", "description": "MOE_SERVE_API_TOKEN"}
            }
            for path, operations in schema["paths"].items():
                if path not in open_paths:
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
        return app.openapi_schema

    app.openapi = openapi
