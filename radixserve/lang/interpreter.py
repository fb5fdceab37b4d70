"""How a program runs.

Each program state has an `Executor`: a worker thread that takes the expressions the program
appends (`s += ...`) from a queue and runs them in order, calling the backend for `gen` and
`select`. The program's own thread only enqueues, so it runs ahead until it reads something:
`s["x"]` waits for the event of variable x, `s.text()` waits for the queue to drain. A
failed backend call is kept as the state's error: every waiter wakes, the expressions after
it are skipped, and each later read raises `ProgramError` (nothing hangs).

`fork(n)` waits for the parent's queue to drain, first sending the parent's text to the
backend once as a prefix hint (so the n branches find it cached, or being computed, rather
than each computing it), then gives each child a copy of the parent's text, messages and
variables and a worker of its own. The hint is sent, not waited for: the branches follow it
at once, and the runtime holds them back a round behind the prefix the hint computes (its
in-batch sharing rule), so the hint costs the program no round trip. A failed hint costs
only the cache (logged); the program waits for its hints before it finishes. `join()`
waits for the children and gathers their new variables into lists on the parent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import queue
import threading
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from radixserve.lang.backend.base import PrefixReuse
from radixserve.lang.chat_template import ChatTemplate
from radixserve.lang.global_config import global_config
from radixserve.lang.ir import (
    Constant,
    Expr,
    ExprList,
    Gen,
    PrefixHint,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    variable_names,
)

if TYPE_CHECKING:
    from radixserve.lang.backend.base import Backend
    from radixserve.lang.ir import Function

logger = logging.getLogger(__name__)
_HINT_POOL = ThreadPoolExecutor(8, thread_name_prefix="sgl-prefix-hint")  # shared, lazy threads


class ProgramError(RuntimeError):
    """A call the program made failed; the original error is the `__cause__`."""


class Executor:
    """Runs one program state's expressions in order (on a worker thread, or inline for
    tracing). See the module docstring for the waiting rules."""

    def __init__(
        self,
        backend: Backend,
        arguments: dict[str, Any],
        defaults: SamplingParams,
        chat_template: ChatTemplate | None = None,
        stream: bool = False,
        num_api_spec_tokens: int | None = None,
        threaded: bool = True,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = arguments
        self.defaults = defaults
        self.chat_template = chat_template or backend.get_chat_template()
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        self.text_ = ""
        self.backend_seen = 0  # leading chars of text_ the backend has cached (its last call)
        self.messages_: list[dict[str, Any]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.cur_role: str | None = None
        self.cur_role_begin_pos: int | None = None
        self.fork_start_text_pos: int | None = None
        self.speculated_text = ""  # generated ahead by API speculative execution
        self.speculated_tokens = 0  # the most tokens the call that made it could make
        self.error_: BaseException | None = None
        self.finished = False  # the worker has run everything and exited
        self._ready: dict[str, threading.Event] = {}
        self._failed: set[str] = set()  # variables whose events were set by an error
        self._changed = threading.Condition()  # text, a variable, or `finished` changed
        self._ended = False
        self._threaded = threaded
        self._queue: queue.Queue[Expr | None] = queue.Queue()
        self._hints: list[Future] = []  # prefix hints sent and maybe still in flight
        if threaded:
            self._worker = threading.Thread(
                target=self._work, name=f"sgl-program-{self.sid[:8]}", daemon=True
            )
            self._worker.start()

    # -- the program's side ---------------------------------------------------------------
    def submit(self, expr: Expr) -> None:
        if self._ended:
            raise RuntimeError("this program has ended: nothing more can be appended to it")
        with self._changed:
            for name in variable_names(expr):
                self._ready[name] = threading.Event()
                self._failed.discard(name)
            self._changed.notify_all()
        if self._threaded:
            self._queue.put(expr)
        else:
            self._execute(expr)

    def wait(self) -> None:
        """Wait until every submitted expression has run (or been skipped after an error)."""
        if self._threaded:
            self._queue.join()

    def sync(self) -> None:
        """`wait`, then raise the program's error if it has one."""
        self.wait()
        self.raise_error()

    def raise_error(self) -> None:
        if self.error_ is not None:
            raise ProgramError(f"the program failed: {self.error_!r}") from self.error_

    def get_var(self, name: str) -> Any:
        event = self._ready.get(name)
        if event is not None:
            event.wait()
        if name in self._failed:
            self.raise_error()
        if name not in self.variables:
            raise KeyError(f"the program has no variable {name!r}")
        return self.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        self.variables[name] = value

    def get_meta_info(self, name: str, timeout: float | None = None) -> Any:
        event = self._ready.get(name)
        if event is not None and not event.wait(timeout):
            raise TimeoutError(f"variable {name!r} was not produced within {timeout} s")
        if name in self._failed:
            self.raise_error()
        return self.meta_info.get(name)

    def fork(self, size: int) -> list[Executor]:
        size = int(size)
        if size > 1:
            self.submit(PrefixHint())  # runs after everything before it: the text is final
        self.sync()
        children = [
            Executor(self.backend, self.arguments, self.defaults, self.chat_template, self.stream)
            for _ in range(size)
        ]
        for child in children:
            child.text_ = self.text_
            child.backend_seen = self.backend_seen
            child.messages_ = list(self.messages_)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.cur_role = self.cur_role
            child.cur_role_begin_pos = self.cur_role_begin_pos
            child.fork_start_text_pos = len(self.text_)
        return children

    def end(self) -> None:
        """No more expressions; the worker exits when it has run the ones it has."""
        if self._ended:
            return
        self._ended = True
        if self._threaded:
            self._queue.put(None)
        else:
            self._finish()

    def text(self) -> str:
        self.sync()
        return self.text_

    def messages(self) -> list[dict[str, Any]]:
        self.sync()
        return self.messages_

    # -- streaming ------------------------------------------------------------------------
    def next_chunk(self, var: str | None, prev: int) -> tuple[str, bool, Any]:
        """Block until the text (or variable `var`) has grown past `prev` characters or is
        complete; the new characters, whether it is complete, and the variable's meta_info
        as of those characters."""

        def current() -> str:
            if var is None:
                return self.text_
            value = self.variables.get(var, "")
            return value if isinstance(value, str) else ""

        def complete() -> bool:
            if var is None or self.error_ is not None:
                return self.finished
            event = self._ready.get(var)
            return (event is not None and event.is_set()) or self.finished

        with self._changed:
            self._changed.wait_for(lambda: len(current()) > prev or complete())
            meta = None if var is None else self.meta_info.get(var)
            return current()[prev:], complete(), meta

    # -- the worker -----------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    self._finish()
                    return
                if self.error_ is None:
                    self._run_guarded(expr)
                if self.error_ is not None:
                    self._release(variable_names(expr))
            finally:
                self._queue.task_done()

    def _run_guarded(self, expr: Expr) -> None:
        try:
            self._execute(expr)
        except Exception as e:  # a failed call fails this program alone, and is re-raised
            logger.warning("program %s failed: %r", self.sid[:8], e)
            self.error_ = e
            self._release(None)

    def _release(self, names: list[str] | None) -> None:
        """Wake whoever waits on these variables (None: on any): they will find the error."""
        with self._changed:
            for name in list(self._ready) if names is None else names:
                event = self._ready.get(name)
                if event is not None and not event.is_set():
                    self._failed.add(name)
                    event.set()
            self._changed.notify_all()

    def _finish(self) -> None:
        for hint in self._hints:  # nothing of the program's is left in flight
            hint.exception()
        self._hints.clear()
        with self._changed:
            self.finished = True
            self._changed.notify_all()

    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, str):
            expr = Constant(expr)
        if isinstance(expr, ExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, Constant):
            self._fill(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self.variables[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            self._set(expr.name, self.text_[self.variables[expr.name] :], None)
        elif isinstance(expr, PrefixHint):
            self._prefix_hint()
        else:
            raise TypeError(f"cannot run {expr!r} in a program")

    def _prefix_hint(self) -> None:
        """Before a fork's branches: cache the parent's text, where the part the backend has
        not seen is worth a call and the runtime keeps prefixes; fork() waits for it unless
        the runtime shares a prefix among the branches arriving together."""
        unseen = len(self.text_) - self.backend_seen
        if not global_config.enable_fork_prefix_hint or unseen < global_config.fork_hint_min_chars:
            return
        reuse = self.backend.prefix_reuse()
        if reuse is PrefixReuse.NONE:
            return
        if reuse is PrefixReuse.BATCH:
            self._hints.append(_HINT_POOL.submit(self._send_hint, self.text_))
        else:
            self._send_hint(self.text_)
        self.backend_seen = len(self.text_)

    def _send_hint(self, prefix: str) -> None:
        try:
            self.backend.cache_prefix(prefix)
        except Exception as e:  # only the cache is lost: the branches compute the prefix
            logger.info("program %s: the prefix hint failed: %r", self.sid[:8], e)

    def _fill(self, value: str) -> None:
        value = str(value)
        if self.speculated_text.startswith(value):
            self.speculated_text = self.speculated_text[len(value) :]
        else:
            self.speculated_text = ""  # the program went another way than the speculation
        with self._changed:
            self.text_ += value
            self._changed.notify_all()

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is None:
            return
        with self._changed:
            self.variables[name] = value
            self.meta_info[name] = meta
            self._ready[name].set()
            self._changed.notify_all()

    def _gen(self, expr: Gen) -> None:
        params = self.defaults.merged(expr.params, self.chat_template.stop_str)
        if self.stream:
            self._gen_stream(expr.name, params)
            return
        spec = self._spec_gen(params) if self._speculates(params) else None
        comp, meta = spec if spec is not None else self.backend.generate(self, params)
        self._fill(comp[0] if isinstance(comp, list) else comp)
        self.backend_seen = len(self.text_)  # the prompt and its output are cached now
        self._set(expr.name, comp, meta)

    def _speculates(self, params: SamplingParams) -> bool:
        """API speculative execution (`function(num_api_spec_tokens=N)`) applies to plain
        text gens on completion backends."""
        plain = params.regex is None and params.json_schema is None and params.dtype is None
        return (
            self.num_api_spec_tokens is not None
            and not self.backend.is_chat_model
            and plain
            and params.n in (None, 1)
        )

    def _spec_gen(self, params: SamplingParams) -> tuple[str, Any] | None:
        """Serve this gen from text generated ahead: when none is left, one call generates
        `num_api_spec_tokens` tokens (or the gen's own max, if larger) without stops, and
        later gens and fills of the program consume it as long as it matches what they
        expect. The gen takes the speculated text up to its first stop string, where that
        cannot be more than its max_tokens tokens (at most as many characters, or made by a
        call of no more tokens); else None: the gen is made by a call of its own."""
        meta: Any = {"speculated": True}
        if not self.speculated_text:
            tokens = max(params.max_new_tokens or 0, self.num_api_spec_tokens or 0)
            ahead = dataclasses.replace(params, max_new_tokens=tokens, stop=None)
            text, meta = self.backend.generate(self, ahead)
            self.speculated_text, self.speculated_tokens = text, tokens
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or ())
        cut = min(
            (i for i in (self.speculated_text.find(x) for x in stops if x) if i >= 0),
            default=len(self.speculated_text),
        )
        limit = params.max_new_tokens
        if limit is not None and cut > limit and self.speculated_tokens > limit:
            return None  # it may hold more than `limit` tokens
        return self.speculated_text[:cut], meta  # appending it consumes it (see _fill)

    def _gen_stream(self, name: str | None, params: SamplingParams) -> None:
        if params.n not in (None, 1):
            raise ValueError("a streamed gen makes one sample: n must be 1")
        key = name if name is not None else f"_gen_{uuid.uuid4().hex[:8]}"
        self.variables[key] = ""
        meta = None
        for delta, meta in self.backend.generate_stream(self, params):
            with self._changed:
                self.text_ += delta
                self.variables[key] += delta
                self.meta_info[key] = meta
                self._changed.notify_all()
        self.backend_seen = len(self.text_)
        if name is not None:
            self._set(name, self.variables[name], meta)

    def _select(self, expr: Select) -> None:
        decision = self.backend.select(self, expr.choices, expr.temperature, expr.choices_method)
        self._fill(decision.decision)
        self.backend_seen = len(self.text_)  # every choice was scored after the text
        self._set(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"roles cannot nest: {role} inside {self.cur_role}")
        default_system = self.chat_template.default_system_prompt
        if not self.messages_ and role != "system" and default_system:
            self._role_begin("system")
            self._fill(default_system)
            self._role_end("system")
        prefix, _ = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role = role
        self.cur_role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"{role}_end without {role}_begin (open role: {self.cur_role})")
        content = self.text_[self.cur_role_begin_pos :].lstrip()
        _, suffix = self.chat_template.get_prefix_and_suffix(role, self.messages_)
        self._fill(suffix)
        self.messages_.append({"role": role, "content": content})
        self.cur_role = None


