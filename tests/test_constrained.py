"""Constrained decoding below the server: the llguidance backend (compile errors, masks,
jump-forward) on the committed tiny tokenizer, and the scheduler through the offline Engine
with the tiny random-weight model — whose outputs are close to random, so every document
that validates was made valid by the masks, not by the model."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
import threading

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from radixserve import Engine
from radixserve.constrained.base import Constraint, GrammarError, unpack_bitmask
from radixserve.constrained.grammars import jump_forward
from radixserve.constrained.llguidance_backend import LLGuidanceBackend
from radixserve.core.sampling_params import SamplingParams, ThinkBlock
from tests.conftest import FP32, TINY_SHAPE, TINY_TOKENIZER, build_tiny_model

VOCAB = TINY_SHAPE["vocab_size"]

# bounded documents: a random model could otherwise write an unbounded string forever
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"enum": ["a", "bc"]}, "maxItems": 3},
        "nick": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 9},
        "owner": {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "score": {"enum": [1, 2, 3]}},
            "required": ["ok", "score"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "owner"],
    "additionalProperties": False,
}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= [1-9] [0-9]{0,2}
"""
ARITHMETIC_RE = r"[1-9][0-9]{0,2}([+-][1-9][0-9]{0,2}){0,3}"
PROMPTS = [[5, 6, 7, 8], [9, 10, 11, 12, 13], [40, 41, 42], [100] * 30]


@pytest.fixture(scope="module")
def backend() -> LLGuidanceBackend:
    return LLGuidanceBackend(AutoTokenizer.from_pretrained(TINY_TOKENIZER), VOCAB)


@pytest.fixture(scope="module")
def engine(tiny_model_dirs):
    with Engine(
        str(tiny_model_dirs["llama"]), progress=False, max_total_tokens=8192, dtype=FP32
    ) as e:
        yield e


def sampled(i: int, **constraint) -> dict:
    return {"temperature": 1.0, "sampling_seed": i, "max_new_tokens": 96, **constraint}


def greedy(max_new_tokens: int = 96, **extra) -> dict:
    return {"temperature": 0, "max_new_tokens": max_new_tokens, **extra}


# -- the backend ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        ("json_schema", "{not json", "invalid json_schema"),
        ("json_schema", '{"type": "foo"}', "foo"),
        ("json_schema", '{"type": "string", "format": "no-such-format"}', "no-such-format"),
        ("regex", "((", "unclosed group"),
        ("ebnf", "root ::= missing", "missing"),
        # valid, but nothing can be generated: caught by computing the first mask
        ("regex", r"[^\s\S]", "invalid regex: no text satisfies it"),
        ("json_schema", '{"$ref": "#"}', "invalid json_schema: no text satisfies it"),
        # the lexer gives up on the first token of the forced text
        ("regex", "a{1000000}", "too many expressions constructed"),
    ],
)
def test_invalid_constraints_name_the_problem(backend, kind, spec, message):
    with pytest.raises(GrammarError, match=re.escape(message)) as e:
        backend.matcher(Constraint(kind, spec))
    assert "\n" not in str(e.value)
    # refused again the same way, from the refusals kept: not compiled a second time
    compiles = backend.compiles
    with pytest.raises(GrammarError, match=re.escape(message)) as again:
        backend.matcher(Constraint(kind, spec))
    assert again.value.param == e.value.param == kind
    assert backend.compiles == compiles


def test_at_most_one_constraint_and_schema_objects_become_json():
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf"):
        SamplingParams.from_dict({"regex": "a", "ebnf": "root ::= 'a'"})
    params = SamplingParams.from_dict({"json_schema": {"type": "object"}, "regex": ""})
    assert json.loads(params.json_schema) == {"type": "object"} and params.regex is None
    assert Constraint.of(params) == Constraint("json_schema", '{"type": "object"}')
    assert Constraint.of(SamplingParams()) is None


def test_mask_allows_exactly_the_tokens_the_grammar_accepts(backend):
    matcher = backend.matcher(Constraint("json_schema", json.dumps(PERSON)))
    prefix = backend.tokenize_bytes(b'{"name": "ab')
    assert matcher.accept(prefix)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    backend.fill_masks([matcher], bitmask)
    allowed = unpack_bitmask(bitmask, VOCAB)[0]
    accepted = [matcher.valid_prefix([t]) == 1 for t in range(VOCAB)]
    assert allowed.tolist() == accepted
    assert 0 < sum(accepted) < VOCAB


