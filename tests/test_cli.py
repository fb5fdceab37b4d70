"""The command line end to end, as a user runs it (a real subprocess, the real model)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def radixserve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "radixserve", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_generate_answers_a_chat_prompt_with_the_default_model():
    # fp32, as the other tests' servers: `--dtype auto` is bf16 on CPUs with bf16 units, and
    # SmolLM2-135M's greedy answer in bf16 depends on the CPU's kernels (on an Intel Xeon with
    # AMX it wanders off before naming the city, before and after the AMX extend kernel)
    proc = radixserve(
        "generate", "--prompt", "What is the capital of France?", "--max-new-tokens", "24",
        "--dtype", "float32",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout


def test_generate_raw_text_with_a_tiny_model(tiny_model_dirs):
    proc = radixserve(
        "generate",
        "--model-path",
        str(tiny_model_dirs["qwen2"]),
        "--prompt",
        "The quick",
        "--no-chat-template",
        "--max-new-tokens",
        "5",
        "--log-level",  # after the command as well as before it (default: warning)
        "info",
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
    assert " INFO radixserve." in proc.stderr


def test_missing_model_path_is_a_clear_error(tmp_path):
    proc = radixserve("generate", "--model-path", str(tmp_path / "nope"), "--prompt", "hi")
    assert proc.returncode == 2
    assert "model path does not exist" in proc.stderr and "Traceback" not in proc.stderr


def test_bad_sampling_value_is_a_clear_error(tiny_model_dirs):
    proc = radixserve(
        "generate", "--model-path", str(tiny_model_dirs["llama"]), "--prompt", "hi", "--top-p", "0"
    )
    assert proc.returncode == 2
    assert "top_p" in proc.stderr and "Traceback" not in proc.stderr


def test_run_batch_writes_every_result_in_the_inputs_order(tiny_model_dirs, tmp_path):
    def line(custom_id: str, url: str, body: dict) -> str:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})

    completion = {"model": "m", "max_tokens": 4, "temperature": 0}
    lines = [
        line("c1", "/v1/completions", {**completion, "prompt": "The quick"}),
        line("e1", "/v1/embeddings", {"model": "m", "input": "hello"}),
        "{oops",
        line("c2", "/v1/completions", {**completion, "prompt": "The quick"}),
        line("s1", "/v1/rerank", {"model": "m"}),
        line("c1", "/v1/embeddings", {"model": "m", "input": "again"}),
        line("bad", "/v1/completions", {**completion, "prompt": "x", "max_tokens": -1}),
        line("c3", "/v1/completions", {**completion, "prompt": "Once upon"}),
    ]
    given, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    given.write_text("\n".join(lines) + "\n")
    model = ("--model-path", str(tiny_model_dirs["llama"]))
    proc = radixserve("run-batch", "-i", str(given), "-o", str(results), *model)
    assert proc.returncode == 0, proc.stderr
    entries = [json.loads(x) for x in results.read_text().splitlines()]
    ids = ["c1", "e1", None, "c2", "s1", "c1", "bad", "c3"]
    assert [e["custom_id"] for e in entries] == ids
    status = [(e["response"] or {}).get("status_code") for e in entries]
    assert status == [200, 200, None, 200, None, None, 400, 200]
    errors = [(e["error"] or {}).get("code") for e in entries]
    assert errors[2:6] == ["invalid_json_line", None, "invalid_url", "duplicate_custom_id"]
    texts = [e["response"]["body"]["choices"][0]["text"] for e in (entries[0], entries[3])]
    assert texts[0] == texts[1]  # greedy: the same prompt, the same text
    assert entries[1]["response"]["body"]["data"][0]["embedding"]
    assert entries[6]["response"]["body"]["error"]["param"] == "max_tokens"
    assert "8 requests" in proc.stderr and "Traceback" not in proc.stderr


def test_run_batch_stopped_midway_resumes_when_run_again(tiny_model_dirs, tmp_path):
    """With --file-storage-path, a run-batch stopped (SIGTERM) before its end resumes when
    the same command runs again: its batch is taken up, not sent anew, and every line gets
    one result, all alike (greedy)."""
    body = {"model": "m", "prompt": "The quick", "max_tokens": 100, "temperature": 0}
    lines = [
        json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                    "body": {**body, "ignore_eos": True}})
        for i in range(16)
    ]  # fmt: skip
    given, results, folder = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "files"
    given.write_text("\n".join(lines) + "\n")
    command = [
        sys.executable, "-m", "radixserve", "run-batch", "-i", str(given), "-o", str(results),
        "--model-path", str(tiny_model_dirs["llama"]), "--max-running-requests", "2",
        "--file-storage-path", str(folder), "--dtype", "float32",
    ]  # fmt: skip
    first = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    work = folder / "batches" / "work"
    deadline = time.monotonic() + 300
    while not any(p.name.endswith(".output.jsonl") and p.stat().st_size for p in _files(work)):
        assert first.poll() is None and time.monotonic() < deadline, "no answer came"
        time.sleep(0.1)
    first.send_signal(signal.SIGTERM)
    _, said = first.communicate(timeout=120)
    assert first.returncode == 1, said  # stopped: some results missing
    assert list((folder / "run-batch").iterdir())  # the run's batch, named for a resume

    again = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    assert "taking up batch" in again.stderr
    entries = [json.loads(x) for x in results.read_text().splitlines()]
    assert [e["custom_id"] for e in entries] == [f"r{i}" for i in range(16)]
    texts = {e["response"]["body"]["choices"][0]["text"] for e in entries}
    assert len(texts) == 1 and not list((folder / "run-batch").iterdir())


def _files(folder) -> list:
    return list(folder.iterdir()) if folder.is_dir() else []


def test_a_benchmark_stopped_by_sigterm_stops_the_server_it_started(tiny_model_dirs):
    """`radixserve bench server-vs-engine` runs the Engine, then a server (a subprocess):
    a SIGTERM to the benchmark while that server runs stops the server too."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "radixserve", "bench", "server-vs-engine", "--rounds", "1",
         "--model-path", str(tiny_model_dirs["llama"]), "--dtype", "float32",
         "--num-groups", "2", "--prompts-per-group", "2", "--output-len", "4"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    servers = []
    try:
        deadline = time.monotonic() + 300
        while not (servers := _children(bench.pid, "serve")):
            assert bench.poll() is None and time.monotonic() < deadline, "no server started"
            time.sleep(0.1)
        bench.send_signal(signal.SIGTERM)
        _, said = bench.communicate(timeout=120)
        assert bench.returncode == 128 + signal.SIGTERM, said
        for pid in servers:
            assert not _alive(pid), f"the server {pid} outlived the benchmark"
    finally:  # (a failed check leaves nothing running either)
        for pid in servers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        bench.kill()
        bench.communicate()


def _children(pid: int, word: str) -> list[int]:
    """The pids of `pid`'s children whose command line has `word`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid and word.encode() in cmdline:
            found.append(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie, dead but not yet reaped, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
