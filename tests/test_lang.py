"""The frontend language end to end: SGLang-style programs through every backend — HTTP to a
real `radixserve serve` (SmolLM2), the in-process Engine (SmolLM2), and the OpenAI backend
against the server's OpenAI routes — with greedy outputs equal across backends."""

from __future__ import annotations

import asyncio
import json
import re
import threading

import pytest
import requests
from transformers import AutoTokenizer

import radixserve.lang as sgl
from radixserve.lang.backend.base import PrefixReuse
from radixserve.lang.backend.runtime_endpoint import RuntimeEndpoint
from tests.server_utils import ServerProcess

pytestmark = pytest.mark.smollm2

GREEDY = {"temperature": 0}
FEW_SHOT = (
    "Answer each question with one word.\n\n"
    "Q: What color is the sky on a clear day?\nA: Blue\n\n"
    "Q: What animal says meow?\nA: Cat\n\n"
    "Q: What is frozen water called?\nA: Ice\n\n"
)
QUESTIONS = [
    "What is the capital of France?",
    "What color is grass?",
    "What do bees make?",
    "What is the opposite of hot?",
]


# -- backends -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("lang-server") / "server.log"
    proc = ServerProcess("--max-total-tokens", "20000", log=log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def engine():
    from radixserve import Engine

    with Engine(progress=False, max_total_tokens=20000, dtype="float32") as engine:
        yield engine


@pytest.fixture(scope="module")
def http_backend(server):
    backend = sgl.RuntimeEndpoint(server.url)
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def engine_backend(engine):
    return sgl.EngineBackend(engine)


@pytest.fixture(scope="module")
def openai_backend(server):
    """The server's OpenAI routes as a completion model (programs build their own text)."""
    backend = sgl.OpenAI("default", base_url=server.url + "/v1", is_chat_model=False)
    yield backend
    backend.shutdown()


@pytest.fixture(params=["http", "engine", "openai"])
def backend(request):
    return request.getfixturevalue(f"{request.param}_backend")


@pytest.fixture(scope="module")
def tokenizer(server):
    info = requests.get(server.url + "/get_model_info", timeout=30).json()
    return AutoTokenizer.from_pretrained(info["model_path"])


# -- programs -------------------------------------------------------------------------------
@sgl.function
def few_shot_qa(s, question):
    s += FEW_SHOT + "Q: " + question + "\nA:"
    s += sgl.gen("answer", max_tokens=4, stop="\n")


@sgl.function
def multi_turn(s, first, second):
    s += sgl.system("You are a terse assistant.")
    s += sgl.user(first)
    s += sgl.assistant(sgl.gen("a1", max_tokens=12))
    s += sgl.user(second)
    s += sgl.assistant(sgl.gen("a2", max_tokens=12))


@sgl.function
def capital(s, method):
    s += "The capital of France is"
    s += sgl.select("city", choices=[" Paris", " London", " a banana"], choices_method=method)


@sgl.function
def short_prefix_select(s, method):
    s += "I"  # one prompt token: the first prompt logprob is null
    s += sgl.select("word", choices=[" am", " zebra"], choices_method=method)


@sgl.function
def typed(s):
    s += "Q: How many legs does a dog have?\nA (a number): "
    s += sgl.gen_int("legs")
    s += "\nQ: Write the number pi with two decimals.\nA: "
    s += sgl.gen("pi", dtype=float, max_tokens=8)


@sgl.function
def legs_only(s):
    s += "Q: How many legs does a dog have?\nA (a number): "
    s += sgl.gen_int("legs", max_tokens=4)


@sgl.function
def json_record(s):
    s += "Write a JSON record of a person named Alice, aged 30.\n"
    with s.var_scope("json"):
        s += '{"name": "' + sgl.gen("name", regex=r"[A-Z][a-z]{1,12}", max_tokens=8)
        s += '", "age": ' + sgl.gen("age", regex=r"[1-9][0-9]?", max_tokens=4) + "}"


@sgl.function
def tool_use(s):
    s += "Write a Python expression that multiplies twelve by seven.\nExpression: "
    s += sgl.gen("expr", regex=r"[0-9]{1,3} ?\* ?[0-9]{1,3}", max_tokens=12)
    value = eval(s["expr"], {"__builtins__": {}})  # the regex admits only a product
    s += f"\nResult: {value}\n"
    s["value"] = value


@sgl.function
def skeleton_of_thought(s, topic):
    s += f"Give five short tips about {topic}.\nTips:\n"
    s += "1." + sgl.gen("skeleton", max_tokens=16, stop="\n")
    forks = s.fork(5)
    forks += lambda i: (
        f"\nExpand tip {i + 1} in one sentence:" + sgl.gen("expansion", max_tokens=12, stop="\n")
    )
    forks.join()
    s += "\nIn summary:" + sgl.gen("summary", max_tokens=12, stop="\n")


@sgl.function
def story(s):
    s += sgl.user("Tell me a two-sentence story about a cat.")
    s += sgl.assistant(sgl.gen("story", max_tokens=24))


# -- tests ----------------------------------------------------------------------------------
def test_few_shot_run_batch_matches_single_runs_and_hits_the_cache(backend):
    states = few_shot_qa.run_batch([{"question": q} for q in QUESTIONS], backend=backend, **GREEDY)
    answers = [s["answer"] for s in states]
    assert all(isinstance(a, str) and a.strip() for a in answers), answers
    # the constant few-shot prefix was cached once before the batch: every program hits it
    prefix_tokens = few_shot_qa.cache(backend=backend)
    assert prefix_tokens and prefix_tokens > 40
    for state in states:
        assert state.get_meta_info("answer")["cached_tokens"] >= prefix_tokens - 1
    single = few_shot_qa.run(question=QUESTIONS[0], backend=backend, **GREEDY)
    assert single["answer"] == answers[0]


def test_trace_finds_the_constant_prefix(backend):
    trace = few_shot_qa.trace(backend=backend)
    assert trace.prefix == FEW_SHOT + "Q: "
    assert "question" in trace.stopped_at


def test_multi_turn_roles_follow_the_models_chat_template(backend, tokenizer):
    state = multi_turn.run(first="Hi!", second="Name a color.", backend=backend, **GREEDY)
    messages = state.messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == state["a1"].lstrip()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert state.text() == rendered


def test_default_system_prompt_comes_from_the_template(backend, tokenizer):
    state = story.run(backend=backend, **GREEDY)
    messages = state.messages()
    assert messages[0]["role"] == "system"  # SmolLM2's template inserts its own
    assert state.text() == tokenizer.apply_chat_template(messages, tokenize=False)
    assert backend.get_chat_template().name in ("server", "engine")


@pytest.mark.parametrize(
    "method",
    [
        sgl.token_length_normalized,
        sgl.greedy_token_selection,
        sgl.unconditional_likelihood_normalized,
    ],
    ids=str,
)
def test_select_with_each_method(backend, method):
    state = capital.run(method=method, backend=backend)
    meta = state.get_meta_info("city")
    key = (
        "normalized_unconditional_prompt_logprobs"
        if method is sgl.unconditional_likelihood_normalized
        else "normalized_prompt_logprobs"
    )
    scores = meta[key]
    assert len(scores) == 3 and all(isinstance(x, float) for x in scores)
    if method is not sgl.greedy_token_selection:
        assert state["city"] == [" Paris", " London", " a banana"][scores.index(max(scores))]
    assert state["city"] == " Paris"
    assert state.text() == "The capital of France is Paris"
    # each choice's tokens as SGLang's meta gives them: [logprob, id, text], texts ending in
    # the choice (a healed token may hold the prefix's last characters too)
    for choice, triples in zip([" Paris", " London", " a banana"], meta["input_token_logprobs"]):
        assert "".join(text for _, _, text in triples).endswith(choice), triples
    short = short_prefix_select.run(method=method, backend=backend)
    assert short["word"] in (" am", " zebra")


def test_select_scores_match_prompt_logprobs(server, http_backend):
    """The batched score of a choice is its tokens' logprobs as /generate reports them."""
    prefix = "The capital of France is"
    scores = http_backend.score_choices(prefix, [" Paris", " a banana"], unconditional=False)
    for choice, score in zip([" Paris", " a banana"], scores):
        body = {
            "text": prefix + choice,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        out = requests.post(server.url + "/generate", json=body, timeout=60).json()
        triples = out["meta_info"]["input_token_logprobs"][-len(score.token_ids) :]
        assert [t[1] for t in triples] == score.token_ids
        assert [t[0] for t in triples] == pytest.approx(score.logprobs, abs=1e-4)


def test_typed_generation(backend):
    if isinstance(backend, sgl.OpenAI):  # logit_bias can force digits, not a float's shape
        with pytest.raises(sgl.ProgramError, match="dtype"):
            typed.run(backend=backend, **GREEDY)
        legs = legs_only.run(backend=backend, **GREEDY)["legs"]
        assert re.fullmatch(r"[0-9 ]+", legs) and legs.strip(), legs
        return
    state = typed.run(backend=backend, **GREEDY)
    assert re.fullmatch(r"[-+]?[0-9]+[ \n]*", state["legs"])
    int(state["legs"])
    assert re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+[ \n]*", state["pi"]), state["pi"]
    float(state["pi"])


def test_regex_and_json_regex_in_a_var_scope(backend):
    state = json_record.run(backend=backend, **GREEDY)
    record = json.loads(state["json"])
    assert re.fullmatch(r"[A-Z][a-z]{1,12}", record["name"]) and record["name"] == state["name"]
    assert record["age"] == int(state["age"])
    assert state.text().endswith(state["json"])


def test_tool_use_evaluates_the_generated_expression(backend):
    state = tool_use.run(backend=backend, **GREEDY)
    assert state["value"] == eval(state["expr"], {"__builtins__": {}})
    assert state.text().endswith(f"Result: {state['value']}\n")


def test_skeleton_of_thought_fork_and_join(backend):
    state = skeleton_of_thought.run(topic="sleeping well", backend=backend, **GREEDY)
    expansions = state["expansion"]
    assert isinstance(expansions, list) and len(expansions) == 5
    assert all(isinstance(e, str) for e in expansions)
    assert "In summary:" in state.text()
    assert "Expand tip" not in state.text()  # the branches' text stays in the branches


def test_streaming_text_iter_and_async_iter(backend):
    whole = story.run(backend=backend, **GREEDY)
    streamed = story.run(backend=backend, stream=True, **GREEDY)
    pieces = list(streamed.text_iter())
    assert len(pieces) > 1 and "".join(pieces) == whole.text()
    by_var = story.run(backend=backend, stream=True, **GREEDY)
    assert "".join(by_var.text_iter("story")) == whole["story"]

    async def collect():
        state = story.run(backend=backend, stream=True, **GREEDY)
        chunks = [c async for c in state.text_async_iter("story", return_meta_data=True)]
        return state, chunks

    state, chunks = asyncio.run(collect())
    assert "".join(c for c, _ in chunks) == whole["story"]
    assert all(isinstance(meta, dict) for _, meta in chunks)
    assert state.get_meta_info("story")["completion_tokens"] > 0


def test_min_tokens(backend):
    @sgl.function
    def terse(s, min_tokens):
        s += sgl.system("You are a helpful AI assistant.")
        s += sgl.user("What is the capital of France? Answer in one word.")
        s += sgl.assistant(sgl.gen("r", max_tokens=20, min_tokens=min_tokens))

    free = terse.run(min_tokens=0, backend=backend, **GREEDY)
    forced = terse.run(min_tokens=12, backend=backend, **GREEDY)
    assert free.get_meta_info("r")["completion_tokens"] < 12
    assert forced.get_meta_info("r")["completion_tokens"] >= 12


def test_n_samples(backend):
    @sgl.function
    def two(s):
        s += "Name an animal:" + sgl.gen("animal", max_tokens=4, n=2, temperature=1.0)

    state = two.run(backend=backend)
    assert isinstance(state["animal"], list) and len(state["animal"]) == 2
    assert state.text() == "Name an animal:" + state["animal"][0]


# -- errors never hang ----------------------------------------------------------------------
@sgl.function
def failing(s):
    s += "Count: " + sgl.gen("a", max_tokens=2)
    s += sgl.gen("bad", max_tokens=2, temperature=-1.0)  # the server refuses it
    s += sgl.gen("after", max_tokens=2)


def _within(seconds, fn):
    """fn's result (or exception) within `seconds`, else the test fails: no hang."""
    out: dict = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "hung"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def test_a_failed_call_raises_from_run_and_every_read(backend):
    with pytest.raises(sgl.ProgramError, match="temperature"):
        _within(120, lambda: failing.run(backend=backend))

    state = failing.run(backend=backend, stream=True)
    with pytest.raises(sgl.ProgramError):
        _within(120, lambda: state["after"])
    with pytest.raises(sgl.ProgramError):
        _within(120, state.text)
    assert isinstance(_within(120, state.error), Exception)
    assert _within(120, lambda: state["a"]) is not None  # made before the failure


def test_appending_what_is_no_expression_fails_the_program(backend):
    """`s += 5` or `s += inner(...)` (another program's state, which would put its repr in
    the prompt) is a TypeError, as `expr + 5` is, not text made by str()."""

    @sgl.function
    def inner(s, topic):
        s += "Topic: " + topic

    @sgl.function
    def appends(s, what):
        s += "A"
        s += what

    for what, words in ((5, "append int"), (inner.func, "append function")):
        with pytest.raises(TypeError, match=words):
            _within(120, lambda what=what: appends.run(what=what, backend=backend))

    @sgl.function
    def nests(s):
        s += inner(topic="cats", backend=backend)

    with pytest.raises(TypeError, match="inner.func"):
        _within(120, lambda: nests.run(backend=backend))

    @sgl.function
    def calls(s):  # the way: the function's own body, on this state
        inner.func(s, "cats")

    assert _within(120, lambda: calls.run(backend=backend)).text().endswith("Topic: cats")


def test_run_batch_isolates_a_failing_program(backend):
    @sgl.function
    def maybe(s, temperature):
        s += "Say hi:" + sgl.gen("x", max_tokens=3, temperature=temperature)

    states = _within(
        180, lambda: maybe.run_batch([{"temperature": 0}, {"temperature": -1}], backend=backend)
    )
    assert isinstance(states[0]["x"], str)
    with pytest.raises(sgl.ProgramError):
        states[1].text()


# -- co-design ------------------------------------------------------------------------------
class RecordingEndpoint(RuntimeEndpoint):
    """The real HTTP backend, noting the prefixes it is asked to cache."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.cached: list[str] = []

    def cache_prefix(self, prefix: str) -> int:
        self.cached.append(prefix)
        return super().cache_prefix(prefix)


def test_fork_sends_the_prefix_hint_for_long_unseen_text_only(server):
    """The hint caches the parent's text before the children start, when the text the
    backend has not seen since the program's last call is long enough to be worth a call."""
    backend = RecordingEndpoint(server.url)
    intro = "You are a careful writer who states facts plainly and briefly.\n"  # 64 chars

    @sgl.function
    def branches(s, topic, preamble):
        s += preamble + f"Three facts about {topic}:\n"  # still queued when fork() is called
        forks = s.fork(3)
        forks += lambda i: f"{i + 1}." + sgl.gen("fact", max_tokens=6, stop="\n")
        forks.join()
        s += "In short:" + sgl.gen("summary", max_tokens=4)
        again = s.fork(2)  # the backend saw all but a few characters: no hint
        again += lambda i: sgl.gen("more", max_tokens=2)
        again.join()

    topics = ["owls", "rivers", "glass"]
    states = [branches.run(topic=t, preamble=intro, backend=backend, **GREEDY) for t in topics]
    assert backend.cached == [intro + f"Three facts about {t}:\n" for t in topics]
    backend.cached.clear()
    branches.run(topic="tea", preamble="", backend=backend, **GREEDY)  # 24 chars: not worth it
    assert backend.cached == []
    for state in states:
        assert len(state["fact"]) == 3
    backend.shutdown()


class SlowHintEndpoint(RuntimeEndpoint):
    """The real HTTP backend whose prefix hints wait until a branch has generated (at most
    `patience` s), or fail: the branches must never wait for a hint."""

    def __init__(self, url: str, fail: bool = False, patience: float = 60.0) -> None:
        super().__init__(url)
        self.branch_ran = threading.Event()
        self.hint_waited: list[bool] = []
        self.fail = fail
        self.patience = patience

    def cache_prefix(self, prefix: str) -> int:
        self.hint_waited.append(self.branch_ran.wait(self.patience))
        if self.fail:
            raise sgl.BackendError("the hint failed on purpose")
        return super().cache_prefix(prefix)

    def generate(self, s, params):
        self.branch_ran.set()
        return super().generate(s, params)


@sgl.function
def two_facts(s):
    s += "You are a careful writer who states facts plainly and briefly. Two facts:\n"
    forks = s.fork(2)
    forks += lambda i: f"{i + 1}." + sgl.gen("fact", max_tokens=4, stop="\n")
    forks.join()


@pytest.mark.parametrize("fail", [False, True])
def test_the_prefix_hint_is_not_waited_for_and_may_fail(server, fail):
    backend = SlowHintEndpoint(server.url, fail=fail)

    state = _within(120, lambda: two_facts.run(backend=backend, **GREEDY))
    assert backend.hint_waited == [True]  # a branch generated while the hint was in flight
    assert len(state["fact"]) == 2 and state.error() is None
    backend.shutdown()


class NoSharingEndpoint(RuntimeEndpoint):
    """The real HTTP backend, told the runtime does not share a prefix among the requests
    of one batch (as a server run with --disable-in-batch-prefix-caching, or SGLang's,
    says), or with `reuse` NONE that it keeps no prefix (--disable-radix-cache); it notes
    the order of its calls."""

    def __init__(self, url: str, reuse: PrefixReuse = PrefixReuse.CACHE) -> None:
        super().__init__(url)
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        self.reuse = reuse

    def prefix_reuse(self) -> PrefixReuse:
        return self.reuse

    def _note(self, kind: str, text: str) -> None:
        with self._lock:
            self.calls.append((kind, text))

    def cache_prefix(self, prefix: str) -> int:
        tokens = super().cache_prefix(prefix)
        self._note("cached", prefix)  # noted once the prefix is in the server's cache
        return tokens

    def generate(self, s, params):
        self._note("generate", s.text_)
        return super().generate(s, params)

    def score_choices(self, prefix, choices, unconditional):
        self._note("score", prefix)
        return super().score_choices(prefix, choices, unconditional)


def test_a_backend_knows_how_the_runtime_reuses_a_prefix(server, http_backend, engine_backend):
    assert http_backend.prefix_reuse() is engine_backend.prefix_reuse() is PrefixReuse.BATCH
    for info, reuse in [
        ({"disable_in_batch_prefix_caching": False}, PrefixReuse.BATCH),
        ({"disable_in_batch_prefix_caching": True}, PrefixReuse.CACHE),
        ({"disable_in_batch_prefix_caching": False, "disable_radix_cache": True}, PrefixReuse.NONE),
        ({"schedule_policy": "fcfs", "disable_radix_cache": False}, PrefixReuse.CACHE),  # SGLang
        ({}, PrefixReuse.CACHE),  # a server that does not say
    ]:
        assert PrefixReuse.of(info) is reuse, info


@pytest.mark.parametrize("reuse", [PrefixReuse.CACHE, PrefixReuse.NONE])
def test_without_batch_sharing_the_branches_wait_for_the_prefix_hint(server, http_backend, reuse):
    """The runtime would compute a prefix once per branch that arrives with the others: the
    hint is cached before any branch generates (a runtime that keeps no prefix gets no
    hint), and the outputs are those of a server that shares (the hint changes what is
    cached, never what is generated)."""
    backend = NoSharingEndpoint(server.url, reuse)

    state = _within(120, lambda: two_facts.run(backend=backend, **GREEDY))
    kinds = [kind for kind, _ in backend.calls]
    hint = ["cached"] if reuse is PrefixReuse.CACHE else []
    assert kinds == [*hint, "generate", "generate"], backend.calls
    assert state["fact"] == two_facts.run(backend=http_backend, **GREEDY)["fact"]
    backend.shutdown()


def test_without_batch_sharing_a_select_caches_its_context_first(server, http_backend):
    backend = NoSharingEndpoint(server.url)
    for method in (sgl.token_length_normalized, sgl.unconditional_likelihood_normalized):
        backend.calls.clear()
        state = capital.run(method=method, backend=backend, **GREEDY)
        text = "The capital of France is"
        assert backend.calls == [("score", text), ("cached", text)]  # cached, then scored
        shared = capital.run(method=method, backend=http_backend, **GREEDY)
        assert state["city"] == shared["city"]
        assert state.get_meta_info("city") == shared.get_meta_info("city")
    backend.shutdown()


def test_http_in_process_and_openai_backends_agree(http_backend, engine_backend, openai_backend):
    for program, kwargs in [
        (multi_turn, {"first": "Hello!", "second": "What is 2+2?"}),
        (skeleton_of_thought, {"topic": "learning"}),
        (json_record, {}),
        (capital, {"method": sgl.token_length_normalized}),
    ]:
        via_http = program.run(backend=http_backend, **kwargs, **GREEDY)
        in_process = program.run(backend=engine_backend, **kwargs, **GREEDY)
        via_openai = program.run(backend=openai_backend, **kwargs, **GREEDY)
        assert via_http.text() == in_process.text() == via_openai.text(), program.func.__name__


def test_set_default_backend_and_server_info(http_backend, engine):
    sgl.set_default_backend(http_backend)
    try:
        assert "internal_states" in sgl.get_server_info()
        assert few_shot_qa.run(question=QUESTIONS[1], **GREEDY)["answer"]
    finally:
        sgl.global_config.default_backend = None
    sgl.set_default_backend(engine)  # an Engine is wrapped in-process
    try:
        assert few_shot_qa.run(question=QUESTIONS[1], **GREEDY)["answer"]
    finally:
        sgl.global_config.default_backend = None


class CountingEndpoint(RuntimeEndpoint):
    """The real HTTP backend, counting its generate calls."""

    calls = 0

    def generate(self, s, params):
        self.calls += 1
        return super().generate(s, params)


def test_api_speculative_execution_serves_later_gens_from_one_call(server):
    backend = CountingEndpoint(server.url)

    @sgl.function(num_api_spec_tokens=48)
    def profile(s):
        s += "Name: Alice\nAge: 30\nCity: Paris\n\nName: Bob\nAge: 41\nCity: Rome\n\n"
        # each gen's text ahead, up to its stop, has at most max_tokens characters (so at
        # most that many tokens): it is served from the text ahead
        s += "Name: Carol\nAge:" + sgl.gen("age", stop="\n", max_tokens=16)
        s += "\nCity:" + sgl.gen("city", stop="\n", max_tokens=16)

    state = profile.run(backend=backend, **GREEDY)
    assert state["age"].strip() and state["city"].strip()
    assert "\n" not in state["age"] + state["city"]
    assert state.text().endswith(f"Age:{state['age']}\nCity:{state['city']}")
    assert backend.calls == 1  # the city came from the text generated ahead
    backend.shutdown()


def test_api_speculative_execution_keeps_each_gens_max_tokens(server, http_backend):
    """A gen with no stop in the text generated ahead gets no more than its max_tokens: what
    could hold more is made by a call of its own (the output is the program's without
    speculation)."""

    def alphabet(s):
        s += "Alphabet: A B C" + sgl.gen("a", max_tokens=4) + "|" + sgl.gen("b", max_tokens=4)

    plain = sgl.function(alphabet).run(backend=http_backend, **GREEDY)
    ahead = sgl.function(num_api_spec_tokens=32)(alphabet).run(backend=http_backend, **GREEDY)
    assert (ahead["a"], ahead["b"]) == (plain["a"], plain["b"])
    assert ahead.text() == plain.text()


def test_the_wire_contract_fallback_scores_as_the_route_does(server, http_backend):
    """Against a server without /score_continuations (SGLang's), select goes through two
    /generate calls of the wire contract and must reach the same scores."""
    plain = RuntimeEndpoint(server.url)
    plain._scores_route = False  # as if the route had answered 404
    for prefix, choices in [
        ("The capital of France is", [" Paris", " a banana"]),
        ("x = (", ["(1)", "2)"]),  # "((" merges: the healed token is part of the choice
        ("I", [" am", " zebra"]),  # the first prompt logprob is null
    ]:
        via_route = http_backend.score_choices(prefix, choices, unconditional=True)
        via_generate = plain.score_choices(prefix, choices, unconditional=True)
        for a, b in zip(via_route, via_generate):
            assert a.token_ids == b.token_ids and a.healed_tokens == b.healed_tokens
            assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
            assert a.unconditional_logprobs[1:] == pytest.approx(
                b.unconditional_logprobs[1:], abs=1e-4
            )
    plain.shutdown()


@pytest.mark.parametrize("name", ["http", "engine"])  # the OpenAI backend has no logprobs
def test_streamed_logprobs_come_per_chunk(request, name):
    backend = request.getfixturevalue(f"{name}_backend")

    @sgl.function
    def answer(s):
        s += sgl.user("Name three colors.")
        s += sgl.assistant(sgl.gen("a", max_tokens=16, return_logprob=True))

    async def collect():
        state = answer.run(backend=backend, stream=True, **GREEDY)
        return [c async for c in state.text_async_iter("a", return_meta_data=True)]

    chunks = asyncio.run(collect())
    delivered = 0
    for text, meta in chunks:  # each chunk carries the logprobs of its own new tokens
        assert text
        assert meta["output_token_logprobs_length"] == meta["completion_tokens"]
        assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] - delivered
        delivered = meta["completion_tokens"]
    final = answer.run(backend=backend, **GREEDY).get_meta_info("a")["completion_tokens"]
    assert 0 < delivered <= final  # an end-of-turn token adds no text, so no chunk
