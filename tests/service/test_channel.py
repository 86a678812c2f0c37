"""The front-end channel in one process: EngineClient (a front end's end) against ChannelServer on
a real CPU engine and batcher. Replies match the reference, a JSON reply lies in the region or,
longer than its room, comes whole over the channel, errors keep their status and headers (for
safetensors and JSON bodies alike), a withdrawn forward leaves the queue and is answered 499, a
front end that goes away takes its queued forwards with it, DONE records reach the metrics (held
back until the next record, or until a scrape settles them), and records cut anywhere by the
socket's reads arrive whole."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import tempfile
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from moe_serve.service.codecs.safetensors_wire import decode_safetensors, encode_safetensors
from moe_serve.service.core.runtime import Runtime
from moe_serve.service.engine.batcher import BatchPolicy, DynamicBatcher
from moe_serve.service.frontends import channel, channel_server
from moe_serve.service.frontends.arena import BLOCK_BYTES, BodyArena, Region
from moe_serve.service.frontends.channel import (
    _HEAD,
    CANCEL,
    DONE,
    DONE_FIELDS,
    FORWARD,
    FORWARD_FIELDS,
    HELLO,
    REPLY,
    SETTLE,
    EngineClient,
    RecordProtocol,
    RecordReader,
    RecordWriter,
)
from moe_serve.service.frontends.channel_server import (
    MAX_FRONT_END_RECORD_BYTES,
    ChannelServer,
    _FrontEndLink,
)
from moe_serve.service.metrics import Metrics
from moe_serve.service.settings import Settings
from tests.service.layers import TINY, H, reference_forward, tiny_layers
from tests.service.test_batcher import WAIT_S, RecordingEngine, rows

FORWARD_ROUTE = "/v1/layers/{name}/forward"


@dataclass(frozen=True)
class Served:
    """A channel served on a fresh engine and batcher, one front end connected."""

    engine: RecordingEngine
    metrics: Metrics
    batcher: DynamicBatcher
    server: ChannelServer
    client: EngineClient


@contextlib.asynccontextmanager
async def served(
    policy: BatchPolicy, on_lost: Callable[[], None] = lambda: None, stay_awake: bool = False
):
    """`Served`; everything closed after (closing twice is harmless: a test may close parts
    itself). `stay_awake`: the front end's, as for an engine on a GPU."""
    engine = RecordingEngine(tiny_layers())
    metrics = Metrics()
    batcher = DynamicBatcher(engine, policy, metrics)
    batcher.start()
    runtime = Runtime(Settings(device="cpu"), metrics, engine, batcher, not_ready=None)
    with tempfile.TemporaryDirectory() as directory:
        server = ChannelServer(runtime, Path(directory) / "channel.sock")
        await server.start()
        arena = BodyArena.create(Path(directory), 64 * BLOCK_BYTES)
        client = EngineClient(server.path, arena, on_lost=on_lost, stay_awake=stay_awake)
        await client.connect()
        try:
            yield Served(engine, metrics, batcher, server, client)
        finally:
            engine.gate.set()
            await client.close()
            await server.close()
            await batcher.close()
            arena.close()


def run(policy: BatchPolicy, body: Callable[..., Awaitable], stay_awake: bool = False) -> object:
    """body(engine, metrics, client) with a channel `served`."""

    async def main():
        async with served(policy, stay_awake=stay_awake) as s:
            return await asyncio.wait_for(body(s.engine, s.metrics, s.client), WAIT_S)

    return asyncio.run(main())


def _lay(client, x: torch.Tensor, as_json: bool = False):
    """`x` as a body in a region of the client's arena: a safetensors blob, or JSON."""
    if as_json:
        body = json.dumps({"hidden_states": x.tolist()}).encode()
    else:
        body = encode_safetensors({"hidden_states": x}, {})
    region = client.arena.allocate(len(body))
    client.arena.body(region)[:] = body
    return region


