"""The service benchmark: its pure parts, the trivial server and the load generators, and one
short run of the whole harness on the tiny layer on the CPU (Python load generator)."""

from __future__ import annotations

import json
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from moe_serve.bench.environment import capture
from moe_serve.bench.load_gen import (
    Load,
    Probes,
    SideProber,
    hey_binary,
    hey_load,
    parse_hey_csv,
    probe,
    run_hey,
    run_one_client,
)
from moe_serve.bench.service_bench import (
    DEMO,
    Check,
    LevelResult,
    ServerRun,
    ServiceBench,
    ServiceBenchConfig,
    ServiceBenchResult,
    checks,
    level_result,
    make_bodies,
    probe_stats,
    render,
    with_bare,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def echo_url() -> Iterator[str]:
    port = _free_port()
    command = [
        sys.executable,
        "-m",
        "moe_serve.bench.echo_server",
        "--port",
        str(port),
        "--processes",
        "1",
    ]
    proc = subprocess.Popen(command)
    deadline = time.monotonic() + 20
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, "echo server did not start"
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/echo"
    proc.terminate()
    proc.wait(10)


def test_echo_server_answers_each_of_two_pipelined_requests(echo_url: str) -> None:
    port = int(echo_url.split(":")[2].split("/")[0])
    request = b"POST /x HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request + request)
        received = b""
        while received.count(b"200 OK") < 2:
            received += sock.recv(4096)
    assert received.count(b"HTTP/1.1 200 OK") == 2


class _Ticks:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def test_one_client_times_requests_on_one_connection(echo_url: str) -> None:
    # the clock reads 1 at the start (the deadline 31), then three times a request: its start
    # (2, 5, ..., 29: ten requests), its end and the deadline's test (31 ends it)
    load = run_one_client(echo_url, b"x" * 70_000, "application/octet-stream", 30.0, _Ticks())
    assert load.ok == 10 and not load.errors
    assert load.latencies_s == [1.0] * 10
    assert load.elapsed_s == 31.0  # read last at 32


def test_one_client_sends_one_request_however_late_it_starts(echo_url: str) -> None:
    load = run_one_client(echo_url, b"x", "application/octet-stream", 0.0, _Ticks())
    assert load.ok == 1 and load.latencies_s == [1.0]


class _ProbeStub(socketserver.StreamRequestHandler):
    """/health: 200; /v2/health/ready: 503; any other path: no answer until the client goes."""

    def handle(self) -> None:
        while line := self.rfile.readline():
            path = line.split()[1]
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
            if path == b"/health":
                self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            elif path == b"/v2/health/ready":
                self.wfile.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n")


@pytest.fixture
def probe_stub() -> Iterator[str]:
    socketserver.ThreadingTCPServer.daemon_threads = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _ProbeStub) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        yield f"http://127.0.0.1:{server.server_address[1]}"
        server.shutdown()


class _After:
    """`stopped` for `probe`: true on its `n`th call; keeps the waits it was asked for."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.waits: list[float] = []

    def __call__(self, seconds: float) -> bool:
        self.waits.append(seconds)
        return len(self.waits) >= self.n


def test_probes_are_timed_and_failures_counted_by_path_and_kind(probe_stub: str) -> None:
    stopped = _After(6)
    paths = ("/health", "/v2/health/ready", "/hang")
    probes = probe(probe_stub, stopped, paths, interval_s=0.0, timeout_s=0.05)
    assert len(probes.latencies_s) == 2 and all(t > 0 for t in probes.latencies_s)
    assert probes.failures == {"/v2/health/ready 503": 2, "/hang timeout": 2}
    assert probes.sent == 6 and all(w >= 0 for w in stopped.waits)


def test_a_probe_that_finds_no_server_has_failed() -> None:
    probes = probe(f"http://127.0.0.1:{_free_port()}", _After(2), ("/health",), 0.0, 0.05)
    assert probes.latencies_s == [] and probes.failures == {"/health ConnectionRefusedError": 2}


def test_the_side_prober_probes_from_its_own_process_while_the_block_runs(echo_url: str) -> None:
    with SideProber(echo_url.removesuffix("/echo")) as prober:
        pass
    assert prober.probes is not None and prober.probes.failures == {}
    assert prober.probes.sent >= 1  # one at least, however soon the block ends


def _hey_csv(*rows: tuple[float, str, float]) -> str:
    """hey's `-o csv` of (response-time, status, offset) rows."""
    head = "response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,"
    lines = [f"{t},0,0,0,0,0,{status},{offset}" for t, status, offset in rows]
    return head + "offset\n" + "\n".join(lines) + "\n"


