"""docker-compose.yml against the Compose specification and what a GPU deployment needs.

compose-spec.json beside this file is the Compose schema docker compose itself validates with:
compose-spec/compose-go, schema/compose-spec.json at tag v2.13.0 (commit
0670a1c375c19defea19147bd82eb126a7c33b29), https://github.com/compose-spec/compose-go,
Apache-2.0. No PyPI package ships it; refresh it from a newer tag when Compose adds keys we use.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.deploy.files import SERVING, with_two_gpu_example

SCHEMA = json.loads((Path(__file__).parent / "compose-spec.json").read_text())
VALIDATOR = jsonschema.Draft202012Validator(
    SCHEMA, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
)


def schema_errors(doc: dict[str, Any]) -> list[str]:
    return [f"{list(e.absolute_path)}: {e.message}" for e in VALIDATOR.iter_errors(doc)]


def gpu_devices(service: dict[str, Any]) -> list[dict[str, Any]]:
    return service["deploy"]["resources"]["reservations"]["devices"]


def test_compose_file_is_valid_against_the_compose_schema(compose: dict[str, Any]) -> None:
    assert schema_errors(compose) == []


def test_schema_check_rejects_a_misspelt_key(compose: dict[str, Any]) -> None:
    broken = {**compose, "services": {SERVING: {**compose["services"][SERVING], "shm_sise": "2g"}}}
    assert any("shm_sise" in e for e in schema_errors(broken))


def test_images_are_built_from_this_checkout_never_pulled(compose: dict[str, Any]) -> None:
    services = compose["services"].values()
    assert all(s["build"] == "." and s["pull_policy"] == "build" for s in services)


def test_serving_service_reserves_one_nvidia_gpu(serving: dict[str, Any]) -> None:
    assert gpu_devices(serving) == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert serving["environment"]["MOE_SERVE_DEVICE"] == "cuda"


def test_serving_mounts_the_weights_read_only(serving: dict[str, Any]) -> None:
    assert "./weights-data:/weights:ro" in serving["volumes"]
    layers = serving["environment"]["MOE_SERVE_WEIGHTS"].split(",")
    assert layers and all(layer.startswith("/weights/") for layer in layers)


def test_healthcheck_probes_ready_on_the_container_port(serving: dict[str, Any]) -> None:
    check = serving["healthcheck"]
    assert check["test"][0] == "CMD"
    assert "/ready" in check["test"][-1] and "MOE_SERVE_PORT" in check["test"][-1]
    assert serving["ports"] == ["8000:8000"]


def test_api_token_comes_from_the_env_file_not_the_compose_file(
    compose: dict[str, Any], serving: dict[str, Any]
) -> None:
    assert serving["env_file"] == [{"path": "deploy/moe-serve.env", "required": True}]
    for service in compose["services"].values():
        assert "MOE_SERVE_API_TOKEN" not in service.get("environment", {})


def test_serving_restarts_and_bounds_its_logs_and_limits(serving: dict[str, Any]) -> None:
    assert serving["restart"] == "unless-stopped"
    assert serving["logging"]["options"] == {"max-size": "50m", "max-file": "5"}
    assert serving["shm_size"] == "2gb"
    assert serving["ulimits"]["memlock"] == -1


def test_convert_is_a_one_shot_tool_writing_only_the_weights(compose: dict[str, Any]) -> None:
    convert = compose["services"]["convert"]
    assert convert["profiles"] == ["tools"]
    assert convert["entrypoint"] == ["moe-serve", "convert"]
    assert convert["restart"] == "no"
    assert "deploy" not in convert  # converting needs no GPU: it stays free for serving
    writable = [v for v in convert["volumes"] if not v.endswith(":ro")]
    assert writable == ["./weights-data:/weights"]
    assert any(v.endswith(":/checkpoint:ro") for v in convert["volumes"])


@pytest.fixture(scope="module")
def two_gpu(compose_text: str) -> dict[str, Any]:
    doc = yaml.safe_load(with_two_gpu_example(compose_text))
    del doc["services"][SERVING]  # the example replaces the single-GPU service
    return doc


def test_two_gpu_example_is_valid_compose(two_gpu: dict[str, Any]) -> None:
    assert schema_errors(two_gpu) == []


def test_two_gpu_example_pins_distinct_gpus_ports_and_layers(two_gpu: dict[str, Any]) -> None:
    servers = [s for name, s in two_gpu["services"].items() if name != "convert"]
    assert len(servers) == 2
    gpus = [tuple(gpu_devices(s)[0]["device_ids"]) for s in servers]
    ports = [s["ports"][0].split(":")[0] for s in servers]
    layers = [set(s["environment"]["MOE_SERVE_WEIGHTS"].split(",")) for s in servers]
    assert gpus == [("0",), ("1",)]
    assert len(set(ports)) == 2
    assert not layers[0] & layers[1]
    assert all("./weights-data:/weights:ro" in s["volumes"] for s in servers)
