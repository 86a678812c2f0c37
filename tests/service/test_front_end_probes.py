"""`--http-workers`: each front end answers the probes itself from the state the engine process
publishes (service/frontends/engine_state.py), with no relay: alike to the engine's own
answers, while the engine's event loop is blocked, and not live once its heartbeat stops."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from moe_serve.service.core.probes import ProbeState
from moe_serve.service.frontends import supervisor
from moe_serve.service.frontends.engine_state import _SLOT_HEAD, _SLOTS, StateBlock
from moe_serve.service.frontends.front_end import _PROBE_ANSWERS, FrontEnd
from moe_serve.service.http import probes
from moe_serve.service.http.probes import MODEL_READY, READY
from moe_serve.service.settings import Settings
from tests.service.layers import NO_ROUTER, TINY, running_front_ends
from tests.service.test_cli import _serve_until_ready
from tests.service.test_front_ends import TOKEN, _count, _url

WAIT_S = 30.0  # bound on a poll for what the front ends answer
PROBES = ["/health", "/ready", "/v2/health/live", "/v2/health/ready"]
MODEL_PROBES = [
    f"/v2/models/{TINY}/ready",
    f"/v2/models/{NO_ROUTER}/versions/1/ready",
    f"/v2/models/{TINY}/versions/2/ready",  # 404: one version only
    "/v2/models/nope/ready",  # 404
]


@pytest.fixture(scope="module")
def front_ends():
    with running_front_ends(Settings(device="cpu", http_workers=1, grpc_port=0)) as running:
        yield running


def _engine(front_ends) -> httpx.Client:
    """A client of the engine process's own HTTP server (what the front ends relay to)."""
    transport = httpx.HTTPTransport(uds=str(front_ends.http_path))
    return httpx.Client(transport=transport, base_url="http://engine")


def _answer(reply: httpx.Response) -> tuple[int, str, bytes, str | None]:
    return (
        reply.status_code,
        reply.headers["content-type"],
        reply.content,
        reply.headers.get("retry-after"),
    )


def _poll(get, path: str, until) -> httpx.Response:
    deadline = time.monotonic() + WAIT_S
    while not until(reply := get(path)):
        assert time.monotonic() < deadline, f"{path}: {reply.status_code} {reply.text}"
        time.sleep(0.02)
    return reply


def test_probes_are_answered_by_the_front_end_alike_to_the_engine(
    front_ends, caplog: pytest.LogCaptureFixture
) -> None:
    url = _url(front_ends)
    series = 'moe_serve_requests_total{route="/v2/models/{name}/ready",status="404"}'
    before = _count(httpx.get(f"{url}/metrics").text, series)
    paths = PROBES + MODEL_PROBES
    with caplog.at_level(logging.INFO, logger="moe_serve.service.http.middleware"):
        fronted = {path: httpx.get(url + path) for path in paths}
        heads = {path: httpx.head(url + path) for path in ("/health", "/ready")}
    # answered by the front end (the engine's HTTP server logs every request it serves) ...
    assert not [line for line in caplog.messages if "/ready" in line or "/health" in line]
    with _engine(front_ends) as engine:
        for path in paths:
            assert _answer(fronted[path]) == _answer(engine.get(path)), path
            assert fronted[path].headers["X-Request-ID"]
        for path, head in heads.items():
            assert (head.status_code, head.content) == (200, b"")
            assert head.headers["content-length"] == engine.head(path).headers["content-length"]
    assert [fronted[path].status_code for path in paths] == [200] * 6 + [404, 404]
    # ... and counted by the engine under the route's template, as it counts its own
    after = _count(httpx.get(f"{url}/metrics").text, series)
    assert after - before == 2


def test_a_model_probe_needs_the_token_and_the_server_probes_do_not() -> None:
    settings = Settings(device="cpu", http_workers=1, grpc_port=0, api_token=TOKEN)
    with running_front_ends(settings) as front_ends:
        url = _url(front_ends)
        assert httpx.get(f"{url}/v2/models/{TINY}/ready").status_code == 401
        auth = {"Authorization": f"Bearer {TOKEN}"}
        assert httpx.get(f"{url}/v2/models/{TINY}/ready", headers=auth).status_code == 200
        assert all(httpx.get(url + path).status_code == 200 for path in PROBES)


