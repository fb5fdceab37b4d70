"""radixserve: an LLM serving engine with a radix-tree KV prefix cache (the SGLang design)."""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:  # `radixserve.Engine` without importing torch eagerly
    if name == "Engine":
        from radixserve.engine import Engine

        return Engine
    raise AttributeError(f"module 'radixserve' has no attribute {name!r}")