def _ask(client, as_json: bool):
    """The client's call for a body laid by `_lay(..., as_json)`."""
    return client.forward_json if as_json else client.forward


BODY_KINDS = pytest.mark.parametrize("as_json", [False, True], ids=["safetensors", "json"])


def _never() -> asyncio.Future:
    """A client that stays: `gone` never done."""
    return asyncio.get_running_loop().create_future()


async def _forward_begun(engine: RecordingEngine) -> None:
    """Returns once the engine's thread has begun a forward (held at its gate)."""
    assert await asyncio.to_thread(engine.entered.wait, WAIT_S), "no forward began"


async def _queued(metrics: Metrics, requests: int) -> None:
    """Yields to the event loop (the channel and the batcher run on it) until `requests` wait
    in the layer's queue: an order of events, not a span of time."""
    for _ in range(10_000):
        if metrics.registry.get_sample_value("moe_serve_queue_depth", {"layer": TINY}) == requests:
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never {requests} requests queued")


def test_forwards_match_the_reference_and_their_done_records_are_counted() -> None:
    inputs = [rows(t, seed) for seed, t in enumerate([1, 3, 17, 64, 2])]

    async def body(_engine, metrics, client):
        regions = [_lay(client, x) for x in inputs]
        replies = await asyncio.gather(*(client.forward(TINY, r, _never()) for r in regions))
        for status in (200, 200, 499):
            client.done(FORWARD_ROUTE, status, 0.002)
        outputs = [
            decode_safetensors(bytes(client.arena.reply(region, reply.nbytes)))["output"]
            for region, reply in zip(regions, replies, strict=True)
        ]
        await client.forward("nope", regions[0], _never())  # answered after the DONEs
        return replies, outputs, metrics.registry

    replies, outputs, registry = run(BatchPolicy(64, 0.01, 16), body)
    for x, reply, out in zip(inputs, replies, outputs, strict=True):
        assert reply.status == 200
        torch.testing.assert_close(out, reference_forward(TINY, x), rtol=1e-5, atol=1e-5)
    labels = {"route": FORWARD_ROUTE}
    assert registry.get_sample_value("moe_serve_requests_total", labels | {"status": "200"}) == 2
    assert registry.get_sample_value("moe_serve_requests_total", labels | {"status": "499"}) == 1
    assert registry.get_sample_value("moe_serve_request_seconds_count", labels) == 3


@BODY_KINDS
def test_errors_keep_their_status_message_and_headers(as_json: bool) -> None:
    async def body(engine, _metrics, client):
        ask = _ask(client, as_json)
        unknown = await ask("nope", _lay(client, rows(1, 0), as_json), _never())
        bad = await ask(TINY, _lay(client, torch.randn(2, H + 1), as_json), _never())
        engine.gate.clear()  # the first forward holds the engine; max_queue 1: the next is 429
        held = asyncio.ensure_future(ask(TINY, _lay(client, rows(1, 1), as_json), _never()))
        await _forward_begun(engine)
        full = await ask(TINY, _lay(client, rows(1, 2), as_json), _never())
        engine.gate.set()
        return unknown, bad, full, await held

    unknown, bad, full, held = run(BatchPolicy(64, 0.0, 1), body)
    assert (unknown.status, unknown.headers) == (404, {})
    assert "no layer named 'nope'" in unknown.error
    assert bad.status == 400 and "hidden_states" in bad.error
    assert full.status == 429 and full.headers == {"Retry-After": "1"}
    assert "already has 1 requests queued" in full.error
    assert held.status == 200