class ProgramState:
    """What a program sees as `s`, and what `run` returns."""

    def __init__(self, executor: Executor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    # -- building -------------------------------------------------------------------------
    def __iadd__(self, other: Expr | str) -> ProgramState:
        if other is None:
            raise ValueError("cannot append None to a program")
        if isinstance(other, ProgramState):  # `s += inner(...)` ran `inner` on its own
            raise TypeError(
                "cannot append a program's state to a program: `inner(...)` runs `inner` as "
                "a program of its own; to write its text into this one, call `inner.func(s, "
                "...)`"
            )
        self.stream_executor.submit(as_expr(other))  # a TypeError for 5, [..], ...
        return self

    def _role(self, role: str, expr: Expr | str | None) -> Any:
        if expr is not None:
            self += RoleBegin(role) + expr + RoleEnd(role)
            return None

        @contextmanager
        def scope() -> Iterator[None]:
            self.stream_executor.submit(RoleBegin(role))
            yield
            self.stream_executor.submit(RoleEnd(role))

        return scope()

    def system(self, expr: Expr | str | None = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Expr | str | None = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Expr | str | None = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(
        self, size: int = 1, position_ids_offset: list[int] | None = None
    ) -> ProgramStateGroup:
        children = self.stream_executor.fork(size)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None) -> Iterator[ProgramState]:
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # -- reading --------------------------------------------------------------------------
    def text(self) -> str:
        return self.stream_executor.text()

    def messages(self) -> list[dict[str, Any]]:
        return self.stream_executor.messages()

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The error that failed the program, or None (waits for the program to run)."""
        self.stream_executor.wait()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text (or one variable) piece by piece as it is generated; without streaming,
        all of it at once when ready."""
        executor = self.stream_executor
        if not executor.stream:
            yield self.text() if var_name is None else self.get_var(var_name)
            return
        prev = 0
        while True:
            chunk, done, _ = executor.next_chunk(var_name, prev)
            prev += len(chunk)
            if chunk:
                yield chunk
            if done:
                break
        executor.raise_error()

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """`text_iter` for asyncio; with return_meta_data, (chunk, meta_info) pairs."""
        executor = self.stream_executor
        if not executor.stream:
            value = await asyncio.to_thread(
                self.text if var_name is None else lambda: self.get_var(var_name)
            )
            yield (value, self._meta(var_name)) if return_meta_data else value
            return
        prev, delivered = 0, 0
        while True:
            chunk, done, meta = await asyncio.to_thread(executor.next_chunk, var_name, prev)
            prev += len(chunk)
            if chunk and return_meta_data:
                meta, delivered = _incremental(meta, delivered)
                yield chunk, meta
            elif chunk:
                yield chunk
            if done:
                break
        executor.raise_error()

    def _meta(self, var_name: str | None) -> Any:
        return None if var_name is None else self.stream_executor.meta_info.get(var_name)

    def __del__(self) -> None:
        executor = getattr(self, "stream_executor", None)
        if executor is not None:
            executor.end()  # lets its worker thread exit

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


_PER_TOKEN_KEYS = ("output_token_logprobs", "output_top_logprobs")


def _incremental(meta: Any, delivered: int) -> tuple[Any, int]:
    """A streamed chunk's meta_info with only the output tokens' logprobs not delivered
    before (as SGLang streams them), `output_token_logprobs_length` the running count."""
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        return meta, delivered
    total = len(meta["output_token_logprobs"])
    out = {k: (v[delivered:] if k in _PER_TOKEN_KEYS else v) for k, v in meta.items()}
    out["output_token_logprobs_length"] = total
    return out, total


class ProgramStateGroup:
    """The children of a fork."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every child. gather_variable: each variable a child made becomes, on
        the parent, the list of the children's values. concate_and_append: the children's
        texts since the fork are appended to the parent's, in order."""
        for state in self.states:
            state.sync()
        parent = self.src_state.stream_executor
        if mode == "gather_variable":
            self._gather(parent)
        elif mode == "concate_and_append":
            self.src_state += "".join(
                s.stream_executor.text_[s.stream_executor.fork_start_text_pos :]
                for s in self.states
            )
            parent.sync()
        else:
            raise ValueError(f"unknown join mode {mode!r}: gather_variable or concate_and_append")
        for state in self.states:
            state.stream_executor.end()

    def _gather(self, parent: Executor) -> None:
        before = set(parent.variables)
        for state in self.states:
            child = state.stream_executor.variables
            for name in child.keys() - before:
                parent.variables.setdefault(name, []).append(child[name])

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, state: ProgramState) -> None:
        """What `forks[i] += expr` ends with: the same state back."""
        if state is not self.states[i]:
            raise TypeError("a fork's branches cannot be replaced; append to them instead")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (Expr, str)):
            for state in self.states:
                state += other
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} forks")
            for state, expr in zip(self.states, other):
                state += expr
        else:
            raise TypeError(f"cannot append {type(other).__name__} to a fork group")
        return self