def test_a_matcher_that_faults_says_why_in_one_line(backend):
    """A refused token is not consumed (no fault, nothing to say); a token forced into
    llguidance's matcher past that check puts it in error, and `error` gives llguidance's
    reason on one line (what the request's abort message carries)."""
    matcher = backend.matcher(Constraint("regex", "ab"))
    z = backend.tokenize_bytes(b"z")
    assert not matcher.accept(z) and matcher.error == ""
    assert matcher.accept(backend.tokenize_bytes(b"a"))
    matcher.m.consume_tokens(z)
    assert "doesn't satisfy the grammar" in matcher.error and "\n" not in matcher.error
    assert "<" not in matcher.error, matcher.error  # no <state> dump, no <non-verbose/>


def test_a_grammar_that_fails_mid_output_aborts_with_one_clean_line(engine):
    """`x|a{1000000}` is admitted (it can start: with `x`), but once the output is an `a`
    llguidance's lexer gives up at the next token: the request ends in an abort whose
    message is llguidance's reason alone, not its parser state."""
    a = AutoTokenizer.from_pretrained(TINY_TOKENIZER).encode("a", add_special_tokens=False)
    params = greedy(8, regex="x|a{1000000}", logit_bias={str(a[0]): 100.0})
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    reason = out["meta_info"]["finish_reason"]
    assert reason == {
        "type": "abort",
        "message": "the grammar cannot continue: lexer error: too many expressions constructed",
    }, reason
    assert out["text"] == "a"


THINKING = ThinkBlock("<think>", "</think>", inside=False)
AFTER_THOUGHT = [
    # (constraint, text, valid) with the block optional (the output may open it) ...
    (("json_schema", json.dumps(NESTED["properties"]["owner"])), '{"ok": true, "score": 2}', 1),
    (
        ("json_schema", json.dumps(NESTED["properties"]["owner"])),
        '<think>\nok? {</think>\n\n{"ok": false, "score": 1}',
        1,
    ),
    (("regex", DATE), "<think>any < / think> text</think>2024-05-17", 1),
    (("regex", DATE), "2024-05-17", 1),
    (("regex", DATE), "<think>x</think>\n\n\n\n\n2024-05-17", 0),  # at most 4 spaces
    (("regex", DATE), "<think>x</think>no date", 0),
    (("regex", DATE), "thinking</think>2024-05-17", 0),  # a block opens with its tag
    (("ebnf", ARITHMETIC), "<think></think>12+3", 1),
]


@pytest.mark.parametrize(("constraint", "text", "valid"), AFTER_THOUGHT)
def test_a_constraint_after_a_block_of_reasoning(backend, constraint, text, valid):
    matcher = backend.matcher(Constraint(*constraint, THINKING))
    tokens = backend.tokenize_bytes(text.encode())
    complete = matcher.valid_prefix(tokens) == len(tokens)
    assert (complete and matcher.accept(tokens) and matcher.is_accepting) == bool(valid)


