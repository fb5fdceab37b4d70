"""The model runner: owns the model, the KV pool, the request→token table and the slot
allocator, and runs one forward pass over a `ForwardBatch`.

The scheduler reaches the model only through `ModelRunner.forward`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from radixserve.cache import KVPool, ReqToTokenPool, SlotAllocator
from radixserve.cache.swa_pool import HybridSlotAllocator, swa_pool_size
from radixserve.config import Config, parse_host_port
from radixserve.core.batch import ForwardBatch
from radixserve.hardware import (
    CODED_LUT_MARGIN,
    CODED_LUT_SAMPLE_ROWS,
    KernelPlan,
    chunk_default,
    cpu_info,
    keep_freed_memory,
    place_process,
    resolve_device_and_dtype,
    resolve_kv_dtype,
)
from radixserve.lora.adapter import LoraAdapter, LoraError, ModelShape
from radixserve.lora.state import LoraState
from radixserve.model.attention import DeviceDecodeKernel, TorchNativeAttention
from radixserve.model.base import CausalLM, LastRows, head_dim_of
from radixserve.model.cpu_kernels import (
    CodedAmxLinear,
    CodedLinear,
    CodedPrefill,
    LutSample,
    blocked_linear,
    coded_amx_linear,
    coded_linear,
    fused_ops,
    gemm_small_kernel,
    gemv_kernel,
    kernels_building,
    measure_coded_lut,
    plan_kernels,
)
from radixserve.model.cuda_graph import DecodeGraphs
from radixserve.model.decode_layers import DecodeLayers, decode_layers_library
from radixserve.model.layers import Linear, PackedRows, RotaryEmbedding, RowKernels, product_shape
from radixserve.model.loader import (
    CheckpointTensor,
    MemoryTensor,
    ModelLoadError,
    checkpoint_shapes,
    iter_checkpoint,
    read_architecture,
    resolve_model_folder,
    with_overrides,
)
from radixserve.model.parallel import (
    SINGLE,
    ForwardStep,
    TensorParallel,
    TensorParallelError,
    init_tensor_parallel,
    leave_tensor_parallel,
)
from radixserve.model.quantization import (
    DEQUANT_MIN_ROWS,
    check_int8_supported,
    quantize_model_int8,
)
from radixserve.model.registry import MODEL_CLASSES

if TYPE_CHECKING:
    from radixserve.core.output import ModelInfo

logger = logging.getLogger(__name__)

DEFAULT_CPU_MEM_FRACTION = 0.25
DEFAULT_CUDA_MEM_FRACTION = 0.85


# what a checkpoint must share with the loaded model to replace its weights
SAME_SHAPE_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
)


@dataclass
class ForwardOutput:
    logits: torch.Tensor  # (L, vocab) fp32, rows in the order of batch.logits_indices
    # (E, hidden) fp32 final-norm hidden states, rows in the order of batch.hidden_indices;
    # None when the batch asks for none
    hidden: torch.Tensor | None = None


class ModelRunner:
    """`tp_rank`: this process's rank in its replica's tensor-parallel group
    (`--tp-size` ranks meeting at `--dist-init-addr`); rank 0 serves the scheduler, the
    others call `follow`."""

    def __init__(self, config: Config, progress: bool = True, tp_rank: int = 0) -> None:
        self.config = config
        self.device, self.dtype = resolve_device_and_dtype(config.model)
        if self.device.type == "cpu":
            keep_freed_memory()  # activations reuse the heap's pages (hardware.MALLOC)
        parallel = config.parallel
        if self.device.type == "cuda" and parallel.tp_size > 1:
            gpus = torch.cuda.device_count()
            if parallel.ranks_per_node > gpus:  # NCCL takes one GPU per rank
                raise ValueError(
                    f"--tp-size {parallel.tp_size} puts {parallel.ranks_per_node} ranks on "
                    f"this machine, which has {gpus} GPUs (one per rank)"
                )
            self.device = torch.device("cuda", tp_rank % parallel.ranks_per_node)
        self.tp = SINGLE
        if parallel.tp_size > 1:
            if parallel.dist_init_addr is None:
                raise ValueError("--tp-size > 1 needs the ranks' --dist-init-addr")
            addr = parse_host_port(parallel.dist_init_addr)
            self.tp = init_tensor_parallel(
                tp_rank, parallel.tp_size, addr, parallel.dist_timeout, self.device,
                parallel.tp_comm,
            )  # fmt: skip
        self.kv_dtype = resolve_kv_dtype(config.cache, self.dtype)
        self.kernels = KernelPlan.choose(
            config.model.kernels, self.device, self.dtype, self.kv_dtype
        )
        if self.device.type == "cpu":
            logger.info("%s", cpu_info().summary())
        if config.model.quantization == "int8":
            check_int8_supported(self.device, self.dtype)
        start = time.perf_counter()
        self.model_folder = resolve_model_folder(
            config.model.model_path, config.model.cache_dir, progress=progress
        )
        # a first start compiles the plan's kernels side by side while the model loads
        builds = plan_kernels(self.kernels, self.dtype, config.model.quantization)
        with kernels_building(builds, config.model.cache_dir / "kernels"):
            self._load(config, start)

    def _load(self, config: Config, start: float) -> None:
        """The model from its folder, its KV memory and its adapters (after the plan is
        chosen; `start`: when loading began, for the log)."""
        self.hf_config, self.tokenizer = load_config_and_tokenizer(self.model_folder)
        self.architecture = read_architecture(self.model_folder)  # (the folder may go)
        self.context_len = self._context_length(config.model.context_length)  # (before load)
        # what a weight update from tensors may replace (by the checkpoint's names), and
        # the tensors given since the checkpoint was read: the model is built again from
        # both, so that an update of some tensors keeps what earlier ones gave
        self.checkpoint_shapes = checkpoint_shapes(self.model_folder)
        self.weight_overrides: dict[str, torch.Tensor] = {}
        self.model = build_model(
            self.model_folder,
            self.hf_config,
            self.dtype,
            self.device,
            config.model.quantization,
            config.model.cache_dir,
            self.kernels,
            self.tp,
        )
        self.weight_bytes = self.tp.gather_ints(model_bytes(self.model))
        self.tp_pids = self.tp.gather_ints(os.getpid())
        if self.tp.size > 1 and self.tp.is_first:
            mib = ", ".join(f"{b / 2**20:.1f}" for b in self.weight_bytes)
            logger.info("tensor parallel over %d ranks: weights per rank %s MiB", self.tp.size, mib)
        self.vocab_size = int(self.hf_config.vocab_size)

        self.swa_window = self._hybrid_swa_window()
        self.max_total_tokens = self.tp.broadcast_int(self._kv_pool_size())  # pools match
        self.swa_tokens = self._swa_pool_size()
        self._build_kv_memory(config)
        self.decode_graphs = self._decode_graphs(config, self.model)
        # LoRA adapters by uid, and the rows of the step in flight that use them
        self.lora = LoraState() if config.lora.enabled else None
        if self.lora is not None:
            self.model.use_lora(self.lora)
            for uid, (name, path) in enumerate(config.lora.adapters, start=1):  # as the
                self.load_lora(uid, name, path)  # edge numbers them (lora/registry.py)
        # a step's last layer runs past its K/V for the logits rows alone
        # (ForwardBatch.logits_rows); off: every row (benchmarks/last_layer_rows.py)
        self.narrow_last_layer = True
        logger.info(
            "loaded %s (%s) on %s/%s in %.1fs; KV pool holds %d tokens in %s; kernels %s",
            self.model_folder,
            type(self.model).__name__,
            self.device,
            self.dtype,
            time.perf_counter() - start,
            self.max_total_tokens,
            self.kv_dtype,
            self.kernels,
        )

    def _build_kv_memory(self, config: Config) -> None:
        """The KV pool, its slot allocator, the request→token table and the attention
        backend reading them."""
        head_dim = head_dim_of(self.hf_config)
        windows = self.model.attention_windows
        window_layers = [i for i, w in enumerate(windows) if w] if self.swa_window else []
        self.kv_pool = KVPool(
            self.max_total_tokens,
            self.hf_config.num_hidden_layers,
            self.kv_heads,
            head_dim,
            self.kv_dtype,
            self.device,
            # the scheduler loop maps the pool's pages while idle; the other tensor-parallel
            # ranks have no loop of their own, so theirs are mapped as first written
            prefault=config.cache.kv_prefault and self.tp.is_first,
            window_layers=window_layers,
            window_slots=self.swa_tokens,
        )
        self.allocator: SlotAllocator | HybridSlotAllocator
        if self.swa_window:
            self.allocator = HybridSlotAllocator(
                self.max_total_tokens, self.swa_tokens, self.swa_window, self.device
            )
        else:
            self.allocator = SlotAllocator(self.max_total_tokens, self.device)
        # +1 row: the request being prefilled in chunks is not yet among the running ones
        running = config.scheduler.running_limit(self.max_total_tokens)
        self.req_to_token = ReqToTokenPool(running + 1, self.context_len, self.device)
        self.attention = TorchNativeAttention(
            self.kv_pool,
            self.req_to_token,
            self.model.attention_scale,
            self.tp.split(self.hf_config.num_attention_heads, "attention heads"),
            use_kernel=self.kernels.decode_attention,
            kernel_isa=self.kernels.decode_attention_isa,
            use_extend_kernel=self.kernels.extend_attention,
            kernel_dir=config.model.cache_dir / "kernels",
            windows=windows,
            window_map=self.allocator.full_to_swa if self.swa_window else None,
            device_kernel=device_decode_kernel(self.device),
        )

    def _decode_graphs(self, config: Config, model: CausalLM) -> DecodeGraphs | None:
        """On CUDA, decode steps captured in CUDA graphs (cuda_graph.py), unless turned off
        or the step is one they do not take (then it runs eagerly, said in the log)."""
        if self.device.type != "cuda" or config.model.disable_cuda_graph:
            return None
        why_not = None
        if self.attention.decode_kernel is None:
            why_not = "no decode kernel reads the lengths on the device (Triton missing?)"
        elif self.attention.window_map is not None:
            why_not = "hybrid sliding-window memory (--disable-hybrid-swa-memory lifts it)"
        elif self.tp.size > 1:
            why_not = "tensor parallelism"
        if why_not is not None:
            logger.info("decode steps run eagerly, without CUDA graphs: %s", why_not)
            return None
        running = config.scheduler.running_limit(self.max_total_tokens)
        max_batch = min(config.model.cuda_graph_max_bs or running, running)
        return DecodeGraphs(model, self.attention, max_batch)

    def update_weights(self, model_path: str) -> Path:
        """Serve the weights of `model_path` (a folder or .gguf of the same architecture and
        shapes: a later checkpoint of the model, as an RL trainer writes them) in place of
        the loaded ones; the tokenizer and the KV memory stay. Built beside the old model
        (room for a second copy of the weights is needed meanwhile) and swapped in only once
        complete, CUDA graphs included, so a failure changes nothing. Returns the folder
        read."""
        if self.tp.size > 1:
            raise ModelLoadError("updating weights is not supported under tensor parallelism")
        folder = resolve_model_folder(model_path, self.config.model.cache_dir, progress=False)
        hf_config, _ = load_config_and_tokenizer(folder)
        differences = [
            f"{key} {getattr(hf_config, key, None)} (loaded: {getattr(self.hf_config, key, None)})"
            for key in SAME_SHAPE_KEYS
            if getattr(hf_config, key, None) != getattr(self.hf_config, key, None)
        ]
        if read_architecture(folder) != self.architecture:
            differences.insert(0, f"architecture {read_architecture(folder)}")
        model_class = MODEL_CLASSES[self.architecture]
        span = model_class.attention_span(hf_config)  # (one shorter than the served context
        # would be exceeded by full attention)
        if span is not None and span < self.context_len:
            differences.append(f"a sliding window of {span} (served context: {self.context_len})")
        if differences:
            raise ModelLoadError(
                f"{folder} is not the loaded model's shape: {', '.join(differences)}"
            )
        shapes = checkpoint_shapes(folder)
        self._swap_in(self._build(folder, hf_config))
        self.model_folder, self.hf_config = folder, hf_config
        self.checkpoint_shapes, self.weight_overrides = shapes, {}
        return folder

    def update_weights_from_tensors(self, named: Sequence[tuple[str, torch.Tensor]]) -> int:
        """Serve the loaded checkpoint with these tensors (by the checkpoint's names, as
        Hugging Face writes them: `model.layers.0.self_attn.q_proj.weight`) in place of
        its own, and of those earlier updates gave: SGLang's update_weights_from_tensor, for
        a trainer in the same process. The model is built again (beside the old one, as
        `update_weights` does), so every kernel choice follows the new values; the tensors
        given are kept (a copy on the CPU) for later updates of some of them. Where they
        cover every tensor, the checkpoint is not read, and may be gone. Returns how many
        tensors were given."""
        if self.tp.size > 1:
            raise ModelLoadError("updating weights is not supported under tensor parallelism")
        given = self._checked_tensors(named)
        overrides = {**self.weight_overrides, **given}
        weights = with_overrides(self.model_folder, self.checkpoint_shapes, overrides)
        self._swap_in(self._build(self.model_folder, self.hf_config, weights))
        self.weight_overrides = overrides
        return len(given)

    def _checked_tensors(
        self, named: Sequence[tuple[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The tensors by name, copied to the CPU; ModelLoadError naming the first that is
        not one of the checkpoint's, or not its shape."""
        given: dict[str, torch.Tensor] = {}
        for name, tensor in named:
            shape = self.checkpoint_shapes.get(name)
            if shape is None:
                example = next(iter(self.checkpoint_shapes))
                raise ModelLoadError(
                    f"{name!r} is not a tensor of the loaded checkpoint (its names are as "
                    f"Hugging Face writes them, e.g. {example!r})"
                )
            if name == "lm_head.weight" and self.model.tie_word_embeddings:
                raise ModelLoadError(
                    f"{name!r}: the head is tied to model.embed_tokens.weight; update that"
                )
            if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
                raise ModelLoadError(f"{name!r}: a floating-point torch.Tensor is needed")
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(
                    f"{name!r} has shape {tuple(tensor.shape)}, the checkpoint's is {shape}"
                )
            given[name] = tensor.detach().to("cpu", copy=True)
        return given

    def _build(
        self,
        folder: Path,
        hf_config: PretrainedConfig,
        weights: Iterable[tuple[str, CheckpointTensor | MemoryTensor]] | None = None,
    ) -> CausalLM:
        """A model of the loaded one's architecture and settings, with these weights."""
        start = time.perf_counter()
        model = build_model(
            folder,
            hf_config,
            self.dtype,
            self.device,
            self.config.model.quantization,
            self.config.model.cache_dir,
            self.kernels,
            self.tp,
            weights,
            self.architecture,
        )
        # what the attention backend took from the loaded model must hold for this one
        if (model.attention_scale, model.attention_windows) != (
            self.model.attention_scale,
            self.model.attention_windows,
        ):
            raise ModelLoadError(f"{folder}: its attention scale or windows differ")
        logger.info("new weights built in %.1fs", time.perf_counter() - start)
        return model

    def _swap_in(self, model: CausalLM) -> None:
        """Serve `model` from the next step on, its CUDA graphs built first (a failure
        leaves the loaded model in place)."""
        graphs = None if self.decode_graphs is None else self._decode_graphs(self.config, model)
        if self.lora is not None:
            model.use_lora(self.lora)
        self.model, self.decode_graphs = model, graphs

    def load_lora(self, uid: int, name: str, path: str) -> LoraAdapter:
        """Read the adapter in PEFT folder `path` for requests naming `uid` (LoraError
        says why one cannot be served on this model)."""
        self.check_lora_room()
        adapter = self.read_lora(name, path)
        self.add_lora(uid, adapter)
        return adapter

    def check_lora_room(self, pending: int = 0) -> None:
        """LoraError where no other adapter may be loaded (`pending`: loads under way)."""
        if self.lora is None:
            raise LoraError("LoRA adapters are not served: start with --enable-lora")
        limit = self.config.lora.max_loaded_loras
        if limit is not None and len(self.lora.adapters) + pending >= limit:
            raise LoraError(
                f"{limit} adapters are loaded already (--max-loaded-loras); unload one first"
            )

    def read_lora(self, name: str, path: str) -> LoraAdapter:
        """The adapter in PEFT folder `path`, laid out for this model in host memory
        (LoraError says why it cannot be served here). It changes nothing and touches no
        accelerator: it may run on another thread (`add_lora` moves it to the device)."""
        attn, mlp = self.model.layers[0].self_attn, self.model.layers[0].mlp
        shape = ModelShape.of(
            hidden=int(self.hf_config.hidden_size),
            q_size=attn.num_heads * attn.head_dim,
            kv_size=attn.num_kv_heads * attn.head_dim,
            intermediate=mlp.intermediate,
            layers=len(self.model.layers),
        )
        adapter = LoraAdapter.load(name, path, shape, self.dtype, "cpu")
        limits = self.config.lora
        if limits.max_lora_rank is not None and adapter.rank > limits.max_lora_rank:
            raise LoraError(
                f"{adapter.path}: rank {adapter.rank} is above --max-lora-rank "
                f"{limits.max_lora_rank}"
            )
        others = sorted(set(adapter.modules) - limits.modules)
        if others:
            raise LoraError(
                f"{adapter.path} trains {', '.join(others)}, outside --lora-target-modules "
                f"({', '.join(sorted(limits.modules))})"
            )
        return adapter

    def add_lora(self, uid: int, adapter: LoraAdapter) -> None:
        """Serve `adapter` to requests naming `uid` from the next step on."""
        assert self.lora is not None
        if self.device.type != "cpu":  # on this thread: a CUDA graph capture may be under way
            adapter = adapter.to(self.device)
        self.lora.drop(uid)  # (uids are not reused; were one, nothing of the old one stays)
        self.lora.adapters[uid] = adapter
        logger.info(
            "loaded LoRA adapter %s from %s: rank %d on %s (%.1f MiB)",
            adapter.name, adapter.path, adapter.rank, ", ".join(adapter.modules),
            adapter.nbytes / 2**20,
        )  # fmt: skip

    def unload_lora(self, uid: int) -> None:
        if self.lora is not None:
            self.lora.drop(uid)

    def model_info(self) -> ModelInfo:
        """The loaded model and the limits derived from it (sent to every process)."""
        from radixserve.core.output import ModelInfo  # msgspec: not needed below this call

        return ModelInfo(
            model_path=str(self.model_folder),
            max_total_num_tokens=self.max_total_tokens,
            max_running_requests=self.config.scheduler.running_limit(self.max_total_tokens),
            chunked_prefill_size=self.config.scheduler.chunk_size(chunk_default(self.device)) or 0,
            context_length=self.context_len,
            vocab_size=self.vocab_size,
            dtype=str(self.dtype).removeprefix("torch."),
            kv_cache_dtype=str(self.kv_dtype).removeprefix("torch."),
            kv_pool_bytes=self.kv_pool.nbytes,
            hidden_size=int(self.hf_config.hidden_size),
            kernel_plan=asdict(self.kernels),
            cpu=cpu_info().as_dict(),
            tp_size=self.tp.size,
            weight_bytes=self.weight_bytes,
            tp_pids=self.tp_pids,
        )

    @property
    def kv_heads(self) -> int:
        """KV heads of this rank's pool (all of them without tensor parallelism)."""
        return self.tp.kv_heads(self.hf_config.num_key_value_heads)[0]

    @property
    def eos_token_ids(self) -> set[int]:
        """End-of-sequence ids from the model config and the tokenizer."""
        ids: set[int] = set()
        for source in (self.hf_config.eos_token_id, self.tokenizer.eos_token_id):
            if source is not None:
                ids.update(source if isinstance(source, list) else [source])
        return ids

    def forward(self, batch: ForwardBatch) -> ForwardOutput:
        """One forward pass over `batch` (on every tensor-parallel rank: rank 0 sends it)."""
        if self.tp.size > 1:
            rows = self.req_to_token.table[batch.req_rows, : max(batch.seq_lens)]
            self.tp.send_step(ForwardStep(batch, rows))
        return self._forward(batch)

    def follow(self) -> None:
        """A tensor-parallel rank other than 0: run each step rank 0 sends, until it stops
        (a dead or silent rank 0 raises TensorParallelError)."""
        assert not self.tp.is_first
        width = self.req_to_token.table.shape[1]
        for step in self.tp.steps():
            rows = step.table_rows
            if rows.shape[1] > width:
                raise TensorParallelError(f"a step reads {rows.shape[1]} positions of {width}")
            self.req_to_token.table[step.batch.req_rows, : rows.shape[1]] = rows
            self._forward(step.batch)

    def keep_alive(self) -> None:
        """The scheduler is idle: rank 0 tells the other ranks it is still there."""
        self.tp.keep_alive()

    def close(self) -> None:
        """Rank 0 is done: the other ranks leave `follow`, and the group is left."""
        if self.tp.size > 1:
            if self.tp.is_first:
                try:
                    self.tp.stop()
                except TensorParallelError:  # they are gone already (the server stopping)
                    logger.debug("the other tensor-parallel ranks have left")
            leave_tensor_parallel(self.tp)

    @torch.inference_mode()
    def _forward(self, batch: ForwardBatch) -> ForwardOutput:
        if batch.uses_lora:  # the rows' adapters, for this step alone
            if self.lora is None:
                raise LoraError("a step names LoRA adapters, which are not served here")
            self.lora.begin(batch.lora_ids, batch.extend_lens, self.dtype)
            try:
                return self._run(batch, narrow=False)  # every row of the last layer too
            finally:
                self.lora.end()
        graphs = self.decode_graphs
        if graphs is not None and graphs.can_run(batch):
            return ForwardOutput(graphs.run(batch))
        return self._run(batch, self.narrow_last_layer)

    def _run(self, batch: ForwardBatch, narrow: bool) -> ForwardOutput:
        if self.kv_pool.mapping:  # the pages this step writes K/V to, mapped first
            self.kv_pool.map_for_slots(batch.out_slots)
        meta = self.attention.prepare(batch)
        model = self.model
        narrowed = batch.logits_rows() if narrow else None
        last = None
        if narrowed is not None:  # the last layer past its K/V: these rows alone
            last = LastRows(
                batch.logits_indices, narrowed.positions, self.attention.prepare(narrowed)
            )
        x = model.hidden_states(batch.input_ids, batch.positions, self.attention, meta, last)
        if batch.logits_indices.numel():
            rows = x if last is not None else x[batch.logits_indices]
            logits = model.compute_logits(model.norm(rows))
        else:  # only embedding rows: the LM head is not run at all
            logits = x.new_empty((0, self.vocab_size), dtype=torch.float32)
        hidden = None
        if batch.hidden_indices is not None and batch.hidden_indices.numel():
            hidden = model.norm(x[batch.hidden_indices]).float()
        return ForwardOutput(logits, hidden)

    def _context_length(self, wanted: int | None) -> int:
        """--context-length, within the model's own context (max_position_embeddings, its
        rotary tables' length, or a shorter attention span its class bounds it to: a
        sliding window it serves as full attention), which is the default."""
        own = int(self.hf_config.max_position_embeddings)
        why = "max_position_embeddings, which its rotary tables are built for"
        span = MODEL_CLASSES[self.architecture].attention_span(self.hf_config)
        if span is not None and span < own:
            own, why = span, "its sliding window, served as full attention within it"
            logger.info("context bounded to the model's sliding window: %d tokens", span)
        if wanted is not None and wanted > own:
            raise ModelLoadError(
                f"--context-length {wanted} is longer than the model's own context ({own} "
                f"tokens, {why})"
            )
        return wanted or own

    def _hybrid_swa_window(self) -> int:
        """The sliding window whose layers get their own, smaller KV pool (swa_pool.py), or
        0 where every layer keeps K/V for every token: no window layers, one of the flags
        that turn it off, the hierarchical cache (its tiers copy every layer by full slot),
        or several different windows."""
        windows = set(self.model.attention_windows) - {0}
        if (
            len(windows) != 1
            or self.config.cache.disable_hybrid_swa_memory
            or self.config.hicache.enable_hierarchical_cache
            or self.tp.size > 1  # the other ranks would need the window slot map each step
        ):
            return 0
        return windows.pop()

    def _swa_pool_size(self) -> int:
        """Tokens of the window layers' pool (`swa_pool_size`), logged; 0 without hybrid
        window memory."""
        if not self.swa_window:
            return 0
        ratio = self.config.cache.swa_full_tokens_ratio
        size = swa_pool_size(self.max_total_tokens, self.swa_window, ratio)
        layers = sum(1 for w in self.model.attention_windows if w)
        logger.info(
            "hybrid sliding-window memory: %d full-attention layers hold %d tokens, "
            "%d window layers (window %d) hold %d tokens",
            len(self.model.attention_windows) - layers,
            self.max_total_tokens,
            layers,
            self.swa_window,
            size,
        )
        return size

    def _kv_pool_size(self) -> int:
        """KV tokens of the full-attention layers: --max-total-tokens if given, else what
        the memory fraction leaves after the weights (with hybrid sliding-window memory a
        token costs its full layers plus the ratio's share of its window layers)."""
        cache = self.config.cache
        if cache.max_total_tokens is not None:
            return cache.max_total_tokens
        num_layers = self.hf_config.num_hidden_layers
        if self.swa_window:
            window_layers = sum(1 for w in self.model.attention_windows if w)
            num_layers += (cache.swa_full_tokens_ratio - 1) * window_layers
        per_token = KVPool.bytes_per_token(
            num_layers, self.kv_heads, head_dim_of(self.hf_config), self.kv_dtype
        )
        if self.device.type == "cuda":
            fraction = cache.mem_fraction_static or DEFAULT_CUDA_MEM_FRACTION
            _, total = torch.cuda.mem_get_info(self.device)
            used = torch.cuda.memory_allocated(self.device)
        else:
            fraction = cache.mem_fraction_static or DEFAULT_CPU_MEM_FRACTION
            # the tensor-parallel ranks of one machine share its memory
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            total //= self.config.parallel.ranks_per_node
            used = model_bytes(self.model)
        budget = int(total * fraction) - used
        tokens = budget // per_token
        if tokens < 1:
            raise ValueError(
                f"mem_fraction_static={fraction} leaves no memory for the KV cache after the "
                f"weights ({used / 2**30:.2f} GiB of {total / 2**30:.2f} GiB); raise it or "
                "set --max-total-tokens"
            )
        return int(tokens)


