"""The frontend language's OpenAI backend against a real radixserve server's /v1 routes (the
tiny random-weight Llama: the mechanics, not the text's meaning), each result checked
against the same request made directly with the `openai` client. One server serves the
whole module."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

import radixserve.lang as sgl
from radixserve.lang.backend.base import BackendError
from tests.server_utils import ServerProcess, tiny_model_server

TIMEOUT_S = 120  # no program may take longer: a hang is a failure too
PROMPT = "The cat"


# -- fixtures ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_model_dirs, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("lang-openai-server")
    yield from tiny_model_server(tiny_model_dirs["llama"], log_dir)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def model_id(client) -> str:
    return client.models.list().data[0].id


def test_the_model_id_is_the_model_path_as_given(client, model_id, tiny_model_dirs):
    # as SGLang and vLLM report it: SGLang's bench_serving loads its tokenizer from this id
    assert model_id == str(tiny_model_dirs["llama"])
    assert client.models.retrieve(model_id).id == model_id  # a path, slashes and all


@pytest.fixture(scope="module")
def completion(server, model_id):
    backend = sgl.OpenAI(
        model_id, is_chat_model=False, base_url=server.url + "/v1", api_key="x", max_retries=0
    )
    yield backend
    backend.shutdown()


@pytest.fixture(scope="module")
def chat(server, model_id):
    backend = sgl.OpenAI(model_id, base_url=server.url + "/v1", api_key="x", max_retries=0)
    yield backend
    backend.shutdown()


def run(program, backend, *args, **kwargs):
    """Run a program in a worker thread, so a hang fails the test instead of stalling it."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(program.run, *args, backend=backend, **kwargs).result(TIMEOUT_S)


def program_error(program, backend, *args, **kwargs) -> BaseException:
    """The cause of the ProgramError the program's run raises."""
    with pytest.raises(sgl.ProgramError) as info:
        run(program, backend, *args, **kwargs)
    return info.value.__cause__


# -- programs ---------------------------------------------------------------------------------
@sgl.function
def continue_text(s, prompt, **gen_args):
    s += prompt
    s += sgl.gen("out", **gen_args)


@sgl.function
def answer(s, question, **gen_args):
    s += sgl.user(question)
    s += sgl.assistant(sgl.gen("answer", **gen_args))


@sgl.function
def choose(s, prefix, choices, method):
    s += prefix
    s += sgl.select("choice", choices=choices, choices_method=method)


# -- generation -------------------------------------------------------------------------------
def test_completion_gen_is_the_direct_completion(completion, client, model_id):
    usage_before = completion.token_usage.completion_tokens
    state = run(continue_text, completion, PROMPT, max_tokens=8, temperature=0)
    direct = client.completions.create(model=model_id, prompt=PROMPT, max_tokens=8, temperature=0)
    assert state["out"] == direct.choices[0].text
    assert state.text() == PROMPT + direct.choices[0].text
    meta = state.get_meta_info("out")
    assert meta["finish_reason"] == direct.choices[0].finish_reason
    assert meta["usage"]["prompt_tokens"] == direct.usage.prompt_tokens
    assert meta["usage"]["completion_tokens"] == 8
    assert completion.token_usage.completion_tokens == usage_before + 8


def test_chat_program_is_the_direct_chat_call(chat, client, model_id):
    state = run(answer, chat, "What is a cat?", max_tokens=8, temperature=0)
    stop = list(chat.get_chat_template().stop_str)
    direct = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "What is a cat?"}],
        max_tokens=8,
        temperature=0,
        **({"stop": stop} if stop else {}),
    )
    text = direct.choices[0].message.content
    assert state["answer"] == text
    assert state.messages()[-1] == {"role": "assistant", "content": text.lstrip()}
    assert state.get_meta_info("answer")["usage"]["completion_tokens"] == 8