@BODY_KINDS
def test_a_withdrawn_forward_leaves_the_queue_and_is_answered_499(as_json: bool) -> None:
    async def body(engine, metrics, client):
        ask = _ask(client, as_json)
        engine.gate.clear()
        running = asyncio.ensure_future(ask(TINY, _lay(client, rows(3, 0), as_json), _never()))
        await _forward_begun(engine)  # CPU: one forward at a time
        gone = asyncio.get_running_loop().create_future()
        queued = asyncio.ensure_future(ask(TINY, _lay(client, rows(5, 1), as_json), gone))
        await _queued(metrics, 1)
        gone.set_result(None)  # the client went away: CANCEL
        withdrawn = await queued
        engine.gate.set()
        return withdrawn, await running, engine.batch_sizes

    withdrawn, running, batch_sizes = run(BatchPolicy(64, 0.0, 16), body)
    assert withdrawn.status == 499 and "withdrawn" in withdrawn.error
    assert running.status == 200
    assert batch_sizes == [3]  # the withdrawn rows never ran


@pytest.mark.parametrize("stay_awake", [True, False], ids=["gpu-engine", "cpu-engine"])
def test_the_front_end_is_held_while_a_forward_is_the_engines_and_awake_for_a_gpu_engine(
    stay_awake: bool,
) -> None:
    async def body(engine, _metrics, client):
        engine.gate.clear()
        answered = asyncio.ensure_future(client.forward(TINY, _lay(client, rows(3, 0)), _never()))
        cancelled = asyncio.ensure_future(client.forward(TINY, _lay(client, rows(2, 1)), _never()))
        await _forward_begun(engine)
        running = client.awake.held, client.awake.awake
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        still = client.awake.held  # the answered one is still the engine's
        engine.gate.set()
        await answered
        return running, still, client.awake.held

    running, still, after = run(BatchPolicy(64, 0.0, 16), body, stay_awake)
    assert running == (True, stay_awake)
    assert still and not after


def _first_free(arena: BodyArena) -> int:
    """Where the arena's next region would begin."""
    probe = arena.allocate(0)
    arena.free(probe)
    return probe.offset


def test_a_cancelled_forward_keeps_its_region_until_the_engine_answers() -> None:
    """The region stays the engine's while it runs the forward of a caller that was cancelled,
    and is freed once the engine answers (its withdrawal, 499)."""

    async def body(engine, metrics, client):
        engine.gate.clear()
        region = _lay(client, rows(3, 0))
        running = asyncio.ensure_future(client.forward(TINY, region, _never()))
        await _forward_begun(engine)
        running.cancel()
        with pytest.raises(asyncio.CancelledError):
            await running
        held = _first_free(client.arena) != region.offset  # not handed out again
        engine.gate.set()
        for _ in range(10_000):  # until the engine's answer has come
            if _first_free(client.arena) == region.offset:
                return held, True
            await asyncio.sleep(0)
        return held, False

    held, freed = run(BatchPolicy(64, 0.0, 16), body)
    assert held and freed


def test_a_json_reply_lies_in_the_region_or_longer_than_its_room_comes_over_the_channel() -> None:
    x = rows(40, 3)

    async def body(_engine, _metrics, client):
        region = _lay(client, x, as_json=True)
        in_place = await client.forward_json(TINY, region, _never())
        text = bytes(client.arena.reply(region, in_place.nbytes))
        cramped = Region(region.offset, region.body_bytes, reply_capacity=in_place.nbytes - 1)
        carried = await client.forward_json(TINY, cramped, _never())
        return in_place, text, carried

    in_place, text, carried = run(BatchPolicy(64, 0.0, 16), body)
    assert (in_place.status, in_place.data) == (200, None)
    assert (carried.status, carried.nbytes, bytes(carried.data)) == (200, len(text), text)
    reply = json.loads(text)
    assert (reply["layer"], reply["tokens"]) == (TINY, 40)
    torch.testing.assert_close(torch.tensor(reply["output"]), reference_forward(TINY, x))


