"""The in-process backend: a program's calls go straight to a `radixserve.Engine` (no HTTP),
whose scheduler batches the calls of concurrent programs like the server's does. Only the
Engine's public methods are used."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from radixserve.lang.backend.base import (
    Backend,
    native_completion,
    native_deltas,
)
from radixserve.lang.chat_template import ChatTemplate, get_chat_template_by_model_path
from radixserve.lang.choices import ChoiceScores

if TYPE_CHECKING:
    from radixserve.engine import Engine
    from radixserve.lang.interpreter import Executor
    from radixserve.lang.ir import SamplingParams


class EngineBackend(Backend):
    def __init__(self, engine: Engine | None = None, **engine_args: Any) -> None:
        """Wrap an Engine, or start one from Engine arguments (then `shutdown` stops it)."""
        if engine is None:
            from radixserve.engine import Engine

            engine = Engine(**engine_args)
            self._owned = True
        else:
            self._owned = False
        self.engine = engine
        roles = engine.chat_roles()
        self.chat_template = (
            ChatTemplate.from_server(roles, "engine")
            if roles
            else get_chat_template_by_model_path(str(engine.config.model.model_path or ""))
        )

    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def generate(
        self, s: Executor, params: SamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        return native_completion(
            self.engine.generate(s.text_, params.to_native(), **params.logprob_fields())
        )

    def generate_stream(
        self, s: Executor, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        fields = params.logprob_fields()
        yield from native_deltas(
            self.engine.generate(s.text_, params.to_native(), stream=True, **fields)
        )

    def score_choices(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> list[ChoiceScores]:
        self.cache_context_first(prefix, choices)
        out = self.engine.score_continuations(prefix, choices, unconditional=unconditional)
        return [
            ChoiceScores(
                c["token_ids"],
                c["logprobs"],
                c["unconditional_logprobs"],
                c["healed_tokens"],
                c["tokens"],
            )
            for c in out["continuations"]
        ]

    def cache_prefix(self, prefix: str) -> int:
        out = self.engine.generate(prefix, {"max_new_tokens": 0})
        return int(out["meta_info"]["prompt_tokens"])

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return self.engine.get_server_info()

    def shutdown(self) -> None:
        if self._owned:
            self.engine.shutdown()