def test_hey_processes_with_different_bodies_add_up() -> None:
    finished = [
        (0, _hey_csv((0.002, "200", 0.1), (0.003, "200", 0.4)), ""),
        (0, _hey_csv((0.001, "200", 0.2), (0.004, "503", 0.9)), ""),
        (2, "", "cannot read the body\n"),
    ]
    load = hey_load(6, finished)
    assert load.clients == 6 and load.generator == "hey"
    assert load.latencies_s == [0.002, 0.003, 0.001]
    assert load.errors == {"503": 1, "hey exit 2: cannot read the body": 1}
    assert load.elapsed_s == pytest.approx(0.904)  # the process that ended last


@pytest.mark.skipif(hey_binary() is None, reason="hey is not installed here")
def test_hey_runs_a_process_per_body(echo_url: str, tmp_path: Path) -> None:
    bodies = []
    for i in range(3):
        bodies.append(tmp_path / f"b{i}")
        bodies[-1].write_bytes(bytes([i]) * 1000)
    load = run_hey(echo_url, bodies, "application/octet-stream", 6, 0.5)
    assert load.ok > 0 and not load.errors


def test_hey_csv_keeps_200_latencies_and_counts_other_statuses() -> None:
    text = (
        "response-time,DNS+dialup,DNS,Request-write,Response-delay,Response-read,status-code,"
        "offset\n0.0021,0,0,0,0,0,200,0.0100\n0.0030,0,0,0,0,0,429,0.5000\n"
        "0.0010,0,0,0,0,0,200,0.9000\n"
    )
    latencies, errors, end = parse_hey_csv(text)
    assert latencies == [0.0021, 0.0010]
    assert errors == {"429": 1}
    assert end == pytest.approx(0.901)


def _level(**figures: float) -> LevelResult:
    load = Load(clients=16, elapsed_s=2.0, latencies_s=[0.01] * 100, errors={}, generator="hey")
    before = {"moe_serve_forward_seconds_count": 10.0, "moe_serve_forward_seconds_sum": 1.0,
              "moe_serve_batch_tokens_sum": 640.0, "moe_serve_stage_seconds_count:queue": 5.0,
              "moe_serve_stage_seconds_sum:queue": 0.5}  # fmt: skip
    after = {key: value + figures.get(key, 0.0) for key, value in before.items()}
    return level_result("deepseek-v3", "default", "binary", 64, load, before, after)


def test_level_figures_come_from_the_metrics_difference_over_the_wall_time() -> None:
    level = _level(
        **{
            "moe_serve_forward_seconds_count": 4,
            "moe_serve_forward_seconds_sum": 1.8,  # 0.45 s each over 2 s: 90% busy
            "moe_serve_batch_tokens_sum": 1024,
            "moe_serve_stage_seconds_count:queue": 2,
            "moe_serve_stage_seconds_sum:queue": 0.002,
        }
    )
    assert level.requests_per_s == 50 and level.tokens_per_s == 3200
    assert level.forwards == 4 and level.tokens_per_forward == 256
    assert level.server_forward_ms == pytest.approx(450)
    assert level.gpu_busy == pytest.approx(0.9)
    assert level.stage_ms == {"queue": pytest.approx(1.0)}


def test_the_bare_forward_is_compared_at_each_batch_size_the_level_formed() -> None:
    level = _level(
        **{"moe_serve_forward_seconds_count": 4, "moe_serve_forward_seconds_sum": 1.8,
           "moe_serve_batch_tokens_sum": 1024}
    ).model_copy(update={"forward_sizes": {128: (2, 0.6), 384: (2, 1.2)}})  # fmt: skip
    bare = {128: {"median_us": 250_000.0}, 384: {"median_us": 500_000.0}, 256: {"median_us": 1}}
    compared = with_bare(level, bare)
    # the bare forward over the same four batches: 2 x 0.25 + 2 x 0.5 s, not the one at 256
    assert compared.bare_forward_ms == pytest.approx(375)
    assert compared.tokens_per_s_vs_bare == pytest.approx(3200 / (1024 / 1.5))
    # 0.3 s served against 0.25 at 128, 0.6 against 0.5 at 384: the larger excess is the worst
    assert compared.worst_size == (384, pytest.approx(600), pytest.approx(500))
    assert with_bare(level, {128: bare[128]}).bare_forward_ms is None  # a size not timed