def test_a_front_end_that_goes_away_takes_its_queued_forwards_with_it() -> None:
    async def body(engine, metrics, client):
        engine.gate.clear()
        running = asyncio.ensure_future(client.forward(TINY, _lay(client, rows(3, 0)), _never()))
        await _forward_begun(engine)
        queued = asyncio.ensure_future(client.forward(TINY, _lay(client, rows(5, 1)), _never()))
        await _queued(metrics, 1)
        await client.close()  # the engine sees the socket close
        replies = await asyncio.gather(running, queued)
        await _queued(metrics, 0)  # withdrawn (the held forward keeps it from being taken)
        engine.gate.set()  # the running forward finishes, unheard
        return replies, engine.batch_sizes  # once the batcher is closed: no more forwards

    replies, batch_sizes = run(BatchPolicy(64, 0.0, 16), body)
    assert [r.status for r in replies] == [503, 503]  # ENGINE_GONE, as the front end sees it
    assert batch_sizes == [3]


def test_the_first_record_of_a_turn_goes_out_at_once_the_rest_at_its_end() -> None:
    async def main():
        sink = _Sink()
        writes, out = sink.writes, RecordWriter(sink)
        out.send(DONE, DONE_FIELDS.pack(200, 0.5) + b"/a")
        first = list(writes)
        out.send(DONE, DONE_FIELDS.pack(200, 0.5) + b"/b")
        out.send(DONE, DONE_FIELDS.pack(200, 0.5) + b"/c")
        within = list(writes)
        await asyncio.sleep(0)  # the turn ends
        after = list(writes)
        out.send(DONE, DONE_FIELDS.pack(200, 0.5) + b"/d")  # a new turn
        return first, within, after, writes

    first, within, after, writes = asyncio.run(main())
    assert len(first) == 1 and first[0].endswith(b"/a")
    assert within == first  # the others wait for the turn's end
    assert len(after) == 2 and after[1].endswith(b"/c") and b"/b" in after[1]
    assert len(writes) == 3 and writes[2].endswith(b"/d")


def _wire(records: list[tuple[int, bytes]]) -> bytes:
    """The bytes a RecordWriter puts on the wire for `records`, sent and flushed."""
    sink = _Sink()

    async def send() -> None:
        out = RecordWriter(sink)
        for kind, payload in records:
            out.send(kind, payload)
        out.flush()

    asyncio.run(send())
    return b"".join(sink.writes)


class _Sink:
    """A transport that keeps each write."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return False


def test_a_record_sent_later_goes_after_the_next_record_or_alone_once_its_wait_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(channel, "LATER_S", 0.0)

    async def main():
        sink = _Sink()
        writes, out = sink.writes, RecordWriter(sink)
        out.later(DONE, b"/a")
        held = list(writes)
        out.send(CANCEL, b"c")
        carried = list(writes)
        await asyncio.sleep(0)  # the turn ends
        out.later(DONE, b"/b")
        while len(writes) < 2:  # its wait is over at the loop's next turns
            await asyncio.sleep(0)
        return held, carried, writes

    held, carried, writes = asyncio.run(main())
    assert held == []
    assert carried == [_wire([(CANCEL, b"c"), (DONE, b"/a")])]  # in the same write, after it
    assert writes[1] == _wire([(DONE, b"/b")])


def test_a_scrape_settles_the_done_records_a_front_end_holds() -> None:
    async def body(served):
        served.client.done(FORWARD_ROUTE, 200, 0.002)  # held: no record follows it
        held = _requests(served.metrics)
        await served.server.settle()
        return held, _requests(served.metrics)

    async def main():
        async with served(BatchPolicy(64, 0.0, 16)) as s:
            return await asyncio.wait_for(body(s), WAIT_S)

    held, settled = asyncio.run(main())
    assert (held, settled) == (None, 1)


def test_a_scrape_begun_while_another_settles_counts_what_was_answered_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The front end answers a request once it has settled the first scrape: the second scrape,
    begun before that SETTLE's answer is back, must count it too."""
    monkeypatch.setattr(channel, "LATER_S", WAIT_S * 10)  # held until a record takes it

    async def body(served):
        protocol = served.client._out._transport.get_protocol()
        front_end_records, second = protocol.on_records, []

        def on_records(records):
            front_end_records(records)
            if not second and any(kind == SETTLE for kind, _ in records):
                served.client.done(FORWARD_ROUTE, 200, 0.002)  # answered, then scraped
                second.append(asyncio.ensure_future(served.server.settle()))

        protocol.on_records = on_records
        await served.server.settle()
        await second[0]
        return _requests(served.metrics)

    async def main():
        async with served(BatchPolicy(64, 0.0, 16)) as s:
            return await asyncio.wait_for(body(s), WAIT_S)

    assert asyncio.run(main()) == 1


