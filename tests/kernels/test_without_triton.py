"""The core install (a CPU build of torch, no triton, no deep_gemm, no triton_kernels): the
command line and the service import, the reference backend serves the demo layers, and every
backend that needs a missing package stays registered and says which."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moe_serve.kernels.stages import NO_TRITON

# Run in a fresh interpreter where importing any of these fails as if it were not installed.
SERVE_WITHOUT_TRITON = textwrap.dedent(
    """
    import json, sys, time

    MISSING = ("triton", "deep_gemm", "triton_kernels")
    for name in MISSING:
        sys.modules[name] = None  # import fails: ModuleNotFoundError

    import torch
    from fastapi.testclient import TestClient

    from moe_serve.kernels.registry import experts_backends
    from moe_serve.service import cli
    from moe_serve.service.http.app import create_app
    from moe_serve.service.settings import Settings

    cli.build_parser()  # every command's module imports
    cuda = torch.device("cuda")
    report = {"environment": {n: c.environment(cuda).reason for n, c in experts_backends().items()}}
    settings = Settings(device="cpu", grpc_port=0, cache_dir=sys.argv[1])
    with TestClient(create_app(settings)) as client:
        while client.get("/ready").status_code != 200:  # the demo layers load in the background
            time.sleep(0.05)
        report["backends"] = client.get("/backends").json()
        forward = client.post("/v1/layers/demo/forward", json={"hidden_states": [[0.01] * 256]})
        report["forward"] = [forward.status_code, forward.json().get("backend")]
    report["imported"] = sorted(
        name for name, module in sys.modules.items()
        if module is not None and name.split(".")[0] in MISSING
    )
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cache = tmp_path_factory.mktemp("demo-layers")
    done = subprocess.run(
        [sys.executable, "-c", SERVE_WITHOUT_TRITON, str(cache)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_service_serves_the_demo_layers_on_the_reference(report: dict) -> None:
    layers = {layer["layer"]: layer["experts"] for layer in report["backends"]["layers"]}
    assert layers == {"demo": "reference", "demo-fp8": "reference"}
    assert report["forward"] == [200, "reference"]
    assert report["imported"] == []


def test_every_backend_stays_registered_and_says_why_it_cannot_run(report: dict) -> None:
    experts = {e["name"]: e for e in report["backends"]["experts"]}
    assert {n for n, e in experts.items() if e["available"]} == {"reference", "reference-batched"}
    assert all(e["reason"] for e in experts.values() if not e["available"])
    environment = report["environment"]
    assert environment["triton"] == environment["triton-batched"] == NO_TRITON.reason
    for name in ("deep-gemm", "deep-gemm-batched", "deep-gemm-fp4", "triton-or-deep-gemm"):
        assert environment[name].startswith("deep_gemm not importable: ModuleNotFoundError")
    for name in ("oai-triton", "oai-triton-unfused"):
        assert environment[name].startswith("triton_kernels not importable: ModuleNotFoundError")