def test_probes_say_the_engine_drains(front_ends) -> None:
    """SIGTERM: the engine's runtime drains (service/serve.py); the front ends' readiness says
    so at once (published from the engine's event loop), liveness does not change."""
    url = _url(front_ends)
    runtime = front_ends._runtime
    try:
        runtime.drain()  # from this thread, as a signal handler would
        reply = _poll(httpx.get, f"{url}/ready", lambda r: r.status_code == 503)
        assert reply.json() == {"ready": False, "reason": "shutting down"}
        with _engine(front_ends) as engine:
            for path in PROBES + MODEL_PROBES:
                assert _answer(httpx.get(url + path)) == _answer(engine.get(path)), path
        assert httpx.get(f"{url}/v2/health/ready").json() == {"error": "not ready: shutting down"}
        assert httpx.get(f"{url}/health").status_code == 200
    finally:
        runtime.drain_deadline = None
    _poll(httpx.get, f"{url}/ready", lambda r: r.status_code == 200)


def test_probes_give_the_reason_a_load_failed() -> None:
    def broken_loader(settings, devices):
        raise ValueError(
            "/w/layer0/experts.safetensors: tensor 'w13': shape [4, 8] expected [4, 9]"
        )

    def failed(url: str) -> bool:
        try:
            return "failed" in httpx.get(f"{url}/ready").json()["reason"]
        except httpx.TransportError:
            return False

    settings = Settings(device="cpu", http_workers=1, grpc_port=0)
    with running_front_ends(settings, broken_loader, started=failed) as front_ends:
        url = _url(front_ends)
        reply = httpx.get(f"{url}/ready")
        assert reply.status_code == 503
        assert reply.json()["reason"].startswith(
            "loading the layers failed: /w/layer0/experts.safetensors: tensor 'w13'"
        )
        assert httpx.get(f"{url}/health").status_code == 200
        with _engine(front_ends) as engine:
            for path in PROBES + MODEL_PROBES:
                assert _answer(httpx.get(url + path)) == _answer(engine.get(path)), path


STALE_S = 3.0  # the front ends' heartbeat limit in the tests that stop the engine's loop


@pytest.fixture
def short_heartbeat(monkeypatch: pytest.MonkeyPatch) -> Iterator:
    monkeypatch.setattr(supervisor, "STALE_S", STALE_S)  # what the front ends are started with
    with running_front_ends(Settings(device="cpu", http_workers=1, grpc_port=0)) as running:
        yield running


@contextmanager
def _blocked(loop: asyncio.AbstractEventLoop) -> Iterator[float]:
    """The engine's event loop blocked (as by a long call on it) until the block ends; yields
    the time.monotonic() it was blocked at."""
    blocked, release = threading.Event(), threading.Event()

    def block() -> None:
        blocked.set()
        release.wait()

    loop.call_soon_threadsafe(block)
    assert blocked.wait(WAIT_S)
    try:
        yield time.monotonic()
    finally:
        release.set()


def test_probes_answer_while_the_engines_event_loop_is_blocked_then_say_it_stopped(
    short_heartbeat,
) -> None:
    url = _url(short_heartbeat)
    with _blocked(short_heartbeat._beating.get_loop()) as since:
        ready = httpx.get(f"{url}/ready", timeout=WAIT_S)  # no relay: answered all the same
        if time.monotonic() - since < STALE_S - 1.0:  # the last beat is younger than STALE_S
            assert ready.status_code == 200 and ready.json()["ready"] is True
        health = _poll(httpx.get, f"{url}/health", lambda r: r.status_code == 503)
        stopped = "the engine process has not run its event loop for "
        assert health.json()["error"].startswith(f"not live: {stopped}")
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and ready.json()["reason"].startswith(stopped)
        for path in ("/v2/health/live", "/v2/health/ready", f"/v2/models/{TINY}/ready"):
            reply = httpx.get(url + path)
            assert reply.status_code == 503 and stopped in reply.json()["error"], path
    for path in PROBES + MODEL_PROBES[:2]:  # the loop runs again: so does the heartbeat
        _poll(httpx.get, url + path, lambda r: r.status_code == 200)


