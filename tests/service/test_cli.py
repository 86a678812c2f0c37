"""`moe-serve serve` as users run it: settings from options and environment, refusals that
name the problem, and a SIGTERM that lets in-flight requests finish."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from pydantic import ValidationError

from moe_serve.kernels.config import MoEConfig, RoutingConfig
from moe_serve.kernels.quant_scheme import QuantConfig, QuantScheme
from moe_serve.service.cli import COMMANDS, build_parser, main
from moe_serve.service.settings import Settings, usable_cpus
from moe_serve.weights.demo import ensure_demo_layers

ROOT = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0
EXIT_TIMEOUT_S = 30.0


def _parsers(parser: argparse.ArgumentParser, name: str) -> Iterator[tuple[str, object]]:
    """(command, parser) for `parser` and every subcommand below it."""
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _parsers(sub, f"{name} {sub_name}")


def test_every_command_and_option_describes_itself() -> None:
    commands = dict(_parsers(build_parser(), "moe-serve"))
    assert {"moe-serve serve", "moe-serve convert", "moe-serve bench service"} <= set(commands)
    for command, parser in commands.items():
        assert parser.description, f"{command} --help has no description"
        for action in parser._actions:
            if not isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                assert action.help, f"{command}: {'/'.join(action.option_strings) or action.dest}"


def test_help_imports_none_of_the_commands_modules() -> None:
    """`moe-serve --help` answers at once: torch, the service and the benchmarks stay unloaded."""
    code = (
        "import sys\nfrom moe_serve.service.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'fastapi', 'triton') "
        "or m.startswith(('moe_serve.kernels', 'moe_serve.bench', 'moe_serve.weights'))))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "serve MoE layers" in run.stdout
    assert run.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_is_registered_in_full_by_its_module(command: str) -> None:
    parser = build_parser(command)
    (commands,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    full = commands.choices[command]  # runs, or has subcommands of its own
    assert full.get_default("run") or any(
        isinstance(a, argparse._SubParsersAction) for a in full._actions
    )
    assert set(commands.choices) == set(COMMANDS)


def test_every_setting_reads_its_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOE_SERVE_PORT", "9001")
    monkeypatch.setenv("MOE_SERVE_WEIGHTS", "/w/a, /w/b,")  # spaces and a trailing comma
    monkeypatch.setenv("MOE_SERVE_MAX_BATCH_TOKENS", "64")
    monkeypatch.setenv("MOE_SERVE_LOG_FORMAT", "json")
    monkeypatch.setenv("MOE_SERVE_CALIBRATE", "always")
    settings = Settings()
    assert (settings.calibrate, settings.calibrate_budget_s) == ("always", 60.0)
    assert (settings.port, settings.max_batch_tokens, settings.log_format) == (9001, 64, "json")
    assert settings.weights == (Path("/w/a"), Path("/w/b"))
    assert settings.host == "127.0.0.1"
    assert Settings(port=9002).port == 9002  # an option beats the environment


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("device", "tpu", "device must be auto, cpu, cuda or cuda:N"),
        ("api_token", "short", "at least 16 characters"),
        ("port", 70000, "less than or equal to 65535"),
        ("max_batch_tokens", 0, "greater than or equal to 1"),
        ("log_format", "xml", "'text' or 'json'"),
        ("calibrate", "sometimes", "'off', 'once' or 'always'"),
        ("calibrate_budget_s", 0, "greater than 0"),
    ],
)
def test_bad_setting_is_refused_naming_the_field(field: str, value: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message) as err:
        Settings(**{field: value})
    assert err.value.errors()[0]["loc"] == (field,)


def _serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "moe_serve.service.cli", "serve", *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_serve_refuses_a_missing_weights_dir_naming_it(tmp_path: Path, caplog) -> None:
    missing = tmp_path / "no-such-layer"
    assert main(["serve", "--weights", str(missing), "--device", "cpu"]) == 2
    assert str(missing) in caplog.text


def test_serve_refuses_an_unknown_backend_listing_the_registered_ones(caplog) -> None:
    assert main(["serve", "--backend", "fastest", "--device", "cpu"]) == 2
    assert "unknown backend 'fastest'; registered: " in caplog.text
    assert "reference" in caplog.text


def test_serve_refuses_a_backend_that_cannot_run_a_layer_naming_both(tmp_path, caplog) -> None:
    layer = ensure_demo_layers(tmp_path)[0]
    assert main(["serve", "--weights", str(layer), "--backend", "triton", "--device", "cpu"]) == 2
    assert f"{layer}: backend 'triton' cannot run this layer: runs on cuda, not cpu" in caplog.text


def test_serve_refuses_a_backend_that_cannot_run_the_demo_layers(caplog) -> None:
    # without --weights the demo layers are served: they are checked before anything starts
    assert main(["serve", "--backend", "triton", "--device", "cpu"]) == 2
    assert "demo: backend 'triton' cannot run this layer: runs on cuda, not cpu" in caplog.text


@pytest.mark.parametrize(
    ("host", "token", "warned"),
    [("0.0.0.0", None, True), ("0.0.0.0", "x" * 32, False), ("127.0.0.1", None, False)],
)
def test_serve_warns_when_listening_beyond_loopback_without_a_token(
    monkeypatch, caplog, host: str, token: str | None, warned: bool
) -> None:
    started = []

    def run(server: object, sockets: list[socket.socket]) -> None:
        started.append(sockets[0].getsockname()[0])

    monkeypatch.setattr("moe_serve.service.serve.uvicorn.Server.run", run)
    monkeypatch.setattr(
        "moe_serve.service.serve.logs.configure", lambda *args: None
    )  # keep caplog's
    monkeypatch.setattr(
        "moe_serve.service.serve.collect_less", lambda: None
    )  # not in the test process
    if token:
        monkeypatch.setenv("MOE_SERVE_API_TOKEN", token)
    assert main(["serve", "--host", host, "--port", "0", "--device", "cpu"]) == 0
    assert started == [host]
    assert ("with no MOE_SERVE_API_TOKEN: open to all" in caplog.text) is warned


def test_serve_refuses_one_port_for_http_and_grpc(monkeypatch, caplog) -> None:
    """Both servers bound the port and requests went to either (found serving on --port 8001)."""
    monkeypatch.setattr(
        "moe_serve.service.serve.uvicorn.Server.run", lambda *args: None
    )  # never serves
    monkeypatch.setattr("moe_serve.service.serve.collect_less", lambda: None)
    assert main(["serve", "--port", "8001", "--grpc-port", "8001", "--device", "cpu"]) == 2
    assert "port and grpc_port are both 8001" in caplog.text


def test_serve_refuses_a_bad_option_value_naming_it(caplog) -> None:
    assert main(["serve", "--port", "70000"]) == 2
    assert "port: Input should be less than or equal to 65535" in caplog.text


def test_serve_refuses_two_layers_of_one_name_before_starting(tmp_path: Path, caplog) -> None:
    layer = ensure_demo_layers(tmp_path)[0]
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in layer.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    argv = ["serve", "--weights", str(layer), "--weights", str(copy), "--device", "cpu"]
    assert main(argv) == 2
    assert f"{layer} and {copy} are both named 'demo'; layer names must be unique" in caplog.text


def test_serve_refuses_a_placement_file_without_expert_parallelism(tmp_path: Path, caplog) -> None:
    placement = tmp_path / "placement.json"
    placement.write_text('{"ranks": [[0, 1, 2, 3, 4, 5, 6, 7]]}')
    assert main(["serve", "--ep-placement", str(placement), "--device", "cpu"]) == 2
    expected = (
        "ep_placement: Value error, places experts over expert-parallel ranks: it needs ep > 1"
    )
    assert expected in caplog.text


def test_serve_refuses_a_placement_file_that_does_not_fit_the_layers(tmp_path: Path, caplog):
    placement = tmp_path / "placement.json"
    placement.write_text('{"ranks": [[0, 1, 2], [3, 4, 5, 6]]}')  # expert 7 is nowhere
    argv = ["serve", "--ep", "2", "--ep-placement", str(placement), "--device", "cpu"]
    assert main(argv) == 2
    assert "demo: placement file " in caplog.text
    assert "every expert of 0..7 must sit on at least one rank: missing [7]" in caplog.text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ep-redundant", "2"], "ep_redundant and ep_local_ranks need expert parallelism"),
        (["--ep", "2", "--ep-local-ranks", "3"], "ep_local_ranks (3) exceeds ep (2)"),
        (["--ep", "2", "--ep-redundant", "9"], "9 redundant copies do not fit"),
    ],
)
def test_serve_refuses_redundant_copies_and_local_ranks_that_do_not_fit(
    argv: list[str], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    assert main(["serve", "--device", "cpu", *argv]) == 2
    assert message in caplog.text


def test_serve_refuses_a_port_in_use_before_loading_anything(tmp_path: Path, caplog) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--port", str(port), "--device", "cpu", "--cache-dir", str(tmp_path)]
        assert main(argv) == 2
    assert f"cannot listen on 127.0.0.1:{port} (HTTP, --port): Address already in use" in (
        caplog.text
    )
    assert list(tmp_path.iterdir()) == []  # the demo layers were not even written


def test_serve_stops_with_status_1_when_a_layer_fails_to_load(
    tmp_path: Path, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Damaged data passes the header checks made before starting; the load finds it, and the
    process ends instead of answering 503 forever."""
    monkeypatch.setattr(
        "moe_serve.service.serve.logs.configure", lambda *args: None
    )  # keep caplog's
    layer = ensure_demo_layers(tmp_path)[0]
    raw = bytearray((layer / "experts.safetensors").read_bytes())
    raw[-100] ^= 0xFF
    (layer / "experts.safetensors").write_bytes(bytes(raw))
    assert main(["serve", "--weights", str(layer), "--device", "cpu", "--port", "0"]) == 1
    assert "loading the layers failed: " in caplog.text
    assert "xxh3-64 of" in caplog.text
    assert "ready:" not in caplog.text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_until_ready(tmp_path: Path, *args: str, env: dict[str, str] | None = None):
    """`moe-serve serve` on the demo layers at a free port, once /ready says 200: (proc, url)."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = _serve(
        "--port", str(port), "--device", "cpu", *args,
        env={"MOE_SERVE_CACHE_DIR": str(tmp_path), **(env or {})},
    )  # fmt: skip
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(f"{url}/ready").status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "server never got ready"
        time.sleep(0.1)


def _sigterm_with_a_request_queued(proc: subprocess.Popen, url: str) -> httpx.Response:
    """Post a forward, SIGTERM once it waits in its batch; the reply, after the process ended."""
    x = torch.randn(3, 256)
    replies: list[httpx.Response] = []
    request = threading.Thread(
        target=lambda: replies.append(
            httpx.post(
                f"{url}/v1/layers/demo/forward",
                content=safetensors.torch.save({"hidden_states": x}),
                headers={"Content-Type": "application/octet-stream"},
                timeout=EXIT_TIMEOUT_S,
            )
        )
    )
    request.start()
    queued = 'moe_serve_queue_depth{layer="demo"} 1.0'
    deadline = time.monotonic() + START_TIMEOUT_S
    while queued not in httpx.get(f"{url}/metrics").text:  # the request waits in its batch
        assert time.monotonic() < deadline, "the request never reached the queue"
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    request.join(EXIT_TIMEOUT_S)
    # uvicorn re-raises the signal once it has shut down, as a process killed by it would:
    # the shell sees 128 + 15 = 143
    assert proc.wait(EXIT_TIMEOUT_S) == -signal.SIGTERM
    return replies[0]


# Alone, or behind two front-end processes (service/frontends/supervisor.py), which drain first.
HTTP_WORKERS = pytest.mark.parametrize("workers", ["0", "2"])


@pytest.mark.slow
@HTTP_WORKERS
def test_sigterm_drains_in_flight_requests_before_exiting(tmp_path: Path, workers: str) -> None:
    # A long batch delay keeps the request queued when SIGTERM arrives.
    proc, url = _serve_until_ready(
        tmp_path, "--max-batch-delay-ms", "3000", "--log-format", "json", "--http-workers", workers
    )
    try:
        reply = _sigterm_with_a_request_queued(proc, url)
    finally:
        proc.kill()
    assert reply.status_code == 200
    assert safetensors.torch.load(reply.content)["output"].shape == (3, 256)
    log = proc.stdout.read()
    assert '"message": "POST /v1/layers/demo/forward -> 200' in log  # JSON lines, with its id
    # before the last process (the engine process, behind front ends) has shut down
    assert log.index("POST /v1/layers/demo/forward -> 200") < log.rindex("shutdown complete")


@pytest.mark.slow
@HTTP_WORKERS
def test_request_cut_by_the_drain_timeout_gets_a_json_503_with_retry_after(
    tmp_path: Path, workers: str
) -> None:
    # The batch waits 20 s; the drain allows 1 s.
    proc, url = _serve_until_ready(
        tmp_path,
        "--max-batch-delay-ms", "20000", "--http-workers", workers,
        env={"MOE_SERVE_DRAIN_TIMEOUT_S": "1"},
    )  # fmt: skip
    try:
        reply = _sigterm_with_a_request_queued(proc, url)
    finally:
        proc.kill()
    assert reply.status_code == 503
    assert reply.headers["Retry-After"] == "1"
    assert reply.json() == {"error": "the server shut down before this request finished; retry"}
    log = proc.stdout.read()
    assert "Traceback" not in log
    assert "POST /v1/layers/demo/forward -> 503" in log


def test_serve_refuses_a_grpc_port_in_use_before_loading_anything(tmp_path: Path, caplog) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        grpc_port = taken.getsockname()[1]
        argv = ["serve", "--port", str(_free_port()), "--grpc-port", str(grpc_port)]
        assert main([*argv, "--device", "cpu", "--cache-dir", str(tmp_path)]) == 2
    expected = f"cannot listen on 127.0.0.1:{grpc_port} (gRPC, --grpc-port; 0 turns gRPC off)"
    assert f"{expected}: Address already in use" in caplog.text
    assert list(tmp_path.iterdir()) == []


def test_serve_refuses_batch_invariance_for_an_fp8_tensor_layer_saying_why(
    monkeypatch, caplog
) -> None:
    cfg = MoEConfig(4, 64, 128, RoutingConfig(top_k=2), quant=QuantConfig(QuantScheme.FP8_TENSOR))
    monkeypatch.setattr("moe_serve.service.serve.demo_configs", lambda: {"demo": cfg})
    assert main(["serve", "--batch-invariant", "--device", "cpu"]) == 2
    reason = "reference: not batch-invariant: fp8-tensor quantises the activations with one scale"
    assert reason in caplog.text


def test_batch_invariance_with_expert_parallelism_is_refused() -> None:
    with pytest.raises(ValidationError, match="batch_invariant cannot be used with expert"):
        Settings(batch_invariant=True, ep=2)


@pytest.mark.parametrize(
    ("device", "cpus", "expected"),
    [("cpu", 16, 0), ("cuda", 16, 8), ("cuda", 64, 8), ("cuda", 6, 3), ("cuda", 1, 1)],
)
def test_http_workers_auto_runs_front_ends_on_a_gpu_host_only(
    monkeypatch: pytest.MonkeyPatch, device: str, cpus: int, expected: int
) -> None:
    """The default: one process on the CPU, where the forwards need the cores; on a GPU one
    front end per two usable cores, at most 8. A number given is taken as it is."""
    monkeypatch.setattr(Settings, "torch_device", lambda _: torch.device(device))
    monkeypatch.setattr("moe_serve.service.settings.usable_cpus", lambda: cpus)
    assert Settings().http_workers == "auto"
    assert Settings().front_ends() == expected
    monkeypatch.setenv("MOE_SERVE_HTTP_WORKERS", "auto")
    assert Settings().front_ends() == expected
    assert Settings(http_workers="0").front_ends() == 0
    assert Settings(http_workers=3).front_ends() == 3
    assert Settings(ep=2).front_ends() == 0  # expert parallelism runs in one process
    with pytest.raises(ValidationError, match="http_workers"):
        Settings(http_workers="some")


@pytest.mark.parametrize(
    ("cpu_max", "expected"),
    [(None, 12), ("max 100000", 12), ("400000 100000", 4), ("50000 100000", 1)],
    ids=["no cgroup", "no quota", "quota of 4", "half a core"],
)
def test_usable_cpus_are_the_affinity_within_the_cgroup_quota(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cpu_max: str | None, expected: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(12)))
    quota = tmp_path / "cpu.max"
    if cpu_max is not None:
        quota.write_text(cpu_max + "\n")
    assert usable_cpus(quota) == expected
