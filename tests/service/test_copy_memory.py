"""Copy memory: blocks lent to requests and kept for the next ones, given back explicitly or
once the last view of a block lent as a view is gone (service/engine/copy_memory.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import torch

from moe_serve.service.engine.copy_memory import MIN_BLOCK_BYTES, CopyMemory, Loan
from moe_serve.service.http import forward_body
from tests.service.layers import TINY, H, reference_forward
from tests.service.test_freed_on_failure import collector_off
from tests.service.test_grpc_limits import serving

WAIT_S = 10.0  # bound on the wait for a block to come back


def given_back(memory: CopyMemory, idle_bytes: int) -> bool:
    """Whether `memory` holds `idle_bytes` idle within WAIT_S."""
    deadline = time.monotonic() + WAIT_S
    while memory.idle_bytes != idle_bytes and time.monotonic() < deadline:
        time.sleep(0.001)
    return memory.idle_bytes == idle_bytes


def _memory(loan: Loan) -> torch.Tensor:
    """A loan's bytes (uint8)."""
    return loan.view(torch.uint8, (loan.nbytes,))


def test_copy_memory_is_reused_and_what_it_keeps_idle_is_bounded() -> None:
    """A block given back serves the next request of about its size (no allocation, no page
    faults); blocks given back past `max_idle_bytes` are let go."""
    memory = CopyMemory(max_idle_bytes=2 * MIN_BLOCK_BYTES)
    first = memory.lend(1000, pinned=False)
    address = _memory(first).data_ptr()
    first.release()
    again = memory.lend(MIN_BLOCK_BYTES, pinned=False)
    assert _memory(again).data_ptr() == address and _memory(again).numel() == MIN_BLOCK_BYTES
    larger = memory.lend(MIN_BLOCK_BYTES + 1, pinned=False)  # the next power of two
    assert _memory(larger).numel() == MIN_BLOCK_BYTES + 1
    loans = [again, larger, memory.lend(10, pinned=False)]
    for loan in loans:
        loan.release()
    assert memory.idle_bytes == 2 * MIN_BLOCK_BYTES  # the larger block was let go
    assert _memory(memory.lend(10, pinned=False)).data_ptr() in (
        address,
        _memory(loans[2]).data_ptr(),
    )


def test_a_block_of_copy_memory_keeps_the_tensors_made_over_it_for_its_next_loans() -> None:
    """The next request of a shape gets the tensors the last one of it had; a loan's bytes are
    its block's first `nbytes`, however it is viewed."""
    memory = CopyMemory(max_idle_bytes=4 * MIN_BLOCK_BYTES)
    first = memory.lend(48, pinned=False)
    rows = first.view(torch.float32, (3, 4))
    rows.copy_(torch.arange(12.0).view(3, 4))
    assert _memory(first).data_ptr() == rows.data_ptr() and _memory(first).numel() == 48
    assert bytes(first.raw) == _memory(first).numpy().tobytes() == rows.numpy().tobytes()
    first.release()
    again = memory.lend(48, pinned=False)
    assert again.view(torch.float32, [3, 4]) is rows  # the same tensor, shape as a list too
    assert _memory(again) is _memory(first)
    assert again.view(torch.int32, (12,)).data_ptr() == rows.data_ptr()
    assert memory.lend(48, pinned=False).view(torch.float32, (3, 4)) is not rows  # another block
    assert again.block.view(4, torch.float32, []).shape == ()  # a scalar
    smaller = again.block.view(8, torch.uint8, (8,))
    assert smaller.numel() == 8 and smaller.data_ptr() == rows.data_ptr()


def test_a_block_lent_as_a_view_comes_back_once_its_last_slice_is_gone() -> None:
    memory = CopyMemory(max_idle_bytes=4 * MIN_BLOCK_BYTES)
    view = memory.lend_view(1000, pinned=False)
    body, reply = view[:400], view[400:]
    del view
    body[:3] = b"abc"
    del body
    assert memory.idle_bytes == 0  # the reply still holds the block
    address = torch.frombuffer(reply, dtype=torch.uint8).data_ptr() - 400
    del reply
    assert memory.idle_bytes == MIN_BLOCK_BYTES
    again = memory.lend_view(MIN_BLOCK_BYTES, pinned=False)
    assert torch.frombuffer(again, dtype=torch.uint8).data_ptr() == address
    assert memory.idle_bytes == 0


def test_a_block_let_go_on_another_thread_comes_back_whole() -> None:
    memory = CopyMemory(max_idle_bytes=64 * MIN_BLOCK_BYTES)
    views = [memory.lend_view(MIN_BLOCK_BYTES, pinned=False) for _ in range(32)]
    threads = [threading.Thread(target=views.pop) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    views.clear()
    assert memory.idle_bytes == 32 * MIN_BLOCK_BYTES
    lent = {id(memory.lend(MIN_BLOCK_BYTES, pinned=False).block) for _ in range(32)}
    assert len(lent) == 32 and memory.idle_bytes == 0


def test_one_process_forward_bodies_are_read_into_copy_memory_and_given_back() -> None:
    """A JSON body large enough to leave the event loop is read into a block of copy memory,
    which is back once the reply is sent, with no collection: the next bodies reuse it."""
    rows = (forward_body.JSON.on_loop_bytes // (H * 12)) + 1
    x = torch.randn(rows, H)
    body = json.dumps({"hidden_states": x.tolist()}).encode()
    assert len(body) > forward_body.JSON.on_loop_bytes
    with serving() as s, collector_off(), httpx.Client(base_url=s.url) as http:
        memory = s.runtime.shared_memory.copy_memory
        assert memory.idle_bytes == 0
        for _ in range(3):
            r = http.post(
                f"/v1/layers/{TINY}/forward",
                content=body,
                headers={"content-type": "application/json"},
            )
            assert r.status_code == 200, r.text
            torch.testing.assert_close(
                torch.tensor(r.json()["output"]), reference_forward(TINY, x), rtol=1e-5, atol=1e-5
            )
            block = 1 << (len(body) - 1).bit_length()
            # one block, given back once the reply is sent (the server may still be sending it
            # as the client reads its last bytes) and lent again
            assert given_back(memory, block), memory.idle_bytes
