"""A KServe client in its own process (CUDA IPC needs two), for test_cuda_shared_memory.py:
passes tensors through CUDA shared memory made by tritonclient.utils.cuda_shared_memory, over
gRPC with the stock tritonclient.grpc and over HTTP with bench.transport_bench's httpx client
(tritonclient.http needs geventhttpclient, which the GPU machine lacks). Writes {case: "ok" or
the server's error} as report.json, and each output as .npy, into --out."""

from __future__ import annotations

import argparse
import base64
import json
import os
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.cuda_shared_memory as cudashm
from tritonclient.utils import InferenceServerException

from bench.transport_bench import HttpKServe


def output_half(region: object, x: np.ndarray) -> np.ndarray:
    """The output written after the input in `region` (tritonclient reads a CUDA region from its
    start only: read both halves, keep the second)."""
    rows = x.shape[0]
    return cudashm.get_contents_as_numpy(region, np.float32, [2 * rows, *x.shape[1:]])[rows:]


def over_grpc(address: str, model: str, x: np.ndarray) -> np.ndarray:
    """Input at 0 and output after it, in one CUDA buffer of device 0; the output read back."""
    region = cudashm.create_shared_memory_region("io-grpc", 2 * x.nbytes, 0)
    with grpcclient.InferenceServerClient(address) as client:
        try:
            cudashm.set_shared_memory_region(region, [x])
            raw = cudashm.get_raw_handle(region)
            client.register_cuda_shared_memory("io-grpc", raw, 0, 2 * x.nbytes)
            tensor = grpcclient.InferInput("hidden_states", list(x.shape), "FP32")
            tensor.set_shared_memory("io-grpc", x.nbytes)
            out = grpcclient.InferRequestedOutput("output")
            out.set_shared_memory("io-grpc", x.nbytes, offset=x.nbytes)
            client.infer(model, [tensor], outputs=[out])
            return output_half(region, x)
        finally:
            client.unregister_cuda_shared_memory("io-grpc")
            cudashm.destroy_shared_memory_region(region)


def over_http(address: str, x: np.ndarray) -> np.ndarray:
    region = cudashm.create_shared_memory_region("io-http", 2 * x.nbytes, 0)
    client = HttpKServe(address)
    try:
        cudashm.set_shared_memory_region(region, [x])
        client.register_cuda("io-http", cudashm.get_raw_handle(region), 2 * x.nbytes)
        client.infer(x, "io-http")
        return output_half(region, x)
    finally:
        client.http.post("/v2/cudasharedmemory/region/io-http/unregister")
        cudashm.destroy_shared_memory_region(region)


def refused(call: Callable[[], object]) -> str:
    """'ok', or the error the server answered: 'STATUS: message'."""
    try:
        call()
    except InferenceServerException as err:
        return f"{err.status()}: {err.message()}"
    except httpx.HTTPStatusError as err:
        return f"{err.response.status_code}: {err.response.json()['error']}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", required=True)  # host:port
    parser.add_argument("--grpc", required=True)
    parser.add_argument("--model", default="demo")
    parser.add_argument("--input", type=Path, required=True)  # .npy, float32 [T, H]
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    x = np.load(args.input)
    np.save(args.out / "grpc.npy", over_grpc(args.grpc, args.model, x))
    np.save(args.out / "http.npy", over_http(args.http, x))
    http = HttpKServe(args.http)
    region = cudashm.create_shared_memory_region("bad", 4096, 0)
    handle = cudashm.get_raw_handle(region)

    def register(raw: bytes, device_id: int, byte_size: int) -> None:
        body = {"raw_handle": {"b64": raw.decode()}, "device_id": device_id, "byte_size": byte_size}
        http.http.post("/v2/cudasharedmemory/region/bad/register", json=body).raise_for_status()

    try:
        import torch  # only to count the GPUs this process sees, as the server does

        report = {
            "another device": refused(lambda: register(handle, torch.cuda.device_count(), 4096)),
            "invalid handle": refused(
                lambda: grpcclient.InferenceServerClient(args.grpc).register_cuda_shared_memory(
                    "bad", base64.b64encode(os.urandom(64)), 0, 4096
                )
            ),
            "larger than the buffer": refused(lambda: register(handle, 0, 1 << 30)),
            "unregistered region": refused(lambda: http.infer(x, "never")),
        }
    finally:
        cudashm.destroy_shared_memory_region(region)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
