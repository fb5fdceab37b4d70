"""Tracing: run a program with its arguments left unknown, to find the text every run of it
begins with (the few-shot examples, a system prompt). `run_batch` caches that prefix once
before the batch starts, so the programs' first calls find it in the radix cache instead of
all computing it at once.

The program runs inline on an `Executor` whose backend refuses every call: the first `gen`,
`select`, fork, read of a variable, or use of an argument ends the trace, and the text built
up to there is the constant prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from radixserve.lang.global_config import global_config
from radixserve.lang.interpreter import Executor, ProgramState
from radixserve.lang.ir import Expr, SamplingParams

if TYPE_CHECKING:
    from radixserve.lang.backend.base import Backend
    from radixserve.lang.chat_template import ChatTemplate
    from radixserve.lang.ir import Function


class StopTracing(Exception):
    """The program did something whose result is unknown until it runs."""


class Argument(Expr):
    """An argument whose value is unknown while tracing: appending it, formatting it or
    looking into it ends the trace."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _unknown(self, *args: Any, **kwargs: Any) -> Any:
        raise StopTracing(f"argument {self.name!r}")

    __str__ = __format__ = __len__ = __iter__ = __getitem__ = __bool__ = _unknown
    __int__ = __float__ = __contains__ = __eq__ = __hash__ = __getattr__ = _unknown

    def __repr__(self) -> str:
        return f"Argument({self.name!r})"


class _TracingBackend:
    """Refuses every call: tracing must not reach the model."""

    def __init__(self, chat_template: ChatTemplate) -> None:
        self.chat_template = chat_template

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def __getattr__(self, name: str) -> Any:
        raise StopTracing(name)


class _TracingState(ProgramState):
    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> Any:
        raise StopTracing("fork")

    def get_var(self, name: str) -> Any:
        raise StopTracing(f"variable {name!r}")

    __getitem__ = get_var


@dataclass
class Trace:
    """What tracing saw: the expressions run before it stopped, the constant text they
    made, and why it stopped (None: the program ended)."""

    prefix: str
    exprs: list[Expr] = field(default_factory=list)
    stopped_at: str | None = None

    def __iter__(self) -> Iterator[Expr]:
        return iter(self.exprs)


def trace_program(program: Function, backend: Backend, kwargs: dict[str, Any]) -> Trace:
    arguments = {name: Argument(name) for name in program.arg_names}
    arguments.update(program.bind_arguments)
    arguments.update(kwargs)
    executor = Executor(
        _TracingBackend(backend.get_chat_template()),  # type: ignore[arg-type]
        arguments,
        SamplingParams(),
        threaded=False,
    )
    state = _TracingState(executor)
    exprs: list[Expr] = []
    submit = executor.submit

    def recording_submit(expr: Expr) -> None:
        submit(expr)
        exprs.append(expr)

    executor.submit = recording_submit  # type: ignore[method-assign]
    stopped_at = None
    try:
        program.func(state, **arguments)
    except StopTracing as e:
        stopped_at = str(e)
    except Exception as e:  # the program's own code choked on an unknown argument
        stopped_at = repr(e)
    return Trace(executor.text_, exprs, stopped_at)


def cache_program(program: Function, backend: Backend) -> int | None:
    """Cache the program's constant prefix; its token count, or None if it is too short."""
    prefix = trace_program(program, backend, {}).prefix
    if len(prefix) < global_config.precache_min_chars:
        return None
    return backend.cache_prefix(prefix)
