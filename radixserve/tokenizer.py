"""Loading a model folder's tokenizer on its own, for the processes that only turn ids into
text and back (the detokenizer needs neither the model config nor its weights)."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class TokenizerLoadError(OSError):
    """The folder has no tokenizer transformers can load."""


def load_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as e:
        raise TokenizerLoadError(f"cannot load the tokenizer of {folder}: {e}") from e


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters any one token stands for, from the vocabulary's keys: a byte-level
    key has a character per byte, a SentencePiece key one per character (a byte fallback
    `<0x0A>`, six for one), so a key is never shorter than the text its token decodes to."""
    keys = [*tokenizer.get_vocab(), *tokenizer.all_special_tokens]
    return max(map(len, keys), default=1)
