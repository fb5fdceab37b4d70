"""Settings of the frontend language, one object shared by every program (as SGLang's
`sglang.global_config`). The three `enable_*` switches of the co-design are what
`radixserve bench programs` turns off to measure what they are worth."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    default_backend: Any = None  # a backend, a Runtime, or a radixserve.Engine
    verbosity: int = 0  # 2: print each program's text when it ends
    # sent with every gen (the native API's defaults)
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    # -- the co-design with the runtime --------------------------------------------------
    # run_batch first caches the constant prefix the programs share (found by tracing)
    enable_precache_with_tracing: bool = True
    # fork(n > 1) caches the parent's text once before the children start, when the text
    # the backend has not seen yet (since the program's last call) is at least this long:
    # a shorter one costs the children less to recompute than the extra call
    enable_fork_prefix_hint: bool = True
    fork_hint_min_chars: int = 64
    # select scores every choice in one call on one cached prefix (off: one call per choice)
    enable_batched_select: bool = True
    # join(mode="concate_and_append") is done on the text (the KV is not concatenated)
    enable_parallel_encoding: bool = True
    # a prefix shorter than this (in characters) is not worth a pre-cache call
    precache_min_chars: int = 64


global_config = GlobalConfig()
