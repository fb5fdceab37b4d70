"""The default grammar backend, on llguidance: JSON schemas compile in milliseconds, masks
are computed in Rust without the GIL (several requests in parallel), and it reports the
bytes a grammar forces, which jump-forward appends."""

from __future__ import annotations

import copy
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance

from radixserve.constrained.base import Constraint, GrammarBackend, GrammarError, GrammarMatcher
from radixserve.constrained.schema import JSON_DEFAULTS, one_line
from radixserve.constrained.structural_format import FormatGrammar, lark_string, legacy_format
from radixserve.core.sampling_params import ThinkBlock
from radixserve.core.structural_tag import StructuralTag

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

COMPILED_CACHE_SIZE = 1024  # distinct constraints kept compiled
MASK_THREADS = 2
# llguidance's own limits, but errors without the parser's state and the grammar appended:
# a matcher's error reaches the client, in the abort message of its request.
LIMITS = llguidance.LLParserLimits(verbose_errors=False)
MAX_GAP = 4  # whitespace characters between a block of reasoning and the constrained text
# the error llguidance reports when a mask came out empty: no token can extend the output
EMPTY_MASK = "NoExtensionBias"


class LLGuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.m = matcher

    def accept(self, tokens: Sequence[int]) -> bool:
        tokens = list(tokens)
        if self.m.validate_tokens(tokens) != len(tokens):
            return False
        return self.m.consume_tokens(tokens)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return self.m.validate_tokens(list(tokens))

    def rollback(self, num_tokens: int) -> None:
        if num_tokens and not self.m.rollback(num_tokens):
            raise RuntimeError(f"grammar rollback of {num_tokens} tokens failed")

    def forced_bytes(self) -> bytes:
        return self.m.compute_ff_bytes()

    @property
    def is_finished(self) -> bool:
        return self.m.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.m.is_accepting()

    @property
    def error(self) -> str:
        return _reason(self.m.get_error()) if self.m.is_error() else ""


