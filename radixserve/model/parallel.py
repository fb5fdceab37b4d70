"""Tensor parallelism: a replica's ranks, how a model is split among them, and the
collectives that join the pieces.

Every rank is one process holding 1/N of each layer: the query heads and their o_proj
columns, the KV heads (replicated where there are fewer KV heads than ranks), the MLP's
intermediate columns, and the vocabulary rows of the embedding and the LM head. Rank 0 runs
the scheduler; before each forward pass it broadcasts the step (`ForwardStep`: the batch and
the request→token table rows it reads) and every other rank runs the same forward on its
own slice of the KV pool. Per layer two all-reduces (after o_proj and down_proj), one for
the embedding, and a gather of the vocabulary slices of the logits onto rank 0, which alone
samples.

Process groups live on torch.distributed: gloo on CPU, NCCL on CUDA (the step channel stays
on gloo). Every collective runs under `--dist-timeout`; an idle rank 0 sends a heartbeat
(`keep_alive`) well within it, so a rank waiting for the next step tells "no work" from "rank
0 is gone". A peer that dies breaks the group at once: the error is `TensorParallelError`,
which nothing catches, so every rank's process exits.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from radixserve.model.shm_comm import SHM_DIR, ShmCommunicator, machine_id, new_segment_name

logger = logging.getLogger(__name__)

HEARTBEAT_EVERY_S = 1.0  # an idle rank 0 tells the others it is alive this often


class TensorParallelError(RuntimeError):
    """A collective failed: a rank died, hung past the timeout, or left the group."""


@dataclass(frozen=True)
class ForwardStep:
    """What rank 0 sends before each forward pass: the batch, and the request→token table
    rows it reads (B, S): the other ranks keep no allocator and no tree, only the table."""

    batch: Any  # core.batch.ForwardBatch
    table_rows: torch.Tensor


class _Heartbeat:
    """Rank 0 is alive and idle."""


class _Stop:
    """Rank 0 is shutting down: the other ranks leave their loop."""


class TensorParallel:
    """This rank's place in its replica's tensor-parallel group (`size` 1: alone, every
    collective is a no-op), and the shapes of its slice of a model."""

    def __init__(
        self,
        rank: int = 0,
        size: int = 1,
        group: Any = None,
        channel: Any = None,
        shm: ShmCommunicator | None = None,
    ) -> None:
        self.rank, self.size = rank, size
        self.group = group  # the model's collectives (gloo on CPU, NCCL on CUDA)
        self.channel = channel  # the step channel (gloo)
        self.shm = shm  # all ranks on this machine: all-reduce and gather in shared memory
        self._last_send = time.monotonic()

    @property
    def comm(self) -> str:
        """What sums the ranks' partial results: "shm", "gloo", "nccl" or "none"."""
        if self.size == 1:
            return "none"
        return "shm" if self.shm is not None else dist.get_backend(self.group)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    # -- the slice of a model -------------------------------------------------------------
    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, columns); they must divide evenly."""
        if total % self.size:
            raise ValueError(f"--tp-size {self.size} does not divide the {total} {what}")
        return total // self.size

    def kv_heads(self, total: int) -> tuple[int, int]:
        """(count, first) of the KV heads this rank holds: total / size of them, or one
        shared by size / total ranks when there are fewer KV heads than ranks."""
        if total % self.size and self.size % total:
            raise ValueError(
                f"--tp-size {self.size} neither divides nor is a multiple of the {total} KV heads"
            )
        return max(total // self.size, 1), self.rank * total // self.size

    def vocab_rows(self, vocab: int) -> int:
        """Embedding / LM head rows per rank (the last rank's tail past `vocab` is zero)."""
        return -(-vocab // self.size)

    # -- collectives ----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (every rank gets the same bits)."""
        if self.size == 1:
            return x
        if self.shm is not None and self.shm.fits(x):
            self._collective(self.shm.all_reduce, x)
        else:
            self._collective(dist.all_reduce, x, group=self.group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab: int) -> torch.Tensor:
        """Each rank's (L, rows) slice of the logits → (L, vocab) on rank 0; the other ranks
        get their own slice back (they never sample)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and self.shm.fits(x):
            out = self._collective(self.shm.gather_columns, x)
            return out[..., :vocab] if out is not None else x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.is_first else None
        self._collective(dist.gather, x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[..., :vocab] if parts is not None else x

    def broadcast_int(self, value: int) -> int:
        """Rank 0's value on every rank (e.g. the KV pool size, so all pools match)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        self._collective(dist.broadcast, t, src=0, group=self.channel)
        return int(t.item())

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's value, in rank order, on every rank."""
        if self.size == 1:
            return [value]
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._collective(dist.all_gather, parts, torch.tensor([value]), group=self.channel)
        return [int(p.item()) for p in parts]

    def send_step(self, step: ForwardStep) -> None:
        """Rank 0: the next forward pass, to every other rank."""
        self._broadcast(step)

    def keep_alive(self) -> None:
        """Rank 0, when idle: a heartbeat if nothing was sent for a while."""
        if self.size > 1 and time.monotonic() - self._last_send >= HEARTBEAT_EVERY_S:
            self._broadcast(_Heartbeat())

    def stop(self) -> None:
        """Rank 0: the other ranks leave `steps`."""
        if self.size > 1:
            self._broadcast(_Stop())

    def steps(self):
        """The other ranks: each step rank 0 sends, until it stops (heartbeats skipped)."""
        while True:
            box: list[Any] = [None]
            self._collective(dist.broadcast_object_list, box, src=0, group=self.channel)
            msg = box[0]
            if isinstance(msg, _Stop):
                return
            if isinstance(msg, ForwardStep):
                yield msg

    def _broadcast(self, msg: object) -> None:
        self._collective(dist.broadcast_object_list, [msg], src=0, group=self.channel)
        self._last_send = time.monotonic()

    def _collective(self, op, *args: Any, **kwargs: Any) -> Any:
        try:
            return op(*args, **kwargs)
        except RuntimeError as e:  # gloo / NCCL / shm: a peer died, hung, or closed its socket
            raise TensorParallelError(
                f"tensor-parallel rank {self.rank} of {self.size}: a collective failed "
                f"({_first_words(e)}); another rank died or hung"
            ) from e


SINGLE = TensorParallel()


def init_tensor_parallel(
    rank: int,
    size: int,
    addr: tuple[str, int],
    timeout_s: float,
    device: torch.device,
    comm: str = "auto",
) -> TensorParallel:
    """Join the replica's group at `addr` (rank 0 listens there) as `rank` of `size`; with
    `comm` "auto" on CPU, sum through shared memory when every rank is on this machine."""
    if size == 1:
        return SINGLE
    host, port = addr
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    start = time.perf_counter()
    try:
        dist.init_process_group(
            backend,
            init_method=f"tcp://{host}:{port}",
            rank=rank,
            world_size=size,
            timeout=timeout,
        )
        channel = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    except (RuntimeError, ValueError) as e:  # DistNetworkError / DistStoreError: timeouts
        raise TensorParallelError(
            f"tensor-parallel rank {rank} of {size} could not join the group at "
            f"{host}:{port} within {timeout_s:.0f}s: {_first_words(e)}"
        ) from e
    group = dist.group.WORLD
    tp = TensorParallel(rank, size, group, channel or group)
    if comm == "auto" and device.type == "cpu":
        tp.shm = tp._collective(_attach_shared_memory, tp, timeout_s)
    logger.info(
        "tensor-parallel rank %d of %d joined the %s group at %s:%d in %.1fs; sums via %s",
        rank, size, backend, host, port, time.perf_counter() - start, tp.comm,
    )  # fmt: skip
    return tp


def _attach_shared_memory(tp: TensorParallel, timeout_s: float) -> ShmCommunicator | None:
    """A shared-memory communicator when every rank runs on this machine, else None."""
    places: list[Any] = [None] * tp.size
    dist.all_gather_object(places, (machine_id(), os.getpid()), group=tp.channel)
    if len({machine for machine, _ in places}) > 1 or not SHM_DIR.is_dir():
        return None
    pids = [pid for _, pid in places]
    box: list[Any] = [None]
    shm = None
    if tp.is_first:
        box = [new_segment_name()]
        shm = ShmCommunicator(box[0], 0, tp.size, pids, timeout_s)
    dist.broadcast_object_list(box, src=0, group=tp.channel)
    if shm is None:
        shm = ShmCommunicator(box[0], tp.rank, tp.size, pids, timeout_s)
    dist.barrier(group=tp.channel)  # every rank attached: the name can go
    shm.unlink()
    return shm


def leave_tensor_parallel(tp: TensorParallel) -> None:
    if tp.shm is not None:
        tp.shm.close()
        tp.shm = None
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_words(error: BaseException) -> str:
    """The gist of a gloo / store error: its first line, without the source location in
    brackets and the boilerplate that follows the first sentence."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0][:300]
