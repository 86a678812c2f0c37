"""service/engine/host_memory.py: rows in a registered range are pinned without asking CUDA; any
other memory is asked about; a refused or removed registration pins nothing."""

from __future__ import annotations

import pytest
import torch

from moe_serve.service.engine import host_memory


class FakeCudart:
    def __init__(self, error: int) -> None:
        self.error = error
        self.calls: list[tuple] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address, size, flags))
        return self.error

    def cudaHostUnregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch):
    def with_error(error: int) -> FakeCudart:
        fake = FakeCudart(error)
        monkeypatch.setattr(host_memory.torch.cuda, "cudart", lambda: fake)
        return fake

    monkeypatch.setattr(host_memory, "_registered", ())
    return with_error


def test_rows_inside_a_registered_range_are_pinned_without_asking(cudart, monkeypatch) -> None:
    fake = cudart(0)
    arena = torch.zeros(1024, dtype=torch.uint8)
    address = arena.data_ptr()
    assert host_memory.register(address, 1024)
    assert fake.calls == [("register", address, 1024, 1)]

    def asked(_: torch.Tensor) -> bool:
        raise AssertionError("CUDA was asked about rows in a registered range")

    rows = arena[256:768].view(torch.bfloat16).view(16, 16)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_pinned", asked)
        assert host_memory.is_pinned(rows)
        assert host_memory.is_pinned(arena)
    elsewhere = torch.zeros(16, 16, dtype=torch.bfloat16)
    assert not host_memory.is_pinned(elsewhere)  # asked: a CPU tensor of its own


def test_rows_reaching_past_a_range_are_asked_about(cudart) -> None:
    cudart(0)
    memory = torch.zeros(1024, dtype=torch.uint8)
    assert host_memory.register(memory.data_ptr(), 512)
    assert not host_memory.is_pinned(memory[256:768])


def test_a_refused_or_removed_registration_pins_nothing(cudart) -> None:
    arena = torch.zeros(1024, dtype=torch.uint8)
    cudart(1)
    assert not host_memory.register(arena.data_ptr(), 1024)
    assert not host_memory.is_pinned(arena)
    fake = cudart(0)
    assert host_memory.register(arena.data_ptr(), 1024)
    host_memory.unregister(arena.data_ptr())
    assert fake.calls[-1] == ("unregister", arena.data_ptr())
    assert not host_memory.is_pinned(arena)
