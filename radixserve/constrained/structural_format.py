"""Structural tags as llguidance Lark grammars: xgrammar's format trees (`{"type":
"structural_tag", "format": {...}}`, the form vLLM and newer SGLang take), of which SGLang's
older `structures` + `triggers` form is one case (`triggered_tags` of JSON-schema tags).

    format             Lark
    const_string       "text"
    json_schema        %json {schema}                  (style json; written as json_schema
                                                        constraints write JSON)
    regex              /pattern/
    grammar            @name, a sub-grammar             (GBNF/EBNF, as the ebnf constraint)
    any_text           text up to the enclosing tag's end (a suffix lexeme), or to the end of
                       the output; `excludes`: text it may not hold
    sequence, or       a b ..., (a | b | ...)
    optional, plus, star, repeat   (a)?, (a)+, (a)*, (a){m,n}
    tag                "begin" content end             (end: a string or a list of them)
    triggered_tags     free text whose first trigger (a lazy lexeme) begins one of the tags
                       that trigger starts; at_least_one: a tag first; stop_after_first
    tags_with_separator   tag (separator tag)*

Token-level formats (`token`, `exclude_token`, `any_tokens`, `token_triggered_tags`), `dispatch`,
non-JSON styles and length budgets are refused by name. A trigger that is one special token
is that token (Lark strings never match special tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import llguidance

from radixserve.constrained.schema import JSON_DEFAULTS

ANY = "/(?s:.*)/"
MAX_DEPTH = 64  # formats within formats
SUPPORTED = (
    "const_string", "json_schema", "regex", "grammar", "any_text", "sequence", "or",
    "optional", "plus", "star", "repeat", "tag", "triggered_tags", "tags_with_separator",
)  # fmt: skip


def lark_string(text: str) -> str:
    """`text` as a Lark string: JSON's escapes (quote, newline, \\\\u007f...), which Lark reads;
    raw, a control character such as DEL is a lexer error."""
    return json.dumps(text)


def legacy_format(structures: list[tuple[str, dict, str]], triggers: list[str]) -> dict:
    """SGLang's structures (begin, schema, end) and triggers as the format tree they mean."""
    tags = [
        {"type": "tag", "begin": begin, "content": {"type": "json_schema", "json_schema": schema},
         "end": end}
        for begin, schema, end in structures
    ]  # fmt: skip
    return {"type": "triggered_tags", "triggers": triggers, "tags": tags}


