"""How long /health and /ready take while clients post large JSON forwards, and what the server's
memory does meanwhile (issue 19: a 51 MB JSON body stalled /health for 9 s and grew the process
by 2.7 GB).

    python -m bench.probe_latency --url http://127.0.0.1:8000 --layer demo --tokens 3000 \\
        --clients 3 --duration 10

Each client thread posts the same pre-encoded JSON body back to back; a probe thread asks
/health and /ready in turn every 20 ms. Prints the probes' latency percentiles, the forwards'
statuses, and the server's resident memory (from /metrics) before, at the end and after a pause.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROBE_INTERVAL_S = 0.02
RSS = "process_resident_memory_bytes"


def server_rss_mb(http: httpx.Client) -> float:
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for sample in family.samples:
            if sample.name == RSS:
                return sample.value / 1e6
    raise SystemExit(f"{RSS} is not in /metrics")


def json_body(http: httpx.Client, layer: str, tokens: int) -> bytes:
    hidden = http.get(f"/v1/layers/{layer}").json()["hidden_size"]
    row = [round(0.01 * ((i % 7) - 3), 3) for i in range(hidden)]
    return json.dumps({"hidden_states": [row] * tokens}).encode()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server")
    p.add_argument("--layer", default="demo", help="the layer the clients post to")
    p.add_argument("--tokens", type=int, default=3000, help="tokens per JSON forward")
    p.add_argument("--clients", type=int, default=3, help="threads posting forwards")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load")
    args = p.parse_args(argv)

    with httpx.Client(base_url=args.url, timeout=300) as http:
        body = json_body(http, args.layer, args.tokens)
        rss_before = server_rss_mb(http)
    stop = threading.Event()
    probes: list[float] = []
    statuses: Counter[int | str] = Counter()

    def probe() -> None:
        with httpx.Client(base_url=args.url, timeout=60) as http:
            while not stop.is_set():
                for path in ("/health", "/ready"):
                    started = time.perf_counter()
                    http.get(path)
                    probes.append(time.perf_counter() - started)
                time.sleep(PROBE_INTERVAL_S)

    def post() -> None:
        headers = {"Content-Type": "application/json"}
        url = f"/v1/layers/{args.layer}/forward"
        with httpx.Client(base_url=args.url, timeout=300) as http:
            while not stop.is_set():
                try:
                    statuses[http.post(url, content=body, headers=headers).status_code] += 1
                except httpx.HTTPError as err:
                    statuses[type(err).__name__] += 1

    threads = [threading.Thread(target=probe)] + [
        threading.Thread(target=post) for _ in range(args.clients)
    ]
    for t in threads:
        t.start()
    time.sleep(args.duration)
    with httpx.Client(base_url=args.url, timeout=60) as http:
        rss_loaded = server_rss_mb(http)
        stop.set()
        for t in threads:
            t.join()
        time.sleep(2.0)
        rss_after = server_rss_mb(http)

    ms = sorted(1e3 * s for s in probes)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    sys.stdout.write(
        f"body {len(body) / 1e6:.1f} MB x {args.clients} clients for {args.duration:g} s: "
        f"forwards {dict(statuses)}\n"
        f"probes: {len(ms)}, p50 {statistics.median(ms):.1f} ms, p99 {p99:.1f} ms, "
        f"max {ms[-1]:.1f} ms\n"
        f"server RSS: {rss_before:.0f} MB before, {rss_loaded:.0f} MB under load, "
        f"{rss_after:.0f} MB 2 s after\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