def test_chat_gen_must_follow_assistant_begin(chat):
    @sgl.function
    def gen_in_user_turn(s):
        s += sgl.user("Hello")
        s += sgl.gen("x", max_tokens=4)

    @sgl.function
    def text_before_gen(s):
        s += sgl.user("Hello")
        s += sgl.assistant("Sure: " + sgl.gen("x", max_tokens=4))

    for program in (gen_in_user_turn, text_before_gen):
        error = program_error(program, chat)
        assert "right after assistant begins" in str(error)


def test_n_samples(completion):
    # ignore_eos: a sample at temperature 1 may draw EOS early; the counts below need all six
    state = run(
        continue_text, completion, PROMPT, max_tokens=6, temperature=1.0, n=2, ignore_eos=True
    )
    samples = state["out"]
    assert isinstance(samples, list) and len(samples) == 2
    assert all(isinstance(text, str) for text in samples)
    assert state.text() == PROMPT + samples[0]
    metas = state.get_meta_info("out")  # one per sample, as the native backends give
    assert [m["finish_reason"] for m in metas] == ["length", "length"]
    assert metas[0]["usage"]["completion_tokens"] == 12  # the call's usage, both samples


def test_regex_reaches_the_server(completion):
    state = run(continue_text, completion, PROMPT, max_tokens=10, temperature=0, regex="[ab]{3}c")
    assert re.fullmatch("[ab]{3}c", state["out"]), state["out"]


def test_gen_int_is_digits_and_gen_string_is_quoted(completion):
    @sgl.function
    def typed(s):
        s += "Number: "
        s += sgl.gen_int("number", max_tokens=8, temperature=0)
        s += "\nName: "
        s += sgl.gen_string("name", max_tokens=8, temperature=0)

    state = run(typed, completion)
    assert re.fullmatch(r"[0-9]+", state["number"]), state["number"]
    name = state["name"]
    assert name.startswith('"') and name.endswith('"') and '"' not in name[1:-1], name


def test_dtype_on_a_chat_model_is_refused(chat):
    @sgl.function
    def typed(s):
        s += sgl.user("How many legs has a cat?")
        s += sgl.assistant(sgl.gen_int("n", max_tokens=4))

    assert "needs a completion model" in str(program_error(typed, chat))


def test_streamed_text_is_the_generated_text(completion, chat):
    cases = [
        (completion, continue_text, (PROMPT,), "out"),
        (chat, answer, ("What is a cat?",), "answer"),
    ]
    for backend, program, args, var in cases:
        whole = run(program, backend, *args, max_tokens=10, temperature=0)
        streamed = program.run(*args, backend=backend, stream=True, max_tokens=10, temperature=0)
        with ThreadPoolExecutor(1) as pool:
            chunks = pool.submit(lambda s=streamed: list(s.text_iter())).result(TIMEOUT_S)
        assert "".join(chunks) == whole.text()
        assert streamed[var] == whole[var]
        assert streamed.get_meta_info(var)["usage"]["completion_tokens"] == 10


# -- select -----------------------------------------------------------------------------------
METHODS = {
    "token_length_normalized": (sgl.token_length_normalized, "normalized_prompt_logprobs"),
    "greedy_token_selection": (sgl.greedy_token_selection, "greedy_logprob_matrix"),
    "unconditional_likelihood_normalized": (
        sgl.unconditional_likelihood_normalized,
        "normalized_unconditional_prompt_logprobs",
    ),
}


@pytest.mark.parametrize("name", list(METHODS))
def test_select_picks_the_best_score_it_reports(completion, name):
    method, key = METHODS[name]
    choices = [" sat on the mat", " ran", " jumped over the dog"]
    state = run(choose, completion, PROMPT, choices, method)
    scores = state.get_meta_info("choice")[key]
    assert len(scores) == len(choices)
    # the rows of the greedy matrix compare as lists: the first row that is largest wins
    assert state["choice"] == choices[max(range(len(choices)), key=scores.__getitem__)]
    assert state.text() == PROMPT + state["choice"]


