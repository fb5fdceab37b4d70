"""Backends of the frontend language: over HTTP to a server, in-process over an Engine, or
to any OpenAI-compatible API."""

from __future__ import annotations

from typing import Any

from radixserve.lang.backend.base import Backend, BackendError


def as_backend(obj: Any) -> Backend:
    """A backend from what a user may hand over: a backend, a `Runtime` (its endpoint), or
    a `radixserve.Engine` (wrapped in-process; the wrapper holds nothing of its own)."""
    if isinstance(obj, Backend):
        return obj
    endpoint = getattr(obj, "endpoint", None)
    if isinstance(endpoint, Backend):
        return endpoint
    if type(obj).__name__ == "Engine" and type(obj).__module__.startswith("radixserve"):
        from radixserve.lang.backend.engine import EngineBackend

        return EngineBackend(obj)
    raise TypeError(
        f"not a backend: {type(obj).__name__}; use RuntimeEndpoint(url), Runtime(...), "
        "OpenAI(model) or a radixserve.Engine"
    )


__all__ = ["Backend", "BackendError", "as_backend"]
