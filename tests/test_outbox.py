"""The outbox thread's backlog and faults: a step loop waits while unfiled rows fill the backlog
and gives up in time; a dead or stuck outbox thread fails the requests it holds, as the replica's
fault, and frees what it held."""

from __future__ import annotations

import threading

import numpy as np
import torch

from replicas.worker.outbox import Outbox, RequestBuffers, StepRows
from tests.arena_host import D_MODEL, HOOKS, request_plan


class SlowCopy:
    """A CUDA event whose copy ends when the test says so."""

    def __init__(self):
        self.done = threading.Event()

    def synchronize(self):
        self.done.wait()


class FailedCopy:
    """A CUDA event whose wait raises: what kills an unguarded outbox thread."""

    def synchronize(self):
        raise RuntimeError("copy failed")


def step_rows(buffers, copy, rows=10, first=0):
    data = torch.ones(len(HOOKS), rows, D_MODEL)
    buffers.n_rows = first + rows
    return StepRows("rows", data, copy, [buffers], np.array([0]), np.array([rows]), np.array([first]))


def test_the_step_loop_waits_while_the_backlog_of_unfiled_rows_is_full():
    """Rows whose copy has not finished (or not been filed) count against the backlog: a step
    that would overflow it waits for the outbox, one that fits, or the first, goes straight in."""
    outbox = Outbox(None, D_MODEL, backlog_bytes=2000)
    plan = request_plan(prompt_len=10, max_tokens=1)
    buffers = [RequestBuffers.for_plan(plan, D_MODEL, 16, None) for _ in range(3)]
    first = SlowCopy()
    outbox.put(step_rows(buffers[0], first, rows=20))  # 3 hooks x 20 rows x 8 float32: 1,920 bytes over nothing
    blocked = threading.Thread(target=outbox.put, args=(step_rows(buffers[1], None),))
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive()  # 1,920 + 960 > 2,000: waits for the first step's copy
    first.done.set()
    blocked.join(timeout=10)
    assert not blocked.is_alive()
    outbox.finish("b1", buffers[1])
    assert buffers[1].done.wait(10) and outbox.wait_seconds > 0


def test_a_dead_outbox_thread_fails_the_requests_it_holds_and_every_later_one_at_once():
    from replicas.api.errors import OUTBOX_DEAD
    outbox = Outbox(None, D_MODEL)
    plan = request_plan(prompt_len=10, max_tokens=1)
    held, later = (RequestBuffers.for_plan(plan, D_MODEL, 16, None) for _ in range(2))
    outbox.put(step_rows(held, FailedCopy()))
    outbox.finish("held", held)
    assert held.done.wait(10), "the request the dead thread held was never answered"
    assert held.result["replica_fault"] == OUTBOX_DEAD
    assert "outbox thread died (RuntimeError('copy failed'))" in held.result["error"]
    outbox.put(step_rows(later, None))  # nothing waits for a dead thread
    outbox.finish("later", later)
    assert later.done.is_set() and later.result == held.result


def test_a_stuck_outbox_fails_the_wait_and_frees_the_result_once_it_comes(tmp_path):
    """`take` gives up after the timeout; the outbox then frees the arena blocks of the result
    nobody will read."""
    from replicas.api.errors import OUTBOX_STUCK
    outbox = Outbox(str(tmp_path), D_MODEL, timeout_s=0.1)
    buffers = RequestBuffers.for_plan(request_plan(prompt_len=64, max_tokens=1), D_MODEL, 16, outbox.arena_layout)
    assert buffers.rows_per_block  # it files into the arena
    copy = SlowCopy()  # the device's write into the arena has not ended
    rows, counts, dests = torch.ones(len(HOOKS), 64, D_MODEL), np.array([64]), np.array([0])
    destinations = outbox.writer.destinations([buffers], counts, dests, len(HOOKS))
    outbox.writer.write(rows, torch.from_numpy(destinations.arena_rows()).reshape(-1), None)
    buffers.n_rows = 64
    buffers.written = copy
    outbox.finish("stuck", buffers)
    result = buffers.wait(0.1)
    assert result["replica_fault"] == OUTBOX_STUCK and "outbox_timeout_s" in result["error"]
    copy.done.set()
    assert buffers.done.wait(10)
    stats = outbox.stats()
    for _ in range(100):  # the blocks go back through the outbox's queue
        if not (stats := outbox.stats())["arena_bytes_in_use"]:
            break
        threading.Event().wait(0.05)
    assert stats["arena_bytes"] > 0 and stats["arena_bytes_in_use"] == 0


def test_a_step_loop_waiting_for_backlog_room_gives_up_and_fails_those_rows():
    from replicas.api.errors import OUTBOX_STUCK
    outbox = Outbox(None, D_MODEL, backlog_bytes=2000, timeout_s=0.1)
    plan = request_plan(prompt_len=20, max_tokens=1)
    first, second = (RequestBuffers.for_plan(plan, D_MODEL, 16, None) for _ in range(2))
    outbox.put(step_rows(first, SlowCopy(), rows=20))  # 1,920 bytes whose copy never ends
    waiting = threading.Thread(target=outbox.put, args=(step_rows(second, None),))
    waiting.start()
    waiting.join(timeout=10)
    assert not waiting.is_alive(), "the step loop waited for the outbox forever"
    assert second.replica_fault == OUTBOX_STUCK and "did not file earlier rows in time" in second.error
    assert first.error is None
