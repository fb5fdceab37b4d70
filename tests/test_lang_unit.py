"""The frontend language's pure parts: choice methods, the token-healing span rule of the
wire-contract fallback, sampling-parameter resolution, chat templates and programs'
signatures. (Programs against real backends: tests/test_lang.py.)"""

from __future__ import annotations

import math

import pytest

import radixserve.lang as sgl
from radixserve.lang.backend.runtime_endpoint import _choice_span, _flags
from radixserve.lang.chat_template import ChatTemplate, get_chat_template_by_model_path
from radixserve.lang.choices import ChoiceScores
from radixserve.lang.ir import REGEX_INT, SamplingParams, variable_names


def scores(*rows, uncond=None):
    return [
        ChoiceScores(list(range(len(r))), list(r), None if uncond is None else uncond[i])
        for i, r in enumerate(rows)
    ]


def test_token_length_normalized_takes_the_best_mean_and_skips_nulls():
    decision = sgl.token_length_normalized(["a", "b"], scores([None, -1.0, -3.0], [-1.5]))
    assert decision.decision == "b"  # -2.0 vs -1.5
    assert decision.meta_info["normalized_prompt_logprobs"] == [-2.0, -1.5]


def test_greedy_token_selection_breaks_ties_on_later_tokens_and_pads_with_the_mean():
    choices = ["x", "xy", "z"]
    decision = sgl.greedy_token_selection(choices, scores([-1.0], [-1.0, -1.5], [-2.0]))
    assert decision.decision == "x"  # tied on the first token; "x" padded with -1.0 > -1.5
    assert decision.meta_info["greedy_logprob_matrix"][0] == [-1.0, -1.0]


def test_greedy_token_selection_prefers_the_higher_second_token():
    decision = sgl.greedy_token_selection(["x", "xy"], scores([-1.0, -2.0], [-1.0, -0.5]))
    assert decision.decision == "xy"


def test_unconditional_likelihood_normalized_counts_a_null_as_zero():
    rows = scores([-1.0, -1.0], [-2.0], uncond=[[None, -3.0], [None]])
    decision = sgl.unconditional_likelihood_normalized(["a", "b"], rows)
    # a: mean(-1 - 0, -1 + 3) = 0.5; b: -2 - 0 = -2
    assert decision.meta_info["normalized_unconditional_prompt_logprobs"] == [0.5, -2.0]
    assert decision.decision == "a"
    with pytest.raises(ValueError, match="unconditional"):
        sgl.unconditional_likelihood_normalized(["a"], scores([-1.0]))


def test_a_choice_with_no_scored_token_never_wins():
    decision = sgl.token_length_normalized(["a", "b"], scores([None], [-9.0]))
    assert decision.decision == "b"
    assert decision.meta_info["normalized_prompt_logprobs"][0] == -math.inf


def test_choice_span_without_healing():
    # triples from two tokens before the prefix's end: "is", " the", then the choice
    triples = [[-1.0, 1, " is"], [-2.0, 2, " the"], [-0.5, 3, " cap"], [-0.1, 4, "ital"]]
    span = _choice_span(triples, " capital", prefix_tokens=2)
    assert span.token_ids == [3, 4] and span.logprobs == [-0.5, -0.1] and span.healed_tokens == 0
    assert span.token_texts == [" cap", "ital"]


def test_choice_span_with_a_merged_token():
    # the prefix ends in "(" and the choice "A)" tokenizes as "(A" + ")": "(A" is healed
    triples = [[-1.0, 1, " is"], [-2.0, 2, " (A"], [-0.3, 3, ")"]]
    span = _choice_span(triples, "A)", prefix_tokens=2)
    assert span.token_ids == [2, 3] and span.logprobs == [-2.0, -0.3] and span.healed_tokens == 1


def test_choice_span_falls_back_to_the_prefix_end_when_texts_do_not_add_up():
    triples = [[None, 1, None], [-2.0, 2, None], [-0.3, 3, None]]
    span = _choice_span(triples, "xyz", prefix_tokens=1)
    assert span.token_ids == [2, 3] and span.healed_tokens == 0 and span.token_texts is None


