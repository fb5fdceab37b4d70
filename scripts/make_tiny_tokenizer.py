"""Train the byte-level BPE tokenizer of the tiny test models (tests/fixtures/tiny_tokenizer).

Its output depends on the corpus and library version, so the result is committed; run this
only to change the fixture: `python scripts/make_tiny_tokenizer.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "tiny_tokenizer"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A radix tree stores shared prefixes once; every request that shares a prefix reuses it.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159",
    "Large language models generate text one token at a time, attending to every earlier token.",
    "Continuous batching lets new requests join a running batch between decoding steps.",
    "The sea was calm and the sky was grey; the ship sailed slowly toward the harbour.",
    '{"name": "Ada", "age": 36, "city": "London", "tags": ["math", "code"]}',
    "Question: what is two plus two? Answer: four.",
] * 20


def main() -> None:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    OUT.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(OUT / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 2048,
    }
    (OUT / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"vocab {tokenizer.get_vocab_size()} → {OUT}")


if __name__ == "__main__":
    main()
