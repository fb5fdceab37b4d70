"""Embeddings at the edge: the native `/encode` and OpenAI's `/v1/embeddings` bodies, their
translation into embedding requests (prefill-only sequences pooled by the scheduler, see
core/embedding.py), and the answers' shapes.

Pooling and normalization are server flags (--embedding-pooling, --embedding-normalize),
since the OpenAI API has no field for them. `encoding_format: "base64"` (what the `openai`
client asks for unless told otherwise) is the vector's little-endian float32 bytes in base64.
"""

from __future__ import annotations

import base64
import struct
from typing import Any, Literal

from pydantic import ConfigDict

from radixserve.config import EmbeddingConfig
from radixserve.core.embedding import EmbedParams
from radixserve.core.req import Req
from radixserve.native import Expanded, expand_embedding
from radixserve.server.body import ServiceTier, StrictBody
from radixserve.server.checks import (
    MAX_SEQUENCES_PER_REQUEST,
    Fields,
    call_error,
    check_sequences,
    native_fields,
)
from radixserve.server.errors import APIError, bad_request
from radixserve.server.state import ServerState

EMBEDDING_FIELDS = Fields("input")
INPUT_KINDS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class EncodeRequest(StrictBody):
    """The native /encode body (SGLang's): exactly one of text and input_ids; a list is a
    batch. Unknown top-level fields are ignored, as /generate does."""

    model_config = ConfigDict(extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None  # as /generate's


class EmbeddingRequest(StrictBody):
    """OpenAI's /v1/embeddings body (unknown fields refused, as OpenAI does)."""

    model_config = ConfigDict(extra="forbid")
    input: Any  # checked by `split_input`, so that its errors name the problem
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    service_tier: ServiceTier | None = None  # (an extension: "flex" defers them, as chat's)


def embed_params(config: EmbeddingConfig) -> EmbedParams:
    return EmbedParams(config.embedding_pooling, config.embedding_normalize)  # type: ignore[arg-type]


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def split_input(value: Any) -> tuple[str | list[str] | None, list[int] | list[list[int]] | None]:
    """OpenAI's `input` as (texts, token ids), exactly one of them set; a 400 naming what is
    wrong otherwise."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input is empty: give a non-empty string", param="input")
        return value, None
    if not isinstance(value, list) or not value:
        kind = "an empty list" if value == [] else type(value).__name__
        raise bad_request(f"input must be {INPUT_KINDS}, got {kind}", param="input")
    if all(isinstance(x, str) for x in value):
        if not all(value):
            raise bad_request("input has an empty string", param="input")
        return value, None
    if all(_is_token_id(x) for x in value):
        return None, value
    if all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in value):
        if not all(value):
            raise bad_request("input has an empty list of token ids", param="input")
        return None, value
    kinds = sorted({type(x).__name__ for x in value})
    raise bad_request(
        f"input must be {INPUT_KINDS}; got a list of {', '.join(kinds)} (types mixed or "
        "not text/token ids)",
        param="input",
    )


def check_dimensions(dimensions: int | None, hidden_size: int) -> None:
    if dimensions is not None and dimensions != hidden_size:
        raise bad_request(
            f"dimensions: this model's embeddings have {hidden_size} dimensions and cannot be "
            f"shortened; got dimensions={dimensions} (omit it or pass {hidden_size})",
            param="dimensions",
        )


def encode_reqs(body: EncodeRequest, state: ServerState) -> Expanded:
    """The /encode call's embedding requests, checked against the served model."""
    fields = native_fields("input_ids" if body.input_ids is not None else "text")
    params = embed_params(state.config.embedding)
    try:
        expanded = expand_embedding(
            state.manager.encode,
            body.text,
            body.input_ids,
            params,
            body.rid,
            max_sequences=MAX_SEQUENCES_PER_REQUEST,
            lora_ids=state.loras.uids(body.lora_path),
        )
    except ValueError as e:
        raise call_error(e, fields) from None
    check_sequences(expanded.reqs, state, fields)
    return expanded


def embedding_reqs(body: EmbeddingRequest, state: ServerState) -> list[Req]:
    """The /v1/embeddings call's embedding requests, checked against the served model."""
    check_dimensions(body.dimensions, state.manager.info.hidden_size)  # type: ignore[union-attr]
    texts, ids = split_input(body.input)
    params = embed_params(state.config.embedding)
    lora_id = state.adapter_of(body.model)  # an adapter's name, or the base model
    try:
        expanded = expand_embedding(
            state.manager.encode,
            texts,
            ids,
            params,
            max_sequences=MAX_SEQUENCES_PER_REQUEST,
            lora_ids=lora_id,
        )
    except ValueError as e:
        raise call_error(e, EMBEDDING_FIELDS) from None
    check_sequences(expanded.reqs, state, EMBEDDING_FIELDS)
    return expanded.reqs


def encode_vector(vector: list[float], encoding_format: str) -> list[float] | str:
    """The vector as OpenAI sends it: floats, or base64 of little-endian float32 bytes."""
    if encoding_format == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def embedding_response(results: list[dict[str, Any]], fmt: str, model: str) -> dict[str, Any]:
    """OpenAI's answer: one embedding per input in order, vectors in `fmt` (float/base64);
    a 503 if one was aborted before its prompt ran (a pause, a weight update, a stop)."""
    for r in results:
        if "embedding" not in r:
            reason = r["meta_info"].get("finish_reason") or {}
            message = f"an embedding request was aborted before it ran: {reason.get('message')}"
            raise APIError(503, message)
    prompt_tokens = sum(r["meta_info"]["prompt_tokens"] for r in results)
    data = [
        {"object": "embedding", "index": i, "embedding": encode_vector(r["embedding"], fmt)}
        for i, r in enumerate(results)
    ]
    return {
        "object": "list",
        "data": data,
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