class LLGuidanceBackend(GrammarBackend):
    """Thread-safe for `matcher` and `ready_matcher`: the scheduler compiles on a thread of
    its own (constrained/grammars.py) while its loop thread looks up compiled grammars."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.tokenizer, added = text_tokenizer(tokenizer, vocab_size)
        # the added tokens it holds as text, which the model's tokenizer writes as one token
        self._added = {text.encode(): token for text, token in added.items()}
        pattern = b"|".join(re.escape(t) for t in sorted(self._added, key=len, reverse=True))
        self._added_split = re.compile(b"(" + pattern + b")") if self._added else None
        self.executor = llguidance.LLExecutor(num_threads=MASK_THREADS)
        # each constraint compiled, most recently used last: the validated matcher at the
        # start of its grammar (requests get copies), or the error that refused it. Refusals
        # are kept too: a pathological constraint (a regex of a million states) costs ~0.3 s
        # to refuse, which a client repeating it would make the server pay every time.
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher | GrammarError]
        self._compiled = OrderedDict()
        self._lock = threading.Lock()  # over `_compiled` only: compiling runs outside it
        self.compiles = 0  # constraints compiled (not found in `_compiled`)

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        found = self.ready_matcher(constraint)
        if found is not None:
            return found
        try:
            start: llguidance.LLMatcher | GrammarError = self._compile(constraint)
        except GrammarError as e:
            start = e
        with self._lock:
            self.compiles += 1
            self._compiled[constraint] = start
            if len(self._compiled) > COMPILED_CACHE_SIZE:
                self._compiled.popitem(last=False)
        return self._start(start)

    def ready_matcher(self, constraint: Constraint) -> GrammarMatcher | None:
        with self._lock:
            start = self._compiled.get(constraint)
            if start is None:
                return None
            self._compiled.move_to_end(constraint)
        return self._start(start)

    @staticmethod
    def _start(start: llguidance.LLMatcher | GrammarError) -> GrammarMatcher:
        if isinstance(start, GrammarError):
            raise GrammarError(str(start), start.param)
        return LLGuidanceMatcher(start.deep_copy())

    def _compile(self, constraint: Constraint) -> llguidance.LLMatcher:
        """A matcher at the start of the grammar, validated."""
        try:
            if constraint.kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    constraint.spec, defaults=JSON_DEFAULTS
                )
            elif constraint.kind == "structural_tag":
                grammar = self._structural_tag(
                    StructuralTag.parse(constraint.spec), self._opening(constraint.think)
                )
            else:
                grammar = llguidance.grammar_from(constraint.kind, constraint.spec)
        except ValueError as e:  # the JSON schema is not JSON, the EBNF does not convert, a
            # structural tag's schema is invalid
            raise GrammarError(f"invalid {constraint.kind}: {e}", constraint.kind) from None
        if constraint.think is not None:
            grammar = self._after_thinking(grammar, constraint.think)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self.tokenizer
        )
        if is_error:
            message = one_line(messages[0])
            raise GrammarError(f"invalid {constraint.kind}: {message}", constraint.kind)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if matcher.is_error():
            message = _reason(matcher.get_error())
            raise GrammarError(f"invalid {constraint.kind}: {message}", constraint.kind)
        _check_it_can_start(matcher, constraint.kind)
        return matcher

    def _after_thinking(self, grammar: str, think: ThinkBlock) -> str:
        """`grammar` after a block of free reasoning, as one llguidance grammar: a Lark top
        level for the block, then `@answer`, the constraint's own grammar. The reasoning is
        any text up to the first end tag (a lazy lexeme; a greedy one where the tag is a
        special token, which no text can hold); a little whitespace may follow the tag
        (Qwen3 and DeepSeek-R1 write two newlines), not so much that a model could fill its
        output with it."""
        if grammar.lstrip().startswith("{"):  # llguidance's JSON form: a list of grammars
            answer = json.loads(grammar)["grammars"]
        else:  # Lark text (from EBNF)
            answer = [{"lark_grammar": grammar}]
        answer[0]["name"] = "answer"
        end = self._special(think.end)
        if end is None:
            thought = f"thought[suffix={lark_string(think.end)}]: /(?s:.*)/"
        else:
            thought = f"thought: THOUGHT {end}\nTHOUGHT: /(?s:.*)/"
        if think.inside:
            start = "start: thought GAP? @answer"
        else:
            opening = self._special(think.start) or lark_string(think.start)
            start = f"start: block? @answer\nblock: {opening} thought GAP?"
        top = f"{start}\n{thought}\nGAP: /[ \\t\\r\\n]{{1,{MAX_GAP}}}/\n"
        return json.dumps({"grammars": [{"lark_grammar": top}, *answer]})

    def _structural_tag(self, tag: StructuralTag, shunned: str | None = None) -> str:
        """The grammar of a structural tag (`structural_format.FormatGrammar`): SGLang's
        structures and triggers as xgrammar's `triggered_tags`, or the format tree given.

        With `shunned`, the output may not start with that text: it opens an optional block
        of reasoning before this grammar (`_after_thinking`), and the lazy lexemes of free
        text that could start with it too would end the block at a trigger inside it."""
        if tag.format is not None:
            tree, check = tag.format, self._check_schema
        else:
            for i, structure in enumerate(tag.structures):  # errors that name the structure
                self._check_schema(structure.schema, f"structures[{i}].schema")
            parts = [(s.begin, s.schema, s.end) for s in tag.structures]
            tree, check = legacy_format(parts, list(tag.triggers)), _checked_already
        return FormatGrammar(self._special, check, shunned).build(tree)

    def _check_schema(self, schema: dict, where: str) -> None:
        """ValueError (`_compile` says it is the structural_tag's) naming the schema that is
        invalid, or admits no text, as the json_schema constraint would be refused: such a
        part would abort its request once the model began it."""
        options = schema.get("x-guidance", {})
        if not isinstance(options, dict):  # (merged with the defaults in the grammar)
            raise ValueError(f"{where}: x-guidance must be an object of options")
        try:  # as the json_schema constraint compiles it
            self._compile(Constraint("json_schema", json.dumps(schema)))
        except GrammarError as e:
            raise ValueError(f"{where}: {str(e).removeprefix('invalid json_schema: ')}") from None

    def _opening(self, think: ThinkBlock | None) -> str | None:
        """The text that opens an optional block of reasoning, if the output may write it
        (None where the block is open already, or opens with a special token)."""
        if think is None or think.inside or self._special(think.start) is not None:
            return None
        return think.start

    def _special(self, text: str) -> str | None:
        """`text` as Lark's reference to a special token, if it is one (Lark strings never
        match those), else None."""
        ids = self.tokenizer.tokenize_str(text, parse_special=True)
        if len(ids) == 1 and self.tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>"
        return None

    def fill_masks(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        import llguidance.torch  # here: it loads torch._dynamo (~2 s), which only the
        # scheduler process needs

        pairs = [(m.m, i) for i, m in enumerate(matchers)]  # type: ignore[attr-defined]
        llguidance.torch.fill_next_token_bitmask_par(self.executor, pairs, bitmask)

    def token_bytes(self, tokens: Sequence[int]) -> bytes:
        return self.tokenizer.decode_bytes(list(tokens))

    def tokenize_bytes(self, data: bytes) -> list[int]:
        """As the model's tokenizer writes `data`: the added tokens first (Qwen's
        `<tool_call>` is one token, which llguidance's BPE alone would spell in pieces,
        having no merges for it), the text between them by llguidance's tokenizer."""
        if self._added_split is None:
            return self.tokenizer.tokenize_bytes(data)
        tokens: list[int] = []
        for i, piece in enumerate(self._added_split.split(data)):
            if i % 2:  # an added token's text (split keeps the separators at odd places)
                tokens.append(self._added[piece])
            elif piece:
                tokens.extend(self.tokenizer.tokenize_bytes(piece))
        return tokens