@dataclass
class FormatGrammar:
    """Builds one grammar from a format tree. `special(text)`: Lark's reference to the
    special token `text` is, or None; `check_schema(schema, path)`: raises ValueError where
    a schema is invalid or admits no text. Errors are ValueErrors naming the node's path."""

    special: Callable[[str], str | None]
    check_schema: Callable[[dict, str], None]
    shunned: str | None = None  # text the output may not start with (a reasoning opening)
    rules: list[str] = field(default_factory=list)
    subgrammars: list[dict] = field(default_factory=list)
    count: int = 0
    depth: int = 0

    def build(self, node: Any) -> str:
        """The grammar: Lark text, or llguidance's JSON form where there are sub-grammars."""
        body = self.node(node, "format", tail=True, first=True)
        if body is None:
            raise ValueError("format: it matches the empty text only")
        lark = "\n".join(["%llguidance {}", f"start: {body}", *self.rules]) + "\n"
        if not self.subgrammars:
            return lark
        return json.dumps({"grammars": [{"lark_grammar": lark}, *self.subgrammars]})

    def fresh(self, prefix: str) -> str:
        self.count += 1
        return f"{prefix}_{self.count}"

    # -- one node -------------------------------------------------------------------------
    def node(self, node: Any, path: str, tail: bool, first: bool = False) -> str | None:
        """The Lark expression of `node` (None: it matches the empty text only). `tail`: the
        output ends where it does (free text may run to the end); `first`: it begins the
        output (where a reasoning block may open before it)."""
        _check_node(node, path)
        if self.depth >= MAX_DEPTH:
            raise ValueError(f"{path}: formats nest more than {MAX_DEPTH} deep")
        self.depth += 1
        try:
            return getattr(self, f"_{node['type']}")(node, path, tail, first)
        finally:
            self.depth -= 1

    def _const_string(self, node: dict, path: str, tail: bool, first: bool) -> str | None:
        value = _field(node, "value", str, path)
        return lark_string(value) if value else None

    def _json_schema(self, node: dict, path: str, tail: bool, first: bool) -> str:
        schema = _field(node, "json_schema", dict, path)
        if node.get("style", "json") != "json":
            raise ValueError(f"{path}.style {node['style']!r} is not supported (only json)")
        if node.get("any_order"):
            raise ValueError(f"{path}.any_order is not supported")
        self.check_schema(schema, f"{path}.json_schema")
        options = schema.get("x-guidance", {})
        return f"%json {json.dumps({**schema, 'x-guidance': {**JSON_DEFAULTS, **options}})}"

    def _regex(self, node: dict, path: str, tail: bool, first: bool) -> str:
        pattern = _field(node, "pattern", str, path)
        out, i = [], 0
        while i < len(pattern):  # a "/" closes a Lark regex: escaped, unless it is already
            if pattern[i] == "\\":
                if i + 1 == len(pattern):
                    raise ValueError(f"{path}.pattern ends in a lone backslash")
                out.append(pattern[i : i + 2])
                i += 2
                continue
            out.append("\\/" if pattern[i] == "/" else pattern[i])
            i += 1
        return "/" + "".join(out) + "/"

    def _grammar(self, node: dict, path: str, tail: bool, first: bool) -> str:
        text = _field(node, "grammar", str, path)
        try:
            lark = llguidance.grammar_from("ebnf", text)  # Lark text, as the ebnf constraint
        except ValueError as e:
            raise ValueError(f"{path}.grammar: {e}") from None
        name = self.fresh("grammar")
        self.subgrammars.append({"name": name, "lark_grammar": lark})
        return f"@{name}"

    def _any_text(self, node: dict, path: str, tail: bool, first: bool) -> str:
        if not tail:
            raise ValueError(
                f"{path}: any_text is supported as a tag's content or at the end of the "
                "output, where something marks where it ends"
            )
        return self.terminal("ANYTEXT", self.text_terminal(node, path, first))

    def terminal(self, prefix: str, expression: str) -> str:
        """`expression` as a named terminal (Lark's `&` and `~` work in terminals only)."""
        if expression == ANY:
            return ANY
        name = self.fresh(prefix)
        self.rules.append(f"{name}: {expression}")
        return name

    def _sequence(self, node: dict, path: str, tail: bool, first: bool) -> str | None:
        elements = _elements(node, path)
        parts = []
        for i, element in enumerate(elements):
            last = all(_empty_only(e) for e in elements[i + 1 :])
            at_start = first and all(_may_be_empty(e) for e in elements[:i])
            part = self.node(element, f"{path}.elements[{i}]", tail and last, at_start)
            if part is not None:
                parts.append(part)
        return " ".join(parts) if parts else None

    def _or(self, node: dict, path: str, tail: bool, first: bool) -> str | None:
        options = [
            self.node(e, f"{path}.elements[{i}]", tail, first)
            for i, e in enumerate(_elements(node, path))
        ]
        given = [o for o in options if o is not None]
        if not given:
            return None
        choice = f"({' | '.join(given)})"
        return choice + "?" if len(given) < len(options) else choice

    def _optional(self, node: dict, path: str, tail: bool, first: bool) -> str | None:
        inner = self.node(node.get("content"), f"{path}.content", tail, first)
        return None if inner is None else f"({inner})?"

    def _plus(self, node: dict, path: str, tail: bool, first: bool) -> str | None:
        return self._repeated(node, path, first, "+")

    def _star(self, node: dict, path: str, tail: bool, first: bool) -> str | None:
        return self._repeated(node, path, first, "*")

    def _repeat(self, node: dict, path: str, tail: bool, first: bool) -> str | None:
        low, high = _field(node, "min", int, path), _field(node, "max", int, path)
        if low < 0 or high < -1 or (high != -1 and high < low):
            raise ValueError(f"{path}: min and max must satisfy 0 <= min <= max, or max -1")
        if high == 0:
            return None
        return self._repeated(node, path, first, f"{{{low},{'' if high == -1 else high}}}")

    def _repeated(self, node: dict, path: str, first: bool, times: str) -> str | None:
        inner = self.node(node.get("content"), f"{path}.content", tail=False, first=first)
        return None if inner is None else f"({inner}){times}"

    def _tag(self, node: dict, path: str, tail: bool, first: bool, skip: int = 0) -> str:
        """begin (past its first `skip` characters, which a trigger wrote), content, end."""
        begin = _field(node, "begin", str, path)
        ends = node.get("end")
        ends = [ends] if isinstance(ends, str) else ends
        if not isinstance(ends, list) or not ends or not all(isinstance(e, str) for e in ends):
            raise ValueError(f"{path}.end: a string or a non-empty list of strings is needed")
        content = node.get("content")
        head = [lark_string(begin[skip:])] if begin[skip:] else []
        if isinstance(content, dict) and content.get("type") == "any_text":
            text = self.terminal("CONTENT", self.text_terminal(content, f"{path}.content", False))
            marked = [e for e in ends if e]
            if len(marked) < len(ends) and not tail:  # no end: the text runs on
                raise ValueError(f"{path}.end: an empty end cannot end any_text here")
            options = [text] if len(marked) < len(ends) else []
            if marked:
                end = self.fresh("END")
                self.rules.append(f"{end}: {' | '.join(map(lark_string, marked))}")
                name = self.fresh("text")
                self.rules.append(f"{name}[suffix={end}]: {text}")
                options.insert(0, name)
            return " ".join([*head, f"({' | '.join(options)})"])
        if isinstance(content, dict) and content.get("type") == "triggered_tags":
            raise ValueError(f"{path}.content: triggered_tags inside a tag is not supported")
        inner = self.node(content, f"{path}.content", tail=False)
        end = f"({' | '.join(lark_string(e) for e in ends if e)})" if any(ends) else None
        if end is not None and "" in ends:
            end += "?"
        return " ".join(p for p in [*head, inner, end] if p) or '""'

    def _tags(self, node: dict, path: str) -> list[dict]:
        tags = node.get("tags")
        if not isinstance(tags, list) or not tags:
            raise ValueError(f"{path}.tags: a non-empty list of tags is needed")
        for i, tag in enumerate(tags):
            if not isinstance(tag, dict) or tag.get("type") != "tag":
                raise ValueError(f"{path}.tags[{i}]: a format of type tag is needed")
        return tags

    def _triggered_tags(self, node: dict, path: str, tail: bool, first: bool) -> str:
        if not tail:
            raise ValueError(f"{path}: triggered_tags is supported at the end of the output")
        triggers = node.get("triggers")
        if not isinstance(triggers, list) or not triggers:
            raise ValueError(f"{path}.triggers: a non-empty list of strings is needed")
        if not all(isinstance(t, str) and t for t in triggers):
            raise ValueError(f"{path}.triggers: non-empty strings are needed")
        tags = self._tags(node, path)
        groups: dict[str, list[str]] = {}
        for i, tag in enumerate(tags):
            where = f"{path}.tags[{i}]"
            begin = _field(tag, "begin", str, where)
            starting = [t for t in triggers if begin.startswith(t)]
            if not starting:
                raise ValueError(f"{where}.begin {begin!r} does not start with any trigger")
            trigger = min(starting, key=len)  # written first: a longer one comes after it
            groups.setdefault(trigger, []).append(self._tag(tag, where, False, False, len(trigger)))
        shunned = self.shunned if first else None
        for trigger in groups if shunned is not None else ():
            if trigger.startswith(shunned) or shunned.startswith(trigger):
                raise ValueError(  # its lazy lexeme would end the text before the block
                    f"the trigger {trigger!r} begins as the reasoning block's opening "
                    f"{shunned!r} does, so the block could not be told from it; "
                    "require_reasoning false applies the tag to the whole output"
                )
        text = self.terminal("TEXT", self.text_terminal(node, path, first=False))
        leads = [("call", text)]
        if shunned is not None:  # the output's first text may not open the reasoning block
            leads.append(("first", self.terminal("FIRST", self.text_terminal(node, path, True))))
        calls: dict[str, list[str]] = {prefix: [] for prefix, _ in leads}
        bare = []
        for trigger, bodies in groups.items():
            tagged = self.fresh("tagged")
            self.rules.append(f"{tagged}: {' | '.join(bodies)}")
            special = self.special(trigger)
            opener = special or lark_string(trigger)
            bare.append(f"{opener} {tagged}")
            for prefix, lead in leads:
                name = self.fresh(prefix)
                if special is None:  # the text up to the trigger's first occurrence
                    self.rules.append(f"{name}_head[lazy]: {lead} {opener}")
                    self.rules.append(f"{name}: {name}_head {tagged}")
                else:
                    self.rules.append(f"{name}: {lead} {special} {tagged}")
                calls[prefix].append(name)
        call = f"({' | '.join(calls['call'])})"
        tag = f"({' | '.join(bare)})"
        first_call, first_text = call, text
        if shunned is not None:
            first_call, first_text = f"({' | '.join(calls['first'])})", leads[1][1]
        at_least_one = bool(node.get("at_least_one"))
        if node.get("stop_after_first"):
            return tag if at_least_one else f"({first_call} | {first_text})"
        if at_least_one:  # a tag first, no text before it
            return f"{tag} {call}* {text}"
        if shunned is None:
            return f"{call}* {text}"
        return f"({first_call} {call}* {text} | {first_text})"

    def _tags_with_separator(self, node: dict, path: str, tail: bool, first: bool) -> str:
        separator = _field(node, "separator", str, path)
        tags = [self._tag(t, f"{path}.tags[{i}]", False, False)
                for i, t in enumerate(self._tags(node, path))]  # fmt: skip
        tag = f"({' | '.join(tags)})"
        if node.get("stop_after_first"):
            listed = tag
        else:
            gap = f"{lark_string(separator)} " if separator else ""
            listed = f"{tag} ({gap}{tag})*"
        return listed if node.get("at_least_one") else f"({listed})?"

    def text_terminal(self, node: dict, path: str, first: bool) -> str:
        """Free text as a Lark terminal expression: any text without `excludes` (and, at
        the start of the output, not opening the reasoning block)."""
        for budget in ("max_tokens", "max_chars"):
            if node.get(budget) is not None:
                raise ValueError(f"{path}.{budget} is not supported")
        excludes = node.get("excludes", [])
        if not isinstance(excludes, list) or not all(isinstance(e, str) and e for e in excludes):
            raise ValueError(f"{path}.excludes: a list of non-empty strings is needed")
        shunned = [self.shunned] if first and self.shunned is not None else []
        text = ANY
        for excluded in excludes:
            text += f" & ~({ANY} {lark_string(excluded)} {ANY})"
        for opening in shunned:
            text += f" & ~({lark_string(opening)} {ANY})"
        return text if text == ANY else f"({text})"


