"""Triton's metrics as Triton exposes them, and the host's and GPUs' own.

Triton names its cumulative metrics without `_total` and declares them `counter`
(`# TYPE nv_inference_request_success counter`, then `nv_inference_request_success{...} 5`);
prometheus_client's text format would name such a counter `..._total`, so the families here are
built as Triton's (`family`) and printed by `exposition`, and dashboards made for Triton find
them under the names they query.

HostCollector: nv_cpu_utilization (the share of CPU time busy since the previous scrape, from
/proc/stat) and nv_cpu_memory_{total,used}_bytes (/proc/meminfo), where /proc has them.
GpuCollector: nv_gpu_* per GPU, labelled gpu_uuid, from NVML (nvidia-ml-py) where a GPU driver
is present; nothing elsewhere.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

log = logging.getLogger(__name__)

COUNTER, GAUGE = "counter", "gauge"


def family(name: str, documentation: str, kind: str) -> Metric:
    """An empty family of Triton's; `family.add_sample(name, labels, value)` fills it."""
    return Metric(name, documentation, kind)


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def exposition(collectors: Iterable[Collector]) -> bytes:
    """The Prometheus text format of the collectors' families, named and typed as they are."""
    lines = []
    for collector in collectors:
        for metric in collector.collect():
            lines.append(f"# HELP {metric.name} {_escape(metric.documentation)}\n")
            lines.append(f"# TYPE {metric.name} {metric.type}\n")
            for sample in metric.samples:
                labels = ",".join(f'{k}="{_escape(v)}"' for k, v in sample.labels.items())
                labelled = f"{sample.name}{{{labels}}}" if labels else sample.name
                lines.append(f"{labelled} {floatToGoString(sample.value)}\n")
    return "".join(lines).encode()


class HostCollector(Collector):
    """nv_cpu_utilization and nv_cpu_memory_*_bytes, as Triton reads them on Linux."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self._lock = threading.Lock()
        self._last: tuple[int, int] = (0, 0)  # (busy, total) CPU ticks at the previous scrape

    def collect(self) -> Iterator[Metric]:
        try:
            ticks = [int(t) for t in (self.proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
            memory = _meminfo(self.proc / "meminfo")
        except (OSError, ValueError, IndexError):  # no /proc here: no host metrics
            return
        total, idle = sum(ticks[:8]), ticks[3] + ticks[4]  # user .. steal; idle + iowait
        with self._lock:
            busy_before, total_before = self._last
            self._last = (total - idle, total)
        elapsed = total - total_before
        utilization = family("nv_cpu_utilization", "CPU utilization rate [0.0 - 1.0]", GAUGE)
        used_share = (total - idle - busy_before) / elapsed if elapsed > 0 else 0.0
        utilization.add_sample("nv_cpu_utilization", {}, used_share)
        yield utilization
        for kind, value in (
            ("total", memory["MemTotal"]),
            ("used", memory["MemTotal"] - memory["MemAvailable"]),
        ):
            name = f"nv_cpu_memory_{kind}_bytes"
            metric = family(name, f"CPU {kind} memory (RAM), in bytes", GAUGE)
            metric.add_sample(name, {}, value)
            yield metric


def _meminfo(path: Path) -> dict[str, int]:
    """/proc/meminfo's fields in bytes."""
    fields = {}
    for line in path.read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if parts:
            fields[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return fields


# Triton's GPU metric -> (help, type, what it reads from NVML of one device)
_GPU: dict[str, tuple[str, str, Callable[[object, object], float]]] = {
    "nv_gpu_utilization": (
        "GPU utilization rate [0.0 - 1.0)",
        GAUGE,
        lambda nvml, h: nvml.nvmlDeviceGetUtilizationRates(h).gpu / 100,
    ),
    "nv_gpu_memory_total_bytes": (
        "GPU total memory, in bytes",
        GAUGE,
        lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).total,
    ),
    "nv_gpu_memory_used_bytes": (
        "GPU used memory, in bytes",
        GAUGE,
        lambda nvml, h: nvml.nvmlDeviceGetMemoryInfo(h).used,
    ),
    "nv_gpu_power_usage": (
        "GPU power usage in watts",
        GAUGE,
        lambda nvml, h: nvml.nvmlDeviceGetPowerUsage(h) / 1000,
    ),
    "nv_gpu_power_limit": (
        "GPU power management limit in watts",
        GAUGE,
        lambda nvml, h: nvml.nvmlDeviceGetPowerManagementLimit(h) / 1000,
    ),
    "nv_energy_consumption": (
        "GPU energy consumption in joules since the driver loaded",
        COUNTER,
        lambda nvml, h: nvml.nvmlDeviceGetTotalEnergyConsumption(h) / 1000,
    ),
}


class GpuCollector(Collector):
    """Triton's nv_gpu_* metrics for every GPU NVML sees, labelled gpu_uuid; none without a
    GPU driver (or without nvidia-ml-py). A reading a GPU does not support is left out."""

    def __init__(self) -> None:
        self.nvml = _nvml()

    def collect(self) -> Iterator[Metric]:
        nvml = self.nvml
        if nvml is None:
            return
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        except nvml.NVMLError as err:
            log.warning("NVML: the GPUs cannot be listed: %s", err)
            return
        for name, (help_text, kind, read) in _GPU.items():
            metric = family(name, help_text, kind)
            for handle, uuid in zip(handles, uuids, strict=True):
                try:
                    metric.add_sample(name, {"gpu_uuid": uuid}, read(nvml, handle))
                except nvml.NVMLError:
                    continue  # not supported on this GPU
            yield metric


def _nvml() -> object | None:
    """pynvml, initialised; None where there is no GPU driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # ImportError, or NVMLError: no driver, no library
        return None
    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