def text_tokenizer(
    tokenizer: PreTrainedTokenizerBase, n_vocab: int
) -> tuple[llguidance.LLTokenizer, dict[str, int]]:
    """llguidance's wrapper of a fast tokenizer (as `llguidance.hf.from_tokenizer`), with
    the added tokens that are not special (Qwen's `<think>`, `<tool_call>`) made the text
    they stand for; and those tokens (text → id). llguidance 1.9.1 holds every added
    token special: where a grammar forced the text of one, its mask offered only that
    token, which its parser then refused (a regex writing `<think>` was refused, or aborted
    mid-output). Moved into the BPE vocabulary, such a token matches its text like any
    other; those whose text the vocabulary would spell otherwise (spaces, non-ASCII) stay
    as they are. (No merge makes one: `LLGuidanceBackend.tokenize_bytes` puts them in.)"""
    plain: list[dict] = []
    backend = copy.copy(tokenizer.backend_tokenizer)  # type: ignore[attr-defined]
    backend.no_padding()
    backend.no_truncation()
    spec = json.loads(backend.to_str())
    model = spec.get("model", {})
    if model.get("type") == "BPE" and isinstance(model.get("vocab"), dict):
        vocab = model["vocab"]
        plain = [
            added
            for added in spec.get("added_tokens", [])
            if not added["special"]
            and added["content"] not in vocab
            and added["content"].isascii()
            and added["content"].isprintable()
            and " " not in added["content"]
        ]
        for added in plain:
            vocab[added["content"]] = added["id"]
        spec["added_tokens"] = [a for a in spec["added_tokens"] if a not in plain]
    eos = tokenizer.eos_token_id
    text = llguidance.LLTokenizer(json.dumps(spec), n_vocab=n_vocab, eos_token=eos)
    return text, {added["content"]: added["id"] for added in plain}


def _check_it_can_start(matcher: llguidance.LLMatcher, kind: str) -> None:
    """Raise GrammarError if the grammar fails at its first step, which validation does not
    see: it matches no text at all (the regex `[^\\s\\S]`, a schema that only refers to
    itself), or following the text it forces exceeds llguidance's limits (`a{1000000}`).
    Admitted, such a request would only end in an abort at its first token.

    The probe runs on a copy, so the matcher stays at the start; the lexer states it builds
    are shared with the copies requests get, so their first mask is mostly computed already
    (a grammar that takes 0.3 s to mask once costs that here, in the scheduler's thread)."""
    probe = matcher.deep_copy()
    probe.compute_bitmask()  # an empty mask puts the probe in error
    forced = probe.compute_ff_tokens()[:1]
    if forced:
        probe.consume_tokens(forced)
    if not probe.is_error():
        return
    said = probe.get_error().split("\n", 1)[0]
    if said == EMPTY_MASK:
        raise GrammarError(f"invalid {kind}: no text satisfies it", kind)
    raise GrammarError(f"invalid {kind}: constrained decoding cannot follow it: {said}", kind)


def _checked_already(schema: dict, where: str) -> None:
    pass  # SGLang's structures: their schemas are checked under their own names first


def _reason(error: str) -> str:
    """A matcher's error as a client can read it: llguidance's first line (what went wrong;
    the `<non-verbose/>` line after it stands for the state dump that LIMITS turns off)."""
    said = error.split("\n", 1)[0]
    return "no token can extend the output" if said == EMPTY_MASK else said
