"""Whole layers placed over several devices (`--devices`): the placement by memory, the settings,
and, with the devices' memory mocked and CPU devices standing for GPUs, the engine building
each layer on its device, the batcher keeping each device's batches apart, and the routes
showing where each layer runs. tests/service/test_devices_gpu.py serves over two GPUs."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError

from moe_serve.kernels.layer import build_layer
from moe_serve.kernels.tensors import ForwardInputs
from moe_serve.service.cli import main
from moe_serve.service.core.runtime import load_from_disk
from moe_serve.service.engine.batcher import DynamicBatcher
from moe_serve.service.engine.devices import GIB, place_layers
from moe_serve.service.engine.engine import Engine
from moe_serve.service.http.app import create_app
from moe_serve.service.settings import Settings
from moe_serve.weights.demo import ensure_demo_layers
from moe_serve.weights.load import load_layer, read_manifest, weight_bytes
from tests.service.conftest import wait_ready
from tests.service.layers import NO_ROUTER, TINY, E, H, reference_forward, tiny_layers
from tests.service.test_output_into import WAIT_S, EnqueuingEngine, _run

CPU0, CPU1 = torch.device("cpu", 0), torch.device("cpu", 1)
GPU0, GPU1 = torch.device("cuda", 0), torch.device("cuda", 1)
MIB = 1 << 20


# ---- the placement ----------------------------------------------------------------------------


def test_the_largest_layers_go_first_each_onto_the_device_with_the_most_left() -> None:
    sizes = {"small": 1 * GIB, "large": 6 * GIB, "medium": 4 * GIB, "tiny": GIB // 2}
    placed = place_layers(sizes, {GPU0: 10 * GIB, GPU1: 8 * GIB})
    # large -> 0 (4 GiB left), medium -> 1 (4 left), small -> 0 (a tie: the first listed; 3
    # left), tiny -> 1
    assert placed == {"small": GPU0, "large": GPU0, "medium": GPU1, "tiny": GPU1}
    assert list(placed) == list(sizes)  # in the order asked


def test_many_equal_layers_spread_evenly_over_equal_devices() -> None:
    sizes = {f"layer{i}": 11 * GIB for i in range(58)}
    gpus = [torch.device("cuda", d) for d in range(8)]
    placed = place_layers(sizes, dict.fromkeys(gpus, 140 * GIB))
    per_device = [list(placed.values()).count(gpu) for gpu in gpus]
    assert max(per_device) - min(per_device) <= 1 and sum(per_device) == 58


def test_free_memory_already_taken_on_a_device_sends_the_layers_elsewhere() -> None:
    placed = place_layers({"x": 3 * GIB, "y": 3 * GIB}, {GPU0: 4 * GIB, GPU1: 10 * GIB})
    assert placed == {"x": GPU1, "y": GPU1}


def test_a_layer_larger_than_any_devices_free_memory_is_refused_naming_it_and_its_size() -> None:
    with pytest.raises(ValueError) as refused:
        place_layers({"huge": 12 * GIB, "small": GIB}, {GPU0: 10 * GIB, GPU1: 8 * GIB})
    assert str(refused.value) == (
        "layer 'huge' needs 12.00 GiB for its weights, more than any device has free "
        "(cuda:0 10.00 GiB, cuda:1 8.00 GiB)"
    )


def test_a_layer_that_the_larger_ones_leave_no_room_for_is_refused_naming_it() -> None:
    sizes = {"a": 6 * GIB, "b": 6 * GIB, "c": 5 * GIB}
    with pytest.raises(ValueError, match=r"layer .c. needs 5\.00 GiB for its weights; the larger"):
        place_layers(sizes, {GPU0: 10 * GIB, GPU1: 10 * GIB})


# ---- the settings -----------------------------------------------------------------------------


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_devices_all_is_every_visible_gpu_and_a_list_is_those_gpus(monkeypatch) -> None:
    _gpus(monkeypatch, 3)
    assert Settings(devices="all").layer_devices() == tuple(
        torch.device("cuda", i) for i in range(3)
    )
    listed = Settings(devices="cuda:2, cuda:0")
    assert listed.devices == "cuda:2,cuda:0"
    assert listed.layer_devices() == (torch.device("cuda", 2), torch.device("cuda", 0))
    assert Settings(device="cpu").layer_devices() == (torch.device("cpu"),)  # the default


def test_devices_naming_gpus_that_are_not_there_is_refused(monkeypatch) -> None:
    _gpus(monkeypatch, 2)
    with pytest.raises(ValueError, match="devices names cuda:2, but 2 CUDA GPUs are visible"):
        Settings(devices="cuda:0,cuda:2").layer_devices()
    _gpus(monkeypatch, 0)
    with pytest.raises(ValueError, match="devices all: no CUDA GPU is visible"):
        Settings(devices="all").layer_devices()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"devices": "cuda"}, "devices must be all or a comma list of cuda:N, got 'cuda'"),
        ({"devices": "cpu,cuda:0"}, "devices must be all or a comma list of cuda:N"),
        ({"devices": "cuda:0,cuda:1,cuda:0"}, "devices names cuda:0 more than once"),
        ({"devices": "all", "ep": 2}, "devices cannot be used with expert parallelism"),
        ({"devices": "all", "device": "cuda:0"}, "device and devices are both given"),
    ],
)
def test_bad_devices_are_refused_saying_why(settings: dict, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        Settings(**settings)


def test_device_from_the_environment_and_devices_as_an_option_are_refused_together(
    monkeypatch,
) -> None:
    monkeypatch.setenv("MOE_SERVE_DEVICE", "cuda:1")
    with pytest.raises(ValidationError, match="device and devices are both given"):
        Settings(devices="cuda:0,cuda:1")


def test_serve_refuses_devices_with_expert_parallelism_before_starting(caplog) -> None:
    assert main(["serve", "--devices", "cuda:0,cuda:1", "--ep", "2"]) == 2
    assert "devices cannot be used with expert parallelism (ep > 1)" in caplog.text


def test_serve_refuses_a_layer_no_device_has_room_for_naming_it(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    demo, demo_fp8 = ensure_demo_layers(tmp_path)
    _gpus(monkeypatch, 2)
    monkeypatch.setattr("moe_serve.service.engine.devices.free_bytes", lambda _device: MIB)
    argv = ["serve", "--devices", "all", "--weights", str(demo), "--weights", str(demo_fp8)]
    assert main(argv) == 2
    needs = weight_bytes(read_manifest(demo)) / GIB
    assert f"layer '{demo}' needs {needs:.2f} GiB for its weights, more than any" in caplog.text


# ---- the engine and the batcher over mocked devices ---------------------------------------------


@pytest.fixture
def layers(tmp_path: Path) -> list[Path]:
    """The demo layers: `demo` (bf16) is the larger, `demo-fp8` the smaller."""
    paths = ensure_demo_layers(tmp_path)
    sizes = [weight_bytes(read_manifest(p)) for p in paths]
    assert sizes[0] > sizes[1] > 0
    return paths


def _free(monkeypatch: pytest.MonkeyPatch, free: Mapping[torch.device, int]) -> None:
    monkeypatch.setattr("moe_serve.service.engine.devices.free_bytes", free.__getitem__)


def test_the_weight_bytes_of_a_manifest_are_what_loading_puts_on_the_device(layers) -> None:
    for path in layers:
        loaded = load_layer(path, torch.device("cpu"))
        assert weight_bytes(loaded.manifest) == loaded.weights.nbytes() == loaded.nbytes


def test_the_engine_builds_each_layer_on_the_device_it_was_placed_on(layers, monkeypatch) -> None:
    # the larger layer takes cpu:1 (the most free), the smaller then fits on cpu:0 only
    larger = weight_bytes(read_manifest(layers[0]))
    _free(monkeypatch, {CPU0: larger, CPU1: larger + larger // 2})
    devices = (CPU0, CPU1)
    sources = load_from_disk(Settings(weights=tuple(layers)), devices)
    assert [s.device for s in sources] == [CPU1, CPU0]
    engine = Engine(devices)
    for source in sources:
        served = engine.add(source)
        assert served.device == source.device
        assert served.layer.kernel.workspace is engine.workspaces[source.device]
    assert engine.workspaces[CPU0] is not engine.workspaces[CPU1]
    assert {n: s.device for n, s in engine.layers.items()} == {"demo": CPU1, "demo-fp8": CPU0}


def test_the_engine_refuses_a_layer_on_a_device_it_does_not_serve_from() -> None:
    layer = tiny_layers()[0]
    with pytest.raises(ValueError, match="layer 'tiny' is on cpu, not on one of cpu:0, cpu:1"):
        Engine([CPU0, CPU1]).add(layer)


class _HeldPerLayer(EnqueuingEngine):
    """EnqueuingEngine with its two layers on two devices, one batch in flight per device, and
    each layer's batches held until its own gate opens."""

    max_in_flight = 1

    def __init__(self) -> None:
        super().__init__((CPU0, CPU1))
        self.held = {name: threading.Event() for name in self.layers}

    def start(
        self,
        name: str,
        parts: Sequence[ForwardInputs],
        into: Sequence[torch.Tensor | None] | None = None,
    ):
        later, held = super().start(name, parts, into), self.held[name]

        class Held:
            def done(self):
                return held.is_set() and later.done()

            def result(self):
                assert held.wait(WAIT_S), "test gate never opened"
                return later.result()

        return Held()


