"""The service's settings: one pydantic-settings model, every field also an env var MOE_SERVE_*."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

import torch
from pydantic import Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from ..kernels.calibrate import DEFAULT_BUDGET_S, Mode
from ..kernels.stages import resolve_device

_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")
_DEVICES = re.compile(r"all|cuda:\d+(,cuda:\d+)*")
MIN_TOKEN_CHARS = 16  # a shorter bearer token is a placeholder, not a secret
# --http-workers auto on a GPU: the most front ends, chosen by `moe-serve bench service` on a
# 16-core H200 host; half the cores leaves the rest to the engine process, its copies and the
# batcher
AUTO_FRONT_ENDS = 8


CPU_QUOTA = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


def usable_cpus(quota_file: Path = CPU_QUOTA) -> int:
    """The CPU cores this process may run on: its affinity, within its cgroup's CPU quota (a
    container limited to N CPUs sees the host's cores otherwise)."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = quota_file.read_text().split()
    except (OSError, ValueError):
        return cores
    if quota == "max":
        return cores
    return max(1, min(cores, int(quota) // int(period)))


class Settings(BaseSettings):
    """Validated once at start; `moe-serve serve` options override the environment."""

    model_config = SettingsConfigDict(env_prefix="MOE_SERVE_", frozen=True)

    # Layer directories/files to serve; empty: generate and serve the demo layers.
    # In the environment: comma-separated (MOE_SERVE_WEIGHTS=/w/layer0,/w/layer1).
    weights: Annotated[tuple[Path, ...], NoDecode] = ()
    host: str = "127.0.0.1"  # loopback unless asked: the API has no auth by default
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int = Field(8001, ge=0, le=65535)  # KServe v2 over gRPC, as Triton; 0: off
    # GET /metrics on a port of its own, as Triton's; 0: off (/metrics on `port` stays)
    metrics_port: int = Field(8002, ge=0, le=65535)
    # HTTP front-end processes sharing the port (binary forwards laid in shared memory, the rest
    # relayed) around this one, which keeps the GPU; 0: this process serves HTTP itself; auto:
    # `front_ends()`
    http_workers: Annotated[int, Field(ge=0, le=64)] | Literal["auto"] = "auto"
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # GPUs whole layers are placed on, by memory (service/engine/devices.py): all, or a comma
    # list (cuda:0,cuda:1); None: every layer on `device`
    devices: str | None = None
    backend: str = "auto"  # experts backend for every layer, or auto per layer
    max_batch_tokens: int = Field(1024, ge=1)  # tokens per forward; larger requests are chunked
    # How long a batch waits for company once the device is free. 0: go at once; requests that
    # arrive while the device is busy still share its next forward.
    max_batch_delay_ms: float = Field(0.0, ge=0.0)
    max_queue: int = Field(256, ge=1)  # requests waiting per layer before 429
    # Replay each layer's forward from CUDA graphs, one per token bucket, where its backend can
    # be captured; False: every forward runs eagerly (slower; for debugging and comparison).
    cuda_graphs: bool = True
    # Each row's output bit for bit independent of the rest of its batch and of the chunking
    # (reference and triton; fp8-tensor and expert parallelism refused): kernels/batch_invariant.py
    batch_invariant: bool = False
    # `--backend auto`'s rule measured on this GPU at start-up (kernels/calibrate.py), per
    # layer: once (where no tuned table fits and none is cached in cache_dir), always (at each
    # start), off (the tuned tables, else auto's fixed order)
    calibrate: Mode = Mode.ONCE
    calibrate_budget_s: float = Field(
        DEFAULT_BUDGET_S, gt=0
    )  # per layer; then the rest is not timed
    max_body_bytes: int = Field(64 << 20, ge=1024)  # request bodies above this get 413
    # JSON bodies above this get 413 pointing to the binary formats: decoding JSON holds the GIL
    # (the event loop, /health included, waits) and costs a few times the body in memory. 16 MiB
    # holds 64 DeepSeek-V3 tokens (458,752 numbers) however the floats are printed.
    max_json_bytes: int = Field(16 << 20, ge=1024)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    # Triton's shared-memory extension (system and CUDA regions); off, as newer Triton servers
    allow_shared_memory: bool = False
    # Only system shared-memory keys ("/name") whose name starts with this are accepted: a key
    # otherwise names any /dev/shm object the server's user can open, whoever created it
    shared_memory_prefix: str = ""
    # Regions one token (or, without auth, all clients) may have registered at once: each holds
    # a descriptor (system) or a mapping (CUDA) until it is unregistered; beyond, 429
    max_shared_memory_regions: int = Field(256, ge=1)
    # Bytes that requests in flight may hold copied out of system regions (a request names
    # them in a few hundred bytes); beyond, 429. One request alone may take up to the body limit.
    # Also how much copy memory (service/engine/copy_memory.py) is kept idle for later requests
    max_shared_memory_copy_bytes: int = Field(1 << 30, ge=1)
    api_token: SecretStr | None = None  # bearer token required on every non-probe route
    # where the demo layers are written and calibrated rules cached (its calibration/ folder)
    cache_dir: Path = Path.home() / ".cache" / "moe-serve"
    # Triton-style model repository: each subdirectory a layer directory, loaded at start and
    # loaded/unloaded at run time (POST /v2/repository/...)
    model_repository: Path | None = None
    ep: int = Field(1, ge=1)  # expert-parallel ranks, one GPU each; rank 0 serves HTTP
    ep_placement: Path | None = None  # JSON: experts per rank; None: contiguous slices
    ep_redundant: int = Field(0, ge=0)  # extra copies of the hottest experts, over the ranks
    # ranks started on this host (0..N-1); the others join from other hosts (moe-serve ep-rank,
    # at MASTER_ADDR:MASTER_PORT); None: all --ep ranks run here
    ep_local_ranks: int | None = Field(None, ge=1)
    drain_timeout_s: float = Field(30.0, gt=0)  # SIGTERM: how long in-flight requests may finish
    # A request's head, and then its body, must each arrive within this (else closed, or 408).
    read_timeout_s: float = Field(30.0, gt=0)
    max_connections: int = Field(1024, ge=1)  # beyond: a JSON 503 and the connection closed

    @field_validator("weights", mode="before")
    @classmethod
    def _split_paths(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(p.strip() for p in value.split(",") if p.strip())
        return value

    @field_validator("ep_placement")
    @classmethod
    def _check_placement(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is not None and info.data.get("ep") == 1:
            raise ValueError("places experts over expert-parallel ranks: it needs ep > 1")
        return value

    @model_validator(mode="after")
    def _check_repository(self) -> Settings:
        ports = {"port": self.port, "grpc_port": self.grpc_port, "metrics_port": self.metrics_port}
        by_port: dict[int, list[str]] = {}
        for name, port in ports.items():
            if port:
                by_port.setdefault(port, []).append(name)
        for port, names in by_port.items():
            if len(names) > 1:
                raise ValueError(
                    f"{' and '.join(names)} are {'both' if len(names) == 2 else 'all'} {port}: "
                    "HTTP, gRPC and metrics need a port "
                    "each (gRPC's default is 8001 and metrics' 8002, as Triton's; 0 turns gRPC "
                    "or metrics off)"
                )
        if self.model_repository is not None and self.ep > 1:
            raise ValueError("model_repository cannot be used with expert parallelism (ep > 1)")
        if self.batch_invariant and self.ep > 1:
            raise ValueError(
                "batch_invariant cannot be used with expert parallelism (ep > 1): the ranks' "
                "partial outputs are summed by NCCL in an order that depends on the batch"
            )
        if self.ep == 1 and (self.ep_redundant or self.ep_local_ranks is not None):
            raise ValueError("ep_redundant and ep_local_ranks need expert parallelism (ep > 1)")
        if self.ep_local_ranks is not None and self.ep_local_ranks > self.ep:
            raise ValueError(f"ep_local_ranks ({self.ep_local_ranks}) exceeds ep ({self.ep})")
        if self.devices is not None and self.ep > 1:
            raise ValueError(
                "devices cannot be used with expert parallelism (ep > 1): its ranks take one GPU "
                "each, counting from device"
            )
        if self.devices is not None and "device" in self.model_fields_set:
            raise ValueError(
                "device and devices are both given: devices places the layers over several "
                "GPUs, device puts every layer on one; give one of them"
            )
        return self

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {value!r}")
        return value

    @field_validator("devices")
    @classmethod
    def _check_devices(cls, value: str | None) -> str | None:
        if value is None:
            return None
        names = value.replace(" ", "")
        if not _DEVICES.fullmatch(names):
            raise ValueError(f"devices must be all or a comma list of cuda:N, got {value!r}")
        listed = names.split(",")
        twice = sorted({name for name in listed if listed.count(name) > 1})
        if twice:
            raise ValueError(f"devices names {', '.join(twice)} more than once")
        return names

    @field_validator("api_token")
    @classmethod
    def _check_token(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < MIN_TOKEN_CHARS:
            raise ValueError(f"api_token must have at least {MIN_TOKEN_CHARS} characters")
        return value

    def api_token_bytes(self) -> bytes | None:
        return None if self.api_token is None else self.api_token.get_secret_value().encode()

    def front_ends(self) -> int:
        """The HTTP front-end processes to start: http_workers, or for auto none on the CPU
        (the layers' own forwards leave no core for them) or with --ep (its ranks' processes
        take the cores), and on a GPU one per two usable CPU cores, at most AUTO_FRONT_ENDS."""
        if self.http_workers != "auto":
            return self.http_workers
        if self.torch_device().type != "cuda" or self.ep > 1:
            return 0
        return min(AUTO_FRONT_ENDS, max(1, usable_cpus() // 2))

    def torch_device(self) -> torch.device:
        """The device layers run on: `auto` is the first GPU when there is one, else the CPU
        (with `devices`, the first GPU: `layer_devices` are where they run)."""
        return resolve_device(self.device)

    def layer_devices(self) -> tuple[torch.device, ...]:
        """The devices layers are placed on: `devices` (`all`: every visible GPU), else the
        one `device`. A GPU named that is not visible is a ValueError."""
        if self.devices is None:
            return (self.torch_device(),)
        visible = torch.cuda.device_count()
        if self.devices == "all":
            if not visible:
                raise ValueError("devices all: no CUDA GPU is visible")
            return tuple(torch.device("cuda", index) for index in range(visible))
        devices = tuple(torch.device(name) for name in self.devices.split(","))
        missing = [str(device) for device in devices if device.index >= visible]
        if missing:
            raise ValueError(
                f"devices names {', '.join(missing)}, but {visible} CUDA GPUs are visible"
            )
        return devices