def device_decode_kernel(device: torch.device) -> DeviceDecodeKernel | None:
    """On CUDA, the Triton decode-attention kernel (triton_attention.py), where Triton is
    installed (it comes with torch's CUDA builds); None elsewhere."""
    if device.type != "cuda":
        return None
    try:
        from radixserve.model.triton_attention import TritonDecodeKernel
    except ImportError:
        logger.warning(
            "Triton is not installed: decode attention on CUDA gathers K/V for SDPA, and "
            "decode steps are not captured in CUDA graphs"
        )
        return None
    return TritonDecodeKernel()


def load_config_and_tokenizer(folder: Path) -> tuple[PretrainedConfig, PreTrainedTokenizerBase]:
    read_architecture(folder)  # a clear error for unsupported models before anything else
    try:
        hf_config = AutoConfig.from_pretrained(folder)
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the config or tokenizer of {folder}: {e}") from e
    if getattr(hf_config, "use_sliding_window", False):
        raise ModelLoadError(f"{folder}: sliding-window attention is not supported yet")
    return hf_config, tokenizer


def build_model(
    folder: Path,
    hf_config: PretrainedConfig,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str = "none",
    cache_dir: Path | None = None,
    kernels: KernelPlan | None = None,
    tp: TensorParallel = SINGLE,
    weights: Iterable[tuple[str, CheckpointTensor | MemoryTensor]] | None = None,
    architecture: str | None = None,
) -> CausalLM:
    """The model with its weights loaded, on `device` in `dtype`; with quantization "int8"
    its linear layers are then replaced by int8 ones; where the kernel plan says so, the
    weights are pre-blocked for oneDNN (AVX-512 CPUs), and single rows (or a few) not
    packed go to the project's row kernels (kernels cached under `cache_dir`). Under tensor
    parallelism (`tp`), this rank's slice of the model, and only that is read. The weights
    are the folder's checkpoint unless `weights` gives them (and `architecture`, the
    folder's, where it may be gone)."""
    cls = MODEL_CLASSES[architecture or read_architecture(folder)]
    try:
        with torch.device("meta"):
            model = cls(hf_config, max_positions=hf_config.max_position_embeddings, tp=tp)
    except ValueError as e:  # a variant of the architecture this class does not run
        raise ModelLoadError(f"{folder}: {e}") from e
    model = model.to_empty(device="cpu")
    for module in model.modules():  # to_empty leaves buffers uninitialised
        if isinstance(module, RotaryEmbedding):
            module.reset_tables()
    try:
        model.load_weights(iter_checkpoint(folder) if weights is None else weights)
    except (KeyError, ValueError) as e:
        raise ModelLoadError(f"weights in {folder} do not fit {cls.__name__}: {e}") from e
    model = model.to(device=device, dtype=dtype).eval()
    kernel_dir = cache_dir / "kernels" if cache_dir else None
    if quantization == "int8":
        rows = kernels.int8_dequant_min_rows if kernels is not None else DEQUANT_MIN_ROWS
        quantize_model_int8(model, kernel_dir, rows)
    elif kernels is not None:
        if kernels.blocked_rows:
            blocked = blocked_linear(dtype, kernel_dir, kernels.blocked_isa)
            if blocked is not None:
                # a weight whose products the kernel gives as torch's F.linear does takes
                # every product, prefills too: the same bits, faster (hardware.FP32_LINEAR)
                rows = PackedRows(1, kernels.blocked_rows)
                exact = PackedRows(1, kernels.blocked_exact_rows)
                forms = ("q4_1", "q8_0") if kernels.coded_linear else ()
                isa = kernels.blocked_isa
                coded = tuple(
                    c for f in forms if (c := coded_linear(kernel_dir, f, isa)) is not None
                )
                found = model.use_blocked_linears(blocked, rows, exact, coded)
                prefill, shapes = coded_prefill_kernel(model, kernels, coded, kernel_dir)
                if prefill is not None:
                    model.use_coded_prefill_linears(*prefill, found, shapes)
                linears = [m for m in model.modules() if isinstance(m, Linear)]
                if coded:
                    readers = [m.blocked for m in linears] + [model.lm_blocked]
                    logger.info(
                        "fp32 weights that are GGUF codes dequantized, read as their codes: "
                        "%s of %d products",
                        ", ".join(f"{sum(r is c for r in readers)} {c.form}" for c in coded),
                        len(readers),
                    )  # fmt: skip
                if prefill is not None:
                    logger.info(
                        "fp32 products of %d rows or more over the weights' codes %s: %d "
                        "linear layers",
                        prefill[1].first,
                        "on AMX's tiles (x in three exact bf16 parts)"
                        if isinstance(prefill[0], CodedAmxLinear)
                        else "by tables of subset sums",
                        sum(m.coded_prefill is prefill[0] for m in linears),
                    )  # fmt: skip
                if blocked.reproduces_torch:
                    logger.info(
                        "%s linear layers whose products the blocked kernel gives bit for bit "
                        "as torch's (sums in chunks of %d columns) take it at %s",
                        blocked.dtype, blocked.chunk,
                        "every row count" if exact.last is None else f"up to {exact.last} rows",
                    )  # fmt: skip
        if kernels.packed_rows is not None:
            model.pack_linears(PackedRows(*kernels.packed_rows))
        if kernels.gemv or kernels.few_rows_max:  # the row counts packing leaves to them
            gemv = gemv_kernel(kernel_dir) if kernels.gemv else None
            few = gemm_small_kernel(kernel_dir) if kernels.few_rows_max else None
            rows = kernels.few_rows_max if few is not None else 0
            model.use_row_kernels(RowKernels(gemv, few, rows))
    fused = None
    if kernels is not None and kernels.fused_elementwise:
        fused = fused_ops(kernel_dir, kernels.fused_elementwise) or fused_ops(kernel_dir)
    if fused is not None:
        model.use_fused_ops(fused)
    if kernels is not None and kernels.decode_layers and DecodeLayers.takes(model, fused):
        library = decode_layers_library(kernel_dir)
        if library is not None:
            model.decode_layers = DecodeLayers(library, model, fused)
    return model


