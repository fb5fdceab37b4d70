"""The incremental detokenizer (radixserve/text_stream.py, radixserve/output.py) against a
full decode of every id at every step, which is what radixserve did before: the text shown
while running (incomplete characters held back, and the text from a stop string or one
beginning at the end) and the final text (a stop token left out, a stop string trimmed at its
first occurrence) must be the same.
Also: logprob triples, the deltas' wire size, and a detokenization fault confined to one
request, in the detokenizer and in the main process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import regex
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from radixserve.core.messages import ControlReply, ControlReq, WeightUpdate
from radixserve.core.output import FinishReason, ModelInfo, ReqOutput, StrOut
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams
from radixserve.output import Detokenizer, RequestState, ResultAccumulator
from radixserve.scheduler.stop import OutputText, StopChecker
from radixserve.server.dispatcher import Dispatcher
from radixserve.server.errors import APIError
from radixserve.server.messages import AbortReq, Ready, StrOutBatch, decode, encode
from radixserve.server.metrics import Metrics
from radixserve.server.tokenizer_manager import TokenizerManager
from radixserve.text_stream import REPLACEMENT, STOP_REGEX_TIMEOUT_S, partial_stop_len
from tests.conftest import TINY_TOKENIZER

TOKENIZER = AutoTokenizer.from_pretrained(TINY_TOKENIZER)  # byte-level BPE, 512 ids
EOS = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
SPECIAL = sorted(TOKENIZER.all_special_ids) + [TOKENIZER.convert_tokens_to_ids("<|im_start|>")]
SAMPLES = ["héllo", " €", " 😀", " 中文", " naïve", "STOP", "\n\n", " the end", "«»"]
PIECES = [TOKENIZER.encode(s) for s in SAMPLES]  # multi-byte characters span several ids


# -- the reference: a full decode of everything at every step -------------------------------
def full_text(ids: list[int], params: SamplingParams, reason: FinishReason | None) -> str:
    matched = reason.matched if reason else None
    if isinstance(matched, int) and not params.no_stop_trim and ids:
        ids = ids[:-1]
    text = TOKENIZER.decode(ids, skip_special_tokens=params.skip_special_tokens)
    if isinstance(matched, str):
        if not params.no_stop_trim and matched in text:
            text = text[: text.find(matched)]
        return text
    if reason is None:  # held back: from a stop string, or one beginning at the end
        text = text.rstrip(REPLACEMENT)
        begun = len(text) - partial_stop_len(text, params.stop)
        text = text[: min([text.find(s) for s in params.stop if s in text] + [begun])]
    return text


def run(
    steps: list[list[int]], params: SamplingParams, reason: FinishReason, **kwargs: Any
) -> list[tuple[str, str]]:
    """(cumulative text, reference text) after every step, through the wire and back."""
    state = RequestState("r", params, TOKENIZER, **kwargs)
    results = ResultAccumulator("r", state.return_logprob, state.top_logprobs_num)
    seen: list[int] = []
    pairs = []
    for i, ids in enumerate(steps):
        seen += ids
        last = reason if i == len(steps) - 1 else None
        state.update(ReqOutput("r", ids, last, 5, 0, len(seen)))
        delta = roundtrip(state.take_delta())
        update = results.add(delta)
        assert update.result["output_ids"] == seen
        pairs.append((update.result["text"], full_text(seen, params, last)))
    return pairs


def roundtrip(delta: StrOut) -> StrOut:
    batch = decode(encode(StrOutBatch([delta])))
    assert isinstance(batch, StrOutBatch)
    return batch.outputs[0]


# -- hypothesis: random ids, split into random steps ----------------------------------------
token = st.one_of(
    st.integers(3, len(TOKENIZER) - 1),  # any ordinary id, lone bytes of characters included
    st.sampled_from(SPECIAL),
)
chunk = st.one_of(st.lists(token, min_size=1, max_size=3), st.sampled_from(PIECES))


@st.composite
def streams(draw: st.DrawFn) -> tuple[list[list[int]], SamplingParams, FinishReason]:
    pieces = draw(st.lists(chunk, min_size=1, max_size=12))
    ids = [i for piece in pieces for i in piece]
    cuts: list[int] = []
    if len(ids) > 1:  # where the stream's steps begin, after the first
        cuts = sorted(draw(st.sets(st.integers(1, len(ids) - 1), max_size=len(ids))))
    steps = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    text = TOKENIZER.decode(ids)
    stops = draw(st.lists(st.sampled_from(["STOP", "€ 😀", "\n", " the", "o"]), max_size=2))
    if len(text) > 1:  # a stop string that spans tokens: a slice of the text itself
        a = draw(st.integers(0, len(text) - 2))
        stops.append(text[a : a + draw(st.integers(2, 6))])
    kinds = ["length", "abort", "stop token", "stop string"]
    kind = draw(st.sampled_from(kinds))
    if kind == "stop token":
        steps[-1] = [*steps[-1], EOS]
        reason = FinishReason.stop(EOS)
    elif kind == "stop string":
        reason = FinishReason.stop(draw(st.sampled_from(stops or ["o"])))
    elif kind == "length":
        reason = FinishReason.of_length(len(ids))
    else:
        reason = FinishReason.abort("aborted")
    params = SamplingParams(
        stop=[s for s in stops if s],
        skip_special_tokens=draw(st.booleans()),
        no_stop_trim=draw(st.booleans()),
    )
    return steps, params, reason


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_incremental_text_equals_a_full_decode_at_every_step(case):
    steps, params, reason = case
    for got, want in run(steps, params, reason):
        assert got == want


# -- the cases worth naming -----------------------------------------------------------------
def one_id_per_step(text: str) -> list[list[int]]:
    return [[i] for i in TOKENIZER.encode(text)]


def test_a_character_split_across_tokens_waits_for_its_last_byte():
    steps = one_id_per_step("a😀b")
    assert len(steps) > 3  # the emoji is four single-byte tokens
    texts = [got for got, _ in run(steps, SamplingParams(), FinishReason.of_length(6))]
    assert texts == ["a", "a", "a", "a", "a😀", "a😀b"]


def test_a_partial_stop_string_is_held_back_then_released():
    steps = one_id_per_step("x STOx")
    texts = [got for got, _ in run(steps, SamplingParams(stop=["STOP"]), FinishReason.of_length(6))]
    assert texts == ["x", "x ", "x ", "x ", "x ", "x STOx"]


def test_a_stop_string_spanning_tokens_is_trimmed_or_kept():
    steps = one_id_per_step("ab STOP")
    for no_trim, final in [(False, "ab "), (True, "ab STOP")]:
        params = SamplingParams(stop=["STOP"], no_stop_trim=no_trim)
        pairs = run(steps, params, FinishReason.stop("STOP"))
        assert pairs[-1] == (final, final)
        assert all(got == want for got, want in pairs)


def shown_texts(steps: list[list[int]], params: SamplingParams, reason: FinishReason) -> list[str]:
    """The cumulative text after every step, each a prefix of the final one."""
    texts = [got for got, _ in run(steps, params, reason)]
    assert all(texts[-1].startswith(text) for text in texts), texts
    return texts


def test_min_new_tokens_trims_at_the_stop_string_that_ended_the_request():
    """A stop string within the first min_new_tokens tokens does not apply (it is shown);
    the text ends before the occurrence that ended the request, not before the first."""
    steps = one_id_per_step("a STOP b STOP")
    min_new_tokens = len(TOKENIZER.encode("a STOP b"))
    params = SamplingParams(stop=["STOP"], min_new_tokens=min_new_tokens)
    texts = shown_texts(steps, params, FinishReason.stop("STOP"))
    assert texts[min_new_tokens - 1] == "a STOP b"
    assert texts[-1] == "a STOP b "


def test_a_stop_regex_holds_back_the_text_from_where_a_match_could_begin():
    """`5.*8` could match from the "5" on: nothing after it is shown, then the text is
    trimmed there when it does match."""
    steps = one_id_per_step(" 4, 5, 6, 7, 8")
    params = SamplingParams(stop_regex=["5.*8"])
    texts = shown_texts(steps, params, FinishReason.stop("5, 6, 7, 8"))
    assert texts == [" 4", " 4,", *[" 4, "] * 7]


def test_a_partial_stop_regex_match_is_held_back_then_released():
    steps = one_id_per_step("a END-4x")
    params = SamplingParams(stop_regex=[r"END-\d\d"])
    texts = shown_texts(steps, params, FinishReason.of_length(8))
    assert texts == ["a", "a ", "a ", "a ", "a ", "a ", "a ", "a END-4x"]


def test_a_stop_regex_with_an_empty_match_holds_back_all_it_could_still_cut():
    """`END|$` matches empty at the end of any text, and that complete match may hide a
    partial "EN" before it: everything waits for the end."""
    steps = one_id_per_step("a END")
    texts = shown_texts(steps, SamplingParams(stop_regex=["END|$"]), FinishReason.stop("END"))
    assert texts == ["", "", "", "", "a "]


@pytest.mark.parametrize("no_stop_trim", [False, True])
def test_a_stop_token_is_left_out_of_the_text_unless_no_stop_trim(no_stop_trim):
    steps = [*one_id_per_step("hi"), [EOS]]
    params = SamplingParams(skip_special_tokens=False, no_stop_trim=no_stop_trim)
    text, want = run(steps, params, FinishReason.stop(EOS))[-1]
    assert text == want == ("hi<|im_end|>" if no_stop_trim else "hi")


def test_special_tokens_skipped_or_shown():
    steps = [[TOKENIZER.encode("a")[0]], [SPECIAL[0]], [TOKENIZER.encode("b")[0]]]
    for skip, final in [(True, "ab"), (False, "a<|endoftext|>b")]:
        params = SamplingParams(skip_special_tokens=skip)
        assert run(steps, params, FinishReason.of_length(3))[-1] == (final, final)


def test_logprob_triples_carry_each_tokens_text():
    ids = TOKENIZER.encode("ok")
    state = RequestState("r", SamplingParams(), TOKENIZER, True, 1, True)
    results = ResultAccumulator("r", True, 1)
    for i, tid in enumerate(ids):
        out = ReqOutput("r", [tid], None, 2, 0, i + 1, [(-0.5, tid)], [[(-0.5, tid)]])
        if i == 0:
            out.input_logprobs, out.input_top_logprobs = [(None, 7), (-1.0, 8)], [[], []]
        state.update(out)
        meta = results.add(roundtrip(state.take_delta())).result["meta_info"]
    texts = [TOKENIZER.decode([t]) for t in ids]
    assert [list(e) for e in meta["output_token_logprobs"]] == [
        [-0.5, t, s] for t, s in zip(ids, texts)
    ]
    assert len(meta["output_top_logprobs"]) == len(ids)
    assert [e[1] for e in meta["input_token_logprobs"]] == [7, 8]
    assert meta["input_token_logprobs"][0][0] is None


def test_an_earlier_update_keeps_its_result():
    state = RequestState("r", SamplingParams(), TOKENIZER)
    results = ResultAccumulator("r", False, 0)
    updates = []
    for i, ids in enumerate(one_id_per_step("abc")):
        state.update(ReqOutput("r", ids, None, 1, 0, i + 1))
        updates.append(results.add(state.take_delta()))
    assert [u.result["text"] for u in updates] == ["a", "ab", "abc"]
    assert [u.text_delta for u in updates] == ["a", "b", "c"]


def test_only_the_last_update_shows_the_hidden_states():
    """A stream's results are built after later deltas were added: the hidden states, which
    ride on the last delta, show in its result alone."""
    state = RequestState("r", SamplingParams(), TOKENIZER)
    results = ResultAccumulator("r", False, 0)
    updates = []
    for i, ids in enumerate(one_id_per_step("ab")):
        last = i == 1
        out = ReqOutput("r", ids, FinishReason.of_length(2) if last else None, 1, 0, i + 1)
        out.hidden_states = [[0.5], [1.5]] if last else None  # a prompt row, a step's row
        state.update(out)
        updates.append(results.add(roundtrip(state.take_delta())))
    assert "hidden_states" not in updates[0].result["meta_info"]
    assert updates[1].result["meta_info"]["hidden_states"] == [[[0.5]], [1.5]]


def test_a_steps_wire_size_does_not_grow_with_the_output():
    state = RequestState("r", SamplingParams(), TOKENIZER)
    sizes = []
    for i in range(600):
        state.update(ReqOutput("r", [TOKENIZER.encode(" x")[0]], None, 1, 0, i + 1))
        sizes.append(len(encode(StrOutBatch([state.take_delta()]))))
    assert max(sizes[-100:]) <= max(sizes[:100]) + 2  # counts gain a byte past 127, 255...


def test_a_non_stream_sends_counts_then_everything_at_the_end():
    detok = Detokenizer()
    detok.register(RequestState("r", SamplingParams(), TOKENIZER), stream=False)
    ids = TOKENIZER.encode("hello")
    steps = [detok.process([ReqOutput("r", [t], None, 1, 0, i + 1)]) for i, t in enumerate(ids)]
    assert all(d.text_delta == "" and not d.new_ids for [d] in steps)
    [final] = detok.process([ReqOutput("r", [], FinishReason.of_length(5), 1, 0, len(ids))])
    assert (final.text_delta, final.new_ids) == ("hello", ids)
    assert detok.states == {}


# -- faults ---------------------------------------------------------------------------------
class FailingTokenizer:
    """The real tokenizer, except that decoding `BAD` raises (as a Rust panic would)."""

    BAD = 300

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        if self.BAD in ids:
            raise OverflowError("out of range integral type conversion attempted")
        return TOKENIZER.decode(ids, **kwargs)


def test_a_detokenization_fault_ends_one_request_while_another_completes(caplog):
    detok = Detokenizer()
    for rid in ("bad", "good"):
        detok.register(RequestState(rid, SamplingParams(), FailingTokenizer()), stream=True)
    ok = TOKENIZER.encode("fine")

    def step(bad_id: int, good_id: int, reason: FinishReason | None = None) -> list[StrOut]:
        outs = [
            ReqOutput("bad", [bad_id], reason, 1, 0, 1),
            ReqOutput("good", [good_id], reason, 1, 0, 1),
        ]
        return detok.process(outs)

    first = step(FailingTokenizer.BAD, ok[0])
    assert [d.rid for d in first] == ["bad", "good"]
    assert first[0].finish_reason.type == "error"
    assert "OverflowError" in first[0].finish_reason.message
    assert "bad" in caplog.text  # the log line names the request
    texts = [first[1].text_delta]
    for tid in ok[1:-1]:
        later = step(ok[0], tid)  # the scheduler still runs "bad": its outputs are dropped
        assert [d.rid for d in later] == ["good"]
        texts.append(later[0].text_delta)
    final = step(ok[0], ok[-1], FinishReason.of_length(len(ok)))
    assert [d.rid for d in final] == ["good"] and final[0].finished
    assert "".join(texts) + final[0].text_delta == "fine"
    assert detok.states == {} and detok.failed == set()


class RecordingSender:
    def __init__(self) -> None:
        self.sent: list[Any] = []

    def send(self, msg: Any) -> None:
        self.sent.append(msg)


def ready_manager(sender: RecordingSender) -> TokenizerManager:
    manager = TokenizerManager(Dispatcher([sender]), Metrics())
    manager.tokenizer, manager.starting = TOKENIZER, set()
    manager.on_ready(
        Ready("scheduler0", ModelInfo("m", 4096, 8, 2048, 49152, "float32", "float32", 0))
    )
    return manager


def test_the_main_process_turns_an_error_result_into_a_500():
    async def scenario() -> None:
        sender = RecordingSender()
        manager = ready_manager(sender)
        reqs = [Req("a", [1, 2], SamplingParams()), Req("b", [1, 2], SamplingParams())]
        call = manager.submit(reqs, stream=True)
        manager._on_output(StrOut("b", "hi", [5], None, 2, 0, 1))
        error = FinishReason.error("detokenizing the output failed: boom")
        manager._on_output(StrOut("a", "", [], error, 2, 0, 1))
        seen = []
        with pytest.raises(APIError) as raised:
            async for index, out in call.stream():
                seen.append((index, out.text_delta, out.result["text"]))
        assert seen == [(1, "hi", "hi")]
        assert raised.value.status == 500 and "boom" in raised.value.message
        assert "a" not in manager.pending
        assert any(getattr(m, "rid", None) == "a" for m in sender.sent[2:])  # its abort
        call.close()

    asyncio.run(scenario())


def test_outputs_queued_while_the_reader_was_busy_come_as_each_sequences_latest():
    """A stream that lags (its outputs queued up) reads each sequence's latest result
    once, the text whole; one that keeps up reads every output."""

    async def scenario() -> None:
        manager = ready_manager(RecordingSender())
        reqs = [Req(rid, [1, 2], SamplingParams()) for rid in ("a", "b")]
        call = manager.submit(reqs, stream=True)
        manager._on_output(StrOut("a", "one", [5], None, 2, 0, 1))
        manager._on_output(StrOut("b", "uno", [6], None, 2, 0, 1))
        manager._on_output(StrOut("a", " two", [7], None, 2, 0, 2))  # a lagging reader
        seen = []
        stream = call.stream()
        index, out = await anext(stream)
        seen.append((index, out.result["text"]))
        index, out = await anext(stream)
        seen.append((index, out.result["text"]))
        assert seen == [(0, "one two"), (1, "uno")]  # a's first output was skipped
        done = FinishReason.of_length(2)
        manager._on_output(StrOut("b", " dos", [8], done, 2, 0, 2))  # one at a time
        index, out = await anext(stream)
        assert (index, out.result["text"], out.finished) == (1, "uno dos", True)
        manager._on_output(StrOut("a", " three", [9], done, 2, 0, 3))
        index, out = await anext(stream)
        assert (index, out.result["text"], out.finished) == (0, "one two three", True)
        with pytest.raises(StopAsyncIteration):
            await anext(stream)
        call.close()

    asyncio.run(scenario())


def test_a_closed_call_keeps_its_rid_until_the_schedulers_last_output():
    """The old request's outputs, still on their way after its client left, never reach a
    new request that takes the same rid: that rid is refused until the last one arrives."""

    async def scenario() -> None:
        sender = RecordingSender()
        manager = ready_manager(sender)
        old = manager.submit([Req("x", [1, 2], SamplingParams())], stream=True)
        old.close()  # the client left
        assert isinstance(sender.sent[-1], AbortReq) and sender.sent[-1].rid == "x"
        with pytest.raises(APIError) as raised:
            manager.submit([Req("x", [3], SamplingParams())])
        assert raised.value.status == 400 and raised.value.param == "rid"
        assert "still being aborted" in raised.value.message
        manager._on_output(StrOut("x", "a", [5], None, 2, 0, 1))  # still running: dropped
        aborted = FinishReason.abort("the client disconnected")
        manager._on_output(StrOut("x", "", [], aborted, 2, 0, 1))  # its last word
        assert "x" not in manager.pending
        new = manager.submit([Req("x", [3], SamplingParams())])
        manager._on_output(StrOut("x", "b", [6], FinishReason.of_length(1), 1, 0, 1))
        (result,) = await new.results()
        assert result["text"] == "b" and result["meta_info"]["prompt_tokens"] == 1
        new.close()

    asyncio.run(scenario())


def test_a_control_request_the_scheduler_does_not_answer_is_a_503():
    async def scenario() -> None:
        manager = ready_manager(RecordingSender())
        with pytest.raises(APIError) as raised:
            await manager.control("get_state", timeout=0.05)
        assert raised.value.status == 503 and "get_state" in raised.value.message
        assert manager.controls == {}

    asyncio.run(scenario())


def test_a_one_token_delta_is_a_few_dozen_bytes():
    delta = msgspec.msgpack.encode(StrOut("r", "x", [1234], None, 100, 0, 99))
    # an array: no field names on the wire; each optional field left unset costs a byte
    assert len(delta) < 40, delta


# -- stop regexes: the scheduler's text of a request's output -------------------------------
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(streams())
def test_the_stop_checkers_output_text_is_a_full_decode_at_every_step(case):
    """The text stop regexes search (scheduler/stop.py OutputText), grown step by step, is
    the full decode of the output so far, less a character still split across tokens."""
    steps, params, _ = case
    text, seen = OutputText(TOKENIZER, params), []
    for ids in steps:
        seen += ids
        full = TOKENIZER.decode(seen, skip_special_tokens=params.skip_special_tokens)
        assert text.of(seen) == full.rstrip(REPLACEMENT)
    first = TOKENIZER.decode(seen[:1], skip_special_tokens=params.skip_special_tokens)
    assert text.of(seen[:1]) == first.rstrip(REPLACEMENT)  # fewer ids than before: begun again


class CountingTokenizer:
    """The tiny tokenizer, counting the ids it is asked to decode."""

    def __init__(self) -> None:
        self.decoded = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.decoded += len(ids)
        return TOKENIZER.decode(ids, **kwargs)


def test_a_stop_regex_costs_each_step_its_new_tokens_not_the_whole_output():
    """A request with a stop regex is checked every step over its whole output's text, but
    only the new tokens are decoded: 600 steps decode a few ids each (a full decode per step
    would be 180,000 ids), and the pattern still ends the request where it first matches."""
    counting = CountingTokenizer()
    info = ModelInfo("m", 4096, 8, 4096, len(TOKENIZER), "float32", "float32", 0)
    checker = StopChecker(counting, {EOS}, info, grammars=None)
    ids = TOKENIZER.encode(" héllo wörld 😀" * 60)[:600]
    tail = TOKENIZER.encode(" END-42")
    params = SamplingParams(max_new_tokens=2000, stop_regex=[r"END-\d\d"])
    req = Req("r", [1, 2, 3], params)
    for i in ids:
        req.output_ids.append(i)
        assert checker.check(req) is None
    assert counting.decoded < 10 * len(ids), counting.decoded
    reasons = []
    for i in tail:
        req.output_ids.append(i)
        reasons.append(checker.check(req))
    assert reasons[-1] == FinishReason.stop("END-42") and not any(reasons[:-1])


def test_a_requests_stop_regexes_share_one_time_limit_per_step():
    """64 patterns that each search this output in ~1 ms, under the time limit alone, end
    the request once one step's search with them all has taken STOP_REGEX_TIMEOUT_S, rather
    than cost every step ~64 ms. (`(?:x|y)+\\d` backtracks quadratically over "xyxy...".)"""
    pattern = r"(?:x|y)+\d"
    info = ModelInfo("m", 4096, 8, 4096, len(TOKENIZER), "float32", "float32", 0)
    checker = StopChecker(TOKENIZER, {EOS}, info, grammars=None)
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=2000, stop_regex=[pattern] * 64))
    req.output_ids.extend(TOKENIZER.encode("xy" * 200))
    text, compiled = TOKENIZER.decode(req.output_ids), regex.compile(pattern)
    one = min(timed(lambda: compiled.search(text)) for _ in range(5))
    assert STOP_REGEX_TIMEOUT_S / 64 < one < STOP_REGEX_TIMEOUT_S / 2, one
    reason = checker.check(req)
    assert reason is not None and reason.type == "abort", reason
    assert repr(pattern) in reason.message and "took over" in reason.message, reason


def timed(work: Callable[[], Any]) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


# -- the scheduler's stop decision and the text shown, together -----------------------------
WORDS = [" 1", ",", " 5", "5", " 8", "8", " STOP", "ST", "OP", " é", "😀", "a", "b"]
STOP_STRINGS = [",", " STOP", "5,", "8", "😀"]
STOP_REGEXES = ["5.*8", r"\d,", "S.?O", "(?<=a)b", "8|$", r"é\W"]


@st.composite
def checked_requests(draw: st.DrawFn) -> tuple[list[int], SamplingParams, list[int]]:
    """A request's possible output ids, its stops, and where the detokenizer's steps end."""
    words = draw(st.lists(st.sampled_from(WORDS), min_size=1, max_size=16))
    ids = [i for word in words for i in TOKENIZER.encode(word)]
    params = SamplingParams(
        max_new_tokens=len(ids),
        min_new_tokens=draw(st.integers(0, len(ids))),
        stop=draw(st.lists(st.sampled_from(STOP_STRINGS), max_size=2)),
        stop_regex=draw(st.lists(st.sampled_from(STOP_REGEXES), max_size=2)),
        no_stop_trim=draw(st.booleans()),
    )
    cuts = sorted(draw(st.sets(st.integers(1, len(ids)), max_size=len(ids))))
    return ids, params, cuts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(checked_requests())
def test_the_text_shown_only_grows_and_ends_where_the_stop_that_fired_begins(case):
    """The StopChecker ends the request; the text shown at every step is a prefix of the
    final text, which (trimmed) is followed in the output by the matched stop, holds no
    stop string after the first min_new_tokens tokens' text, and holds all of that text."""
    ids, params, cuts = case
    info = ModelInfo("m", 4096, 8, 4096, len(TOKENIZER), "float32", "float32", 0)
    checker = StopChecker(TOKENIZER, {EOS}, info, grammars=None)
    req = Req("r", [1, 2, 3], params)
    reason = None
    for token in ids:
        req.output_ids.append(token)
        if reason := checker.check(req):
            break
    assert reason is not None  # max_new_tokens at the latest
    out = req.output_ids
    ends = sorted({c for c in cuts if c < len(out)} | {len(out)})
    steps = [out[a:b] for a, b in zip([0, *ends], ends)]
    texts = [got for got, _ in run(steps, params, reason)]
    final = texts[-1]
    assert all(final.startswith(text) for text in texts), texts
    full = TOKENIZER.decode(out)
    assert full.startswith(final)
    if not isinstance(reason.matched, str) or params.no_stop_trim:
        assert final == full
        return
    stops_from = len(TOKENIZER.decode(out[: params.min_new_tokens]).rstrip(REPLACEMENT))
    assert full.startswith(final + reason.matched)
    assert len(final) >= stops_from
    assert not any(stop in final[stops_from:] for stop in params.stop)


def test_a_weight_update_that_ends_after_its_caller_gave_up_still_shows():
    """An update waits for the running requests, past the route's timeout if need be: its
    reply, when it comes, still sets the model path and weight version the server reports
    (as the scheduler serves them), and the 503 said it would."""

    async def scenario() -> None:
        sender = RecordingSender()
        manager = ready_manager(sender)
        late = "it still applies"
        with pytest.raises(APIError) as raised:
            await manager.control("update_weights", 0.01, {"weight_version": "step-9"}, late)
        assert raised.value.status == 503 and "(it still applies)" in raised.value.message
        (request,) = [m for m in sender.sent if isinstance(m, ControlReq)]
        update = WeightUpdate(True, "loaded", 0, "/ckpt/step-9", "step-9")
        manager._on_control_reply(ControlReply(request.call_id, update=update))
        assert manager.info.model_path == "/ckpt/step-9"
        assert manager.weight_version == "step-9"
        failed = WeightUpdate(False, "does not fit", 0, None, "step-10")
        manager._on_control_reply(ControlReply(request.call_id + 1, update=failed))
        assert manager.weight_version == "step-9"  # a failed one changes nothing

    asyncio.run(scenario())
