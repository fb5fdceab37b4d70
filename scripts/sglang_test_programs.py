"""Source compatibility, checked with SGLang's own frontend test programs: run
`sglang/test/test_programs.py` (from the sglang 0.5.23 wheel, not part of this repository)
with `sglang` resolving to `radixserve.lang`, against a radixserve server.

    pip download sglang==0.5.23 --no-deps -d /tmp/sglwheel
    unzip -q /tmp/sglwheel/sglang-0.5.23-*.whl 'sglang/test/test_programs.py' -d /tmp/sglx
    radixserve serve --port 30000 &   # SmolLM2 by default
    .venv/bin/python scripts/sglang_test_programs.py /tmp/sglx/sglang/test/test_programs.py

Each test function prints PASS or FAIL; `check_answer` is passed False where a test takes
it (a 135M model gets some answers wrong; the program still has to run).
"""

import inspect
import sys
import time
import types

from transformers import AutoTokenizer

import radixserve.lang as rl
import radixserve.lang.ir

URL = "http://127.0.0.1:30000"


def alias_sglang() -> None:
    """`import sglang as sgl` gives radixserve.lang; the few server-side helpers the test
    file imports get small stand-ins."""
    sys.modules["sglang"] = rl
    sys.modules["sglang.lang"] = types.SimpleNamespace(ir=radixserve.lang.ir)
    sys.modules["sglang.lang.ir"] = radixserve.lang.ir
    srt = types.ModuleType("sglang.srt")
    utils = types.ModuleType("sglang.srt.utils")
    utils.__path__ = []
    utils.is_hip = lambda: False
    hf = types.ModuleType("sglang.srt.utils.hf_transformers_utils")
    hf.get_tokenizer = AutoTokenizer.from_pretrained
    sys.modules.update(
        {"sglang.srt": srt, "sglang.srt.utils": utils, "sglang.srt.utils.hf_transformers_utils": hf}
    )


class RuntimeLike:
    """What SGLang's tests hold as the default backend (a Runtime, with `.endpoint`)."""

    endpoint = None


alias_sglang()
path, *only = sys.argv[1:]
with open(path) as f:
    ns = {"__name__": "sglang_test_programs"}
    exec(compile(f.read(), path, "exec"), ns)
RuntimeLike.endpoint = rl.RuntimeEndpoint(URL)
names = only or [n for n in ns if n.startswith("test_")]
for name in names:
    fn = ns[name]
    if name == "test_completion_speculative":  # written for an OpenAI completion model
        rl.set_default_backend(rl.OpenAI("default", base_url=URL + "/v1", is_chat_model=False))
    else:
        rl.set_default_backend(RuntimeLike())
    t = time.time()
    try:
        kwargs = (
            {"check_answer": False} if "check_answer" in inspect.signature(fn).parameters else {}
        )
        fn(**kwargs)
        print(f"PASS {name} {time.time() - t:.1f}s", flush=True)
    except Exception as e:
        print(f"FAIL {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
