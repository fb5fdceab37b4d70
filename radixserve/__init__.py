"""radixserve: an LLM serving engine with a radix-tree KV prefix cache (the SGLang design)."""

__version__ = "0.1.0"
