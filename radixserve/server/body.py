"""Request bodies: parsed strictly before FastAPI validates them against a route's model.

FastAPI would accept JSON the engine cannot use (lone UTF-16 surrogates, integers of any
size, nesting as deep as the interpreter's stack) and would answer a model mismatch with
its own 422. Here every body is checked once at the edge and every problem is a 400 in the
OpenAI error shape naming the field, so no such value ever reaches the tokenizer or the
scheduler.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Literal, TypeVar

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict
from starlette.requests import ClientDisconnect

from radixserve.server.errors import APIError, bad_request

MAX_JSON_DEPTH = 64  # containers nested in a body; real clients send 5 or fewer
# The largest body a route reads: 256 sequences (checks.MAX_SEQUENCES_PER_REQUEST) of a
# 32k-token prompt as JSON ids fit; past it a 413 comes before the body is read in full.
MAX_BODY_BYTES = 64 << 20
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # every integer of a body fits in 64 bits
_SURROGATE = re.compile("[\ud800-\udfff]")  # only lone ones survive json.loads

# A body past this size is parsed and checked (`load_body`: ~0.25 s for a million token ids,
# ~5 s at MAX_BODY_BYTES) and expanded into requests (tokenized) on a worker thread:
# tokenizing takes ~0.5-1 us a character, so a 1 MB prompt done inline would hold up every
# other request for ~1 s (the tokenizers library lets go of the GIL while it works; pure
# Python work gives the event loop its turn every few ms).
THREAD_BODY_BYTES = 64 << 10

T = TypeVar("T")
Path = Sequence[str | int]
_JSON_KINDS = {dict: "an object", list: "an array", str: "a string", int: "an integer"}
_JSON_KINDS |= {float: "a decimal number", bool: "a boolean", type(None): "null"}


# OpenAI's service tiers: "flex" requests run after the others' (core/req.py `deferred`);
# every other tier is served as "default"
ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


def tier_served(given: str | None) -> str:
    return "flex" if given == "flex" else "default"


class StrictBody(BaseModel):
    """A request body's model, or a part of one: a field takes a value of its own JSON type
    only, as OpenAI's API checks (`true` is not an integer, `"2"` is not a number, `"yes"`
    is not a boolean, `1.0` is not an integer); a JSON integer is still a number where a
    float is expected. A model's own `model_config` adds to this one."""

    model_config = ConfigDict(strict=True)


def field_name(path: Path) -> str | None:
    """`sampling_params.stop.0` for the path (sampling_params, stop, 0); None at the top."""
    return ".".join(str(p) for p in path) or None


