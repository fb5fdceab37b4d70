"""The in-process Engine API: the same scheduler as the server, driven by a background
thread, for offline batch work and tests.

    with radixserve.Engine() as engine:              # None = the default model
        out = engine.generate("The capital of France is", {"max_new_tokens": 16})

Calls from many threads (or `async_generate` from asyncio) are batched together: every
request goes to one scheduler thread, which runs continuous batching over all of them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve import __version__
from radixserve.chat_roles import ChatRoles, derive_chat_roles
from radixserve.config import Config, free_loopback_addr
from radixserve.core.embedding import EmbedParams
from radixserve.core.errors import DuplicateRid, rejection
from radixserve.core.messages import (
    PAUSE_MODES,
    AbortReq,
    ControlOp,
    ControlReply,
    ControlReq,
    GenerateReq,
    LoraUpdate,
    Message,
    PauseMode,
    Rejected,
    SchedulerState,
)
from radixserve.core.output import ReqOutput, SchedulerStats
from radixserve.core.reasoning import give_think_blocks
from radixserve.core.req import Req, draw_seed, seed_draws
from radixserve.hardware import place_process
from radixserve.label_scores import plan_label_scoring
from radixserve.lora import registry as lora_registry
from radixserve.lora.registry import LoraRegistry
from radixserve.model.runner import ModelRunner, run_follower
from radixserve.native import expand_embedding, expand_request, given_rids, named_by
from radixserve.output import RequestState
from radixserve.scheduler.loop import SchedulerLoop
from radixserve.scheduler.scheduler import Scheduler
from radixserve.scoring import check_fits, plan_scoring, token_texts
from radixserve.tokenizer import read_chat_template

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

Sink = Callable[[ReqOutput | BaseException], None]


class EngineDeadError(RuntimeError):
    """The scheduler thread failed; the engine cannot serve more requests."""


@dataclass
class _Waiter:
    sink: Sink
    accepted: bool = False
    names: frozenset[str] = frozenset()  # the rids the caller gave its call


class InProcessTransport:
    """The scheduler loop's transport on the Engine's thread: an inbox queue in, and for
    each request a sink (a callback) that hands its outputs to the caller waiting for it.

    One waiter per rid: a request given the rid of one still waiting or running is refused
    here (DuplicateRid, as the loop would refuse it), so that the loop's answers — accepted
    or refused, on arrival or once its grammar has compiled — and its outputs each concern
    the one request of their rid.
    """

    def __init__(self) -> None:
        self.inbox: queue.SimpleQueue[Message | None] = queue.SimpleQueue()
        self.waiters: dict[str, _Waiter] = {}
        self.controls: dict[int, Future] = {}
        self.stopped = False
        self.closed: BaseException | None = None  # set once the loop has ended
        self._lock = threading.Lock()
        self._call_ids = iter(range(1 << 62))

    # -- the Engine's side ----------------------------------------------------------------
    def submit(self, msg: GenerateReq, sink: Sink, names: frozenset[str] = frozenset()) -> None:
        with self._lock:
            self._check_open()
            duplicate = msg.rid in self.waiters
            if not duplicate:
                self.waiters[msg.rid] = _Waiter(sink, names=names)
        if duplicate:
            sink(DuplicateRid.of(msg.rid))
        else:
            self.inbox.put(msg)

    def named(self, rid: str) -> list[str]:
        """The running sequences the caller named `rid`: that rid's, or every one of the
        call it gave that rid (`{rid}_{i}`)."""
        with self._lock:
            return [seq for seq, w in self.waiters.items() if named_by(seq, rid, w.names)]

    def control(self, op: ControlOp, args: dict[str, Any] | None = None) -> Future:
        future: Future = Future()
        with self._lock:
            self._check_open()
            call_id = next(self._call_ids)
            self.controls[call_id] = future
        self.inbox.put(ControlReq(call_id, op, args or {}))
        return future

    def _check_open(self) -> None:
        """Under the lock: nothing is taken once the loop is stopping or has ended (what is
        taken before either is answered by the loop or by `fail_all`)."""
        if self.closed is not None or self.stopped:
            raise EngineDeadError(f"the engine is not running: {self.closed or 'shut down'}")

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
        self.inbox.put(None)  # wakes a waiting `receive`

    def fail_all(self, error: BaseException) -> None:
        """Every waiter and every pending call ends with `error` (nobody hangs), and no
        later one is taken."""
        with self._lock:
            self.closed = error
            waiters = list(self.waiters.values())
            controls = list(self.controls.values())
            self.waiters.clear()
            self.controls.clear()
        for waiter in waiters:
            waiter.sink(error)
        for future in controls:
            future.set_exception(error)

    # -- the loop's side ------------------------------------------------------------------
    def receive(self, timeout_s: float) -> list[Message]:
        messages: list[Message | None] = []
        try:
            messages.append(self.inbox.get(timeout=timeout_s) if timeout_s > 0 else None)
        except queue.Empty:
            pass
        while True:
            try:
                messages.append(self.inbox.get_nowait())
            except queue.Empty:
                return [m for m in messages if m is not None]

    def send_outputs(self, outputs: list[ReqOutput]) -> None:
        for out in outputs:
            with self._lock:
                waiter = self.waiters.get(out.rid)
                if waiter is not None and not waiter.accepted:
                    waiter = None
                if waiter is not None and out.finished:
                    del self.waiters[out.rid]
            if waiter is not None:
                waiter.sink(out)

    def accepted(self, msg: GenerateReq) -> None:
        with self._lock:
            waiter = self.waiters.get(msg.rid)
            if waiter is not None:
                waiter.accepted = True

    def reply(self, msg: Rejected | ControlReply | SchedulerState) -> None:
        if isinstance(msg, Rejected):
            with self._lock:
                waiter = self.waiters.get(msg.rid)
                if waiter is not None and not waiter.accepted:
                    del self.waiters[msg.rid]
                else:
                    waiter = None
            if waiter is not None:
                waiter.sink(rejection(msg.kind, msg.message, msg.param))
        elif isinstance(msg, ControlReply):
            with self._lock:
                future = self.controls.pop(msg.call_id, None)
            if future is None:
                return
            if msg.error is not None:
                future.set_exception(AssertionError(msg.error))
            elif msg.refused is not None:
                future.set_exception(ValueError(msg.refused))
            else:
                future.set_result(msg.update or msg.lora or msg.result)

    def alive(self) -> bool:
        return not self.stopped


class Engine:
    def __init__(self, model_path: str | None = None, progress: bool = True, **config: Any):
        self.config = Config.from_flat(model_path=model_path, **config)
        if self.config.server.random_seed is not None:
            seed_draws(self.config.server.random_seed)
        template = self.config.server.chat_template  # in place of the model's (chat_roles):
        self._chat_template = None if template is None else read_chat_template(template)
        self.loras = LoraRegistry(self.config.lora)  # the adapters' names (lora_path)
        self._lora_lock = threading.Lock()  # (all read before any process starts)
        self._transport = InProcessTransport()
        self._followers = self._start_tp_followers()
        self._error: BaseException | None = None
        # The model is loaded on the scheduler thread, which then runs every forward: torch's
        # OpenMP runtime (libgomp) gives each thread that runs parallel work its own team,
        # and with two teams on the machine's cores it stops spinning between parallel
        # regions; a decode step then costs up to 2x (measured on 2 cores: 38 vs 72 ms).
        # So the caller's thread does no torch work of ours.
        built: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._run, args=(progress, built), name="radixserve-scheduler", daemon=True
        )
        self._thread.start()
        try:
            built.result()  # re-raises a load error here, in the caller's thread
        except BaseException:
            self._stop_followers()
            raise

    def _start_tp_followers(self) -> list[multiprocessing.process.BaseProcess]:
        """With --tp-size N, ranks 1..N-1 as processes of their own (this thread is rank 0);
        they meet at --dist-init-addr, by default a free loopback port."""
        parallel = self.config.parallel
        if parallel.tp_size == 1:
            return []
        if parallel.nnodes > 1:
            raise ValueError("the in-process Engine runs on one machine: use --nnodes 1")
        if parallel.dist_init_addr is None:
            parallel = dataclasses.replace(parallel, dist_init_addr=free_loopback_addr())
            self.config = dataclasses.replace(self.config, parallel=parallel)
        spawn = multiprocessing.get_context("spawn")
        followers = []
        for rank in range(1, parallel.tp_size):
            process = spawn.Process(
                target=run_follower,
                args=(self.config, rank),
                name=f"radixserve-tp{rank}",
                daemon=True,
            )
            process.start()
            followers.append(process)
        return followers

    def _stop_followers(self) -> None:
        """Wait for the tensor-parallel ranks to leave (rank 0 told them), else stop them."""
        for process in self._followers:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)

    def _build(self, progress: bool) -> None:
        parallel = self.config.parallel
        if parallel.tp_size > 1 or parallel.cpu_threads:  # each rank its share of the cores
            logger.info("scheduler thread: %s", place_process(parallel, 0))
        self.runner = ModelRunner(self.config, progress=progress)
        self.tokenizer = self.runner.tokenizer
        if self._chat_template is not None:
            self.tokenizer.chat_template = self._chat_template
        self._chat_roles: ChatRoles | None = derive_chat_roles(self.tokenizer)
        self.scheduler = Scheduler.from_config(self.runner, self.config)
        self._loop = SchedulerLoop(
            self.scheduler,
            self._transport,
            self.config.server.max_queued_requests,
            decode_log_interval=self.config.server.decode_log_interval,
        )

    # -- public API -----------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        require_reasoning: bool = False,
        lora_path: str | list[str | None] | None = None,
        return_hidden_states: bool | list[bool] = False,
    ) -> dict | list[dict] | Iterator[dict]:
        """Native-API generation: one prompt gives a dict, a list gives a list (n > 1 gives
        n results per prompt); `stream=True` gives an iterator of cumulative results.
        `lora_path`: the name of a loaded LoRA adapter to run with, or one per prompt.
        `return_hidden_states` (an Engine made with enable_return_hidden_states=True): the
        final-norm hidden states in meta_info, as /generate's."""
        reqs, states, single = self._make_requests(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            rid,
            priority,
            stream,
            token_ids_logprob,
            require_reasoning,
            lora_path,
            return_hidden_states,
        )
        queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in reqs]
        for req, q in zip(reqs, queues):
            self._submit(req, q.put, rid=rid)
        if stream:
            return self._stream(states[0], queues[0])
        results = [self._collect(state, q) for state, q in zip(states, queues)]
        return results[0] if single else results

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool = False,
        stream: bool = False,
        rid: str | list[str] | None = None,
        priority: int | None = None,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        require_reasoning: bool = False,
        lora_path: str | list[str | None] | None = None,
        return_hidden_states: bool | list[bool] = False,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """`generate` for asyncio: awaitable result, or an async iterator when streaming."""
        reqs, states, single = self._make_requests(
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            return_text_in_logprobs,
            rid,
            priority,
            stream,
            token_ids_logprob,
            require_reasoning,
            lora_path,
            return_hidden_states,
        )
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue] = [asyncio.Queue() for _ in reqs]
        for req, q in zip(reqs, queues):
            self._submit(
                req, lambda item, q=q: loop.call_soon_threadsafe(q.put_nowait, item), rid=rid
            )
        if stream:
            return self._astream(states[0], queues[0])
        results = [await self._acollect(state, q) for state, q in zip(states, queues)]
        return results[0] if single else results

    def score_continuations(
        self,
        prompt: str | None = None,
        continuations: Sequence[str] = (),
        input_ids: list[int] | None = None,
        unconditional: bool = False,
        rid: str | None = None,
        lora_path: str | None = None,
    ) -> dict[str, Any]:
        """Each continuation's token logprobs after the prefix (`prompt` or `input_ids`),
        token healing included, from one batch of prefill-only requests: the answer of
        `POST /score_continuations` (see radixserve/scoring.py); `lora_path`: the name of
        a loaded LoRA adapter to score with. A ValueError (native.InvalidRequest, its
        `param` naming the field) for an invalid call."""
        lora_id = self.loras.uid(lora_path)
        plan = plan_scoring(self.tokenizer, continuations, prompt, input_ids, unconditional)
        info = self.scheduler.info
        field = "input_ids" if input_ids is not None else "text"
        check_fits(plan, info.vocab_size, info.max_seq_len, field)
        results = self._run_all(plan.requests(rid, lora_id))
        return plan.response(results, token_texts(self.tokenizer))

    def score(
        self,
        query: str | list[int] | None = None,
        items: str | list[str] | list[list[int]] | None = None,
        label_token_ids: list[int] | None = None,
        apply_softmax: bool = False,
        item_first: bool = False,
        lora_path: str | None = None,
    ) -> list[list[float]]:
        """SGLang's `Engine.score`: for each item, the probability of each label token being
        the next after query + item (item + query with `item_first`), over the vocabulary
        or, with `apply_softmax`, over the labels (see radixserve/label_scores.py); the
        answer of `POST /v1/score`. A ValueError (native.InvalidRequest) names the field."""
        lora_id = self.loras.uid(lora_path)
        info = self.scheduler.info
        plan = plan_label_scoring(
            self.tokenizer.encode, query, items, label_token_ids, apply_softmax, item_first,
            info.vocab_size, info.max_seq_len,
        )  # fmt: skip
        return plan.scores(self._run_all(plan.requests(lora_id=lora_id)))

    def encode(
        self,
        prompt: str | list[str] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        pooling: str | None = None,
        normalize: bool | None = None,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]]:
        """Embeddings of a prompt (a dict) or a batch (a list), as `POST /encode` answers:
        `{"embedding": [...], "meta_info": {...}}` each. The final-norm hidden states are
        pooled (`pooling` "last" or "mean") and L2-normalized unless `normalize` is False;
        both default to the config (--embedding-pooling, --embedding-normalize). The
        requests share the scheduler and the prefix cache with generation; `lora_path`
        names a LoRA adapter to run with, as `generate`'s."""
        embed = EmbedParams(
            pooling or self.config.embedding.embedding_pooling,  # type: ignore[arg-type]
            self.config.embedding.embedding_normalize if normalize is None else normalize,
        )
        lora_ids = self.loras.uids(lora_path)
        expanded = expand_embedding(
            self.tokenizer.encode, prompt, input_ids, embed, rid, lora_ids=lora_ids
        )
        results = self._run_all(expanded.reqs)
        return results[0] if expanded.single else results

    def chat_roles(self) -> dict[str, Any] | None:
        """The chat template's role markers (radixserve/chat_roles.py), as
        `/get_model_info` reports them; None without a template they can be read from."""
        return self._chat_roles.as_dict() if self._chat_roles is not None else None

    def abort(self, rid: str | None = None) -> None:
        """Abort a request by the rid it was given (every sequence of it: n > 1 and a batch
        name theirs `{rid}_{i}`), or every request (None)."""
        if rid is None:
            self._transport.inbox.put(AbortReq(None))
            return
        for seq in self._transport.named(rid) or [rid]:
            self._transport.inbox.put(AbortReq(seq))

    def update_weights_from_disk(
        self, model_path: str, abort_all_requests: bool = False
    ) -> dict[str, Any]:
        """Serve a checkpoint of the same model (a folder or .gguf) in place of the loaded
        weights, as SGLang's: once the running requests end (or are aborted), with calls
        made meanwhile waiting and then running on the new weights; the prefix cache is
        emptied. Returns `{"success", "message", "num_paused_requests"}`; on a failure the
        old weights stay."""
        args = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        return self._control("update_weights", args).answer()

    def update_weights_from_tensor(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
        load_format: str | None = None,
        flush_cache: bool = True,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Serve these tensors in place of the loaded ones, as SGLang's Engine does for a
        trainer in the same process: (name, tensor) pairs (or a dict) by the checkpoint's
        Hugging Face names, any of them (a full set needs no checkpoint on disk), each of
        its checkpoint tensor's shape. The update waits for the running requests as
        `update_weights_from_disk` does; the prefix cache is emptied unless `flush_cache`
        is false. Returns `{"success", "message", "num_paused_requests"}`; on a failure (a
        name or shape that does not fit) nothing changes."""
        if load_format is not None:
            raise ValueError(f"load_format {load_format!r}: only the default (None) is supported")
        pairs = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
        for pair in pairs:
            if not (isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[0], str)):
                raise TypeError(f"named_tensors: a (name, tensor) pair is needed, got {pair!r}")
        args = {
            "named_tensors": pairs,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        return self._control("update_weights", args).answer()

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, Any]:
        """Load the LoRA adapter in PEFT folder `lora_path` as `lora_name` (SGLang's
        Engine call; needs enable_lora=True or lora_paths). Returns `{"success",
        "error_message", "loaded_adapters"}`; a folder that cannot be served on this model
        fails with the reason, and so does one not read in `registry.LOAD_TIMEOUT_S`
        seconds (the load is undone: a read that hangs holds no slot)."""
        with self._lora_lock:  # one load or unload at a time: names stay consistent
            ref = self.loras.new_ref(lora_name, lora_path)
            args = {"uid": ref.uid, "name": ref.name, "path": ref.path}
            load = self._control_future("load_lora_adapter", args)
            try:
                update = load.result(timeout=lora_registry.LOAD_TIMEOUT_S)
            except TimeoutError:  # undone, read or not (a read still going is abandoned)
                self._control("unload_lora_adapter", {"uid": ref.uid})
                load.result()
                seconds = lora_registry.LOAD_TIMEOUT_S
                message = f"the adapter's folder was not read in {seconds:g} s: load undone"
                update = LoraUpdate(False, message)
            if update.success:
                self.loras.add(ref)
            return self._lora_answer(update)

    def unload_lora_adapter(self, lora_name: str) -> dict[str, Any]:
        """Unload an adapter: calls naming it fail from now on; it is dropped once the
        requests already running with it have ended (this waits for that)."""
        with self._lora_lock:
            uid = self.loras.uid(lora_name, "lora_name")
            self.loras.remove(lora_name)
        return self._lora_answer(self._control("unload_lora_adapter", {"uid": uid}))

    def _lora_answer(self, update: LoraUpdate) -> dict[str, Any]:
        return {
            "success": update.success,
            "error_message": None if update.success else update.message,
            "loaded_adapters": self.loras.loaded(),
        }

    def pause_generation(self, mode: PauseMode = "abort") -> None:
        """Stop generating until `continue_generation` (SGLang's): `abort` ends every
        request first, `retract` takes the running ones back to the queue (generated tokens
        kept), `in_place` leaves them as they are. Calls made meanwhile wait; a weight
        update goes ahead once no request holds K/V."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self._control("pause_generation", {"mode": mode})

    def continue_generation(self) -> None:
        self._control("continue_generation")

    def flush_cache(self) -> bool:
        """Empty the prefix cache; False (nothing done) while requests are running."""
        return bool(self._control("flush_cache"))

    def start_profile(self, **args: Any) -> None:
        """Profile the scheduler's steps with torch's profiler, as the server's
        /start_profile (its fields: output_dir, start_step, num_steps, activities,
        with_stack, record_shapes, profile_prefix, profile_id); ValueError if one is
        running or an argument is wrong."""
        self._control("start_profile", args)

    def stop_profile(self) -> str:
        """End the profile and write its Chrome trace (or, for one that ended by itself
        after num_steps, report it): its path ('' if no step ran); ValueError if no profile
        was started since the last stop."""
        path = self._control("stop_profile")
        if path is None:
            raise ValueError("no profile is running: start_profile first")
        return path

    def check_kv_accounting(self) -> None:
        """Raises AssertionError if a KV slot is unaccounted for."""
        self._control("check_kv_accounting")

    def get_server_info(self) -> dict[str, Any]:
        state = self._control("get_state")
        assert isinstance(state, SchedulerStats)
        return {
            **self.config.to_flat(),
            **self.scheduler.info.as_dict(),
            "version": __version__,
            "internal_states": [state.as_dict()],
        }

    def shutdown(self) -> None:
        if not self._transport.stopped:
            self._transport.stop()
            self._thread.join(timeout=30)
            self._stop_followers()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- requests -------------------------------------------------------------------------
    def _make_requests(
        self,
        prompt,
        sampling_params,
        input_ids,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        return_text_in_logprobs=False,
        rid=None,
        priority=None,
        stream=False,
        token_ids_logprob=None,
        require_reasoning=False,
        lora_path=None,
        return_hidden_states=False,
    ) -> tuple[list[Req], list[RequestState], bool]:
        """Validated requests (one per prompt and per `n`), their result states, and whether
        the caller gets a single result rather than a list."""
        expanded = expand_request(
            self.tokenizer.encode,
            prompt,
            sampling_params,
            input_ids,
            return_logprob,
            logprob_start_len,
            top_logprobs_num,
            rid,
            priority,
            token_ids_logprob=token_ids_logprob,
            lora_ids=self.loras.uids(lora_path),
            return_hidden_states=return_hidden_states,
        )
        wants_hidden = any(r.return_hidden_states for r in expanded.reqs)
        if wants_hidden and not self.config.server.enable_return_hidden_states:
            raise ValueError(
                "return_hidden_states needs an Engine made with enable_return_hidden_states=True"
            )
        if stream and len(expanded.reqs) != 1:
            raise ValueError("stream=True takes a single prompt with n=1")
        if require_reasoning:  # a constraint after the reasoning (server/reasoning.py)
            parser = self.config.server.reasoning_parser
            if parser is None:
                raise ValueError(
                    "require_reasoning needs an Engine made with reasoning_parser=... (it "
                    "names the model's reasoning tags)"
                )
            give_think_blocks(expanded.reqs, parser, self.tokenizer.decode)
        states = [
            RequestState(
                req.rid,
                req.params,
                self.tokenizer,
                return_logprob,
                top_logprobs_num or 0,
                return_text_in_logprobs,
                bool(req.token_ids_logprob),
            )
            for req in expanded.reqs
        ]
        return expanded.reqs, states, expanded.single

    def _run_all(self, reqs: list[Req]) -> list[dict]:
        """Submit every request at once (so they batch), then their native results."""
        states = [
            RequestState(
                r.rid,
                r.params,
                self.tokenizer,
                r.return_logprob,
                token_ids_logprob=bool(r.token_ids_logprob),
            )  # fmt: skip
            for r in reqs
        ]
        queues: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in reqs]
        for req, q in zip(reqs, queues):
            self._submit(req, q.put)
        return [self._collect(state, q) for state, q in zip(states, queues)]

    def _submit(
        self, req: Req, sink: Sink, return_text: bool = False, rid: str | list[str] | None = None
    ) -> None:
        """Send `req`; `rid` is what the caller named its call (for `abort`)."""
        if self._error is not None or self._transport.stopped:
            raise EngineDeadError(f"the engine is not running: {self._error or 'shut down'}")
        draw_seed(req)
        self._transport.submit(GenerateReq.from_req(req, return_text), sink, given_rids(rid))

    @staticmethod
    def _apply(state: RequestState, item: ReqOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            raise item
        state.update(item)

    def _collect(self, state: RequestState, q: queue.SimpleQueue) -> dict:
        while not state.finished:
            self._apply(state, q.get())
        return state.result()

    def _stream(self, state: RequestState, q: queue.SimpleQueue) -> Iterator[dict]:
        while not state.finished:
            self._apply(state, q.get())
            yield state.result()

    async def _acollect(self, state: RequestState, q: asyncio.Queue) -> dict:
        while not state.finished:
            self._apply(state, await q.get())
        return state.result()

    async def _astream(self, state: RequestState, q: asyncio.Queue) -> AsyncIterator[dict]:
        while not state.finished:
            self._apply(state, await q.get())
            yield state.result()

    def _control(self, op: ControlOp, args: dict[str, Any] | None = None) -> Any:
        """Run a control op on the scheduler thread (the scheduler is not thread-safe)."""
        return self._control_future(op, args).result()

    def _control_future(self, op: ControlOp, args: dict[str, Any] | None = None) -> Future:
        """A control op sent to the scheduler thread, its answer to come."""
        if self._error is not None:
            raise EngineDeadError(str(self._error))
        return self._transport.control(op, args)

    # -- the scheduler thread -------------------------------------------------------------
    def _run(self, progress: bool, built: Future[None]) -> None:
        try:
            self._build(progress)
        except BaseException as e:
            built.set_exception(e)
            return
        built.set_result(None)
        try:
            self._loop.run()
        except BaseException as e:  # the thread must never die silently
            self._error = e
            self._transport.fail_all(EngineDeadError(f"the scheduler failed: {e!r}"))
            raise
        self._transport.fail_all(EngineDeadError("the engine was shut down"))