def test_a_settle_sent_as_the_front_end_is_accepted_is_answered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scrape as a front end (re)starts: its SETTLE follows the answer to HELLO, before the
    front end is connected."""
    scrapes = []

    def accept_then_settle(link, records):
        accept(link, records)
        scrapes.append(link.settle())

    accept = _FrontEndLink._hello
    monkeypatch.setattr(_FrontEndLink, "_hello", accept_then_settle)

    async def main():
        async with served(BatchPolicy(64, 0.0, 16)):
            await asyncio.wait_for(asyncio.shield(scrapes[0]), WAIT_S)

    asyncio.run(main())


def test_a_front_end_that_does_not_answer_a_settle_is_not_sent_another_until_it_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stopped front end: the first scrape waits for it SETTLE_S at most; the next ones neither
    wait for it nor send it more, until it answers."""
    monkeypatch.setattr(channel_server, "SETTLE_S", 0.05)

    async def body(served):
        protocol = served.client._out._transport.get_protocol()
        front_end_records, sent, held, answering = protocol.on_records, [], [], [False]

        def front_end(records):  # stopped: SETTLE read, not answered
            settles = [r for r in records if r[0] == SETTLE]
            sent.extend(settles)
            if answering[0]:
                front_end_records(records)
            else:
                held.extend(settles)
                front_end_records([r for r in records if r[0] != SETTLE])

        protocol.on_records = front_end
        await served.server.settle()  # its cap
        await served.server.settle()  # at once: overdue
        sent_while_stopped = len(sent)
        answering[0] = True
        front_end_records(held)  # it resumes and answers
        (link,) = served.server._links
        while link.overdue():
            await asyncio.sleep(0)
        await served.server.settle()  # sent, and answered
        return sent_while_stopped, len(sent)

    async def main():
        async with served(BatchPolicy(64, 0.0, 16)) as s:
            return await asyncio.wait_for(body(s), WAIT_S)

    assert asyncio.run(main()) == (1, 2)


def test_a_scrape_does_not_wait_for_a_front_end_that_has_gone() -> None:
    async def main():
        async with served(BatchPolicy(64, 0.0, 16)) as s:
            (link,) = s.server._links
            settling = link.settle()
            await s.client.close()  # gone without answering the SETTLE
            await asyncio.wait_for(s.server.settle(), WAIT_S)
            return settling.done()

    assert asyncio.run(main())


def _requests(metrics: Metrics) -> float | None:
    labels = {"route": FORWARD_ROUTE, "status": "200"}
    return metrics.registry.get_sample_value("moe_serve_requests_total", labels)


def test_records_cut_anywhere_by_reads_arrive_whole() -> None:
    """Every split of the wire into two reads, and a byte per read: the same records, each
    handed over by the read that completes it."""
    sent = [(FORWARD, b"x" * 40 + TINY.encode()), (DONE, DONE_FIELDS.pack(200, 0.5) + b"/r")]
    sent *= 3
    wire = _wire(sent)
    for cut in range(len(wire) + 1):
        records = RecordReader()
        assert records.feed(wire[:cut]) + records.feed(wire[cut:]) == sent
    records = RecordReader()
    got = []
    for i in range(len(wire)):
        got += records.feed(wire[i : i + 1])
    assert got == sent


