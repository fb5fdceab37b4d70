"""The reasoning split of /v1/chat/completions (`--reasoning-parser`), as text: what a
finished output splits into, where a block starts, and that any stream of it reassembles to
the same split. (Through the real server: tests/test_server_tools.py.)"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from radixserve.config import REASONING_PARSERS
from radixserve.core.req import Req
from radixserve.core.sampling_params import SamplingParams, ThinkBlock
from radixserve.server.errors import APIError
from radixserve.server.reasoning import (
    REASONING_FORMATS,
    ReasoningStream,
    Split,
    reasoning_plan,
    split,
    think_first,
)

QWEN3 = REASONING_FORMATS["qwen3"]
R1 = REASONING_FORMATS["deepseek-r1"]


def test_every_parser_flag_has_a_format():
    assert set(REASONING_PARSERS) == set(REASONING_FORMATS)


@pytest.mark.parametrize(
    ("text", "inside", "reasoning", "content"),
    [
        ("<think>\nAdd them.\n</think>\n\n4", False, "Add them.", "4"),
        ("  <think>a</think>b", False, "a", "b"),
        ("4", False, None, "4"),  # no block: all content, untouched
        ("  4 <think>x</think>", False, None, "  4 <think>x</think>"),  # only at the start
        ("Add them.</think>4", True, "Add them.", "4"),  # the prompt opened the block
        ("<think>Add them.</think>4", True, "Add them.", "4"),  # ... and the model wrote it
        ("<think>Add them, then", False, "Add them, then", ""),  # cut short by max_tokens
        ("<think>a</think>b</think>c", False, "a", "b</think>c"),  # the first end closes
        ("<think>hm<tool_call>{}</tool_call>", False, "hm", "<tool_call>{}</tool_call>"),
        ("<thi", False, None, "<thi"),  # final: no tag came
        ("", False, None, ""),
        ("", True, "", ""),
    ],
)
def test_a_finished_output_splits_into_reasoning_and_content(text, inside, reasoning, content):
    part = split(QWEN3, text, inside, final=True)
    assert (part.reasoning, part.content, part.closed) == (reasoning, content, True)


def test_after_a_constrained_block_only_the_end_tag_ends_it():
    """Where the constraint applies after the reasoning, its grammar ends the block at
    </think> alone; so does the split: a <tool_call> inside is reasoning, not a call."""
    text = "<think>maybe <tool_call>{}</tool_call></think>\n\nok"
    plain = reasoning_plan("qwen3", True, True, "<|im_start|>assistant\n")
    assert plain.split(text).reasoning == "maybe"
    strict = reasoning_plan("qwen3", True, True, "<|im_start|>assistant\n", end_tag_only=True)
    assert strict.split(text) == Split("maybe <tool_call>{}</tool_call>", "ok", closed=True)


def test_a_tool_call_closes_only_the_formats_that_say_so():
    assert split(R1, "hm<tool_call>{}", inside=True, final=True).reasoning == "hm<tool_call>{}"


@pytest.mark.parametrize(
    ("prompt", "parser", "inside"),
    [
        ("<|im_start|>assistant\n", "qwen3", False),
        ("<|im_start|>assistant\n<think>\n", "qwen3", True),  # a template opened it
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3", False),  # thinking off
        ("<think>a</think> q <|im_start|>assistant\n<think>", "qwen3", True),
        ("<|im_start|>assistant\n", "deepseek-r1", True),  # always inside
        ("<|im_start|>assistant\n", "qwen3-thinking", True),
        ("<|im_start|>assistant\n◁think▷", "kimi", True),
    ],
)
def test_the_prompt_says_whether_outputs_start_inside_a_block(prompt, parser, inside):
    plan = reasoning_plan(parser, separate=True, stream_reasoning=True, prompt=prompt)
    assert plan is not None and plan.inside is inside


def test_no_plan_without_a_parser_or_with_separate_reasoning_off():
    assert reasoning_plan(None, True, True, "") is None
    assert reasoning_plan("qwen3", False, True, "") is None


@pytest.mark.parametrize(
    ("prompt", "parser", "think"),
    [
        ("<|im_start|>assistant\n", "qwen3", ThinkBlock("<think>", "</think>", False)),
        ("<|im_start|>assistant\n<think>\n", "qwen3", ThinkBlock("<think>", "</think>", True)),
        ("<|im_start|>assistant\n", "deepseek-r1", ThinkBlock("<think>", "</think>", True)),
        ("assistant\n", "kimi", ThinkBlock("◁think▷", "◁/think▷", False)),
        # Qwen3 with thinking off: the template closes an empty block, the model will not think
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3", None),
    ],
)
def test_require_reasoning_reads_the_block_from_the_prompt(prompt, parser, think):
    req = Req("r", [1, 2], SamplingParams.from_dict({"regex": "(yes|no)"}))
    think_first([req], parser, lambda _: prompt)
    assert req.think == think


def test_require_reasoning_needs_a_parser():
    with pytest.raises(APIError, match="--reasoning-parser") as e:
        think_first([], None, lambda _: "")
    assert e.value.status == 400 and e.value.param == "require_reasoning"


def test_partial_markers_are_held_back_while_streaming():
    held = [split(QWEN3, t, inside=False, final=False) for t in ("", " ", "<th", "<think>a</th")]
    assert [(p.reasoning, p.content) for p in held] == [
        (None, ""),
        (None, ""),
        (None, ""),
        ("a", ""),
    ]
    assert split(QWEN3, "<think>a  ", inside=False, final=False).reasoning == "a"
    assert split(QWEN3, "<think>a <tool", inside=False, final=False).reasoning == "a"
    assert split(QWEN3, "<think>a</think>", inside=False, final=False).closed


PIECES = ["<think>", "</think>", "<tool_call>", "<th", "ink>", "</", "\n", " ", "a", "b c", "<"]


@given(
    pieces=st.lists(st.sampled_from(PIECES), max_size=12),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    inside=st.booleans(),
    streamed=st.booleans(),
    parser=st.sampled_from(sorted(REASONING_FORMATS)),
)
def test_any_stream_reassembles_to_the_finished_split(pieces, cuts, inside, streamed, parser):
    fmt = REASONING_FORMATS[parser]
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    segments = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    stream = ReasoningStream(fmt, inside, stream_reasoning=streamed)
    reasoning, content, pieces_of_reasoning = "", "", 0
    for i, segment in enumerate(segments):
        new_reasoning, new_content = stream.feed(segment, final=i == len(segments) - 1)
        reasoning += new_reasoning
        content += new_content
        pieces_of_reasoning += bool(new_reasoning)
    whole = split(fmt, text, inside, final=True)
    assert reasoning == (whole.reasoning or "")
    assert content == whole.content
    if not streamed:
        assert pieces_of_reasoning <= 1  # in one piece, once the block ended
