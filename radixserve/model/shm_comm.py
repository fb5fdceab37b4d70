"""All-reduce and gather through shared memory, for tensor-parallel ranks on one machine.

gloo's TCP all-reduce costs ~1.1 ms for a (1, 576) fp32 tensor between two processes on
this project's 2-core machines (measured: `radixserve bench tp`), and a decode step of
SmolLM2 makes 61 of them; vLLM's and SGLang's CPU backends replace it by a shared-memory
one for the same reason. Here each rank copies its tensor into its own row of a shared
buffer, raises its flag to the call's generation, waits for every other flag, and sums the
rows in rank order (so every rank gets the same bits). Two buffers alternate: a rank can
only write generation g + 2 after every rank raised g + 1, i.e. finished reading g.

A rank waiting for its peers spins (each rank has its own cores), yields after a while, and
checks every 0.1 s that its peers still live and that `timeout_s` has not passed: a dead or
stuck peer raises `TensorParallelError`, as a broken gloo group does. Tensors larger than a
row go in pieces of a row.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from pathlib import Path

import numpy as np
import torch

SHM_DIR = Path("/dev/shm")
FLAG_STRIDE = 8  # int64 flags one cache line (64 bytes) apart: no false sharing
ROW_BYTES = 4 << 20  # each rank's row of a buffer: a (1820, 576) fp32 tensor fits
SPIN_POLLS = 2000  # polls before the waiting rank starts yielding its core
CHECK_EVERY_S = 0.1  # how often a waiting rank checks its peers' liveness and the timeout


class ShmError(RuntimeError):
    """A peer died or did not arrive in time."""


def machine_id() -> str:
    """Host name and boot id: ranks with the same one share /dev/shm."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{os.uname().nodename}/{boot}"


def new_segment_name() -> str:
    return f"radixserve-tp-{secrets.token_hex(8)}"


class ShmCommunicator:
    """One machine's ranks `0..size-1` over the segment `name` (rank 0 creates it, the
    others attach; `unlink` once all are attached, so nothing is left behind)."""

    def __init__(self, name: str, rank: int, size: int, pids: list[int], timeout_s: float) -> None:
        self.rank, self.size, self.pids, self.timeout_s = rank, size, pids, timeout_s
        flags_bytes = size * FLAG_STRIDE * 8
        total = flags_bytes + 2 * size * ROW_BYTES
        self.path = SHM_DIR / name
        if rank == 0:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            os.ftruncate(fd, total)
        else:
            fd = os.open(self.path, os.O_RDWR)
        try:
            self.segment = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        buf = self.segment
        self.flags = np.frombuffer(buf, dtype=np.int64, count=size * FLAG_STRIDE)[::FLAG_STRIDE]
        self.flags[rank] = 0
        data = torch.frombuffer(
            buf, dtype=torch.uint8, offset=flags_bytes, count=total - flags_bytes
        )
        # (buffer, rank) → that rank's row of bytes in that buffer
        self._rows = [list(buffer) for buffer in data.view(2, size, ROW_BYTES)]
        self.generation = 0

    def unlink(self) -> None:
        """Remove the segment's name (every rank has attached); the memory stays mapped."""
        if self.rank == 0:
            self.path.unlink(missing_ok=True)

    def fits(self, x: torch.Tensor) -> bool:
        """A CPU tensor whose rows fit a buffer row (larger tensors go in pieces)."""
        row = x.shape[-1] * x.element_size() if x.dim() else 0
        return x.device.type == "cpu" and x.is_contiguous() and row <= ROW_BYTES

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place; every rank adds the rows in rank order. A
        tensor larger than a buffer row goes in row-sized pieces."""
        flat = x.view(-1)
        step = ROW_BYTES // x.element_size()
        pieces = [flat] if flat.numel() <= step else flat.split(step)
        for piece in pieces:
            rows = self._exchange(piece)
            torch.add(rows[0], rows[1], out=piece)
            for row in rows[2:]:
                piece.add_(row)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x (L, N), all of one shape, side by side on rank 0: (L, size * N)
        in rank order; None on the others. More rows than a buffer row holds go in pieces."""
        rows_per = max(ROW_BYTES // (x.shape[-1] * x.element_size()), 1)
        width = x.shape[-1]
        out = x.new_empty(x.shape[0], self.size * width) if self.rank == 0 else None
        for start in range(0, x.shape[0], rows_per):
            part = x[start : start + rows_per]
            rows = self._exchange(part)
            if out is not None:
                for r, row in enumerate(rows):
                    block = out[start : start + part.shape[0], r * width : (r + 1) * width]
                    block.copy_(part if r == self.rank else row.view(part.shape))
        return out

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Write x into this rank's row, wait for every rank's; their rows, as x's dtype."""
        self.generation += 1
        g = self.generation
        nbytes = x.numel() * x.element_size()
        rows = self._rows[g % 2]
        rows[self.rank][:nbytes].copy_(x.view(-1).view(torch.uint8))
        self.flags[self.rank] = g
        self._wait(g)
        return [row[:nbytes].view(x.dtype) for row in rows]

    def _wait(self, g: int) -> None:
        flags = self.flags
        polls = 0
        next_check = 0.0
        start = 0.0
        while flags.min() < g:
            polls += 1
            if polls < SPIN_POLLS:
                continue
            os.sched_yield()
            now = time.monotonic()
            if not start:
                start = now
                next_check = now + CHECK_EVERY_S
            elif now >= next_check:
                next_check = now + CHECK_EVERY_S
                self._check_peers(g, now - start)

    def _check_peers(self, g: int, waited_s: float) -> None:
        for rank, pid in enumerate(self.pids):
            if self.flags[rank] < g and _process_gone(pid):
                raise ShmError(f"rank {rank} (pid {pid}) is gone")
        if waited_s > self.timeout_s:
            late = [r for r in range(self.size) if self.flags[r] < g]
            raise ShmError(f"ranks {late} did not arrive within {self.timeout_s:.0f}s")

    def close(self) -> None:
        self._rows = []  # the buffer's exports must be released before the segment closes
        self.flags = None
        try:
            self.segment.close()
        except BufferError:  # a tensor view still alive: the mapping goes with the process
            pass


def _process_gone(pid: int) -> bool:
    """The process exited (a zombie not yet reaped counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True