@pytest.mark.slow
def test_probes_say_a_stopped_engine_process_is_not_live(tmp_path: Path) -> None:
    """`moe-serve serve --http-workers 1`, its engine process stopped (SIGSTOP): the front end
    goes on answering the probes, not live and not ready once the heartbeat has expired, and
    live and ready again once the engine runs again."""
    proc, url = _serve_until_ready(tmp_path, "--http-workers", "1")
    try:
        proc.send_signal(signal.SIGSTOP)
        health = _poll(httpx.get, f"{url}/health", lambda r: r.status_code == 503)
        assert "the engine process has not run its event loop" in health.json()["error"]
        ready = httpx.get(f"{url}/ready")
        assert ready.status_code == 503 and not ready.json()["ready"]
        proc.send_signal(signal.SIGCONT)
        for path in PROBES:
            _poll(httpx.get, url + path, lambda r: r.status_code == 200)
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_reader_finds_the_last_whole_state_and_its_age() -> None:
    """A writer stopped halfway through a write leaves the state before it readable; a
    heartbeat older than the limit reads as not live and not ready."""
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state"
        writer = StateBlock.create(path)
        reader = StateBlock.attach(path)
        assert reader.read(math.inf).not_live == "the engine process has published no state yet"
        published = ProbeState(degraded="rank 1 lost", models=(TINY,))
        writer.write(published)
        assert reader.read(math.inf) == published
        # the next write, stopped after it marked its slot (sequence odd)
        at = _SLOTS[(writer._generation + 1) % 2]
        _SLOT_HEAD.pack_into(writer._map, at, _SLOT_HEAD.unpack_from(writer._map, at)[0] + 1, 0, 0)
        assert reader.read(math.inf) == published
        stale = reader.read(-1.0)
        assert stale.not_live and stale.not_ready == stale.not_live and stale.ready_reason
        writer.write(ProbeState(draining=True))  # the stopped write, done
        assert reader.read(math.inf) == ProbeState(draining=True)
        reader.close()
        writer.close()


def test_a_probe_s_answer_is_made_once_per_published_state_and_alike_to_a_fresh_one() -> None:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "state"
        writer = StateBlock.create(path)
        front_end = FrontEnd.__new__(FrontEnd)  # only what _probe_answer reads
        front_end.state = StateBlock.attach(path)
        front_end.config = SimpleNamespace(engine_stale_s=math.inf)
        front_end._probed = (None, {})
        writer.write(ProbeState(models=(TINY,)))
        asked = [(READY, "", ""), (MODEL_READY, TINY, ""), (MODEL_READY, "nope", "")]
        first = [front_end._probe_answer(probe) for probe in asked]
        assert [front_end._probe_answer(probe) for probe in asked] == first
        assert all(a is b for a, b in zip(first, map(front_end._probe_answer, asked), strict=True))
        for state in (ProbeState(models=(TINY,)), ProbeState(draining=True)):
            writer.write(state)  # published again: made afresh, as probes.answer makes it
            for probe in asked:
                fresh = probes.answer(state, *probe)
                made = (fresh.status_code, fresh.raw_headers, fresh.body)
                assert front_end._probe_answer(probe) == made
        # the names asked come from clients: past the bound, answered but not kept
        names = [(MODEL_READY, f"m{i}", "") for i in range(_PROBE_ANSWERS + 8)]
        assert all(front_end._probe_answer(probe)[0] == 404 for probe in names)
        assert len(front_end._probed[1]) == _PROBE_ANSWERS
        front_end.state.close()
        writer.close()
