"""Decode steps replayed from CUDA graphs.

A decode step of a small model on a GPU is bound by launching its kernels, not by running
them: SmolLM2-135M's eager step launches ~15 kernels a layer, 30 layers, from Python (the
first H200 check, benchmarks/gpu/: batch 1 decoded at 46.7 tok/s, 21 ms a step). A CUDA
graph records one step's kernels once and replays them with one launch.

A graph replays fixed shapes and fixed addresses, so the step reads its inputs from static
buffers, written before each replay: token ids, positions, the new tokens' slots, the
requests' table rows and sequence lengths. Attention is the decode kernel that reads the
lengths on the device (triton_attention.py), so one graph serves every length. A graph is
captured per batch size in `GRAPH_BATCH_SIZES` up to the largest running batch; a step of B
requests replays the smallest graph of at least B rows, its extra rows padding: they read
one key of table row 0 (whatever it holds; their results are dropped) and write their K/V
into the pool's padding slot, which the step zeroes again at its end (kv_pool.py: that slot
stays zero).

With `capture=False` the same static-buffer step runs eagerly (no graph); the tests use it
on CPU to check the padding and the buffers against the runner's own decode step.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from radixserve.cache.allocator import PADDING_SLOT
from radixserve.core.batch import ForwardBatch, ForwardMode
from radixserve.model.attention import AttentionGroup, TorchNativeAttention, TorchNativeMetadata
from radixserve.model.base import CausalLM

logger = logging.getLogger(__name__)

# Batch sizes a graph is captured for (those up to the largest running batch, and that):
# every size up to 8 rows, then steps of 8 to 64, of 16 to 128, of 32 beyond (SGLang's
# list has the same shape). A step pads to the next one.
GRAPH_BATCH_SIZES = (
    1, 2, 3, 4, 5, 6, 7, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256,
)  # fmt: skip


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The sizes to capture for steps of up to `max_batch` requests."""
    if max_batch < 1:
        raise ValueError(f"the largest graph batch must be >= 1, got {max_batch}")
    return sorted({s for s in GRAPH_BATCH_SIZES if s < max_batch} | {max_batch})


class DecodeGraphs:
    """One decode step per batch size, captured (or, without `capture`, run eagerly from
    the same static buffers)."""

    def __init__(
        self,
        model: CausalLM,
        attention: TorchNativeAttention,
        max_batch: int,
        capture: bool = True,
    ) -> None:
        if attention.decode_kernel is None or attention.window_map is not None:
            raise ValueError(
                "decode graphs need the decode kernel and no hybrid window memory (its "
                "window tables are built on the host each step)"
            )
        self.model = model
        self.attention = attention
        self.kv_pool = attention.kv_pool  # the pool the graphs write and read
        self.sizes = graph_batch_sizes(max_batch)
        device = self.kv_pool.k[0].device
        rows = self.sizes[-1]
        # (5, rows) int64: token ids, positions, slots, table rows, sequence lengths
        self.inputs = torch.zeros(5, rows, dtype=torch.int64, device=device)
        self.input_ids, self.positions, self.out_slots, self.req_rows, self.seq_lens = self.inputs
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output, (size, vocab) fp32
        self.capture_seconds = 0.0
        if capture:
            self._capture()

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def can_run(self, batch: ForwardBatch) -> bool:
        """A plain decode step (one token a request, a logit row each, nothing being loaded
        back into the pool, no hidden states asked for) of at most `max_batch` requests."""
        return (
            batch.mode is ForwardMode.DECODE
            and 0 < batch.batch_size <= self.max_batch
            and batch.input_ids.numel() == batch.batch_size
            and batch.logits_indices.numel() == batch.batch_size
            and not batch.kv_loads
            and (batch.hidden_indices is None or batch.hidden_indices.numel() == 0)
        )

    def run(self, batch: ForwardBatch) -> torch.Tensor:  # (B, vocab) fp32
        """The step's logits, rows in the order of `batch.logits_indices`."""
        bs = batch.batch_size
        size = next(s for s in self.sizes if s >= bs)
        self._load(batch, size)
        if self.graphs:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            logits = self._step(size)
        return logits[batch.logits_indices]  # a copy: the next replay overwrites the output

    def _load(self, batch: ForwardBatch, size: int) -> None:
        """The batch into the static buffers' first rows, padding rows after it up to
        `size`."""
        bs = batch.batch_size
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_slots[:bs].copy_(batch.out_slots)
        self.req_rows[:bs].copy_(batch.req_rows)
        self.seq_lens[:bs].copy_(torch.tensor(batch.seq_lens, dtype=torch.int64))
        self._pad(bs, size)

    def _step(self, size: int) -> torch.Tensor:
        """The decode step over the buffers' first `size` rows: what `ModelRunner._forward`
        does for a decode batch with the decode kernel, reading only static buffers."""
        group = AttentionGroup(
            None, None, None, False, None, 1, self.req_rows[:size], self.seq_lens[:size]
        )
        meta = TorchNativeMetadata(self.out_slots[:size], [group])
        for window in {w for w in self.attention.windows if w}:  # the kernel skips the rest
            meta.window_groups[window] = [dataclasses.replace(group, window=window)]
        model = self.model
        x = model.hidden_states(self.input_ids[:size], self.positions[:size], self.attention, meta)
        logits = model.compute_logits(model.norm(x))
        self.kv_pool.clear_padding_slot()  # the padding rows wrote their K/V there
        return logits

    @torch.inference_mode()
    def _capture(self) -> None:
        """Every size's graph, the largest first, all in one memory pool (one step runs at
        a time, so they can share it)."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        for size in reversed(self.sizes):
            self._pad(0, size)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles the kernels, lets cuBLAS pick its own
                for _ in range(2):
                    self._step(size)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._step(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - start
        logger.info(
            "captured %d CUDA graphs of decode steps (batch sizes %s) in %.1fs",
            len(self.sizes),
            ", ".join(map(str, self.sizes)),
            self.capture_seconds,
        )

    def _pad(self, start: int, end: int) -> None:
        """Rows start..end-1 padding rows: token 0 at position 0 into the padding slot, one
        key of table row 0 (the warm-up and capture steps run on padding rows alone)."""
        if end > start:
            self.inputs[:, start:end] = 0
            self.out_slots[start:end] = PADDING_SLOT
            self.seq_lens[start:end] = 1
