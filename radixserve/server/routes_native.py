"""The SGLang-native routes: health, model and server information, cache and abort control,
metrics, the tokenizer (lm-eval's discovery), /generate (see the wire contract, §1), /encode
(embeddings), /score_continuations (the frontend's select: several continuations of one
prefix) and /v1/score (SGLang's label-token scoring)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import msgspec
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ConfigDict, ValidationError, WithJsonSchema

from radixserve import __version__
from radixserve.core.messages import PauseMode
from radixserve.core.sampling_params import SamplingParams
from radixserve.label_scores import LabelScoring, ScoringAborted, plan_label_scoring, text_bytes
from radixserve.lora import registry as lora_registry
from radixserve.lora.registry import LoraRegistry
from radixserve.native import InvalidRequest, expand_request
from radixserve.scoring import ContextTooLong, check_fits, plan_scoring, token_texts
from radixserve.server.body import (
    JSONBodyRoute,
    ServiceTier,
    StrictBody,
    load_body,
    off_the_loop_if_large,
    validation_error,
)
from radixserve.server.checks import (
    MAX_SEQUENCES_PER_REQUEST,
    call_error,
    check_sequences,
    native_fields,
)
from radixserve.server.embeddings import EncodeRequest, encode_reqs
from radixserve.server.errors import ERROR_RESPONSES, APIError, bad_request
from radixserve.server.loads import (
    PROMETHEUS_TEXT,
    kv_in_use,
    loads_json,
    loads_prometheus,
    parse_include,
    replica_load,
)
from radixserve.server.reasoning import think_first
from radixserve.server.state import State
from radixserve.server.streaming import sse, until_disconnect
from radixserve.server.tokenizer_manager import Call

HEALTH_GENERATE_TIMEOUT_S = 20.0
STOP_PROFILE_TIMEOUT_S = 600.0  # writing a long profile's trace takes a while
# a weight update waits for the running requests to end: as long as they may take
UPDATE_WEIGHTS_TIMEOUT_S = 3600.0

router = APIRouter(route_class=JSONBodyRoute, responses=ERROR_RESPONSES)


def _sampling_params_schema() -> dict[str, Any]:
    """The sampling fields as OpenAPI shows them (SamplingParams validates them itself)."""
    _, components = msgspec.json.schema_components([SamplingParams])
    schema = components["SamplingParams"]
    return {**schema, "additionalProperties": False, "title": "SamplingParams"}


SamplingParamsBody = Annotated[dict[str, Any], WithJsonSchema(_sampling_params_schema())]


class GenerateRequest(StrictBody):
    """The native /generate body (unknown top-level fields are ignored, as SGLang does)."""

    model_config = ConfigDict(extra="ignore")
    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParamsBody | list[SamplingParamsBody] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    priority: int | None = None
    # the constraint applies after the model's reasoning (needs --reasoning-parser)
    require_reasoning: bool = False
    # a loaded LoRA adapter's name to run with, or one per prompt (None: the base model)
    lora_path: str | list[str | None] | None = None
    # meta_info.hidden_states: every position's final-norm hidden state (needs the flag
    # --enable-return-hidden-states, as SGLang's), for every prompt or one flag per prompt
    return_hidden_states: bool | list[bool] = False
    # SGLang's fields for what this server does not do: accepted at their defaults (clients
    # and routers send them so), a 400 naming them otherwise (see UNSUPPORTED)
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None


UNSUPPORTED = {
    "image_data": "image_data: this server runs text-only models",
    "video_data": "video_data: this server runs text-only models",
    "audio_data": "audio_data: this server runs text-only models",
}
HIDDEN_STATES_OFF = (
    "return_hidden_states needs the server started with --enable-return-hidden-states"
)


class TokenizeRequest(StrictBody):
    model_config = ConfigDict(extra="ignore")
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(StrictBody):
    model_config = ConfigDict(extra="ignore")
    tokens: list[int]


class ScoreContinuationsRequest(StrictBody):
    """The /score_continuations body: a prefix (text or input_ids) and its continuations."""

    model_config = ConfigDict(extra="forbid")
    text: str | None = None
    input_ids: list[int] | None = None
    continuations: list[str]
    unconditional: bool = False  # also score each continuation's span on its own
    rid: str | None = None
    lora_path: str | None = None  # a loaded LoRA adapter's name (None: the base model)


class LabelScoreRequest(StrictBody):
    """SGLang's /v1/score body: label tokens' probabilities after query + each item."""

    model_config = ConfigDict(extra="forbid")
    query: str | list[int] | None = None
    items: str | list[str] | list[list[int]] | None = None
    label_token_ids: list[int] | None = None
    apply_softmax: bool = False
    item_first: bool = False
    model: str | None = None  # the served model, or a loaded LoRA adapter's name
    service_tier: ServiceTier | None = None  # (an extension: "flex" defers them, as chat's)
    # SGLang's fields for what this server does not do: accepted at their defaults
    return_pooled_hidden_states: bool = False
    embed_override_token_id: Any = None
    query_embed_overrides: Any = None
    item_embed_overrides: Any = None


class AbortRequest(StrictBody):
    model_config = ConfigDict(extra="forbid")
    rid: str | None = None
    abort_all: bool = False


# -- health and information -----------------------------------------------------------------
@router.get("/health")
async def health(state: State) -> Response:
    manager = state.manager
    if manager.dead is not None or manager.draining or not manager.ready:
        reason = manager.dead or ("shutting down" if manager.draining else "starting")
        return JSONResponse(APIError(503, reason).body(), status_code=503)
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(state: State) -> Response:
    manager = state.manager
    if manager.paused is not None:  # it would wait for /continue_generation
        raise APIError(503, "generation is paused (/pause_generation): nothing generates")
    ids = manager.tokenizer.encode("ping") or [0]
    greedy = {"max_new_tokens": 1, "temperature": 0}  # (draws no seed)
    reqs = expand_request(manager.tokenizer.encode, None, greedy, ids).reqs
    call = manager.submit(reqs)
    try:
        await asyncio.wait_for(call.results(), HEALTH_GENERATE_TIMEOUT_S)
    except TimeoutError:
        raise APIError(503, "a 1-token generation did not finish in time") from None
    finally:
        call.close()
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")  # SGLang's newer name
async def get_model_info(state: State) -> dict[str, Any]:
    return {
        "model_path": state.model.path,
        "tokenizer_path": state.model.path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": state.manager.weight_version,
        "served_model_name": state.model_name,
        "chat_roles": roles.as_dict() if (roles := state.manager.chat_roles) else None,
    }


@router.get("/get_server_info")
@router.get("/server_info")  # SGLang's newer name (its frontend's get_server_info asks it)
async def get_server_info(state: State) -> dict[str, Any]:
    replica_states = await state.manager.control("get_state")  # one per replica
    return {
        **state.config.to_flat(),
        **state.model.fields,
        "served_model_name": state.model_name,
        # the sampling the OpenAI routes take where a request leaves it unset
        "default_sampling_params": state.manager.sampling_defaults,
        "version": __version__,
        "loaded_lora_adapters": state.loras.loaded(),
        "internal_states": replica_states,
    }


@router.get("/get_load")
async def get_load(state: State) -> list[dict[str, int]]:
    """Each replica's load, as SGLang's route gives it (sglang-router's load-aware policies
    and RL frameworks waiting for a drain read it): requests running or queued
    (`num_reqs`), those queued (`num_waiting_reqs`, grammars compiling included), and KV
    tokens in use by requests or asked for by the queued ones (`num_tokens`; the prefix
    cache's evictable K/V are not counted)."""
    loads = []
    for stats in await state.manager.control("get_state"):  # one per replica
        waiting = stats["num_waiting"] + stats["num_grammar_queue"]
        in_use = kv_in_use(stats)
        loads.append(
            {
                "dp_rank": stats["dp_rank"],
                "num_reqs": stats["num_running"] + waiting,
                "num_waiting_reqs": waiting,
                "num_tokens": in_use + stats["num_waiting_tokens"],
            }
        )
    return loads


@router.get("/v1/loads")
async def get_loads(
    state: State, dp_rank: int | None = None, include: str | None = None, format: str = "json"
) -> Response:
    """Each replica's load as SGLang's /v1/loads reports it (radixserve/server/loads.py)."""
    if format not in ("json", "prometheus"):
        raise bad_request(f"format must be json or prometheus, got {format!r}", param="format")
    sections = parse_include(include)
    replicas = await state.manager.control("get_state")  # one per replica
    if dp_rank is not None:
        replicas = [stats for stats in replicas if stats["dp_rank"] == dp_rank]
        if not replicas:
            raise bad_request(f"dp_rank {dp_rank}: there is no such replica", param="dp_rank")
    lora = state.config.lora
    max_running = state.manager.info.max_running_requests
    slots = lora.max_loras_per_batch if lora.enabled else None
    loads = [replica_load(stats, max_running, slots, sections) for stats in replicas]
    if format == "prometheus":
        return PlainTextResponse(loads_prometheus(loads), media_type=PROMETHEUS_TEXT)
    return JSONResponse(loads_json(loads, __version__))


@router.get("/flush_cache", operation_id="flush_cache_get")
@router.post("/flush_cache", operation_id="flush_cache_post")
async def flush_cache(state: State) -> Response:
    if all(await state.manager.control("flush_cache")):
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse(
        "Cache not flushed: requests are still running; retry when the server is idle.\n",
        status_code=400,
    )


class UpdateWeightsRequest(StrictBody):
    """SGLang's /update_weights_from_disk body (its other fields are ignored)."""

    model_config = ConfigDict(extra="ignore")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsRequest, state: State) -> Response:
    """Serve a checkpoint of the same model (an RL trainer's latest) in place of the loaded
    weights, as SGLang's route: once the running requests end (or are aborted, with
    abort_all_requests), requests sent meanwhile waiting and then running on the new
    weights; the prefix cache is emptied. `{"success", "message", "num_paused_requests"}`;
    a failure (the old weights stay) is a 400 that also carries the error shape."""
    if body.load_format not in (None, "auto"):
        raise bad_request("load_format: only auto is supported", param="load_format")
    args = {
        "model_path": body.model_path,
        "abort_all_requests": body.abort_all_requests,
        "weight_version": body.weight_version,  # back in the reply, for one that comes late
    }
    late = (
        "it waits for the running requests to end, and still applies once they have: "
        "/get_weight_version and /get_model_info will say so"
    )
    replies = await state.manager.control("update_weights", UPDATE_WEIGHTS_TIMEOUT_S, args, late)
    answer = {  # the replicas' answers as one
        "success": all(r.success for r in replies),
        "message": "; ".join(dict.fromkeys(r.message for r in replies)),
        "num_paused_requests": sum(r.num_paused_requests for r in replies),
    }
    if not answer["success"]:
        if any(r.success for r in replies):  # data parallelism: say what each serves now
            answer["message"] = "the replicas now serve different weights: " + "; ".join(
                f"replica {i}: {r.message}" for i, r in enumerate(replies)
            )
        error = bad_request(answer["message"], param="model_path")
        return JSONResponse({**answer, **error.body()}, status_code=400)
    state.manager.weights_updated(replies[0].model_path, body.weight_version)
    return JSONResponse(answer)