def test_forward_sizes_counts_what_the_metrics_record_until_taken() -> None:
    from moe_serve.bench.service_server import ForwardSizes
    from moe_serve.service.engine.interface import StageTimes
    from moe_serve.service.metrics import Metrics

    metrics = Metrics()
    sizes = ForwardSizes(metrics)
    no_experts = torch.zeros(4, dtype=torch.int64)
    for tokens, seconds in ((64, 0.002), (64, 0.004), (1, 0.001)):
        metrics.record_batch("demo", "triton", tokens, no_experts, StageTimes(seconds))
    assert [(s.tokens, s.forwards, s.seconds) for s in sizes.take()] == [
        (1, 1, pytest.approx(0.001)), (64, 2, pytest.approx(0.006))
    ]  # fmt: skip
    assert sizes.take() == []
    assert metrics.registry.get_sample_value("moe_serve_tokens_total", {"layer": "demo"}) == 129


def test_probe_figures_are_the_answered_probes_percentiles_and_every_probe_sent() -> None:
    stats = probe_stats(Probes([0.0001 * i for i in range(1, 101)], {"/health 503": 3}))
    assert stats.probes == 103 and stats.failures == {"/health 503": 3}
    assert stats.p50_ms == pytest.approx(5.05) and stats.max_ms == pytest.approx(10.0)
    assert stats.p99_ms == pytest.approx(9.901)
    assert probe_stats(None) is None
    assert probe_stats(Probes([], {"/health timeout": 1})).p50_ms is None


def _probed(p50_ms: float, failures: dict[str, int]) -> ServiceBenchResult:
    """A result whose front-ends run's levels were probed: one at `p50_ms`, one faster."""
    env = capture(torch.device("cpu"), "test", "moe-serve bench service")
    run = ServerRun(layer="tiny", variant="2 front ends", options=[])
    run.idle_probe = probe_stats(Probes([0.0001] * 100, {}))
    for clients, p50_s, failed in ((1, 0.0001, {}), (256, p50_ms / 1e3, failures)):
        load = Load(clients=clients, elapsed_s=1.0, latencies_s=[0.01], errors={}, generator="hey")
        level = level_result("tiny", run.variant, "binary", 8, load, None, None)
        level.probe = probe_stats(Probes([p50_s] * 99 + [0.002], failed))
        run.levels.append(level)
    return ServiceBenchResult(environment=env, config={}, http_stack={}, runs=[run])


def _probe_check(result: ServiceBenchResult) -> Check:
    config = ServiceBenchConfig(layers=("tiny",), clients=(1, 256), tokens=8, http_workers=2)
    return next(c for c in checks(result, config) if "probes" in c.target)


def test_probes_meet_their_target_when_fast_and_never_failing() -> None:
    check = _probe_check(_probed(0.3, {}))
    assert check.target == (
        "tiny (2 front ends): probes answered within 0.5 ms p50 and never failed under load"
    )
    assert check.met is True and "worst p50 0.300 ms (256 clients" in check.figure
    assert "0 of 200 failed, idle p50 0.100 ms" in check.figure


def test_probes_miss_their_target_when_slow_or_failing_and_are_not_measured_when_absent() -> None:
    assert _probe_check(_probed(0.6, {})).met is False
    failed = _probe_check(_probed(0.3, {"/health timeout": 1}))
    assert failed.met is False and "1 of 201 failed" in failed.figure
    unprobed = _probed(0.3, {})
    for level in unprobed.runs[0].levels:
        level.probe = None
    assert _probe_check(unprobed).met is None


def test_the_tables_show_the_probes_of_each_level_and_the_idle_floor() -> None:
    table = render(_probed(0.3, {"/health timeout": 1}))
    assert "| probe p50/p99 ms | errors |" in table
    assert "| 0.300/0.317 | 0 |" in table  # the 256-client level's row ends so
    assert "| tiny | 2 front ends | idle | 100 | 0.100 | 0.100 | 0.100 | 0 |" in table
    assert "| tiny | 2 front ends | 256 (binary, 8 tok) | 101 | 0.300 | " in table
    assert "| /health timeout: 1 |" in table