def test_gen_overrides_the_programs_defaults_and_adds_template_stops():
    defaults = SamplingParams(max_new_tokens=128, temperature=1.0, stop=())
    gen = sgl.gen("x", max_tokens=5, stop="\n")
    merged = defaults.merged(gen.params, ("<|im_end|>",))
    native = merged.to_native()
    assert native["max_new_tokens"] == 5 and native["temperature"] == 1.0
    assert native["stop"] == ["\n", "<|im_end|>"]
    assert "regex" not in native and "n" not in native


def test_dtype_becomes_a_regex_with_its_stops():
    native = SamplingParams(stop=["."]).merged(sgl.gen_int("n").params).to_native()
    assert native["regex"] == REGEX_INT and native["stop"] == [".", " ", "\n"]
    with pytest.raises(ValueError, match="dtype"):
        SamplingParams(dtype=list).to_native()


def test_expressions_concatenate_flat_and_name_their_variables():
    expr = "Q: " + sgl.gen("a") + "\n" + sgl.select("b", choices=["x", "y"])
    assert [type(e).__name__ for e in expr.exprs] == ["Constant", "Gen", "Constant", "Select"]
    assert variable_names(sgl.user(expr)) == ["a", "b"]


def test_bad_expressions_fail_where_they_are_written():
    with pytest.raises(ValueError, match="non-empty"):
        sgl.select("x", choices=["a", ""])
    with pytest.raises(ValueError, match="temperature"):
        sgl.select("x", choices=["a"], temperature=0.7)
    with pytest.raises(Exception, match="unterminated|missing"):
        sgl.gen("x", regex="(")
    with pytest.raises(TypeError, match="append"):
        sgl.gen("x") + 3


def test_a_program_must_take_s_first_and_bind_known_arguments():
    with pytest.raises(TypeError, match="named s"):
        sgl.function(lambda state, q: None)

    @sgl.function
    def program(s, question, context="none"):
        s += question

    assert program.arg_names == ["question", "context"]
    assert program.bind(context="c").bind_arguments == {"context": "c"}
    with pytest.raises(TypeError, match="no arguments"):
        program.bind(nope=1)
    with pytest.raises(RuntimeError, match="no backend"):
        program.run(question="q")
    with pytest.raises(RuntimeError, match="no backend"):  # SGLang's keyword, taken
        program.run(question="q", use_thread=False)


def test_sglang_signatures_and_names_it_does_not_provide():
    assert sgl.gen_int("n", 6).params.max_new_tokens == 6  # max_tokens second, as SGLang's
    assert sgl.gen_string("s", 9).params.max_new_tokens == 9
    with pytest.raises(AttributeError, match="text models only"):
        sgl.image("cat.png")
    with pytest.raises(AttributeError, match="no attribute 'nothing_of_the_kind'"):
        sgl.nothing_of_the_kind  # noqa: B018


def test_chat_template_by_model_path_and_from_a_server():
    assert get_chat_template_by_model_path("/models/SmolLM2-135M-Instruct").name == "chatml"
    assert get_chat_template_by_model_path("meta-llama/Llama-3-8B").name == "llama-3-instruct"
    assert get_chat_template_by_model_path("gpt2").name == "default"
    roles = {
        "roles": {"system": ["<s>", "</s>"], "user": ["<u>", "</u>"], "assistant": ["<a>", "</a>"]},
        "default_system_prompt": "Be nice.",
        "stop_str": ["</a>"],
    }
    template = ChatTemplate.from_server(roles)
    assert template.get_prefix_and_suffix("user") == ("<u>", "</u>")
    assert template.default_system_prompt == "Be nice." and template.stop_str == ("</a>",)
    with pytest.raises(ValueError, match="lack"):
        ChatTemplate.from_server({"roles": {"user": ["", ""]}, "stop_str": []})


def test_runtime_flags_from_keyword_arguments():
    flags = _flags({"max_total_tokens": 4096, "disable_radix_cache": True, "api_key": None})
    assert flags == ["--max-total-tokens", "4096", "--disable-radix-cache"]