def test_the_text_of_an_added_token_is_text(backend):
    """Added tokens that are not special (Qwen's <think>, <tool_call>) match their text:
    a grammar that writes it takes the token, or its pieces. (llguidance alone holds them
    special and refused the token its own mask offered for that text.)"""
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tokenizer.add_tokens(["<think>", "</think>"])
    added = LLGuidanceBackend(tokenizer, VOCAB + 2)
    think = Constraint("regex", "<think>\n[ab]")
    pieces = added.tokenizer.tokenize_bytes(b"<think>\na")  # llguidance's BPE: in pieces
    assert VOCAB not in pieces
    for tokens in ([VOCAB, *added.tokenize_bytes(b"\na")], pieces):
        matcher = added.matcher(think)
        assert matcher.accept(tokens) and matcher.is_accepting, tokens
    bitmask = torch.full((1, (VOCAB + 2 + 31) // 32), -1, dtype=torch.int32)
    added.fill_masks([added.matcher(Constraint("regex", "x|<think>y"))], bitmask)
    assert unpack_bitmask(bitmask, VOCAB + 2)[0][VOCAB]  # offered where not forced
    # forced text is written as the model's tokenizer writes it: the added token whole
    # (llguidance's BPE has no merge that makes it), as jump-forward appends it
    text = "a <think></think>\n<think>b"
    assert added.tokenize_bytes(text.encode()) == tokenizer.encode(text, add_special_tokens=False)
    matcher = added.matcher(Constraint("regex", "a <think>\n[ab]"))
    sampled = added.tokenize_bytes(b"a")
    assert matcher.accept(sampled)
    space = added.tokenize_bytes(b" ")
    assert jump_forward(matcher, added, sampled[0], room=8)[:3] == [*sampled, *space, VOCAB]


def test_a_block_the_prompt_opened_comes_first_and_ends_with_a_special_token(backend):
    inside = Constraint("regex", DATE, dataclasses.replace(THINKING, inside=True))
    for text, valid in [("free, {text}</think>2024-05-17", True), ("2024-05-17", False)]:
        tokens = backend.tokenize_bytes(text.encode())
        matcher = backend.matcher(inside)
        assert (matcher.accept(tokens) and matcher.is_accepting) == valid, text
    # where the tags are special tokens (as Qwen3's are to llguidance), the grammar names
    # them: the block's text may be anything but them, and only them open and close it
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    special = LLGuidanceBackend(tokenizer, VOCAB + 2)
    think, end = VOCAB, VOCAB + 1
    matcher = special.matcher(Constraint("regex", "(yes|no)", THINKING))
    assert matcher.accept([think, *special.tokenize_bytes(b"hm?")])
    bitmask = torch.full((1, (VOCAB + 2 + 31) // 32), -1, dtype=torch.int32)
    special.fill_masks([matcher], bitmask)
    allowed = unpack_bitmask(bitmask, VOCAB + 2)[0]
    assert allowed[end] and not allowed[think] and not allowed[tokenizer.eos_token_id]
    assert matcher.accept([end, *special.tokenize_bytes(b"\nno")]) and matcher.is_accepting


def test_the_engine_takes_require_reasoning_with_a_reasoning_parser(tmp_path):
    """Engine.generate(require_reasoning=True), as /generate's: the regex applies after the
    block, which the model (pushed by a bias to write <think> then </think>, one token each
    in this vocabulary) may open; an Engine without a parser refuses it."""
    folder = build_tiny_model(tmp_path / "model", "llama", added_tokens=("<think>", "</think>"))
    bias = {str(VOCAB): 50.0, str(VOCAB + 1): 100.0}
    params = greedy(20, regex="(yes|no)", logit_bias=bias)
    config = dict(progress=False, max_total_tokens=2048, dtype=FP32)
    with Engine(str(folder), reasoning_parser="qwen3", **config) as e:
        out = e.generate(input_ids=PROMPTS[0], sampling_params=params, require_reasoning=True)
        assert re.fullmatch(r"<think></think>\s*(yes|no)", out["text"]), out["text"]
        assert re.fullmatch(
            "(yes|no)", e.generate(input_ids=PROMPTS[0], sampling_params=params)["text"]
        )
    with Engine(str(folder), **config) as e:
        with pytest.raises(ValueError, match="reasoning_parser"):
            e.generate(input_ids=PROMPTS[0], sampling_params=params, require_reasoning=True)


def test_jump_forward_appends_forced_text_as_the_tokenizer_writes_it(backend):
    matcher = backend.matcher(Constraint("json_schema", json.dumps(PERSON)))
    first = backend.tokenize_bytes(b"{")[0]
    assert matcher.accept([first])
    tokens = jump_forward(matcher, backend, first, room=100)
    text = backend.token_bytes(tokens)
    # the grammar forces '{"name": "' at the start; the last token is left to the model
    assert len(tokens) > 1 and b'{"name": "'.startswith(text) and len(text) > 1
    assert tokens == backend.tokenize_bytes(text)  # the tokenizer's own split
    # the matcher is where the tokens put it: the rest of the forced text is still forced
    assert text + matcher.forced_bytes() == b'{"name": "'


def test_jump_forward_respects_room_and_keeps_the_last_token_that_ends_a_document(backend):
    matcher = backend.matcher(Constraint("regex", "abc-forced-tail"))
    a = backend.tokenize_bytes(b"a")[0]
    assert matcher.accept([a])
    assert jump_forward(matcher, backend, a, room=1) == [a]  # no room: nothing forced
    tokens = jump_forward(matcher, backend, a, room=100)
    assert backend.token_bytes(tokens) == b"abc-forced-tail"  # ends the document: kept whole
    assert matcher.is_finished


# -- through the Engine -------------------------------------------------------------------------
def test_json_schema_outputs_validate_when_sampling_from_a_random_model(engine):
    params = [sampled(i, json_schema=json.dumps(s)) for i, s in enumerate([PERSON, NESTED] * 4)]
    outs = engine.generate(input_ids=PROMPTS[:2] * 4, sampling_params=params)
    for out, schema in zip(outs, [PERSON, NESTED] * 4):
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), schema)
    engine.check_kv_accounting()


def test_regex_and_ebnf_outputs_match(engine):
    outs = engine.generate(
        input_ids=PROMPTS[:3],
        sampling_params=[sampled(1, regex=DATE), sampled(2, ebnf=ARITHMETIC), greedy(regex=DATE)],
    )
    assert re.fullmatch(DATE, outs[0]["text"]), outs[0]["text"]
    assert re.fullmatch(ARITHMETIC_RE, outs[1]["text"]), outs[1]["text"]
    assert re.fullmatch(DATE, outs[2]["text"]), outs[2]["text"]


def test_constrained_and_free_requests_in_one_batch(engine):
    free = [greedy(24, ignore_eos=True) for _ in PROMPTS]
    alone = [engine.generate(input_ids=p, sampling_params=f) for p, f in zip(PROMPTS, free)]
    constrained = [greedy(json_schema=json.dumps(PERSON)), sampled(7, regex=DATE)] * 2
    outs = engine.generate(input_ids=PROMPTS + PROMPTS, sampling_params=free + constrained)
    assert [o["output_ids"] for o in outs[:4]] == [a["output_ids"] for a in alone]
    for out, params in zip(outs[4:], constrained):
        if "json_schema" in params:
            jsonschema.validate(json.loads(out["text"]), PERSON)
        else:
            assert re.fullmatch(DATE, out["text"])
    engine.check_kv_accounting()


def test_max_new_tokens_cuts_a_prefix_of_the_complete_document(engine):
    schema = json.dumps(NESTED)
    full = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(json_schema=schema))
    cut = engine.generate(input_ids=PROMPTS[0], sampling_params=greedy(5, json_schema=schema))
    assert cut["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert cut["meta_info"]["completion_tokens"] == 5
    assert full["text"].startswith(cut["text"]) and len(cut["text"]) < len(full["text"])


def test_stop_strings_and_eos_do_not_cut_an_unfinished_document(engine):
    schema = json.dumps(PERSON)
    out = engine.generate(
        input_ids=PROMPTS[1], sampling_params=sampled(3, json_schema=schema, stop=[",", '"'])
    )
    jsonschema.validate(json.loads(out["text"]), PERSON)
    banned_eos = engine.generate(
        input_ids=PROMPTS[1], sampling_params=greedy(json_schema=schema, logit_bias={"2": 50.0})
    )  # eos pushed hard: the mask still keeps it out until the document is complete
    jsonschema.validate(json.loads(banned_eos["text"]), PERSON)


def test_invalid_constraint_is_refused_before_it_is_queued(engine):
    for _ in range(2):  # refused once compiled, then at once from the refusals kept
        with pytest.raises(ValueError, match="unclosed group"):
            engine.generate(input_ids=[1, 2], sampling_params=greedy(regex="(("))
    with pytest.raises(ValueError, match="at most one"):
        engine.generate(input_ids=[1, 2], sampling_params=greedy(regex="a", ebnf="root ::= 'a'"))
    state = engine.get_server_info()["internal_states"][0]
    assert state["num_waiting"] == state["num_grammar_queue"] == 0


@contextlib.contextmanager
def compiles_held(engine, monkeypatch):
    """Hold the engine's grammar compiles at a gate: yields (entered, gate) events, set
    when a compile reaches the gate and to let it through (set on exit in any case)."""
    backend = engine.scheduler.grammars.backend
    entered, gate = threading.Event(), threading.Event()
    compile_ = backend._compile

    def held(constraint):
        entered.set()
        gate.wait(120)
        return compile_(constraint)

    monkeypatch.setattr(backend, "_compile", held)
    try:
        yield entered, gate
    finally:
        gate.set()


def in_thread(fn, *args, **kwargs) -> tuple[threading.Thread, dict]:
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(out=fn(*args, **kwargs)))
    thread.start()
    return thread, result


def test_the_running_requests_keep_decoding_while_a_grammar_compiles(engine, monkeypatch):
    """A request whose constraint is not compiled yet waits apart while its grammar compiles
    on a thread of its own: with that compile held, a running request decodes to its end;
    then the constrained one runs."""
    regex = r"held-[0-9]{3}"  # compiled by no other test
    free = engine.generate(
        input_ids=PROMPTS[2], sampling_params=greedy(24, ignore_eos=True), stream=True
    )
    with compiles_held(engine, monkeypatch) as (entered, gate):
        assert next(free)["meta_info"]["completion_tokens"] >= 1
        thread, result = in_thread(
            engine.generate, input_ids=PROMPTS[0], sampling_params=greedy(regex=regex)
        )
        assert entered.wait(60)
        last = list(free)[-1]["meta_info"]  # to its end, the compile still held
        assert last["finish_reason"] == {"type": "length", "length": 24}
        assert engine.get_server_info()["internal_states"][0]["num_grammar_queue"] == 1
        gate.set()
        thread.join(60)
    assert re.fullmatch(regex, result["out"]["text"]), result
    engine.check_kv_accounting()


def test_a_rid_taken_by_a_request_whose_grammar_compiles_is_refused_to_another(engine, monkeypatch):
    """The refusal of a duplicate comes back at once while the first request's answer waits
    for its grammar: each still reaches its own caller."""
    regex = r"taken-[0-9]"
    with compiles_held(engine, monkeypatch) as (entered, gate):
        thread, first = in_thread(
            engine.generate, input_ids=PROMPTS[0], sampling_params=greedy(regex=regex), rid="t"
        )
        assert entered.wait(60)
        with pytest.raises(ValueError, match="already running"):
            engine.generate(input_ids=PROMPTS[1], sampling_params=greedy(4), rid="t")
        gate.set()
        thread.join(60)
    assert re.fullmatch(regex, first["out"]["text"]), first
    engine.check_kv_accounting()


def test_a_request_aborted_while_its_grammar_compiles_ends_there(engine, monkeypatch):
    regex = r"aborted-[a-c]{2}"
    with compiles_held(engine, monkeypatch) as (entered, _):
        thread, result = in_thread(
            engine.generate, input_ids=PROMPTS[1], sampling_params=greedy(regex=regex), rid="c1"
        )
        assert entered.wait(60)
        engine.abort("c1")
        thread.join(60)
    out = result["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["text"] == ""
    state = engine.get_server_info()["internal_states"][0]
    assert state["num_grammar_queue"] == state["num_waiting"] == 0
    engine.check_kv_accounting()
    # its compile went on: the next request with that regex finds it compiled
    assert re.fullmatch(
        regex, engine.generate(input_ids=PROMPTS[1], sampling_params=greedy(regex=regex))["text"]
    )


def test_a_pause_that_aborts_ends_a_request_whose_grammar_compiles(engine, monkeypatch):
    """pause_generation("abort") (or an abort while paused) ends a request still waiting
    for its grammar, as it would unpaused: its caller gets the abort."""
    regex = r"paused-[a-c]{2}"
    try:
        with compiles_held(engine, monkeypatch) as (entered, _):
            thread, result = in_thread(
                engine.generate, input_ids=PROMPTS[1], sampling_params=greedy(regex=regex)
            )
            assert entered.wait(60)
            engine.pause_generation("abort")
            thread.join(60)
            assert not thread.is_alive()
    finally:
        engine.continue_generation()
    assert result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    engine.check_kv_accounting()


@pytest.mark.parametrize("jump", [True, False], ids=["jump-forward", "no-jump-forward"])
def test_jump_forward_on_and_off_both_valid_and_retraction_changes_nothing(tiny_model_dirs, jump):
    """With a pool too small for the batch, requests are retracted and re-admitted (their
    grammar state kept); outputs equal an uninterrupted run and validate."""
    schemas = [PERSON, NESTED] * 3
    params = [greedy(json_schema=json.dumps(s)) for s in schemas]
    prompts = [[i + 3] * 40 for i in range(len(schemas))]
    results = {}
    for pool in (8192, 300):
        with Engine(
            str(tiny_model_dirs["llama"]),
            progress=False,
            dtype=FP32,
            max_total_tokens=pool,
            disable_jump_forward=not jump,
            init_new_token_ratio=0.05,
            min_new_token_ratio=0.01,
        ) as e:
            results[pool] = e.generate(input_ids=prompts, sampling_params=params)
            state = e.get_server_info()["internal_states"][0]
            assert (state["grammar_jump_tokens"] > 0) == jump
            if pool == 300:
                assert state["retractions"] > 0
            e.check_kv_accounting()
    for out, schema in zip(results[8192], schemas):
        jsonschema.validate(json.loads(out["text"]), schema)
    assert [o["text"] for o in results[300]] == [o["text"] for o in results[8192]]


def test_a_stop_string_inside_a_document_does_not_cut_it(engine):
    """ "," belongs to the document here; a stop only counts where the text before it is a
    complete document, so every output still matches in full."""
    pattern = "[A-Z][a-z]{1,4}, [A-Z][a-z]{1,4}"
    params = [sampled(i, regex=pattern, stop=[","]) for i in range(4)]
    for out in engine.generate(input_ids=PROMPTS, sampling_params=params):
        assert re.fullmatch(pattern, out["text"]), out