class LoadLoraRequest(StrictBody):
    """SGLang's /load_lora_adapter body (and vLLM's /v1/load_lora_adapter)."""

    model_config = ConfigDict(extra="ignore")  # SGLang's `pinned`: every adapter is resident
    lora_name: str
    lora_path: str


class UnloadLoraRequest(StrictBody):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


@router.post("/load_lora_adapter")
@router.post("/v1/load_lora_adapter", operation_id="load_lora_adapter_v1")
async def load_lora_adapter(body: LoadLoraRequest, state: State) -> JSONResponse:
    """Load the LoRA adapter in PEFT folder `lora_path` (on this machine) as `lora_name`,
    as SGLang's route (needs --enable-lora): requests then pick it by that name.
    `{"success", "error_message", "loaded_adapters"}`; a folder that cannot be served on
    this model is a 400 that says why (and also carries the error shape)."""
    loras = state.loras
    try:
        ref = loras.new_ref(body.lora_name, body.lora_path)
    except ValueError as e:
        raise call_error(e, native_fields("lora_name")) from None
    loras.pending.add(ref.name)
    try:
        args = {"uid": ref.uid, "name": ref.name, "path": ref.path}
        try:
            replies = await state.manager.control(
                "load_lora_adapter", lora_registry.LOAD_TIMEOUT_S, args
            )
        except APIError:  # no answer in time: the load may still end, unnamed; undo it
            state.manager.send_control("unload_lora_adapter", {"uid": ref.uid})
            raise
        failed = [r.message for r in replies if not r.success]
        if failed and len(failed) < len(replies):  # data parallelism: none keeps it
            state.manager.send_control("unload_lora_adapter", {"uid": ref.uid})
        if not failed:
            loras.add(ref)
    finally:
        loras.pending.discard(ref.name)
    answer = _lora_answer(loras, failed[0] if failed else None)
    if failed:
        error = bad_request(failed[0], param="lora_path")
        return JSONResponse({**answer, **error.body()}, status_code=400)
    return JSONResponse(answer)


