"""A KServe client in its own process (CUDA IPC needs two), for test_cuda_shared_memory.py:
passes tensors through CUDA shared memory made by tritonclient.utils.cuda_shared_memory, over
gRPC with the stock tritonclient.grpc and over HTTP with bench.transport_bench's httpx client
(tritonclient.http needs geventhttpclient, which the GPU machine lacks), and the same input in a
binary request; unregisters a region while a request on it waits in the server's queue. Writes
{case: "ok" or the server's error, or a figure} as report.json, and each output as .npy, into
--out."""

from __future__ import annotations

import argparse
import base64
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.utils.cuda_shared_memory as cudashm
from tritonclient.utils import InferenceServerException

from moe_serve.bench.transport_bench import HttpKServe

IN_FLIGHT_ROWS = 16  # fewer than a batch: such a request waits the server's batch delay
UNREGISTER_AFTER_S = 0.05  # into that delay


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


def unregister_in_flight(address: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict]:
    """IN_FLIGHT_ROWS rows through region "inflight" and the same rows in a binary request, at
    once: both wait in the server's queue (and so share a batch), and the region is unregistered
    meanwhile. Returns the output left in the region, the binary one, and {"unregistered at": a
    time.time(), "named afterwards": what a request naming the region gets then}."""
    rows = np.ascontiguousarray(x[:IN_FLIGHT_ROWS])
    region = cudashm.create_shared_memory_region("inflight", 2 * rows.nbytes, 0)
    try:
        cudashm.set_shared_memory_region(region, [rows])
        HttpKServe(address).register_cuda(
            "inflight", cudashm.get_raw_handle(region), 2 * rows.nbytes
        )
        with ThreadPoolExecutor(2) as pool:
            placed = pool.submit(HttpKServe(address).infer, rows, "inflight")
            binary = pool.submit(HttpKServe(address).infer, rows)
            time.sleep(UNREGISTER_AFTER_S)
            unregister = "/v2/cudasharedmemory/region/inflight/unregister"
            HttpKServe(address).http.post(unregister).raise_for_status()
            unregistered_at = time.time()
            placed.result()
            in_reply = binary.result()
        after = refused(lambda: HttpKServe(address).infer(rows, "inflight"))
        report = {"unregistered at": unregistered_at, "named afterwards": after}
        return output_half(region, rows), in_reply, report
    finally:
        cudashm.destroy_shared_memory_region(region)


def places_refused(address: str, model: str, x: np.ndarray) -> dict[str, str]:
    """What the server answers to a NaN in a region and to a misaligned offset."""
    region = cudashm.create_shared_memory_region("places", 2 * x.nbytes + 4, 0)
    http = HttpKServe(address, model)

    def infer(in_offset: int) -> None:
        place = {"shared_memory_region": "places", "shared_memory_byte_size": x.nbytes}
        entry = {"name": "hidden_states", "shape": list(x.shape), "datatype": "FP32"}
        body = {"inputs": [{**entry, "parameters": {**place, "shared_memory_offset": in_offset}}]}
        http.http.post(f"/v2/models/{model}/infer", json=body).raise_for_status()

    try:
        http.register_cuda("places", cudashm.get_raw_handle(region), 2 * x.nbytes + 4)
        nan = x.copy()
        nan[3, 7] = np.nan
        cudashm.set_shared_memory_region(region, [nan])
        return {
            "nan input": refused(lambda: infer(0)),
            "misaligned offset": refused(lambda: infer(2)),
        }
    finally:
        http.http.post("/v2/cudasharedmemory/region/places/unregister")
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
    http = HttpKServe(args.http, args.model)
    np.save(args.out / "binary.npy", http.infer(x))
    inflight, inflight_binary, inflight_report = unregister_in_flight(args.http, x)
    np.save(args.out / "inflight.npy", inflight)
    np.save(args.out / "inflight-binary.npy", inflight_binary)
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
            **places_refused(args.http, args.model, x),
            **inflight_report,
        }
    finally:
        cudashm.destroy_shared_memory_region(region)
    (args.out / "report.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