def load_body(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object whose every value the engine can take; else a 400."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise _too_deep(None) from None
    except ValueError as e:  # bad JSON or UTF-8, NaN/Infinity, an integer of > 4300 digits
        raise bad_request(f"the body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request(f"the body must be a JSON object, got {_JSON_KINDS[type(data)]}")
    check_value(data, [], depth=1)
    return data


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _too_deep(path: Path | None) -> APIError:
    where = field_name(path) if path else None
    at = f"{where}: " if where else "the body "
    return bad_request(f"{at}nests deeper than {MAX_JSON_DEPTH} levels", param=where)


def check_value(value: Any, path: list[str | int], depth: int) -> None:
    """Raise a 400 naming the field of the first value out of range: a container nested
    deeper than MAX_JSON_DEPTH, a string with a lone surrogate, an integer outside 64 bits,
    or a float that overflowed to infinity (1e400)."""
    if isinstance(value, str):
        _check_text(value, path)
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            name = field_name(path)
            raise bad_request(f"{name}: integer outside the 64-bit range", param=name)
    elif isinstance(value, float):
        if not math.isfinite(value):
            name = field_name(path)
            raise bad_request(f"{name}: number too large (not a finite float)", param=name)
    elif isinstance(value, (list, dict)):
        if depth > MAX_JSON_DEPTH:
            raise _too_deep(path)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(key, str):
                _check_text(key, [*path, key])
            check_value(item, [*path, key], depth + 1)


def _check_text(text: str, path: Path) -> None:
    if not text.isascii() and _SURROGATE.search(text):
        name = field_name(path)
        raise bad_request(f"{name}: the string is not valid Unicode (a lone surrogate)", name)


# How pydantic names the member of a union that failed, in an error's location: `str`,
# `list[int]`, `dict[str,any]`, `literal['none','auto']`, a model's class name. Field names
# (snake_case) and list indexes are the rest.
_TYPE_TAG = re.compile(r"[A-Z]\w*|(str|int|float|bool|none|bytes)|\w+\[.*\]|function-\w+.*")


def union_member(part: str | int) -> bool:
    return isinstance(part, str) and _TYPE_TAG.fullmatch(part) is not None


# pydantic's error types for a value of the wrong JSON type, and the type it expected
_EXPECTED_KINDS = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "a boolean",
    "string_type": "a string",
    "list_type": "an array",
    "dict_type": "an object",
    "model_type": "an object",
}


def validation_error(e: RequestValidationError) -> APIError:
    """FastAPI's 422 as the project's 400, naming the first field that failed. A value of
    the wrong type is said as OpenAI says it: "Invalid type for 'n': expected an integer,
    but got a string instead", with every type its field's union would take."""
    errors = e.errors()
    first = errors[0]
    if first["type"] in _EXPECTED_KINDS:  # where a union's members got furthest into it
        same_field = [err for err in errors if err["loc"][:2] == first["loc"][:2]]
        first = max(same_field, key=lambda err: len(err["loc"]))
    field = _error_field(first)
    if first["type"] == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {field}"
    elif first["type"] in _EXPECTED_KINDS:
        kinds = [
            _EXPECTED_KINDS[err["type"]]
            for err in errors
            if err["type"] in _EXPECTED_KINDS and _error_field(err) == field
        ]
        expected = " or ".join(dict.fromkeys(kinds))
        got = _JSON_KINDS.get(type(first["input"]), type(first["input"]).__name__)
        message = f"Invalid type for '{field}': expected {expected}, but got {got} instead"
    else:
        reason = first["msg"].removeprefix("Value error, ")  # pydantic's wording for a ValueError
        message = f"{field}: {reason}" if field else reason
    return bad_request(message, param=field)


def _error_field(error: dict[str, Any]) -> str | None:
    """The field a pydantic error is about, as the client named it (no union tags)."""
    loc = list(error["loc"])
    if loc[:1] == ["body"]:
        loc = loc[1:]
    return field_name([part for part in loc if not union_member(part)])


class JSONBodyRoute(APIRoute):
    """A route whose body, when it declares one, is a JSON object checked by `load_body`
    before FastAPI validates it against the declared model. The body is taken as JSON
    whatever Content-Type the client sent (curl -d sends a form type), as before."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        if self.body_field is None:
            return handler

        async def parse_then_handle(request: Request) -> Response:
            raw = await read_bounded(request)
            data = await off_the_loop_if(len(raw), load_body, raw)
            return await handler(_ParsedRequest(request, raw, data))

        return parse_then_handle


def _too_large() -> APIError:
    return APIError(
        413,
        f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB",
        code="request_too_large",
    )


async def read_bounded(request: Request) -> bytes:
    """The body, or a 413 as soon as it is known to exceed MAX_BODY_BYTES (from its
    Content-Length, else while it streams in)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise _too_large()
            chunks.append(chunk)
    except ClientDisconnect:  # it left while sending: no one to answer, nothing to log
        raise APIError(499, "the client disconnected while sending the body") from None
    return b"".join(chunks)


async def off_the_loop_if_large(request: Request, work: Callable[[], T], extra_bytes: int = 0) -> T:
    """`work()` (a body's expansion into requests), on a worker thread when the body (and
    `extra_bytes` of stored text it brings in: a conversation's earlier turns) is larger
    than THREAD_BODY_BYTES, so that other requests go on meanwhile."""
    return await off_the_loop_if(len(await request.body()) + extra_bytes, work)


async def off_the_loop_if(size: int, work: Callable[..., T], *args: Any) -> T:
    """`work(*args)`, on a worker thread when it handles more than THREAD_BODY_BYTES."""
    if size > THREAD_BODY_BYTES:
        return await asyncio.to_thread(work, *args)
    return work(*args)


class _ParsedRequest(Request):
    """The request with its body already read and parsed (and said to be JSON)."""

    def __init__(self, request: Request, raw: bytes, data: dict[str, Any]) -> None:
        headers = [(k, v) for k, v in request.scope["headers"] if k != b"content-type"]
        headers.append((b"content-type", b"application/json"))
        super().__init__({**request.scope, "headers": headers}, request.receive)
        self._raw = raw
        self._data = data

    async def body(self) -> bytes:
        return self._raw

    async def json(self) -> Any:
        return self._data