@router.post("/unload_lora_adapter")
@router.post("/v1/unload_lora_adapter", operation_id="unload_lora_adapter_v1")
async def unload_lora_adapter(body: UnloadLoraRequest, state: State) -> JSONResponse:
    """Unload an adapter, as SGLang's route: requests naming it are refused from now on;
    it is dropped (and this answers) once the requests already running with it end."""
    loras = state.loras
    try:
        uid = loras.uid(body.lora_name, "lora_name")
    except ValueError as e:
        raise call_error(e, native_fields("lora_name")) from None
    loras.remove(body.lora_name)
    loras.pending.add(body.lora_name)  # not loaded again under this name until it is gone
    try:
        await state.manager.control("unload_lora_adapter", UPDATE_WEIGHTS_TIMEOUT_S, {"uid": uid})
    finally:
        loras.pending.discard(body.lora_name)
    return JSONResponse(_lora_answer(loras, None))


def _lora_answer(loras: LoraRegistry, error: str | None) -> dict[str, Any]:
    return {"success": error is None, "error_message": error, "loaded_adapters": loras.loaded()}


class ProfileRequest(StrictBody):
    """SGLang's /start_profile body (its ProfileReqInput), every field optional: traces go to
    `output_dir` (default $RADIXSERVE_TORCH_PROFILER_DIR or $SGLANG_TORCH_PROFILER_DIR, else
    /tmp); after `start_step` steps, for `num_steps` steps (then the trace is written by
    itself) or until /stop_profile; `activities` among CPU (always), GPU (CUDA's kernels
    where there is a GPU) and MEM (tensor allocations)."""

    model_config = ConfigDict(extra="forbid")
    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_prefix: str | None = None
    profile_id: str | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False