def test_a_record_longer_than_a_read_arrives_whole_among_others() -> None:
    """A reply carried whole over the channel, gathered across reads, the records around it as
    usual."""
    large = bytes(range(256)) * 1000
    sent = [(DONE, b"before"), (REPLY, large), (DONE, b"after")]
    wire = _wire(sent)
    records = RecordReader()
    got = []
    for at in range(0, len(wire), 10_000):
        got += records.feed(wire[at : at + 10_000])
    assert got == sent


def test_the_protocol_hands_over_each_read_s_records_and_reports_the_close() -> None:
    got, lost = [], []
    protocol = RecordProtocol(got.append, lambda: lost.append(True))
    wire = _wire([(DONE, b"a"), (DONE, b"b"), (REPLY, b"c")])
    protocol.data_received(wire[:5])  # no whole record yet: nothing handed over
    protocol.data_received(wire[5:-3])
    protocol.data_received(wire[-3:])
    assert protocol.eof_received() is False  # the transport closes
    protocol.connection_lost(None)
    assert got == [[(DONE, b"a"), (DONE, b"b")], [(REPLY, b"c")]]
    assert lost == [True]


@pytest.mark.parametrize(
    "first",
    [(FORWARD, b"x" * 40 + TINY.encode()), (HELLO, b'{"hello": "/nonexistent", "size": 65536}')],
    ids=["not-hello", "unmappable-arena"],
)
def test_a_connection_that_does_not_begin_with_a_mappable_arena_is_closed(first) -> None:
    """Before its HELLO names an arena the engine maps, a connection is answered at most with a
    refusal, then closed; the server still closes cleanly."""

    wire = _wire([first, (DONE, DONE_FIELDS.pack(200, 0.5) + b"/r")])

    async def body(_engine, _metrics, client):
        reader, writer = await asyncio.open_unix_connection(client.path)
        writer.write(wire)
        answer = await reader.read()  # to the end: the engine closed it
        writer.close()
        return answer

    answer = run(BatchPolicy(64, 0.0, 16), body)
    records = RecordReader().feed(answer)
    if first[0] == HELLO:
        assert [kind for kind, _ in records] == [HELLO]
        assert json.loads(records[0][1])["hello"].startswith("refused")
    else:
        assert records == []


def test_a_record_longer_than_allowed_is_refused_before_it_is_gathered() -> None:
    records = RecordReader(max_record_bytes=64)
    fits = _wire([(DONE, b"x" * 64)])
    assert records.feed(fits + _HEAD.pack(DONE, 1 << 30) + fits) == [(DONE, b"x" * 64)]
    assert records.too_long == "a record of 1073741824 bytes, over the 64 allowed"
    assert records.feed(fits) == []  # nothing is read past it


