"""What the HTTP process checks of a JSON schema before any request is made of it: llguidance's
JSON-schema compiler alone (no tokenizer, no torch), with the defaults the grammar backend
compiles schemas with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import llguidance

# JSON is written as json.dumps writes it: one space after ":" and ",", no other whitespace.
# With fixed separators the grammar forces keys and punctuation, which jump-forward appends
# at once; a schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class SchemaProblem:
    message: str  # llguidance's reason, on one line
    unsupported: bool  # a valid schema that constrained decoding cannot follow, not an invalid one


# how llguidance's JSON-schema compiler words a valid schema it does not compile
UNSUPPORTED_SCHEMA = ("Unimplemented keys", "Unknown format")


def json_schema_problem(schema: dict[str, Any]) -> SchemaProblem | None:
    """What llguidance's JSON-schema compiler finds wrong with `schema`, or None. It needs no
    tokenizer, so the HTTP edge can check a schema the output may never be constrained to (a
    tool's parameters); the backend's `_compile` still checks what only the tokenizer shows."""
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if not is_error:
        return None
    message = one_line(messages[0])
    return SchemaProblem(message, unsupported=message.startswith(UNSUPPORTED_SCHEMA))


def one_line(message: str, limit: int = 300) -> str:
    """llguidance errors span lines (with a source excerpt); one line for an HTTP 400."""
    text = " ".join(line.strip() for line in message.splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."
