"""`OpenAI`: any OpenAI-compatible server (OpenAI's API, a radixserve or SGLang server's
`/v1` routes, vLLM...) through the `openai` package.

A chat model gets the program's messages and may only continue an assistant turn; a
completion model gets the program's text. Sampling settings the OpenAI API does not define
(top_k, min_p, regex...) travel in the request's `extra_body` when a gen sets them, so a
server that does not know them refuses the call (its 400 is the program's error) instead
of ignoring them.

`select` on a completion model scores every choice in one echo call (the prompt's own
logprobs, with `echo=True, logprobs=1`); a server that refuses echoed logprobs gets SGLang's
method instead, one biased greedy token at a time. Token ids, which the OpenAI API does not
return, come from the server's `POST /tokenize` (radixserve's and SGLang's), as do the ids
`dtype=int` biases towards.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import accumulate
from typing import TYPE_CHECKING, Any

import httpx2
import openai

from radixserve.lang.backend.base import Backend, BackendError
from radixserve.lang.chat_template import (
    ChatTemplate,
    get_chat_template,
    get_chat_template_by_model_path,
)
from radixserve.lang.choices import ChoiceScores, ChoicesDecision, ChoicesSamplingMethod

if TYPE_CHECKING:
    from radixserve.lang.interpreter import Executor
    from radixserve.lang.ir import SamplingParams

PROBE_TIMEOUT_S = 5.0  # the server's native routes (/get_model_info...): answer fast or not
NATIVE_TIMEOUT_S = 60.0  # /tokenize, /flush_cache, /get_server_info once known to answer
FORCE_BIAS = 100  # OpenAI's largest logit_bias: only the biased tokens can be sampled
INT_TEXTS = (*"0123456789", " ")  # what dtype=int may generate (and the EOS token)
REFUSED = (400, 422)  # statuses of a request the server will not serve as asked


@dataclass
class TokenUsage:
    """Tokens the backend's calls have used so far (SGLang's `backend.token_usage`)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(self, usage: Any) -> None:
        if usage is None:
            return
        with self._lock:
            self.prompt_tokens += usage.prompt_tokens or 0
            self.completion_tokens += usage.completion_tokens or 0

    def reset(self) -> None:
        with self._lock:
            self.prompt_tokens = self.completion_tokens = 0


@dataclass(frozen=True)
class _Request:
    """One generation call: the endpoint's arguments, and the quote a str dtype puts around
    the generated text (its opening quote ends the prompt, its closing one stops it)."""

    kwargs: dict[str, Any]
    quote: str = ""


@dataclass(frozen=True)
class _Echo:
    """A prompt as the server echoed it: each token's text, logprob and start offset."""

    tokens: list[str]
    logprobs: list[float | None]
    offsets: list[int] | None  # None when the server does not send `text_offset`


class _EchoRefused(BackendError):
    """The server refused the echo call that returns a prompt's logprobs."""