@pytest.mark.parametrize(
    "sent",
    [
        _wire([(FORWARD, b"short")]),
        _wire([(FORWARD, FORWARD_FIELDS.pack(1, 0, 0, 0, False) + b"\xff\xfe")]),
        _wire([(CANCEL, b"\x01")]),
        _wire([(DONE, DONE_FIELDS.pack(200, 0.5) + b"\xff")]),
        _HEAD.pack(DONE, MAX_FRONT_END_RECORD_BYTES + 1),
    ],
    ids=["short-forward", "forward-name-not-utf8", "short-cancel", "done-route", "too-long"],
)
def test_a_front_end_that_sends_a_malformed_record_is_cut_off_and_the_others_are_served(
    sent: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    """After a HELLO the engine maps, a record no front end sends (too short, a name that is
    not UTF-8, longer than the engine takes) closes that connection with a warning that says
    why (no traceback); the others are served."""

    async def body(_engine, _metrics, client):
        reader, writer = await asyncio.open_unix_connection(client.path)
        hello = json.dumps({"hello": str(client.arena.path), "size": client.arena.size}).encode()
        writer.write(_HEAD.pack(HELLO, len(hello)) + hello + sent)
        answer = await reader.read()  # to the end: the engine closed it
        writer.close()
        reply = await client.forward(TINY, _lay(client, rows(3, 0)), _never())
        return answer, reply

    with caplog.at_level(logging.WARNING):
        answer, reply = run(BatchPolicy(64, 0.0, 16), body)
    assert [kind for kind, _ in RecordReader().feed(answer)] == [HELLO]
    assert reply.status == 200
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("its connection is closed" in m for m in warned), warned
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_closing_the_server_ends_each_front_end_s_connection_once_its_forwards_are_done() -> None:
    """The engine stopping with a front end still connected: the front end sees the channel
    close (its forward answered ENGINE_GONE, its on_lost called), and the close returns once the
    forward the engine was running has finished."""

    async def main():
        lost = []
        async with served(BatchPolicy(64, 0.0, 16), lambda: lost.append(True)) as s:
            s.engine.gate.clear()
            region = _lay(s.client, rows(3, 0))
            running = asyncio.ensure_future(s.client.forward(TINY, region, _never()))
            await _forward_begun(s.engine)
            closing = asyncio.ensure_future(s.server.close())
            reply = await asyncio.wait_for(running, WAIT_S)
            still_closing = not closing.done()  # the engine's forward holds it
            s.engine.gate.set()
            await asyncio.wait_for(closing, WAIT_S)
            return reply, lost, s.client.connected, still_closing

    reply, lost, connected, still_closing = asyncio.run(main())
    assert reply.status == 503 and "engine process is gone" in reply.error
    assert lost == [True] and not connected
    assert still_closing


def test_closing_the_server_returns_while_a_front_end_does_not_read_its_replies() -> None:
    """A front end that stopped reading (a reply the engine sent it waits in the socket's
    buffers): the close drops what is unsent rather than wait for a flush that never comes."""

    async def main():
        async with served(BatchPolicy(64, 0.0, 16)) as s:
            client = s.client
            region = _lay(client, rows(1000, 4), as_json=True)  # a reply of about 1 MB
            cramped = Region(region.offset, region.body_bytes, reply_capacity=BLOCK_BYTES)
            client._out._transport.pause_reading()
            forward = asyncio.ensure_future(client.forward_json(TINY, cramped, _never()))
            (link,) = s.server._links
            for _ in range(int(WAIT_S / 0.01)):  # until the reply waits in the engine's buffer
                if waiting := link.protocol.transport.get_write_buffer_size():
                    break
                await asyncio.sleep(0.01)
            closing = asyncio.ensure_future(s.server.close())
            closed = (await asyncio.wait([closing], timeout=WAIT_S))[0] == {closing}
            client._out._transport.resume_reading()  # the front end reads again
            await closing
            reply = await asyncio.wait_for(forward, WAIT_S)
            return waiting, closed, reply

    waiting, closed, reply = asyncio.run(main())
    assert waiting and closed
    assert reply.status == 503 and "engine process is gone" in reply.error


def test_a_front_end_gone_mid_forward_leaves_no_mapping_of_its_arena() -> None:
    """The engine's teardown of a front end's connection finds the arena still viewed by the
    forward it was running (on the CPU it does not wait for it): the mapping goes as soon as
    that forward lets go of it, not once the garbage collector frees the connection's cycle of
    references (rarely, in a serving process: the arena is 128 MiB)."""

    async def main():
        async with served(BatchPolicy(64, 0.0, 16)) as s:
            (link,) = s.server._links
            mapping = weakref.ref(link.arena.arena._map)  # the engine's mapping of the arena
            ended = link.ended
            del link
            s.engine.gate.clear()
            running = asyncio.ensure_future(
                s.client.forward(TINY, _lay(s.client, rows(3, 0)), _never())
            )
            await _forward_begun(s.engine)
            await s.client.close()  # the engine sees the socket close
            await running
            await asyncio.wait_for(ended, WAIT_S)
            s.engine.gate.set()
            await s.batcher.close()  # the forward has ended
            await s.server.close()
            return mapping() is None

    gc.disable()  # what frees the mapping is not the collector
    try:
        unmapped = asyncio.run(main())
    finally:
        gc.enable()
    assert unmapped