@router.api_route("/start_profile", methods=["GET", "POST"])
async def start_profile(request: Request, state: State) -> dict[str, Any]:
    """Start profiling the scheduler's steps with torch's profiler (SGLang's route); each
    data-parallel replica writes its own trace."""
    raw = await request.body()
    try:
        body = ProfileRequest.model_validate(load_body(raw) if raw.strip() else {})
    except ValidationError as e:
        raise validation_error(RequestValidationError(e.errors())) from None
    for served, name in ((body.profile_by_stage, "profile_by_stage"),
                         (body.merge_profiles, "merge_profiles")):  # fmt: skip
        if served:
            raise bad_request(f"{name} is not served: leave it false", name)
    args = body.model_dump(exclude={"profile_by_stage", "merge_profiles"}, exclude_none=True)
    args.setdefault("profile_id", str(time.time()))  # one for every replica's trace
    await state.manager.control("start_profile", args=args)
    return {"message": "Start profiling.", "status": "ok"}


@router.api_route("/stop_profile", methods=["GET", "POST"])
async def stop_profile(state: State) -> dict[str, Any]:
    """Stop profiling and write the traces (which takes a while: up to minutes for a long
    profile); their paths in `traces`."""
    paths = await state.manager.control("stop_profile", timeout=STOP_PROFILE_TIMEOUT_S)
    if all(p is None for p in paths):
        raise bad_request("no profile is running: /start_profile first")
    traces = [p for p in paths if p]  # ('': it ran no step; a replica ended by itself)
    return {"message": "Stop profiling.", "status": "ok", "traces": traces}


class PauseRequest(StrictBody):
    """SGLang's /pause_generation body."""

    model_config = ConfigDict(extra="forbid")
    mode: PauseMode = "abort"