class OpenAI(Backend):
    def __init__(
        self,
        model_name: str,
        is_chat_model: bool | None = None,
        chat_template: ChatTemplate | str | None = None,
        base_url: str | None = None,
        api_key: str | None = None,
        **client_kwargs: Any,
    ) -> None:
        """`model_name` as the server knows it; a chat model unless `is_chat_model=False`.
        `api_key` defaults to $OPENAI_API_KEY, else "EMPTY" (a local server); the other
        keywords go to `openai.OpenAI` (timeout, max_retries, default_headers...)."""
        api_key = api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_kwargs)
        self.model_name = model_name
        self.is_chat_model = True if is_chat_model is None else is_chat_model
        self.root = _server_root(str(self.client.base_url))
        self._http = httpx2.Client(
            headers={"Authorization": f"Bearer {api_key}"}, timeout=NATIVE_TIMEOUT_S
        )
        self.chat_template = self._chat_template(chat_template)
        self.chat_prefix = self.chat_template.get_prefix_and_suffix("assistant")[0]
        self.token_usage = TokenUsage()
        self._score_max_tokens = 0  # raised to 1 if the server refuses echo with 0
        self._int_bias: dict[str, int] | None = None

    def _chat_template(self, given: ChatTemplate | str | None) -> ChatTemplate:
        """The given template; else the roles a radixserve-like server reports; else one
        picked from the model's name."""
        if isinstance(given, str):
            return get_chat_template(given)
        if given is not None:
            return given
        info = self._native_get("/get_model_info", PROBE_TIMEOUT_S)
        roles = info.get("chat_roles") if isinstance(info, dict) else None
        if roles:
            return ChatTemplate.from_server(roles)
        return get_chat_template_by_model_path(self.model_name)

    # -- the backend interface ------------------------------------------------------------
    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(
        self, s: Executor, params: SamplingParams
    ) -> tuple[str | list[str], dict[str, Any]]:
        request = self._request(s, params)
        response = self._call(self._endpoint(), **request.kwargs)
        choices = sorted(response.choices, key=lambda c: c.index)
        texts = [request.quote + self._text(c) + request.quote for c in choices]
        usage = response.usage.model_dump(exclude_none=True) if response.usage else None
        metas = [_meta_info(usage, c.finish_reason) for c in choices]
        if (params.n or 1) > 1:
            return texts, metas
        return texts[0], metas[0]

    def generate_stream(
        self, s: Executor, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        request = self._request(s, params)
        stream_kwargs = {"stream": True, "stream_options": {"include_usage": True}}
        meta: dict[str, Any] = {"usage": None, "finish_reason": None}
        with self._errors():
            stream = self._call(self._endpoint(), **request.kwargs, **stream_kwargs)
            with stream:
                if request.quote:
                    yield request.quote, dict(meta)
                for chunk in stream:
                    if chunk.usage is not None:  # the last chunk (include_usage)
                        self.token_usage.add(chunk.usage)
                        usage = chunk.usage.model_dump(exclude_none=True)
                        meta = _meta_info(usage, meta["finish_reason"])
                    for choice in chunk.choices:
                        meta["finish_reason"] = choice.finish_reason or meta["finish_reason"]
                        yield self._delta(choice), dict(meta)
        yield request.quote, dict(meta)

    def select(
        self,
        s: Executor,
        choices: list[str],
        temperature: float,
        choices_method: ChoicesSamplingMethod,
    ) -> ChoicesDecision:
        self._require_completion_model()
        try:
            return super().select(s, choices, temperature, choices_method)
        except _EchoRefused as refused:
            if choices_method.requires_unconditional_logprobs:
                raise BackendError(
                    "unconditional_likelihood_normalized needs the prompt's logprobs, and "
                    f"the server refused the call asking for them (echo + logprobs): "
                    f"{refused}; token_length_normalized and greedy_token_selection work "
                    "without them"
                ) from refused
        return self._select_by_logit_bias(s.text_, choices)

    def score_choices(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> list[ChoiceScores]:
        """One echo call over every prefix + choice (as token ids, so each echoed token's
        id is known), then, for `unconditional`, one over the choices' own tokens."""
        self._require_completion_model()
        prefix_ids, *full_ids = self._tokenize([prefix, *(prefix + c for c in choices)], True)
        echoes = self._echo(full_ids)
        spans = [
            _choice_span(echo, ids, prefix_ids, choice)
            for echo, ids, choice in zip(echoes, full_ids, choices)
        ]
        span_ids = [ids[first:] for ids, (first, _) in zip(full_ids, spans)]
        uncond = [e.logprobs for e in self._echo(span_ids)] if unconditional else None
        return [
            ChoiceScores(
                span_ids[i],
                echoes[i].logprobs[first:],
                None if uncond is None else uncond[i],
                healed,
                echoes[i].tokens[first:],
            )
            for i, (first, healed) in enumerate(spans)
        ]

    def cache_prefix(self, prefix: str) -> int:
        """Prefill the prefix (a server with a prefix cache keeps it); its token count. A
        chat API has no prefix to cache: 0, without a call."""
        if self.is_chat_model:
            return 0
        response = self._smallest_completion(prompt=prefix)
        return int(response.usage.prompt_tokens)

    def flush_cache(self) -> bool:
        try:
            return self._http.post(self.root + "/flush_cache").status_code == 200
        except httpx2.HTTPError:
            return False

    def get_server_info(self) -> dict[str, Any]:
        info = self._native_get("/get_server_info", NATIVE_TIMEOUT_S)
        return info if isinstance(info, dict) else {}

    def shutdown(self) -> None:
        self.client.close()
        self._http.close()

    # -- generation -----------------------------------------------------------------------
    def _request(self, s: Executor, params: SamplingParams) -> _Request:
        if params.return_logprob:
            raise ValueError(
                "the OpenAI backend does not return logprobs: use RuntimeEndpoint for them"
            )
        if self.is_chat_model:
            if params.dtype is not None:
                raise ValueError(
                    f"dtype={params.dtype!r} needs a completion model (is_chat_model=False): "
                    "a chat model's output cannot be steered token by token; use regex="
                )
            if not s.text_.endswith(self.chat_prefix):
                raise ValueError(
                    "a chat model only continues an assistant turn: gen must come right "
                    "after assistant begins (s += assistant(gen(...))), with no text before "
                    "it in the turn, since the API receives the messages, not the text"
                )
            prompt: dict[str, Any] = {"messages": list(s.messages_)}
        else:
            prompt = {"prompt": s.text_}
        kwargs = {**prompt, **_standard_fields(params)}
        extra = _extra_fields(params)
        if extra:
            kwargs["extra_body"] = extra
        if params.dtype is None:
            return _Request(kwargs)
        # the dtype's own stops replace the gen's (SGLang's rule)
        if params.dtype in (int, "int"):
            return _Request({**kwargs, "logit_bias": self._int_logit_bias(), "stop": [" ", "\n"]})
        if params.dtype in (str, "str", "string"):
            return _Request({**kwargs, "prompt": s.text_ + '"', "stop": ['"']}, quote='"')
        raise ValueError(
            f"dtype {params.dtype!r} is not supported by the OpenAI backend (int and str "
            "are); use regex= on a server that takes it"
        )

    def _int_logit_bias(self) -> dict[str, int]:
        """+100 on the tokens of the digits, the space and EOS (so an integer can end)."""
        if self._int_bias is None:
            ids = self._tokenize(list(INT_TEXTS), add_special_tokens=False)
            bias = {}
            for text, tokens in zip(INT_TEXTS, ids):
                if len(tokens) != 1:
                    raise BackendError(
                        f"dtype=int: the server's tokenizer makes {text!r} {len(tokens)} "
                        "tokens, so there is no token to bias towards"
                    )
                bias[str(tokens[0])] = FORCE_BIAS
            eos = self._native_get("/tokenizer_info", PROBE_TIMEOUT_S)
            if isinstance(eos, dict) and isinstance(eos.get("eos_token_id"), int):
                bias[str(eos["eos_token_id"])] = FORCE_BIAS
            self._int_bias = bias
        return self._int_bias

    def _endpoint(self) -> Callable[..., Any]:
        if self.is_chat_model:
            return self.client.chat.completions.create
        return self.client.completions.create

    def _text(self, choice: Any) -> str:
        return (choice.message.content or "") if self.is_chat_model else choice.text

    def _delta(self, choice: Any) -> str:
        return (choice.delta.content or "") if self.is_chat_model else (choice.text or "")

    def _call(self, create: Callable[..., Any], **kwargs: Any) -> Any:
        """One API call; a refused or failed one as a BackendError, usage counted."""
        with self._errors():
            response = create(model=self.model_name, **kwargs)
        if not kwargs.get("stream"):
            self.token_usage.add(response.usage)
        return response

    @contextmanager
    def _errors(self) -> Iterator[None]:
        try:
            yield
        except openai.APIStatusError as e:
            raise BackendError(_message(e), e.status_code) from e
        except openai.APIError as e:  # no connection, a timeout, an error event mid-stream
            raise BackendError(_message(e)) from e

    # -- scoring --------------------------------------------------------------------------
    def _echo(self, prompts: list[list[int]]) -> list[_Echo]:
        """Each prompt's own tokens as echoed with their logprobs (first: None)."""
        try:
            response = self._smallest_completion(
                prompt=prompts, echo=True, logprobs=1, temperature=0
            )
        except BackendError as e:
            if e.status in REFUSED:
                raise _EchoRefused(str(e)) from e
            raise
        echoes = []
        for choice, ids in zip(sorted(response.choices, key=lambda c: c.index), prompts):
            lp = choice.logprobs
            if lp is None or lp.tokens is None or len(lp.tokens) < len(ids):
                raise _EchoRefused("the server did not echo the prompt's logprobs")
            n = len(ids)  # the echoed prompt, without the generated token (max_tokens 1)
            offsets = list(lp.text_offset[:n]) if lp.text_offset else None
            echoes.append(_Echo(list(lp.tokens[:n]), list(lp.token_logprobs[:n]), offsets))
        return echoes

    def _smallest_completion(self, **kwargs: Any) -> Any:
        """A completion generating as little as the server allows: 0 tokens, else 1."""
        try:
            return self._call(
                self.client.completions.create, max_tokens=self._score_max_tokens, **kwargs
            )
        except BackendError as e:
            if e.status not in REFUSED or self._score_max_tokens > 0:
                raise
        self._score_max_tokens = 1
        return self._call(self.client.completions.create, max_tokens=1, **kwargs)

    def _select_by_logit_bias(self, text: str, choices: list[str]) -> ChoicesDecision:
        """SGLang's method for servers without prompt logprobs: token by token, bias the
        next token of every choice still in the running by +100 and let the model pick
        greedily; a choice scores a point per token the model picks for it. The choice
        with most points wins; meta_info holds the points (`scores`)."""
        prompt = self._tokenize([text], add_special_tokens=True)[0]
        choice_ids = self._tokenize(choices, add_special_tokens=False)
        scores = [0] * len(choices)
        running = [i for i, ids in enumerate(choice_ids) if ids]
        step = 0
        while len(running) > 1:
            bias = {str(choice_ids[i][step]): FORCE_BIAS for i in running}
            response = self._call(
                self.client.completions.create,
                prompt=prompt,
                logit_bias=bias,
                max_tokens=1,
                temperature=0,
            )
            picked = self._tokenize([response.choices[0].text], add_special_tokens=False)[0]
            if not picked or str(picked[0]) not in bias:
                raise BackendError(
                    f"the server did not follow logit_bias: it generated "
                    f"{response.choices[0].text!r} where only {sorted(bias)} could be"
                )
            matched = [i for i in running if choice_ids[i][step] == picked[0]]
            for i in matched:
                scores[i] += 1
            step += 1
            running = [i for i in matched if len(choice_ids[i]) > step]
            prompt = [*prompt, picked[0]]
        best = max(range(len(choices)), key=scores.__getitem__)
        return ChoicesDecision(choices[best], {"scores": scores})

    def _require_completion_model(self) -> None:
        if self.is_chat_model:
            raise ValueError(
                "select needs a completion model: a chat API cannot score choices; use "
                "OpenAI(model, is_chat_model=False) on a server with /v1/completions"
            )

    # -- the server's native routes -------------------------------------------------------
    def _tokenize(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Token ids as the server's tokenizer makes them (its POST /tokenize)."""
        body = {"prompt": texts, "add_special_tokens": add_special_tokens}
        try:
            response = self._http.post(self.root + "/tokenize", json=body)
        except httpx2.HTTPError as e:
            raise BackendError(f"cannot reach {self.root}/tokenize: {e}") from e
        if response.status_code != 200:
            raise BackendError(
                f"the server at {self.root} cannot tokenize (POST /tokenize answered "
                f"{response.status_code}): select and dtype=int on the OpenAI backend need "
                "it (radixserve and SGLang have it)",
                response.status_code,
            )
        tokens = response.json()["tokens"]
        if len(tokens) != len(texts) or not all(isinstance(t, list) for t in tokens):
            raise BackendError(f"{self.root}/tokenize did not answer one id list per prompt")
        return tokens

    def _native_get(self, route: str, timeout: float) -> Any:
        """The JSON of GET <root><route>, or None if the server has no such route."""
        try:
            response = self._http.get(self.root + route, timeout=timeout)
            return response.json() if response.status_code == 200 else None
        except (httpx2.HTTPError, ValueError):
            return None


def _standard_fields(params: SamplingParams) -> dict[str, Any]:
    out = {
        "max_tokens": params.max_new_tokens,
        "stop": _as_list(params.stop) or None,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "n": params.n,
        "frequency_penalty": params.frequency_penalty,
        "presence_penalty": params.presence_penalty,
    }
    return {k: v for k, v in out.items() if v is not None}


# the settings the OpenAI API lacks: (value, what leaves them off); a dtype wins over a regex
def _extra_fields(params: SamplingParams) -> dict[str, Any]:
    fields = {
        "top_k": (params.top_k, -1),
        "min_p": (params.min_p, 0.0),
        "min_tokens": (params.min_new_tokens, 0),
        "stop_token_ids": (list(params.stop_token_ids or ()), []),
        "ignore_eos": (params.ignore_eos, False),
        "regex": (None if params.dtype is not None else params.regex, None),
        "json_schema": (params.json_schema, None),
        "stop_regex": (_as_list(params.stop_regex) or None, None),
    }
    return {k: v for k, (v, off) in fields.items() if v is not None and v != off}


def _choice_span(
    echo: _Echo, ids: list[int], prefix_ids: list[int], choice: str
) -> tuple[int, int]:
    """Where the choice's own tokens start among the echoed prefix + choice, and how many
    of them begin inside the prefix (healed: the choice merged into the prefix's end). By
    the tokens' texts: the span starts at the first token that reaches past the prefix.
    Where the texts do not add up (a character split over tokens), by the ids: the span
    starts where prefix + choice stops matching the prefix's own tokens."""
    texts = echo.tokens
    if "".join(texts).endswith(choice):
        starts = echo.offsets or list(accumulate(map(len, texts), initial=0))[:-1]
        prefix_end = starts[-1] + len(texts[-1]) - len(choice)
        first = next(i for i, t in enumerate(texts) if starts[i] + len(t) > prefix_end)
        return first, int(starts[first] < prefix_end)
    common = 0
    while common < min(len(prefix_ids), len(ids) - 1) and prefix_ids[common] == ids[common]:
        common += 1
    return common, len(prefix_ids) - common


def _server_root(base_url: str) -> str:
    """Where a server's native routes live: the OpenAI base URL without its `/v1`."""
    root = base_url.rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


def _message(e: openai.APIError) -> str:
    body = e.body if isinstance(e, openai.APIStatusError) else None
    if isinstance(body, dict) and isinstance(body.get("message"), str):
        return body["message"]
    return e.message


def _as_list(value: str | list[str] | tuple[str, ...] | None) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _meta_info(usage: dict[str, Any] | None, finish_reason: Any) -> dict[str, Any]:
    """The API's usage and finish reason, with the counts under the native meta_info names
    (prompt/completion/cached tokens) so programs read them alike on every backend."""
    meta: dict[str, Any] = {"usage": usage, "finish_reason": finish_reason}
    if usage:
        details = usage.get("prompt_tokens_details") or {}
        meta["prompt_tokens"] = usage.get("prompt_tokens")
        meta["completion_tokens"] = usage.get("completion_tokens")
        meta["cached_tokens"] = details.get("cached_tokens", 0)
    return meta
