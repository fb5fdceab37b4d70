"""The expressions a program appends to its state, and `function`, a program.

`s += "text"`, `s += gen("x")`, `s += user("hi") + assistant(gen("a"))` each submit one
expression (a list of them for `+`) to the state's executor, which runs them in order on
its own thread (interpreter.py).
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from radixserve.lang.choices import ChoicesSamplingMethod
from radixserve.lang.global_config import global_config

if TYPE_CHECKING:
    from radixserve.lang.interpreter import ProgramState

# the regexes `dtype` stands for (SGLang's, so a program decodes the same on both)
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?[0-9]*\.?[0-9]+[ \n]*"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r"\"[\w\d\s]*\""
_DTYPES = {
    int: (REGEX_INT, True),
    "int": (REGEX_INT, True),
    float: (REGEX_FLOAT, True),
    "float": (REGEX_FLOAT, True),
    bool: (REGEX_BOOL, False),
    "bool": (REGEX_BOOL, False),
    str: (REGEX_STR, False),
    "str": (REGEX_STR, False),
}  # dtype → (regex, whether " " and "\n" also stop it)


@dataclasses.dataclass
class SamplingParams:
    """A gen's sampling settings. In `gen(...)` a None means "the program's default" (the
    keyword arguments of `run`); `merged` resolves them."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    dtype: Any = None
    regex: str | None = None
    json_schema: str | None = None

    def merged(self, overrides: SamplingParams, stop_str: tuple[str, ...] = ()) -> SamplingParams:
        """These defaults with every non-None field of `overrides`; the chat template's stop
        strings are added to the stops."""
        out = dataclasses.replace(self)
        for f in dataclasses.fields(self):
            value = getattr(overrides, f.name)
            if value is not None:
                setattr(out, f.name, value)
        if stop_str:
            out.stop = [*_as_list(out.stop), *stop_str]
        return out

    def constrained(self) -> SamplingParams:
        """`dtype` turned into its regex (and its stops); a dtype wins over a regex."""
        if self.dtype is None:
            return self
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}: use int, float, bool or str")
        regex, stops = _DTYPES[self.dtype]
        stop = [*_as_list(self.stop), " ", "\n"] if stops else self.stop
        return dataclasses.replace(self, regex=regex, stop=stop, dtype=None)

    def to_native(self) -> dict[str, Any]:
        """The /generate `sampling_params` (the native API's names; None fields left out)."""
        params = self.constrained()
        out = {
            "max_new_tokens": params.max_new_tokens,
            "min_new_tokens": params.min_new_tokens,
            "n": params.n,
            "stop": _as_list(params.stop) or None,
            "stop_token_ids": list(params.stop_token_ids or ()) or None,
            "stop_regex": _as_list(params.stop_regex) or None,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "min_p": params.min_p,
            "frequency_penalty": params.frequency_penalty,
            "presence_penalty": params.presence_penalty,
            "ignore_eos": params.ignore_eos,
            "regex": params.regex,
            "json_schema": params.json_schema,
            "skip_special_tokens": global_config.skip_special_tokens_in_output,
            "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
        }
        return {k: v for k, v in out.items() if v is not None}

    def logprob_fields(self) -> dict[str, Any]:
        """The top-level /generate fields for logprobs (None fields left out)."""
        out = {
            "return_logprob": self.return_logprob,
            "logprob_start_len": self.logprob_start_len,
            "top_logprobs_num": self.top_logprobs_num,
            "return_text_in_logprobs": self.return_text_in_logprobs,
        }
        return {k: v for k, v in out.items() if v is not None}


