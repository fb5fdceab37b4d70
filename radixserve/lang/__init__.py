"""radixserve's frontend language: programs of model calls (gen / select / fork / join /
roles), source-compatible with SGLang's (`import radixserve.lang as sgl`).

    @sgl.function
    def qa(s, question):
        s += sgl.user(question)
        s += sgl.assistant(sgl.gen("answer", max_tokens=64))

    sgl.set_default_backend(sgl.RuntimeEndpoint("http://127.0.0.1:30000"))
    print(qa.run(question="What is the capital of France?")["answer"])

This package talks to engines only through its backends (`lang/backend/`): it imports
nothing of the engine's internals.
"""

from radixserve.lang.api import (
    Engine,
    Runtime,
    assistant,
    assistant_begin,
    assistant_end,
    flush_cache,
    function,
    gen,
    gen_int,
    gen_string,
    get_server_info,
    select,
    set_default_backend,
    system,
    system_begin,
    system_end,
    user,
    user_begin,
    user_end,
)
from radixserve.lang.backend.base import Backend, BackendError
from radixserve.lang.backend.engine import EngineBackend
from radixserve.lang.backend.runtime_endpoint import RuntimeEndpoint
from radixserve.lang.choices import (
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.lang.global_config import global_config
from radixserve.lang.interpreter import ProgramError, ProgramState, ProgramStateGroup

# SGLang's frontend names this package does not provide, and why
NOT_PROVIDED = {
    **dict.fromkeys(("image", "video"), "the engine serves text models only"),
    **dict.fromkeys(
        ("Anthropic", "LiteLLM", "VertexAI", "Crusoe"),
        "use OpenAI(...) for an OpenAI-compatible server, or RuntimeEndpoint",
    ),
    "separate_reasoning": "ask the server (--reasoning-parser) for reasoning_content",
}


def __getattr__(name: str):  # the OpenAI backend needs the openai package: import on use
    if name == "OpenAI":
        from radixserve.lang.backend.openai import OpenAI

        return OpenAI
    if name in NOT_PROVIDED:
        raise AttributeError(
            f"radixserve.lang does not provide SGLang's {name!r}: {NOT_PROVIDED[name]}"
        )
    raise AttributeError(f"module 'radixserve.lang' has no attribute {name!r}")


__all__ = [
    "Backend",
    "BackendError",
    "Engine",
    "EngineBackend",
    "OpenAI",
    "ProgramError",
    "ProgramState",
    "ProgramStateGroup",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "assistant_begin",
    "assistant_end",
    "flush_cache",
    "function",
    "gen",
    "gen_int",
    "gen_string",
    "get_server_info",
    "global_config",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "system_begin",
    "system_end",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
    "user_begin",
    "user_end",
]
