"""The shared-memory all-reduce and gather of tensor-parallel ranks on one machine
(model/shm_comm.py), driven by two threads standing in for two ranks: sums and gathers are
exact and the same on both sides, tensors larger than a buffer row go in pieces, and a peer
that is gone or late raises instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from radixserve.model import shm_comm
from radixserve.model.shm_comm import ShmCommunicator, ShmError, new_segment_name

pytestmark = pytest.mark.skipif(not shm_comm.SHM_DIR.is_dir(), reason="no /dev/shm")


def pair(timeout_s: float = 10.0) -> tuple[ShmCommunicator, ShmCommunicator]:
    name = new_segment_name()
    pids = [os.getpid(), os.getpid()]
    first = ShmCommunicator(name, 0, 2, pids, timeout_s)
    second = ShmCommunicator(name, 1, 2, pids, timeout_s)
    first.unlink()
    assert not (shm_comm.SHM_DIR / name).exists()  # nothing is left behind in /dev/shm
    return first, second


def both(op, a, b, xs):
    """op(a, xs[0]) and op(b, xs[1]) at once; their results."""
    out = [None, None]

    def run(i, comm):
        out[i] = op(comm, xs[i])

    thread = threading.Thread(target=run, args=(1, b))
    thread.start()
    run(0, a)
    thread.join(30)
    return out


@pytest.mark.parametrize("row_bytes", [shm_comm.ROW_BYTES, 4096])  # 4096: in pieces
def test_all_reduce_and_gather_are_exact(monkeypatch, row_bytes):
    monkeypatch.setattr(shm_comm, "ROW_BYTES", row_bytes)
    a, b = pair()
    g = torch.Generator().manual_seed(0)
    for shape in [(1, 576), (16, 576), (300, 7)]:
        xs = [torch.randn(shape, generator=g) for _ in range(2)]
        expected = xs[0] + xs[1]
        sums = both(lambda c, x: c.all_reduce(x.clone()), a, b, xs)
        assert torch.equal(sums[0], expected) and torch.equal(sums[1], expected)
        gathered = both(lambda c, x: c.gather_columns(x), a, b, xs)
        assert torch.equal(gathered[0], torch.cat(xs, dim=1)) and gathered[1] is None
    a.close()
    b.close()


def test_a_gone_peer_raises():
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    name = new_segment_name()
    comm = ShmCommunicator(name, 0, 2, [os.getpid(), exited.pid], timeout_s=30)
    comm.unlink()
    start = time.monotonic()
    with pytest.raises(ShmError, match=f"pid {exited.pid}"):
        comm.all_reduce(torch.ones(4))
    assert time.monotonic() - start < 5


def test_a_late_peer_times_out():
    name = new_segment_name()
    comm = ShmCommunicator(name, 0, 2, [os.getpid(), os.getpid()], timeout_s=0.3)
    comm.unlink()
    with pytest.raises(ShmError, match="did not arrive within"):
        comm.all_reduce(torch.ones(4))
