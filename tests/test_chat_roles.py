"""Role markers read off real chat templates: SmolLM2's (ChatML with a default system
prompt), the tiny test tokenizer's (ChatML without one), one that refuses a system message,
and none at all. The markers must rebuild what `apply_chat_template` renders."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from radixserve.chat_roles import chat_roles
from radixserve.config import Config
from radixserve.model.loader import resolve_model_folder
from radixserve.tokenizer import load_tokenizer
from tests.conftest import TINY_TOKENIZER

CHATML = {
    "system": ["<|im_start|>system\n", "<|im_end|>\n"],
    "user": ["<|im_start|>user\n", "<|im_end|>\n"],
    "assistant": ["<|im_start|>assistant\n", "<|im_end|>\n"],
}
SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CONVERSATION = [
    {"role": "system", "content": "You answer in one word."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
# Gemma's shape: a BOS before the conversation, "model" for the assistant, no system role
NO_SYSTEM_TEMPLATE = (
    "{{ '<bos>' }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    folder = resolve_model_folder(None, Config.from_flat().model.cache_dir, progress=False)
    return load_tokenizer(folder)


def tiny_tokenizer():
    return AutoTokenizer.from_pretrained(TINY_TOKENIZER)


def rebuilt(roles: dict, messages: list[dict]) -> str:
    """The conversation as prefix + content + suffix per message."""
    markers = roles["roles"]
    return "".join(markers[m["role"]][0] + m["content"] + markers[m["role"]][1] for m in messages)


@pytest.mark.smollm2
def test_smollm2_gives_chatml_and_its_default_system_prompt(smollm2_tokenizer):
    roles = chat_roles(smollm2_tokenizer)
    assert roles == {
        "roles": CHATML,
        "default_system_prompt": SMOLLM2_SYSTEM,
        "stop_str": ["<|im_end|>"],
        "system_supported": True,
    }


@pytest.mark.smollm2
def test_smollm2_markers_rebuild_the_template(smollm2_tokenizer):
    roles = chat_roles(smollm2_tokenizer)
    rendered = smollm2_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert rebuilt(roles, CONVERSATION) == rendered
    prompt = smollm2_tokenizer.apply_chat_template(
        CONVERSATION[:2], tokenize=False, add_generation_prompt=True
    )
    assert rebuilt(roles, CONVERSATION[:2]) + roles["roles"]["assistant"][0] == prompt
    # without a system message the template adds its default one, as the markers say
    default = [{"role": "system", "content": roles["default_system_prompt"]}, CONVERSATION[1]]
    alone = smollm2_tokenizer.apply_chat_template(CONVERSATION[1:2], tokenize=False)
    assert rebuilt(roles, default) == alone


def test_tiny_tokenizer_gives_chatml_without_a_default_system_prompt():
    tokenizer = tiny_tokenizer()
    roles = chat_roles(tokenizer)
    assert roles["roles"] == CHATML
    assert roles["default_system_prompt"] is None
    assert roles["stop_str"] == ["<|im_end|>"]
    assert rebuilt(roles, CONVERSATION) == tokenizer.apply_chat_template(
        CONVERSATION, tokenize=False
    )


def test_no_chat_template_gives_none():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = None
    assert chat_roles(tokenizer) is None


def test_a_template_that_fails_to_render_gives_none():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('this template renders nothing') }}"
    assert chat_roles(tokenizer) is None
    tokenizer.chat_template = "{% for message in messages %}{{ message['content'] }"  # syntax
    assert chat_roles(tokenizer) is None


def test_a_template_that_repeats_the_content_gives_none():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] + m['content'] }}{% endfor %}"
    assert chat_roles(tokenizer) is None


def test_a_template_without_a_system_role_gives_system_the_user_markers():
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = NO_SYSTEM_TEMPLATE
    roles = chat_roles(tokenizer)
    user = ["<start_of_turn>user\n", "<end_of_turn>\n"]
    assert roles == {
        "roles": {
            "system": user,
            "user": user,
            "assistant": ["<start_of_turn>model\n", "<end_of_turn>\n"],
        },
        "default_system_prompt": None,
        "stop_str": ["<end_of_turn>"],
        "system_supported": False,
    }
    # the BOS the template writes once before the conversation belongs to no marker
    conversation = CONVERSATION[1:]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert "<bos>" + rebuilt(roles, conversation) == rendered


def test_the_generation_prompt_wins_when_it_differs():
    """A template whose generation prompt opens the turn differently from a rendered
    assistant message (here: an empty thinking block): the generation prompt is what the
    model continues from, so its tail is the assistant prefix."""
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] "
        "+ '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n<think></think>' }}{% endif %}"
    )
    roles = chat_roles(tokenizer)
    assert roles["roles"]["assistant"] == ["<|im_start|>assistant\n<think></think>", "<|im_end|>\n"]
    assert roles["roles"]["user"] == CHATML["user"]
