"""A trivial HTTP server: reads each request's body and answers 200 with two bytes. An internal
entry point: `moe-serve bench service` starts it in its own process,

    python -m moe_serve.bench.echo_server --port 8900 [--processes 4]

or one such process of the caller's own (`serve`, the target of a multiprocessing process).

The service benchmark loads it with the same bodies and clients as the real server, to show
what the load generator itself can drive (it must be well above every rate reported). HTTP/1.1
keep-alive with Content-Length bodies only, which is what hey and httpx send; several processes
share the port (SO_REUSEPORT) so that this server is not the limit either.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import signal
import socket
import sys

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Type: text/plain\r\n\r\nok"


class EchoProtocol(asyncio.Protocol):
    """Consume request head + Content-Length body, answer RESPONSE, repeat."""

    def __init__(self) -> None:
        self.buffer = bytearray()
        self.request_end: int | None = None  # where the current request's body ends
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        while True:
            if self.request_end is None:
                head_end = self.buffer.find(b"\r\n\r\n")
                if head_end < 0:
                    return
                self.request_end = head_end + 4 + content_length(bytes(self.buffer[:head_end]))
            if len(self.buffer) < self.request_end:
                return
            del self.buffer[: self.request_end]
            self.request_end = None
            self.transport.write(RESPONSE)


def content_length(head: bytes) -> int:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def _listen(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(1024)
    return sock


def serve(port: int) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # the plain asyncio loop is slower but still far above the service
        pass

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(EchoProtocol, sock=_listen(port))
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--processes", type=int, default=4)
    args = parser.parse_args(argv)
    # SIGTERM exits through Python, so that the daemon workers are ended with this process
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    workers = [
        multiprocessing.Process(target=serve, args=(args.port,), daemon=True)
        for _ in range(args.processes)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