def _as_list(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


# -- expressions -----------------------------------------------------------------------------
class Expr:
    """Something a program appends to its state."""

    def __add__(self, other: Expr | str) -> ExprList:
        return ExprList([*_flat(self), *_flat(as_expr(other))])

    def __radd__(self, other: Expr | str) -> ExprList:
        return ExprList([*_flat(as_expr(other)), *_flat(self)])


def as_expr(value: Expr | str) -> Expr:
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(f"cannot append {type(value).__name__} to a program: {value!r}")


def _flat(expr: Expr) -> list[Expr]:
    return list(expr.exprs) if isinstance(expr, ExprList) else [expr]


class ExprList(Expr):
    def __init__(self, exprs: list[Expr]) -> None:
        self.exprs = exprs

    def __repr__(self) -> str:
        return f"ExprList({self.exprs})"


class Constant(Expr):
    def __init__(self, value: str) -> None:
        self.value = value

    def __repr__(self) -> str:
        return f"Constant({self.value!r})"


class Gen(Expr):
    def __init__(self, name: str | None, params: SamplingParams) -> None:
        if params.regex is not None:
            re.compile(params.regex)  # a bad regex fails where the program is written
        self.name = name
        self.params = params

    def __repr__(self) -> str:
        return f"Gen({self.name!r})"


class Select(Expr):
    def __init__(
        self,
        name: str | None,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> None:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError(f"select needs a list of non-empty strings, got {choices!r}")
        if temperature > 1e-5:
            raise ValueError("select decides greedily: temperature must be 0")
        self.name = name
        self.choices = list(choices)
        self.temperature = temperature
        self.choices_method = choices_method

    def __repr__(self) -> str:
        return f"Select({self.name!r}, choices={self.choices})"


class RoleBegin(Expr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleBegin({self.role})"


class RoleEnd(Expr):
    def __init__(self, role: str) -> None:
        self.role = role

    def __repr__(self) -> str:
        return f"RoleEnd({self.role})"


class VarScopeBegin(Expr):
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeBegin({self.name!r})"


class VarScopeEnd(Expr):
    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"VarScopeEnd({self.name!r})"


class PrefixHint(Expr):
    """Cache the state's text so far (sent before a fork's branches start)."""

    def __repr__(self) -> str:
        return "PrefixHint()"


def variable_names(expr: Expr) -> list[str]:
    """The variables an expression will set (what `s[name]` may wait for)."""
    if isinstance(expr, ExprList):
        return [name for e in expr.exprs for name in variable_names(e)]
    if isinstance(expr, (Gen, Select)) and expr.name is not None:
        return [expr.name]
    if isinstance(expr, VarScopeBegin):
        return [expr.name]
    return []


# -- programs --------------------------------------------------------------------------------
class Function:
    """A program: a Python function whose first argument is the state `s`."""

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ) -> None:
        params = list(inspect.signature(func).parameters.values())
        if not params or params[0].name != "s":
            raise TypeError(f"{func.__name__}: a program's first argument must be named s")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = [p.name for p in params[1:]]
        self.required = [
            p.name
            for p in params[1:]
            if p.default is inspect.Parameter.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]

    def bind(self, **kwargs: Any) -> Function:
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.func.__name__} has no arguments {unknown}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        stream: bool = False,
        backend: Any = None,
        use_thread: bool = True,  # SGLang's; a run here is on the caller's thread either way
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program once; sampling keywords (max_new_tokens, temperature, stop...) are
        the defaults of its gens. Without streaming it returns when the program has ended,
        and raises the first error of a backend call (SGLang's returns at once; run_batch
        runs programs concurrently)."""
        from radixserve.lang.interpreter import run_program

        defaults, kwargs = _split_sampling(kwargs)
        return run_program(self, _backend(backend), args, kwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[tuple | list],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Any,
    ) -> Any:
        """Run the program once per argument set, in parallel threads; a list of states
        (or, with generator_style, a generator of them in order). A program whose backend
        call failed raises that error when its state is read; the others are unaffected."""
        from radixserve.lang.interpreter import run_program_batch

        defaults, extra = _split_sampling(sampling)
        if extra:
            raise TypeError(f"run_batch got unexpected keyword arguments {sorted(extra)}")
        batch = [self._as_kwargs(args) for args in batch_kwargs]
        return run_program_batch(
            self, _backend(backend), batch, defaults, num_threads, progress_bar, generator_style
        )

    def trace(self, *, backend: Any = None, **kwargs: Any) -> Any:
        """The program's expressions up to the first one that depends on an argument or a
        generation, and the constant prefix they make (see tracer.py)."""
        from radixserve.lang.tracer import trace_program

        return trace_program(self, _backend(backend), kwargs)

    def cache(self, backend: Any = None) -> int | None:
        """Cache the program's constant prefix on the backend; its token count, or None when
        the prefix is too short to be worth it."""
        from radixserve.lang.tracer import cache_program

        return cache_program(self, _backend(backend))

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _as_kwargs(self, args: dict[str, Any] | tuple | list) -> dict[str, Any]:
        if isinstance(args, dict):
            return dict(args)
        if not isinstance(args, (tuple, list)) or len(args) > len(self.arg_names):
            raise TypeError(f"{self.func.__name__} takes arguments {self.arg_names}, got {args!r}")
        return dict(zip(self.arg_names, args))


_SAMPLING_DEFAULTS = {
    "max_new_tokens": 128,
    "min_new_tokens": None,
    "n": None,
    "stop": (),
    "stop_token_ids": (),
    "stop_regex": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "ignore_eos": False,
    "return_logprob": None,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "return_text_in_logprobs": None,
}


def _split_sampling(kwargs: dict[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
    """The program's default sampling settings, and the program's own keyword arguments."""
    values = dict(_SAMPLING_DEFAULTS)
    rest = {}
    for key, value in kwargs.items():
        if key in values:
            values[key] = value
        else:
            rest[key] = value
    return SamplingParams(**values), rest


def _backend(backend: Any) -> Any:
    from radixserve.lang.backend import as_backend

    chosen = backend if backend is not None else global_config.default_backend
    if chosen is None:
        raise RuntimeError(
            "no backend: pass backend=... or call set_default_backend(RuntimeEndpoint(url))"
        )
    return as_backend(chosen)
