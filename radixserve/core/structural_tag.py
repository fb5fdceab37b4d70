"""SGLang's structural tag: free text, in which tool calls (or any tagged JSON) must follow
their schemas. The request gives it as JSON (OpenAI's `response_format` of type
`structural_tag`, or the `structural_tag` sampling parameter):

    {"type": "structural_tag",
     "triggers": ["<tool_call>"],
     "structures": [{"begin": "<tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": ",
                     "schema": {...}, "end": "}\\n</tool_call>"}]}

The output is any text until it writes a trigger; from there it must go on as one of the
structures whose `begin` starts with that trigger: the rest of `begin`, a JSON value that
follows `schema` (any JSON where it is null or left out), then `end`; then free text again.
xgrammar's newer form, `{"type": "structural_tag", "format": {...}}`, is a tree of formats
(`constrained/structural_format.py`). Plain data here; constrained/ turns it into a
grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# each is compiled into the request's grammar (OpenAI allows 128 tools; 512 of 40 keys each
# exceed llguidance's 65,535 grammar symbols)
MAX_STRUCTURES = 128
MAX_TRIGGERS = 64  # each is looked for in the free text at every step


class StructuralTagError(ValueError):
    pass


@dataclass(frozen=True)
class Structure:
    begin: str
    schema: dict[str, Any]  # the JSON value between begin and end ({}: any JSON)
    end: str


@dataclass(frozen=True)
class StructuralTag:
    structures: tuple[Structure, ...]
    triggers: tuple[str, ...]
    # or xgrammar's format tree (`{"type": "structural_tag", "format": {...}}`), checked as
    # it is compiled (constrained/structural_format.py)
    format: dict[str, Any] | None = None

    @classmethod
    def parse(cls, text: str) -> StructuralTag:
        """The structural tag in `text` (JSON), or StructuralTagError saying what is wrong."""
        try:
            spec = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise StructuralTagError(f"not JSON: {e}") from None
        if not isinstance(spec, dict):
            raise StructuralTagError("must be a JSON object with structures and triggers")
        if "format" in spec:
            if set(spec) - {"type", "format"}:
                raise StructuralTagError("give either format or structures and triggers")
            if not isinstance(spec["format"], dict):
                raise StructuralTagError("format must be a format object")
            if spec.get("type", "structural_tag") != "structural_tag":
                raise StructuralTagError(f"type must be structural_tag, got {spec['type']!r}")
            return cls((), (), spec["format"])
        unknown = sorted(set(spec) - {"type", "structures", "triggers"})
        if unknown:
            raise StructuralTagError(f"unknown key(s): {', '.join(unknown)}")
        if spec.get("type", "structural_tag") != "structural_tag":
            raise StructuralTagError(f"type must be structural_tag, got {spec['type']!r}")
        triggers = _strings(spec.get("triggers"), "triggers", MAX_TRIGGERS)
        structures = spec.get("structures")
        if not isinstance(structures, list) or not structures:
            raise StructuralTagError("structures must be a non-empty array")
        if len(structures) > MAX_STRUCTURES:
            raise StructuralTagError(f"at most {MAX_STRUCTURES} structures, got {len(structures)}")
        parsed = tuple(_structure(s, i, triggers) for i, s in enumerate(structures))
        return cls(parsed, triggers)


def _strings(value: Any, name: str, limit: int) -> tuple[str, ...]:
    if not isinstance(value, list) or not value:
        raise StructuralTagError(f"{name} must be a non-empty array of strings")
    if not all(isinstance(v, str) and v for v in value):
        raise StructuralTagError(f"{name} must hold non-empty strings")
    if len(value) > limit:
        raise StructuralTagError(f"at most {limit} {name}, got {len(value)}")
    return tuple(dict.fromkeys(value))


def _structure(spec: Any, i: int, triggers: tuple[str, ...]) -> Structure:
    where = f"structures[{i}]"
    if not isinstance(spec, dict):
        raise StructuralTagError(f"{where} must be an object with begin, schema and end")
    unknown = sorted(set(spec) - {"begin", "schema", "end"})
    if unknown:
        raise StructuralTagError(f"{where} has unknown key(s): {', '.join(unknown)}")
    begin, end, schema = spec.get("begin"), spec.get("end"), spec.get("schema")
    if not isinstance(begin, str) or not isinstance(end, str):
        raise StructuralTagError(f"{where} needs begin and end strings")
    if schema is None:
        schema = {}
    if not isinstance(schema, dict):
        raise StructuralTagError(f"{where}.schema must be a JSON schema object")
    if not any(begin.startswith(t) for t in triggers):
        raise StructuralTagError(f"{where}.begin {begin!r} does not start with any trigger")
    return Structure(begin, schema, end)