def test_a_batch_held_on_one_device_holds_back_no_layer_of_another() -> None:
    """Each device has its own batches in flight and its own thread waiting for them: the
    layer on cpu:1 is answered while cpu:0 has its one batch held and a second one waiting."""
    engine = _HeldPerLayer()
    assert {n: s.device for n, s in engine.layers.items()} == {TINY: CPU0, NO_ROUTER: CPU1}
    engine.held[NO_ROUTER].set()
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(3, E, generator=torch.Generator().manual_seed(1))

    async def body(batcher: DynamicBatcher):
        first = asyncio.create_task(batcher.submit(TINY, ForwardInputs(x)))
        while not engine.launched.is_set():  # cpu:0's one batch is in flight, and held
            await asyncio.sleep(0.001)
        second = asyncio.create_task(batcher.submit(TINY, ForwardInputs(2 * x)))
        other = await batcher.submit(NO_ROUTER, ForwardInputs(x, logits))
        waiting = not first.done() and not second.done()
        engine.held[TINY].set()
        return waiting, other, await first, await second

    waiting, other, first, second = _run(engine, body)
    assert waiting
    torch.testing.assert_close(other.output, reference_forward(NO_ROUTER, x, logits))
    torch.testing.assert_close(first.output, reference_forward(TINY, x))
    torch.testing.assert_close(second.output, reference_forward(TINY, 2 * x))