def test_choice_scores_are_the_echoed_logprobs(completion, client, model_id):
    """A choice's logprobs are the prompt logprobs the server echoes for its tokens, the
    token it merges into at the prefix's end included (healed), and its unconditional ones
    are its tokens' echoed logprobs alone."""
    scores = completion.score_choices("The cat ", ["sat", " ran"], unconditional=True)
    for choice, score in zip(["sat", " ran"], scores):
        direct = client.completions.create(
            model=model_id, prompt="The cat " + choice, echo=True, logprobs=1, max_tokens=0
        )
        echoed = direct.choices[0].logprobs
        span = len(score.token_ids)
        assert score.logprobs == echoed.token_logprobs[-span:]
        assert "".join(echoed.tokens[-span:]).endswith(choice)
        alone = client.completions.create(
            model=model_id, prompt=[score.token_ids], echo=True, logprobs=1, max_tokens=0
        )
        assert score.unconditional_logprobs == alone.choices[0].logprobs.token_logprobs
        assert score.unconditional_logprobs[0] is None
    # "The cat " ends with a space token that "The cat sat" merges into " s"
    assert scores[0].healed_tokens == 1 and len(scores[0].token_ids) == 2
    assert scores[1].healed_tokens == 0  # " ran" after it: the space token stays its own


def test_a_character_split_over_tokens_is_scored_by_ids(completion, client, model_id):
    """Byte tokens of one character echo as U+FFFD, so their texts do not add up to the
    choice: its span is where prefix + choice stops matching the prefix's own tokens."""
    prefix_ids, full_ids = completion._tokenize([PROMPT, PROMPT + " café"], True)
    (score,) = completion.score_choices(PROMPT, [" café"], unconditional=False)
    assert score.token_ids == full_ids[len(prefix_ids) :] and score.healed_tokens == 0
    direct = client.completions.create(
        model=model_id, prompt=PROMPT + " café", echo=True, logprobs=1, max_tokens=0
    )
    assert score.logprobs == direct.choices[0].logprobs.token_logprobs[len(prefix_ids) :]


def test_logit_bias_select_agrees_on_one_token_choices(completion):
    """The method for servers without prompt logprobs: on choices of one token each, the
    token the biased greedy step picks is the one with the highest conditional logprob."""
    prefix, choices = PROMPT, [" s", " r", " j"]
    decision = completion._select_by_logit_bias(prefix, choices)
    scores = decision.meta_info["scores"]
    assert sorted(scores) == [0, 0, 1]
    greedy = sgl.greedy_token_selection(choices, completion.score_choices(prefix, choices, False))
    assert decision.decision == greedy.decision == choices[scores.index(1)]


def test_select_on_a_chat_model_is_refused(chat):
    @sgl.function
    def pick(s):
        s += sgl.user("Cats or dogs?")
        s += sgl.assistant(sgl.select("pet", choices=["cats", "dogs"]))

    assert "select needs a completion model" in str(program_error(pick, chat))


# -- errors and the server's other routes -----------------------------------------------------
@pytest.mark.parametrize(
    "gen_args, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"regex": "(?=a)b"}, "regex"),  # valid for Python's re, refused by the server
        ({"stop_regex": "("}, "stop_regex"),  # an extra, checked by the server
    ],
)
def test_a_refused_request_is_the_programs_error(completion, gen_args, message):
    error = program_error(continue_text, completion, PROMPT, max_tokens=4, **gen_args)
    assert isinstance(error, BackendError) and error.status == 400
    assert message in str(error)


def test_cache_prefix_and_server_routes(completion, chat, server):
    tokens = completion._tokenize([PROMPT + " sat"], add_special_tokens=True)[0]
    assert completion.cache_prefix(PROMPT + " sat") == len(tokens)
    assert chat.cache_prefix(PROMPT) == 0
    assert completion.flush_cache() is True
    assert completion.get_server_info()["served_model_name"] == chat.model_name
    elsewhere = sgl.OpenAI("m", base_url=server.url + "/nowhere/v1", api_key="x", max_retries=0)
    assert elsewhere.flush_cache() is False and elsewhere.get_server_info() == {}
    elsewhere.shutdown()