def _check_node(node: Any, path: str) -> None:
    if not isinstance(node, dict) or not isinstance(node.get("type"), str):
        raise ValueError(f"{path}: a format object with a type is needed")
    if node["type"] not in SUPPORTED:
        supported = ", ".join(SUPPORTED)
        raise ValueError(f"{path}.type {node['type']!r} is not supported (supported: {supported})")


def _empty_only(node: Any) -> bool:
    """The node matches the empty text and nothing else."""
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if kind == "const_string":
        return node.get("value") == ""
    if kind in ("sequence", "or"):
        elements = node.get("elements")
        return isinstance(elements, list) and all(_empty_only(e) for e in elements)
    if kind in ("optional", "star", "plus", "repeat"):
        return node.get("max") == 0 or _empty_only(node.get("content"))
    return False


def _may_be_empty(node: Any) -> bool:
    """The node may match the empty text (True where that is not sure: a regex, a grammar),
    so what follows it may begin the output."""
    if not isinstance(node, dict):
        return True
    kind = node.get("type")
    elements = node.get("elements") if isinstance(node.get("elements"), list) else []
    if kind == "const_string":
        return node.get("value") == ""
    if kind in ("json_schema", "tag"):
        return kind == "tag" and node.get("begin") == "" and _may_be_empty(node.get("content"))
    if kind == "sequence":
        return all(_may_be_empty(e) for e in elements)
    if kind == "or":
        return any(_may_be_empty(e) for e in elements)
    if kind == "plus":
        return _may_be_empty(node.get("content"))
    if kind == "repeat":
        return node.get("min") == 0 or _may_be_empty(node.get("content"))
    if kind in ("triggered_tags", "tags_with_separator"):
        return not node.get("at_least_one")
    return True  # optional, star, any_text, regex, grammar


def _field(node: dict, name: str, kind: type, path: str) -> Any:
    value = node.get(name)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise ValueError(f"{path}.{name}: a {kind.__name__} is needed")
    return value


def _elements(node: dict, path: str) -> list:
    elements = node.get("elements")
    if not isinstance(elements, list) or not elements:
        raise ValueError(f"{path}.elements: a non-empty list of formats is needed")
    return elements
