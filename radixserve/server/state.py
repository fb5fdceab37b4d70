"""What every route needs: the tokenizer manager, the configuration, the served model's name,
and the facts about the loaded model, handed to the routers as a FastAPI dependency."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import Depends, Request

from radixserve.config import Config
from radixserve.lora.registry import LoraNotFound, LoraRegistry
from radixserve.native import InvalidRequest
from radixserve.server.errors import APIError, bad_request
from radixserve.server.tokenizer_manager import TokenizerManager


@dataclass(frozen=True)
class ServerState:
    manager: TokenizerManager
    config: Config
    model_name: str  # the id /v1/models reports
    started: int  # unix time the server started (the model card's `created`)
    loras: LoraRegistry  # the LoRA adapters' names, for requests to pick one by

    def adapter_of(self, model: str | None, lora_path: str | None = None) -> int:
        """The uid of the LoRA adapter an OpenAI-API request names (0: the base model):
        `lora_path` (SGLang's extra field), else its `model` where that is an adapter's
        name or BASE:NAME. InvalidRequest for a `lora_path` that is not loaded."""
        try:
            if lora_path is not None:
                return self.loras.uid(lora_path)
            return self.loras.model_uid(model)
        except LoraNotFound as e:  # as OpenAI's and vLLM's answer to an unknown model
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except InvalidRequest as e:
            raise bad_request(str(e), param=e.param, code=e.code) from None

    @property
    def model(self) -> ServedModel:
        return served_model(self.manager)


@dataclass(frozen=True)
class ServedModel:
    """The loaded model as the routes see it."""

    path: str
    vocab_size: int  # token ids are in [0, vocab_size)
    max_seq_len: int  # the longest prompt + output one request may have
    fields: dict[str, Any]  # everything known about it, as /get_server_info reports it


def served_model(manager: TokenizerManager) -> ServedModel:
    """The one place that reads the scheduler's model description."""
    info = manager.info
    assert info is not None, "the scheduler has not reported ready"
    return ServedModel(info.model_path, info.vocab_size, info.max_seq_len, info.as_dict())


def _state(request: Request) -> ServerState:
    return request.app.state.server


State = Annotated[ServerState, Depends(_state)]