@router.post("/pause_generation")
async def pause_generation(body: PauseRequest, state: State) -> dict[str, Any]:
    """Stop generating until /continue_generation, as SGLang's route (RL trainers pause
    rollouts to update the weights): `abort` ends every request first, `retract` takes the
    running ones back to the queue (they resume, prefilled again, on continuing), `in_place`
    leaves them as they are. Requests sent meanwhile wait in the queue; aborts still end
    theirs. A weight update goes ahead once no request holds K/V (at once after `abort` or
    `retract`; refused while paused in place with running requests)."""
    await state.manager.control("pause_generation", args={"mode": body.mode})
    state.manager.paused = body.mode
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(state: State) -> dict[str, Any]:
    await state.manager.control("continue_generation")
    state.manager.paused = None
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.get("/get_weight_version")
async def get_weight_version(state: State) -> dict[str, Any]:
    return {"weight_version": state.manager.weight_version}


@router.post("/abort_request")
async def abort_request(body: AbortRequest, state: State) -> Response:
    if body.abort_all:
        state.manager.send_abort(None)
    elif body.rid is None:
        raise bad_request("give rid or abort_all: true", param="rid")
    else:
        state.manager.abort_request(body.rid)
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(state: State) -> Response:
    registry = state.manager.metrics.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


# -- tokenizer ------------------------------------------------------------------------------
@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request, state: State) -> Response:
    """Each prompt's tokens. A prompt is held to what /generate takes (no more characters
    than the context's tokens could stand for), a batch to MAX_SEQUENCES_PER_REQUEST
    prompts; a long body is tokenized, and its answer written, off the event loop."""
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if len(prompts) > MAX_SEQUENCES_PER_REQUEST:
        message = f"prompt has {len(prompts)} texts; at most {MAX_SEQUENCES_PER_REQUEST} at once"
        raise bad_request(message, param="prompt")

    def answer() -> JSONResponse:
        tokens = [state.manager.encode(p, body.add_special_tokens) for p in prompts]
        out = tokens[0] if isinstance(body.prompt, str) else tokens
        count, context = sum(map(len, tokens)), state.model.max_seq_len
        return JSONResponse({"tokens": out, "count": count, "max_model_len": context})

    try:
        return await off_the_loop_if_large(request, answer)
    except ValueError as e:
        raise call_error(e, native_fields("prompt")) from None


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request, state: State) -> dict[str, Any]:
    """The tokens' text. At most the model's context length of them (no prompt or output
    is longer); a long body is decoded off the event loop."""
    context = state.model.max_seq_len
    if len(body.tokens) > context:
        message = (
            f"tokens has {len(body.tokens)} ids; at most the model's context length "
            f"({context}) may be detokenized at once"
        )
        raise bad_request(message, param="tokens")
    vocab = state.model.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        message = f"tokens outside the vocabulary [0, {vocab}): {bad[:8]}"
        raise bad_request(message, param="tokens")
    decode = state.manager.tokenizer.decode
    return {"prompt": await off_the_loop_if_large(request, lambda: decode(body.tokens))}


@router.get("/tokenizer_info")
async def tokenizer_info(state: State) -> dict[str, Any]:
    tokenizer = state.manager.tokenizer
    return {
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": tokenizer.pad_token,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "chat_template": tokenizer.chat_template,
        "vocab_size": state.model.vocab_size,
    }


# -- generation -----------------------------------------------------------------------------
@router.post("/generate")
async def generate(body: GenerateRequest, request: Request, state: State) -> Response:
    for name, message in UNSUPPORTED.items():
        if getattr(body, name) not in (None, False, [], ""):
            raise bad_request(message, name)
    wants_hidden = body.return_hidden_states
    if isinstance(wants_hidden, list):
        wants_hidden = any(wants_hidden)
    if wants_hidden and not state.config.server.enable_return_hidden_states:
        raise bad_request(HIDDEN_STATES_OFF, "return_hidden_states")
    fields = native_fields("input_ids" if body.input_ids is not None else "text")
    try:
        lora_ids = state.loras.uids(body.lora_path)
        expanded = await off_the_loop_if_large(
            request,
            lambda: expand_request(
                state.manager.encode,
                body.text,
                body.sampling_params,
                body.input_ids,
                body.return_logprob,
                body.logprob_start_len,
                body.top_logprobs_num,
                body.rid,
                body.priority,
                max_sequences=MAX_SEQUENCES_PER_REQUEST,
                token_ids_logprob=body.token_ids_logprob,
                lora_ids=lora_ids,
                return_hidden_states=body.return_hidden_states,
            ),
        )
    except ValueError as e:
        raise call_error(e, fields) from None
    check_sequences(expanded.reqs, state, fields)
    if body.require_reasoning:
        parser = state.config.server.reasoning_parser
        think_first(expanded.reqs, parser, state.manager.tokenizer.decode)
    call = state.manager.submit(
        expanded.reqs, body.return_text_in_logprobs, body.stream, rid=body.rid
    )
    if body.stream:
        return await sse(request, _native_chunks(call, batch=not expanded.single), call)
    results = await until_disconnect(request, call, call.results())
    return JSONResponse(results[0] if expanded.single else results)


