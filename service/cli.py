"""`moe-serve` command line (placeholder until the service lands)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    print("moe-serve: the HTTP service is not built yet (issue 5)", file=sys.stderr)  # noqa: T201
    return 2
