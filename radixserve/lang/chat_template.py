"""Role markers for `system` / `user` / `assistant` blocks.

A radixserve server (and the in-process Engine) derives them from the served model's own
chat template and reports them (`/get_model_info` → `chat_roles`), so a program's roles are
exactly what the model was trained on. A server that does not report them (e.g. SGLang's)
gets a built-in template picked from its model path, as SGLang's frontend does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    role_prefix_and_suffix: dict[str, tuple[str, str]]
    default_system_prompt: str | None = None
    stop_str: tuple[str, ...] = field(default=())

    def get_prefix_and_suffix(
        self, role: str, history: list[dict[str, Any]] | None = None
    ) -> tuple[str, str]:
        if role not in self.role_prefix_and_suffix:
            raise ValueError(f"unknown role {role!r}: expected one of {ROLES}")
        return self.role_prefix_and_suffix[role]

    @classmethod
    def from_server(cls, roles: dict[str, Any], name: str = "server") -> ChatTemplate:
        """From the `chat_roles` a radixserve server reports."""
        markers = {role: (str(p), str(s)) for role, (p, s) in roles["roles"].items()}
        missing = [r for r in ROLES if r not in markers]
        if missing:
            raise ValueError(f"the server's chat roles lack {missing}")
        return cls(name, markers, roles.get("default_system_prompt"), tuple(roles["stop_str"]))


_CHATML = ChatTemplate(
    "chatml",
    {
        "system": ("<|im_start|>system\n", "<|im_end|>\n"),
        "user": ("<|im_start|>user\n", "<|im_end|>\n"),
        "assistant": ("<|im_start|>assistant\n", "<|im_end|>\n"),
    },
    stop_str=("<|im_end|>",),
)
_LLAMA3 = ChatTemplate(
    "llama-3-instruct",
    {role: (f"<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>") for role in ROLES},
    stop_str=("<|eot_id|>",),
)
_DEFAULT = ChatTemplate(
    "default",
    {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")},
)
TEMPLATES = {t.name: t for t in (_CHATML, _LLAMA3, _DEFAULT)}
# substrings of a model path → template, first match wins (the fallback for servers that do
# not report their roles)
_BY_PATH = (
    ("llama-3", "llama-3-instruct"),
    ("llama3", "llama-3-instruct"),
    ("smollm", "chatml"),
    ("qwen", "chatml"),
    ("chatml", "chatml"),
)


def get_chat_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}: known are {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def get_chat_template_by_model_path(path: str) -> ChatTemplate:
    lowered = path.lower()
    for needle, name in _BY_PATH:
        if needle in lowered:
            return TEMPLATES[name]
    return _DEFAULT