@router.post("/encode")
async def encode(body: EncodeRequest, request: Request, state: State) -> Response:
    """Embeddings (server/embeddings.py): `{"embedding", "meta_info"}` per prompt, a list
    for a batch."""
    expanded = await off_the_loop_if_large(request, lambda: encode_reqs(body, state))
    call = state.manager.submit(expanded.reqs)
    results = await until_disconnect(request, call, call.results())
    return JSONResponse(results[0] if expanded.single else results)


@router.post("/score_continuations")
async def score_continuations(
    body: ScoreContinuationsRequest, request: Request, state: State
) -> dict[str, Any]:
    """Each continuation's token logprobs after the prefix, token healing included (see
    radixserve/scoring.py), from one batch of prefill-only requests. Texts are held to what
    /generate takes, and a long body is tokenized off the event loop."""
    state.manager.check_available()
    prompt_field = "input_ids" if body.input_ids is not None else "text"
    try:
        lora_id = state.loras.uid(body.lora_path)
        plan = await off_the_loop_if_large(
            request,
            lambda: plan_scoring(
                state.manager,
                body.continuations,
                body.text,
                body.input_ids,
                body.unconditional,
            ),
        )
        check_fits(plan, state.model.vocab_size, state.model.max_seq_len, prompt_field)
        reqs = plan.requests(body.rid, lora_id)
    except ContextTooLong as e:
        param = native_fields(prompt_field).name(e.param)
        raise bad_request(str(e), param, code="context_length_exceeded") from None
    except ValueError as e:
        raise call_error(e, native_fields(prompt_field)) from None
    call = state.manager.submit(reqs)
    results = await until_disconnect(request, call, call.results())
    token_text = token_texts(state.manager.tokenizer)
    return await off_the_loop_if_large(request, lambda: plan.response(results, token_text))


@router.post("/v1/score")
async def score_labels(body: LabelScoreRequest, request: Request, state: State) -> dict[str, Any]:
    """SGLang's decoder-only scoring: for each item, the probability of each label token
    being the next after query + item (radixserve/label_scores.py), from one batch of
    requests that share the query through the radix cache."""
    state.manager.check_available()
    for name in ("embed_override_token_id", "query_embed_overrides", "item_embed_overrides"):
        if getattr(body, name) is not None:
            raise bad_request(f"{name}: embedding overrides are not supported here", name)
    if body.return_pooled_hidden_states:
        message = "return_pooled_hidden_states is not supported here"
        raise bad_request(message, "return_pooled_hidden_states")
    lora_id = state.adapter_of(body.model)
    model = state.model

    def plan() -> LabelScoring:
        return plan_label_scoring(
            state.manager.encode, body.query, body.items, body.label_token_ids,
            body.apply_softmax, body.item_first, model.vocab_size, model.max_seq_len,
        )  # fmt: skip

    try:  # the query is tokenized once per item: the work decides, not the body's size
        extra = text_bytes(body.query, body.items)
        scoring = await off_the_loop_if_large(request, plan, extra_bytes=extra)
    except InvalidRequest as e:
        raise bad_request(str(e), e.param, code=e.code) from None
    call = state.manager.submit(scoring.requests(lora_id=lora_id), service_tier=body.service_tier)
    results = await until_disconnect(request, call, call.results())
    try:
        scores = scoring.scores(results)
    except ScoringAborted as e:
        raise APIError(503, str(e)) from None
    tokens = scoring.prompt_tokens
    return {
        "scores": scores,
        "model": body.model or state.model_name,
        "usage": {"prompt_tokens": tokens, "completion_tokens": 0, "total_tokens": tokens},
        "object": "scoring",
    }


async def _native_chunks(call: Call, batch: bool) -> AsyncIterator[dict[str, Any]]:
    """Each output as it comes: the cumulative result, with its index in a batch."""
    async for index, out in call.stream():
        yield {**out.result, "index": index} if batch else out.result