# ---- the routes ---------------------------------------------------------------------------------


@pytest.fixture
def placed(layers: list[Path], monkeypatch) -> Iterator[TestClient]:
    """A ready server on the demo layers placed over cpu:0 and cpu:1 standing for two GPUs:
    the larger on cpu:1, which has the most free."""
    monkeypatch.setattr(Settings, "layer_devices", lambda _settings: (CPU0, CPU1))
    larger = weight_bytes(read_manifest(layers[0]))
    _free(monkeypatch, {CPU0: larger, CPU1: larger + larger // 2})
    with TestClient(create_app(Settings(weights=tuple(layers)))) as client:
        wait_ready(client.get)
        yield client


def test_the_layers_and_backends_routes_show_each_layers_device(placed: TestClient) -> None:
    layers = {layer["name"]: layer for layer in placed.get("/v1/layers").json()["layers"]}
    assert {name: layer["device"] for name, layer in layers.items()} == {
        "demo": "cpu:1",
        "demo-fp8": "cpu:0",
    }
    assert placed.get("/v1/layers/demo-fp8").json()["device"] == "cpu:0"
    backends = placed.get("/backends").json()
    assert {b["layer"]: b["device"] for b in backends["layers"]} == {
        "demo": "cpu:1",
        "demo-fp8": "cpu:0",
    }


def test_the_statistics_name_each_layers_own_device(placed: TestClient) -> None:
    stats = placed.get("/v2/models/stats").json()["model_stats"]
    usage = {m["name"]: m["memory_usage"][0] for m in stats}
    assert (usage["demo"]["type"], usage["demo"]["id"]) == ("CPU", 1)
    assert (usage["demo-fp8"]["type"], usage["demo-fp8"]["id"]) == ("CPU", 0)


def test_every_placed_layer_answers_as_its_reference(placed: TestClient, layers) -> None:
    for path in layers:
        loaded = load_layer(path, torch.device("cpu"))
        cfg = loaded.config
        x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
        r = placed.post(f"/v1/layers/{loaded.name}/forward", json={"hidden_states": x.tolist()})
        assert r.status_code == 200, r.text
        layer, _ = build_layer(cfg, loaded.weights, torch.device("cpu"), "reference")
        with torch.inference_mode():
            expected = layer.forward(ForwardInputs(x.to(cfg.dtype))).output
        torch.testing.assert_close(torch.tensor(r.json()["output"]).to(cfg.dtype), expected)


def test_a_model_loaded_at_run_time_goes_where_the_most_memory_is_free(
    layers: list[Path], monkeypatch
) -> None:
    repo = layers[0].parent  # its subdirectories demo and demo-fp8 are the models
    monkeypatch.setattr(Settings, "layer_devices", lambda _settings: (CPU0, CPU1))
    free = {CPU0: GIB, CPU1: 2 * GIB}
    _free(monkeypatch, free)
    with TestClient(create_app(Settings(model_repository=repo))) as client:
        wait_ready(client.get)
        devices = {la["name"]: la["device"] for la in client.get("/v1/layers").json()["layers"]}
        assert devices == {"demo": "cpu:1", "demo-fp8": "cpu:1"}  # the mock's free never drops
        free[CPU0] = 3 * GIB
        assert client.post("/v2/repository/models/demo/load").status_code == 200
        assert client.get("/v1/layers/demo").json()["device"] == "cpu:0"
        free[CPU0] = free[CPU1] = MIB // 2
        r = client.post("/v2/repository/models/demo-fp8/load")
        assert r.status_code == 400
        assert "needs" in r.json()["error"] and "more than any device has free" in r.json()["error"]
        assert client.get("/v1/layers/demo-fp8").json()["device"] == "cpu:1"  # still serving


def test_one_device_places_nothing_and_shows_it(make_client) -> None:
    layers = make_client().get("/v1/layers").json()["layers"]
    assert {layer["device"] for layer in layers} == {"cpu"}
