"""The public names of the language, with SGLang's signatures, so a program written for
`import sglang as sgl` runs with `import radixserve.lang as sgl`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixserve.lang.global_config import global_config
from radixserve.lang.ir import (
    Expr,
    ExprList,
    Function,
    Gen,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
)


def function(func: Callable[..., Any] | None = None, num_api_spec_tokens: int | None = None) -> Any:
    """Decorator: `@function` or `@function(num_api_spec_tokens=...)`."""
    if func is not None:
        return Function(func, num_api_spec_tokens)
    return lambda f: Function(f, num_api_spec_tokens)


def Runtime(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (SGLang's name)
    from radixserve.lang.backend.runtime_endpoint import Runtime

    return Runtime(*args, **kwargs)


def Engine(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 (SGLang's name)
    """A `radixserve.Engine`; as a backend it runs programs in-process."""
    from radixserve.engine import Engine

    return Engine(*args, **kwargs)


def set_default_backend(backend: Any) -> None:
    """Programs run here unless given `backend=`. Kept as given (a Runtime stays a Runtime,
    as SGLang keeps it); checked to be usable now."""
    from radixserve.lang.backend import as_backend

    as_backend(backend)
    global_config.default_backend = backend


def flush_cache(backend: Any = None) -> bool:
    from radixserve.lang.backend import as_backend

    backend = backend or global_config.default_backend
    return False if backend is None else as_backend(backend).flush_cache()


def get_server_info(backend: Any = None) -> dict[str, Any] | None:
    from radixserve.lang.backend import as_backend

    backend = backend or global_config.default_backend
    return None if backend is None else as_backend(backend).get_server_info()


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: Any = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | None = None,
) -> Expr:
    """Generate into variable `name`; None means the program's default. With `choices`,
    this is `select`."""
    if choices:
        return Select(
            name,
            choices,
            0.0 if temperature is None else temperature,
            choices_method or token_length_normalized,
        )
    params = SamplingParams(
        max_new_tokens=max_tokens,
        min_new_tokens=min_tokens,
        n=n,
        stop=stop,
        stop_token_ids=stop_token_ids,
        stop_regex=stop_regex,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        frequency_penalty=frequency_penalty,
        presence_penalty=presence_penalty,
        ignore_eos=ignore_eos,
        return_logprob=return_logprob,
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        dtype=dtype,
        regex=regex,
        json_schema=json_schema,
    )
    return Gen(name, params)


def gen_int(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """An integer (gen with dtype=int): `[-+]?[0-9]+`, ended by a space or a newline."""
    return gen(name, max_tokens=max_tokens, dtype=int, **_typed_args(kwargs))


def gen_string(name: str | None = None, max_tokens: int | None = None, **kwargs: Any) -> Expr:
    """A double-quoted string of word characters and spaces (gen with dtype=str)."""
    return gen(name, max_tokens=max_tokens, dtype=str, **_typed_args(kwargs))


def _typed_args(kwargs: dict[str, Any]) -> dict[str, Any]:
    banned = {"dtype", "regex", "json_schema", "choices", "choices_method", "min_tokens"}
    bad = sorted(banned & kwargs.keys())
    if bad:
        raise TypeError(f"gen_int / gen_string take no {bad}")
    return kwargs


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Append the likeliest of `choices` (by `choices_method`) and store it in `name`."""
    if choices is None:
        raise ValueError("select needs choices")
    return Select(name, choices, temperature, choices_method)


def _role(role: str, expr: Expr | str | None) -> ExprList:
    if expr is None:
        return ExprList([RoleBegin(role), RoleEnd(role)])
    return RoleBegin(role) + expr + RoleEnd(role)


def system(expr: Expr | str | None = None) -> ExprList:
    return _role("system", expr)


def user(expr: Expr | str | None = None) -> ExprList:
    return _role("user", expr)


def assistant(expr: Expr | str | None = None) -> ExprList:
    return _role("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")
