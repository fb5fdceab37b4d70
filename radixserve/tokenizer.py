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