def coded_prefill_kernel(
    model: CausalLM,
    kernels: KernelPlan,
    coded: tuple[CodedLinear, ...],
    kernel_dir: Path | None,
) -> tuple[tuple[CodedPrefill, PackedRows] | None, frozenset[tuple[int, int]] | None]:
    """The kernel (and the rows it takes) for fp32 products of many rows over the weights'
    codes, and the product shapes of the model's linear units it takes (None: all; see
    `CausalLM.linear_units`): AMX's where the plan has it, else the lookup kernel where the
    plan has it and it measures faster here than what makes those products otherwise (the
    layers as they are: the blocked kernel where it takes every row count, else MKL), on
    the shapes where it does (q, k and v measured as the one product they make;
    hardware.CODED_LUT); (None, None) where neither. After `use_blocked_linears`."""
    if kernels.coded_amx_rows:
        amx = coded_amx_linear(kernel_dir)
        return ((amx, PackedRows(kernels.coded_amx_rows, None)) if amx else None), None
    q4 = next((c for c in coded if c.form == "q4_1"), None)
    if not kernels.coded_lut_rows or q4 is None:
        return None, None
    samples: dict[tuple[int, int], LutSample] = {}
    rows = torch.empty(CODED_LUT_SAMPLE_ROWS, 0, device="meta")
    otherwise = set()  # what makes the sampled products now, for the log
    for unit in model.linear_units():  # a unit of several linears (q, k, v) as one product
        shape = product_shape(unit)
        if shape in samples:
            samples[shape] = dataclasses.replace(samples[shape], count=samples[shape].count + 1)
            continue
        founds = [q4.find(m.weight) for m in unit]
        if all(found is not None for found in founds):
            weight = torch.cat([m.weight.detach() for m in unit])
            codes = tuple(torch.cat(parts) for parts in zip(*founds))
            samples[shape] = LutSample(weight, codes, 1, functools.partial(unit_products, unit))
            otherwise.add("the blocked kernel" if unit[0].uses_blocked(rows) else "MKL")
    if not samples:
        return None, None
    start = time.perf_counter()
    with torch.inference_mode():
        choice = measure_coded_lut(samples, CODED_LUT_SAMPLE_ROWS, CODED_LUT_MARGIN, kernel_dir)
    if choice is None:
        return None, None
    logger.info(
        "fp32 products by tables of subset sums (%d rows a vector, chunks of %d groups) "
        "against %s at %d rows, measured in %.2f s: %s; taken where %.2fx or more",
        choice.kernel.lanes, choice.kernel.chunk, " and ".join(sorted(otherwise)),
        CODED_LUT_SAMPLE_ROWS, time.perf_counter() - start,
        ", ".join(f"{n}x{k} {speedup:.2f}x" for (n, k), speedup in choice.speedups.items()),
        CODED_LUT_MARGIN,
    )  # fmt: skip
    if not choice.shapes:
        return None, None
    return (choice.kernel, PackedRows(kernels.coded_lut_rows, None)), choice.shapes


def unit_products(unit: tuple[Linear, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """Each layer's product of x, one by one, as the layers make them."""
    return [linear(x) for linear in unit]


def model_bytes(model: CausalLM) -> int:
    """Bytes of the model's weights (int8 weights are buffers)."""
    tensors = (*model.parameters(), *model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def run_follower(
    config: Config,
    tp_rank: int,
    on_loaded: Callable[[], None] | None = None,
    dp_rank: int = 0,
) -> None:
    """A tensor-parallel rank other than 0: load this rank's slice (then `on_loaded`), then
    run every step rank 0 sends until it stops (the process's whole life; errors
    propagate)."""
    parallel = config.parallel
    local = dp_rank * parallel.ranks_per_node + tp_rank % parallel.ranks_per_node
    logger.info("tensor-parallel rank %d: %s", tp_rank, place_process(parallel, local))
    runner = ModelRunner(config, progress=False, tp_rank=tp_rank)
    if on_loaded is not None:
        on_loaded()
    try:
        runner.follow()
    finally:
        runner.close()
