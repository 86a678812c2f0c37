"""The metrics port (--metrics-port, 8002 as Triton's; 0: off): `GET /metrics` answers the page
that /metrics on the HTTP port answers, with no token, as the probes.

A few lines of HTTP/1.1 on the event loop rather than a second uvicorn (whose server would take
the process's signals) or prometheus_client's threaded server (a thread per connection, with no
deadline): a scraper sends one short GET and reads one reply, and the connection closes. The
request's head must arrive within MOE_SERVE_READ_TIMEOUT_S and fit in HEAD_BYTES.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CONTENT_TYPE_LATEST

from ..metrics import Metrics
from ..settings import Settings

log = logging.getLogger(__name__)

HEAD_BYTES = 8 << 10  # a request line and headers; a scraper sends a few hundred bytes


class MetricsPort:
    def __init__(self, settings: Settings, metrics: Metrics) -> None:
        self.settings = settings
        self.metrics = metrics
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        host, port = self.settings.host, self.settings.metrics_port
        try:
            self.server = await asyncio.start_server(
                self._answer, host, port, limit=HEAD_BYTES, reuse_address=True
            )
        except OSError as err:
            raise OSError(
                f"metrics cannot listen on {host}:{port} (--metrics-port): {err}"
            ) from None
        log.info("metrics on %s:%d/metrics", host, port)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(
                reader.readuntil(b"\r\n\r\n"), self.settings.read_timeout_s
            )
            method, path, *_ = [*head.split(b"\r\n", 1)[0].decode("latin-1").split(" "), ""]
            if path.split("?", 1)[0] != "/metrics":
                status, body, media = "404 Not Found", b"not found: try /metrics\n", "text/plain"
            elif method not in ("GET", "HEAD"):
                status, body, media = "405 Method Not Allowed", b"GET /metrics\n", "text/plain"
            else:
                status, body, media = "200 OK", await self.metrics.scrape(), CONTENT_TYPE_LATEST
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {media}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            )
            if method != "HEAD":
                writer.write(body)
            await asyncio.wait_for(writer.drain(), self.settings.read_timeout_s)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # a scraper that went away, stalled or sent no HTTP: its connection closes
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()