# -- running programs ------------------------------------------------------------------------
def run_program(
    program: Function,
    backend: Backend,
    args: tuple,
    kwargs: dict[str, Any],
    defaults: SamplingParams,
    stream: bool,
    sync: bool = True,
) -> ProgramState:
    kwargs = {**program.bind_arguments, **kwargs}
    executor = Executor(
        backend, kwargs, defaults, stream=stream, num_api_spec_tokens=program.num_api_spec_tokens
    )
    state = ProgramState(executor)
    if stream:
        body = threading.Thread(
            target=_run_body, args=(state, program, args, kwargs, False), daemon=True
        )
        body.start()
        return state
    _run_body(state, program, args, kwargs, sync)
    return state


def _run_body(
    state: ProgramState, program: Function, args: tuple, kwargs: dict[str, Any], sync: bool
) -> None:
    executor = state.stream_executor
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except BaseException as e:
        if executor.error_ is None:
            executor.error_ = e  # a streaming reader must see it too
        raise
    finally:
        executor.end()
    if sync:
        executor.sync()
        if global_config.verbosity >= 2:
            print(executor.text_)


def run_program_batch(
    program: Function,
    backend: Backend,
    batch: list[dict[str, Any]],
    defaults: SamplingParams,
    num_threads: int | str,
    progress_bar: bool,
    generator_style: bool,
) -> list[ProgramState] | Iterator[ProgramState]:
    if not batch:
        return iter(()) if generator_style else []
    if global_config.enable_precache_with_tracing and len(batch) > 1:
        from radixserve.lang.tracer import cache_program

        cache_program(program, backend)
    if num_threads == "auto":
        num_threads = max(96, (os.cpu_count() or 1) * 16)
    num_threads = max(1, min(int(num_threads), len(batch)))

    def one(kwargs: dict[str, Any]) -> ProgramState:
        return _run_isolated(program, backend, kwargs, defaults)

    if generator_style:
        return _in_order(one, batch, num_threads, progress_bar)
    return list(_in_order(one, batch, num_threads, progress_bar))


