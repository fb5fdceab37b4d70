"""`sgl.Runtime`: a program starts its own radixserve server, runs on it, and stops it with
nothing left behind."""

from __future__ import annotations

import psutil
import pytest

import radixserve.lang as sgl


def test_runtime_serves_a_program_and_shuts_down_cleanly(tiny_model_dirs):
    runtime = sgl.Runtime(
        model_path=str(tiny_model_dirs["llama"]),
        max_total_tokens=4096,
        dtype="float32",
        api_key="sesame",  # the endpoint sends it; a client without it is refused
    )
    try:
        server = psutil.Process(runtime._proc.pid)
        processes = [server, *server.children(recursive=True)]
        assert len(processes) >= 3  # the main process, the scheduler and the detokenizer

        @sgl.function
        def hello(s):
            s += "Hello" + sgl.gen("x", max_tokens=4, temperature=0, ignore_eos=True)

        state = hello.run(backend=runtime)
        assert state.get_meta_info("x")["completion_tokens"] == 4
        assert sgl.get_server_info(runtime)["max_total_tokens"] == 4096
        with pytest.raises(sgl.BackendError) as refused:
            sgl.RuntimeEndpoint(runtime.url)
        assert refused.value.status == 401
    finally:
        runtime.shutdown()
    assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in processes)
