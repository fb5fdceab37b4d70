"""`--chat-template`: a template of one's own for the chat routes in place of the model's
(a Jinja file, or the text itself), as vLLM's and SGLang's flag; one tiny-model server
started with a file, and the refusals that stop a start early."""

from __future__ import annotations

import subprocess
import sys
import time

import openai
import pytest
import requests
from transformers import AutoTokenizer

from radixserve.engine import Engine
from radixserve.tokenizer import ChatTemplateError, read_chat_template
from tests.conftest import FP32
from tests.server_utils import tiny_model_server

# a template unlike the tiny tokenizer's own (ChatML): [role] content, then [assistant]
TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "chat.jinja"
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(tiny_model_dirs, template_file, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("chat-template-server")
    flags = ("--chat-template", str(template_file))
    yield from tiny_model_server(tiny_model_dirs["llama"], log_dir, *flags)


def test_chat_prompts_follow_the_template(server, tiny_model_dirs):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    reply = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    ours = "[system] Be brief.\n[user] Hi\n[assistant] "
    own = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert own != ours  # the model's own template would give another prompt
    assert reply.usage.prompt_tokens == len(tokenizer.encode(ours, add_special_tokens=False))
    info = requests.get(server.url + "/tokenizer_info", timeout=30).json()
    assert info["chat_template"] == TEMPLATE
    roles = requests.get(server.url + "/get_model_info", timeout=30).json()["chat_roles"]
    assert roles is not None and roles["roles"]["user"][0] == "[user] "


def test_the_engine_reads_it_too(tiny_model_dirs):
    with Engine(
        str(tiny_model_dirs["llama"]), progress=False, dtype=FP32, chat_template=TEMPLATE
    ) as engine:
        assert engine.chat_roles()["roles"]["assistant"][0] == "[assistant] "


def test_text_that_is_no_template_is_refused(tmp_path):
    assert read_chat_template(TEMPLATE) == TEMPLATE
    with pytest.raises(ChatTemplateError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ChatTemplateError, match="does not parse"):
        read_chat_template("{% for m in messages %}no end")


def test_templates_are_checked_as_transformers_compiles_them():
    """transformers' own extensions and loop controls pass; an unknown filter does not;
    template text longer than a file name may be is text, not a path."""
    hf_only = (
        "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}"
        "{% if loop.index > 3 %}{% break %}{% endif %}{% endfor %}"
    )
    assert read_chat_template(hf_only) == hf_only
    with pytest.raises(ChatTemplateError, match="No filter named 'nosuchfilter'"):
        read_chat_template("{{ messages | nosuchfilter }}")
    long = TEMPLATE + "{# " + "x" * 400 + " #}"
    assert read_chat_template(long) == long


# `tools | length` on the None that transformers passes without tools: a TypeError
FAILS_WITHOUT_TOOLS = (
    "{% if tools | length > 0 %}[tools]{% endif %}"
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
)


def test_a_template_that_fails_to_render_fails_each_request_alone(tiny_model_dirs):
    """No chat roles where the template fails on the sentinel conversations (not a start
    that never ends), and a 400 that names the template's error per request."""
    from radixserve.chat_roles import derive_chat_roles
    from radixserve.server import openai_api as oai
    from radixserve.server.errors import APIError

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"])
    tokenizer.chat_template = FAILS_WITHOUT_TOOLS
    assert derive_chat_roles(tokenizer) is None
    body = oai.ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}])
    plan = body.tool_plan(None, FAILS_WITHOUT_TOOLS)
    with pytest.raises(APIError) as raised:
        oai.chat_prompt(body, tokenizer, plan)
    assert raised.value.status == 400 and "TypeError" in raised.value.message


def test_a_bad_template_stops_the_start_with_the_reason(tmp_path):
    cmd = [sys.executable, "-m", "radixserve", "serve", "--chat-template", "{% if %}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "does not parse" in done.stderr + done.stdout


# -- --log-requests (one more flag of the serve command, on the same kind of server) --------
@pytest.fixture(scope="module")
def logged(tiny_model_dirs, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("log-requests-server")
    flags = ("--log-requests", "--log-requests-chars", "12")
    yield from tiny_model_server(tiny_model_dirs["llama"], log_dir, *flags)


def test_requests_are_logged_with_their_outcome(logged):
    body = {
        "text": "hello world, this is a test",
        "sampling_params": {"max_new_tokens": 4, "temperature": 0, "stop": ["zz"]},
        "rid": "logged-1",
    }
    r = requests.post(logged.url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    refused = {**body, "rid": "logged-2", "input_ids": [10**6]}
    del refused["text"]
    assert requests.post(logged.url + "/generate", json=refused, timeout=60).status_code == 400
    lines = logged.log_path.read_text().splitlines()
    sent = next(line for line in lines if "request logged-1:" in line)
    assert "prompt tokens" in sent and "max_new_tokens=4" in sent and "stop=['zz']" in sent
    assert "temperature=0" in sent and "top_p" not in sent  # only what differs from defaults
    assert "prompt 'hello world,'…" in sent  # the first 12 characters
    ended = next(line for line in lines if "request logged-1 ended (length)" in line)
    assert "4 generated; output" in ended


def test_a_client_that_leaves_is_logged_as_gone(logged):
    body = {
        "text": "hello",
        "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True},
        "rid": "logged-gone",
        "stream": True,
    }
    with requests.post(logged.url + "/generate", json=body, stream=True, timeout=60) as r:
        next(r.iter_lines())  # the first chunk, then away
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if "request logged-gone ended (abort, its client left)" in logged.log_path.read_text():
            return
        time.sleep(0.2)
    raise AssertionError(logged.logs())
