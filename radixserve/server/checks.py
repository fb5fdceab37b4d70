"""The edge's last checks of a call, once expanded into sequences: what the served model
can take (token ids in its vocabulary, prompt + output within its context) and the share of
the queue one request may take. Engine errors become 400s naming the field as each API
names it (`sampling_params.max_new_tokens` natively, `max_tokens` for OpenAI)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParamsError
from radixserve.native import InvalidRequest
from radixserve.server.errors import APIError, bad_request
from radixserve.server.state import ServerState

# Sequences (prompts × n) one HTTP request may queue: an eighth of the default queue
# (--max-queued-requests 2048), twice OpenAI's cap on n (128, checked by SamplingParams).
MAX_SEQUENCES_PER_REQUEST = 256
MAX_TOP_LOGPROBS = 20  # alternatives per position: OpenAI's cap on top_logprobs, also native
# tokens whose logprobs a native request may ask for at every position (each is a triple
# in every position's entry: a classifier's labels, a teacher's candidates)
MAX_TOKEN_IDS_LOGPROB = 1024


@dataclass(frozen=True)
class Fields:
    """How one API names the fields the engine's errors speak of."""

    prompt: str  # the prompt's field
    sampling_prefix: str = ""  # where sampling fields live ("sampling_params." natively)
    renamed: dict[str, str] = field(default_factory=dict)  # engine name → API name

    def name(self, engine_name: str | None, sampling: bool = False) -> str | None:
        if engine_name is None:  # sampling_params as a whole, natively; else no one field
            return (self.sampling_prefix.rstrip(".") or None) if sampling else None
        if engine_name in ("text", "input_ids"):
            return self.prompt
        api_name = self.renamed.get(engine_name, engine_name)
        return self.sampling_prefix + api_name if sampling else api_name

    def message(self, text: str) -> str:
        """The engine's message in the API's words."""
        if not self.renamed:
            return text
        text = text.replace("`sampling_params.", "`")
        pattern = r"\b(" + "|".join(map(re.escape, self.renamed)) + r")\b"
        return re.sub(pattern, lambda m: self.renamed[m.group(1)], text)


def native_fields(prompt: str) -> Fields:
    return Fields(prompt, sampling_prefix="sampling_params.")


_OPENAI_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "structural_tag": "response_format",  # the only way OpenAI's routes take one
}
COMPLETION_FIELDS = Fields(
    "prompt", renamed={**_OPENAI_NAMES, "sampling_seed": "seed", "top_logprobs_num": "logprobs"}
)
CHAT_FIELDS = Fields(
    "messages",
    renamed={**_OPENAI_NAMES, "sampling_seed": "seed", "top_logprobs_num": "top_logprobs"},
)


# /v1/responses (a refused grammar is named by `constraint_error`: text.format or tools)
RESPONSES_FIELDS = Fields(
    "input",
    renamed={
        "max_new_tokens": "max_output_tokens",
        "min_new_tokens": "min_tokens",
        "sampling_seed": "seed",
        "top_logprobs_num": "top_logprobs",
        "response_format": "text.format",  # the chat route's name for it
    },
)


def renamed(e: APIError, fields: Fields) -> APIError:
    """An error the engine raised about its own field names, in the API's words."""
    param = fields.name(e.param) if e.param is not None else None
    return APIError(e.status, fields.message(e.message), e.type, param, e.code)


CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")  # the engine's names


def constraint_error(e: APIError, field: str | None) -> APIError:
    """An error about the output's constraint (a grammar the engine refused), naming the
    request's `field` it came from rather than the engine's kind of constraint."""
    if field is None or e.param not in CONSTRAINT_KINDS:
        return e
    return renamed(e, Fields("", renamed={e.param: field}))


def call_error(e: ValueError, fields: Fields) -> APIError:
    """A ValueError from expanding a call (SamplingParams, expand_request, Req) as a 400
    whose message starts with the field's name when it does not name it already."""
    code = None
    if isinstance(e, SamplingParamsError):
        param = fields.name(e.field, sampling=True)
    elif isinstance(e, InvalidRequest):
        param, code = fields.name(e.param), e.code
    else:
        param = None
    message = fields.message(str(e))
    if param is not None and param.rpartition(".")[2] not in message:
        message = f"{param}: {message}"
    return bad_request(message, param=param, code=code)


def check_sequences(reqs: list[Req], state: ServerState, fields: Fields) -> None:
    """What expand_request cannot know: the served model's vocabulary and context (the
    context first: it bounds how many ids the vocabulary check then scans)."""
    model = state.model
    for req in reqs:
        _check_context(req, state, fields)
    for req in {id(r.input_ids): r for r in reqs}.values():  # the n samples share a prompt
        bad = [t for t in req.input_ids if not 0 <= t < model.vocab_size]
        if bad:
            raise bad_request(
                f"{fields.prompt} has token ids outside the vocabulary "
                f"[0, {model.vocab_size}): {bad[:8]}",
                param=fields.prompt,
            )
    for params in {id(r.params): r.params for r in reqs}.values():
        try:
            params.verify_vocab(model.vocab_size)
        except SamplingParamsError as e:
            raise call_error(e, fields) from None
    for req in reqs:
        if req.top_logprobs_num > MAX_TOP_LOGPROBS:
            name = fields.name("top_logprobs_num")
            raise bad_request(f"{name} must be at most {MAX_TOP_LOGPROBS}", param=name)
        named = req.token_ids_logprob or []
        if len(named) > MAX_TOKEN_IDS_LOGPROB:
            message = f"token_ids_logprob has {len(named)} ids; at most {MAX_TOKEN_IDS_LOGPROB}"
            raise bad_request(message, param="token_ids_logprob")
        bad = [t for t in named if not 0 <= t < model.vocab_size]
        if bad:
            raise bad_request(
                f"token_ids_logprob has token ids outside the vocabulary "
                f"[0, {model.vocab_size}): {bad[:8]}",
                param="token_ids_logprob",
            )


def _check_context(req: Req, state: ServerState, fields: Fields) -> None:
    try:
        state.manager.check_context(req)
    except APIError as e:
        too_long = len(req.input_ids) > state.model.max_seq_len
        param = fields.prompt if too_long else fields.name("max_new_tokens", sampling=True)
        message = f"{e.message} (field: {param})"
        raise APIError(e.status, message, param=param, code=e.code) from None
