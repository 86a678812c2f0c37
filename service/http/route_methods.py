"""The methods each route of the engine process's HTTP server takes, as a table the front ends
(`service/frontends/front_end.py`) hold: they have no app of their own to route with, yet answer
a route asked with a method it does not take as the engine's router does (405, Allow), at once,
instead of reading a body that may never come and relaying it. The engine process reads the
table off its app's routes; it travels to the front ends as JSON."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from http import HTTPStatus

from fastapi.routing import iter_route_contexts
from starlette.responses import Response
from starlette.routing import BaseRoute

from ..errors import error_response

# A route: its path's regex, its path template (the route label of the request metrics) and the
# methods it takes (None: any, as a mount's).
RouteMethods = tuple[str, str, list[str] | None]


def route_methods(routes: Sequence[BaseRoute]) -> list[RouteMethods]:
    """The table of an app's `routes`, in the order its router tries them."""
    table = []
    for route in iter_route_contexts(routes):
        methods = sorted(route.methods) if route.methods else None
        table.append((route.path_regex.pattern, route.path, methods))
    return table


class MethodTable:
    def __init__(self, table: Iterable[RouteMethods]) -> None:
        self.routes = [
            (re.compile(pattern), template, frozenset(methods) if methods else None, methods)
            for pattern, template, methods in table
        ]

    def refused(self, method: str, path: str) -> tuple[str, Response] | None:
        """The router's answer when `path` is a route's and no route of it takes `method`: the
        template of the first such route (the router's choice) and its 405, which names that
        route's methods in Allow. None: a route takes it, or no route has this path."""
        first = None
        for pattern, template, methods, allow in self.routes:
            if pattern.match(path):
                if methods is None or method in methods:
                    return None
                first = first or (template, allow)
        if first is None:
            return None
        template, allow = first
        phrase = HTTPStatus.METHOD_NOT_ALLOWED.phrase  # the router's HTTPException(405) detail
        return template, error_response(405, phrase, {"Allow": ", ".join(allow)})