def test_a_result_written_before_probes_were_timed_still_reads() -> None:
    level = _level().model_dump(exclude={"probe"})
    assert LevelResult.model_validate(level).probe is None
    run = ServerRun.model_validate({"layer": "tiny", "variant": "default", "options": []})
    assert run.idle_probe is None


def test_a_level_without_forwards_has_no_server_figures() -> None:
    level = _level()
    assert level.forwards is None and level.gpu_busy is None


def test_bodies_differ_and_hey_gets_them_as_files(tmp_path: Path) -> None:
    import safetensors.torch

    bodies = make_bodies(16, 4, 3, tmp_path)
    tensors = [safetensors.torch.load(b)["hidden_states"] for b in bodies.binary]
    assert all(t.shape == (4, 16) and str(t.dtype) == "torch.bfloat16" for t in tensors)
    assert not tensors[0].equal(tensors[1])
    assert [f.read_bytes() for f in bodies.files] == bodies.binary
    assert safetensors.torch.load(bodies.one_token)["hidden_states"].shape == (1, 16)


def test_config_refuses_an_unknown_layer() -> None:
    with pytest.raises(ValueError, match="unknown layer 'nope'"):
        ServiceBenchConfig(layers=("nope",))
    with pytest.raises(ValueError, match="nothing to serve"):
        ServiceBenchConfig(one_process=False, http_workers=0)


def test_served_only_behind_the_front_ends_only_their_targets_are_checked() -> None:
    config = ServiceBenchConfig(layers=("tiny",), clients=(1, 256), http_workers=2,
                                one_process=False)  # fmt: skip
    targets = [c.target for c in checks(_probed(0.3, {}), config)]
    assert targets and all(t.startswith("tiny (2 front ends): ") for t in targets)


@pytest.mark.slow
def test_a_short_run_on_the_cpu_fills_every_figure_and_writes_the_tables(tmp_path: Path) -> None:
    config = ServiceBenchConfig(
        layers=("tiny",),
        clients=(1, 3),
        tokens=8,
        duration_s=0.5,
        device="cpu",
        backend="reference",
        shared_intermediate=32,
        bodies=2,
        generator="python",
        stack_variant=False,
        http_workers=2,
        budget_s=120,
    )
    env = capture(torch.device("cpu"), "test", "moe-serve bench service")
    path = tmp_path / "cpu" / "service-test.json"
    result = ServiceBench(config, env, path).run()
    assert result.failures == {}
    assert [run.variant for run in result.runs] == ["default", "2 front ends"]
    for run in result.runs:
        assert run.seconds_to_ready > 0 and run.layer_info["shared_experts"]
        assert set(run.bare) >= {1, 8}
        levels = {(lv.body, lv.tokens, lv.clients): lv for lv in run.levels}
        assert set(levels) == {
            ("binary", 8, 1), ("binary", 8, 3), ("binary", 1, 1), ("json", 8, 1)
        }  # fmt: skip
        for lv in levels.values():
            assert lv.ok > 0 and lv.errors == {}, lv
            assert lv.forwards > 0 and lv.gpu_busy > 0 and lv.bare_forward_ms > 0
            assert sum(n for n, _ in lv.forward_sizes.values()) == lv.forwards
            assert {"queue", "decode", "forward", "encode"} <= set(lv.stage_ms)
            assert lv.probe.probes > 0
        assert run.idle_probe.probes > 0
    fronted = [c.target.removeprefix("tiny (2 front ends)") for c in result.checks
               if c.target.startswith("tiny (2 front ends)")]  # fmt: skip
    one = [c.target.removeprefix("tiny (one process)") for c in result.checks
           if c.target.startswith("tiny (one process)")]  # fmt: skip
    assert fronted == [*one, ": probes answered within 0.5 ms p50 and never failed under load"]
    assert [echo.tokens for echo in result.echo] == [8, 1]
    assert all(isinstance(c, Check) for c in result.checks)
    capacity = [c for c in result.checks if c.target.startswith("load generator")]
    assert len(capacity) == 2 and all(c.met is not None for c in capacity)
    assert next(c for c in result.checks if "probes answered" in c.target).met is not None
    table = path.with_suffix(".md").read_text()
    assert "| tiny | default | json | 8 | 1 |" in table and "| target | measured | met |" in table
    assert json.loads(path.read_text())["environment"]["commit"] == "test"
    assert (tmp_path / "cpu" / "service-test" / "server-tiny-default.log").exists()
    assert DEMO not in table
