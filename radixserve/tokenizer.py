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


class ChatTemplateError(ValueError):
    """--chat-template is neither a readable template file nor a valid template."""


def read_chat_template(source: str) -> str:
    """--chat-template's Jinja text: the file it names, or the text itself; ChatTemplateError
    where it is neither (a missing file, a template that does not parse)."""
    import jinja2
    from transformers.utils.chat_template_utils import _compile_jinja_template

    path = Path(source).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # template text longer than a file name may be
        is_file = False
    if is_file:
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ChatTemplateError(f"--chat-template {source}: cannot read it: {e}") from None
    elif "{{" in source or "{%" in source:
        text = source
    else:
        raise ChatTemplateError(
            f"--chat-template {source!r} is neither a file nor a Jinja template"
        )
    try:  # as transformers compiles it to render (its sandbox, extensions and filters)
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(
            f"--chat-template: the template does not parse (line {e.lineno}): {e.message}"
        ) from None
    return text


def longest_token_chars(tokenizer: PreTrainedTokenizerBase) -> int:
    """The most characters any one token stands for, from the vocabulary's keys: a byte-level
    key has a character per byte, a SentencePiece key one per character (a byte fallback
    `<0x0A>`, six for one), so a key is never shorter than the text its token decodes to."""
    keys = [*tokenizer.get_vocab(), *tokenizer.all_special_tokens]
    return max(map(len, keys), default=1)