def _run_isolated(
    program: Function, backend: Backend, kwargs: dict[str, Any], defaults: SamplingParams
) -> ProgramState:
    """One program of a batch: its failure is kept in its state, not raised here."""
    kwargs = {**program.bind_arguments, **kwargs}
    executor = Executor(backend, kwargs, defaults, num_api_spec_tokens=program.num_api_spec_tokens)
    state = ProgramState(executor)
    try:
        _run_body(state, program, (), kwargs, sync=False)
        executor.wait()
    except Exception as e:  # the program's own failure: its state raises it when read
        if executor.error_ is None:
            executor.error_ = e
    return state


def _in_order(
    one: Callable[[dict[str, Any]], ProgramState],
    batch: list[dict[str, Any]],
    num_threads: int,
    progress_bar: bool,
) -> Iterator[ProgramState]:
    """The states in the batch's order, run `num_threads` at a time, with at most a bounded
    number of programs submitted ahead of the consumer (a generator's reader sees results
    early; the pool never runs dry while there is work)."""
    from tqdm import tqdm

    bar = tqdm(total=len(batch)) if progress_bar else None
    ahead = max(num_threads * 2, 64)
    pending: deque[Future[ProgramState]] = deque()
    with ThreadPoolExecutor(num_threads, thread_name_prefix="sgl-batch") as pool:
        for kwargs in batch:
            future = pool.submit(one, kwargs)
            if bar is not None:
                future.add_done_callback(lambda _: bar.update())
            pending.append(future)
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    if bar is not None:
        bar.close()
