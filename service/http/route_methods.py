"""The methods each route of the engine process's HTTP server takes, as a table the front ends
(`service/frontends/front_end.py`) hold: they have no app of their own to route with, yet answer
what the engine's router refuses as it does, at once, instead of reading a body that may never
come and relaying it: a route asked with a method it does not take (405, Allow), a path no route
has (404). The engine process reads the table off its app's routes; it travels to the front
ends as JSON."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from http import HTTPStatus

from fastapi.routing import iter_route_contexts
from starlette.responses import Response
from starlette.routing import BaseRoute

from ..errors import error_response

UNMATCHED = "unmatched"  # the route label of a path no route has, as the engine counts it
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
        """The router's refusal of `method` on `path`, with the route label it is counted under:
        405 (the template of the first route of this path, whose methods Allow names) where
        routes have the path but none takes the method, 404 ("unmatched") where no route has
        it nor, the router's redirect to the other slash, its twin. None: a route takes it, or
        the router redirects, or the table names no route (it knows of no path)."""
        if not self.routes:
            return None
        first = None
        for pattern, template, methods, allow in self.routes:
            if pattern.match(path):
                if methods is None or method in methods:
                    return None
                first = first or (template, allow)
        if first is not None:
            template, allow = first
            phrase = HTTPStatus.METHOD_NOT_ALLOWED.phrase  # the router's HTTPException(405)
            return template, error_response(405, phrase, {"Allow": ", ".join(allow)})
        twin = path[:-1] if path.endswith("/") else path + "/"
        if path != "/" and any(pattern.match(twin) for pattern, *_ in self.routes):
            return None
        return UNMATCHED, error_response(404, HTTPStatus.NOT_FOUND.phrase)
