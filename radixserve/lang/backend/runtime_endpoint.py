"""`RuntimeEndpoint`: a server's native API over HTTP (a radixserve server, or SGLang's:
only the calls of the wire contract, §1), and `Runtime`, which starts a radixserve server
for the program and stops it at exit."""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import httpx2

from radixserve.lang.backend.base import (
    Backend,
    BackendError,
    native_completion,
    native_deltas,
)
from radixserve.lang.chat_template import (
    ChatTemplate,
    get_chat_template,
    get_chat_template_by_model_path,
)
from radixserve.lang.choices import ChoiceScores

if TYPE_CHECKING:
    from radixserve.lang.interpreter import Executor
    from radixserve.lang.ir import SamplingParams

CONNECT_TIMEOUT_S = 10.0
# an idle connection is dropped well before the server closes it (uvicorn's keep-alive is
# 5 s): reusing one the server is closing fails the request with a reset
KEEPALIVE_EXPIRY_S = 2.0


class RuntimeEndpoint(Backend):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        verify: str | bool | None = None,
        chat_template_name: str | None = None,
        timeout: float | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx2.Client(
            headers=headers,
            verify=True if verify is None else verify,
            timeout=httpx2.Timeout(CONNECT_TIMEOUT_S, read=timeout, write=timeout, pool=None),
            limits=httpx2.Limits(
                max_connections=512,
                max_keepalive_connections=512,
                keepalive_expiry=KEEPALIVE_EXPIRY_S,
            ),
        )
        self.model_info = self._get("/get_model_info")
        self.chat_template = self._chat_template(chat_template_name)
        # a radixserve server scores choices in one call; others get the two-call method
        self._scores_route = True

    def _chat_template(self, name: str | None) -> ChatTemplate:
        if name is not None:
            return get_chat_template(name)
        roles = self.model_info.get("chat_roles")
        if roles:
            return ChatTemplate.from_server(roles)
        return get_chat_template_by_model_path(self.model_info.get("model_path", ""))

    # -- the backend interface ------------------------------------------------------------
    def get_chat_template(self) -> ChatTemplate:
        return self.chat_template

    def get_model_name(self) -> str:
        return self.model_info["model_path"]

    def generate(
        self, s: Executor, params: SamplingParams
    ) -> tuple[str | list[str], dict[str, Any] | list[dict[str, Any]]]:
        return native_completion(self._post("/generate", self._generate_body(s.text_, params)))

    def generate_stream(
        self, s: Executor, params: SamplingParams
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        body = {**self._generate_body(s.text_, params), "stream": True}
        yield from native_deltas(self._events("/generate", body))

    def _events(self, route: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON objects of a server-sent event stream, until `[DONE]`."""
        with self._client.stream("POST", self.base_url + route, json=body) as response:
            if response.status_code != 200:
                response.read()
                raise _error(response)
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise BackendError(chunk["error"].get("message", str(chunk["error"])))
                yield chunk

    def score_choices(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> list[ChoiceScores]:
        if self._scores_route:
            self.cache_context_first(prefix, choices)
            body = {"text": prefix, "continuations": choices, "unconditional": unconditional}
            response = self._client.post(self.base_url + "/score_continuations", json=body)
            if response.status_code == 404:
                self._scores_route = False  # not a radixserve server
            else:
                return [_scores(c) for c in _json(response)["continuations"]]
        return self._score_by_generate(prefix, choices, unconditional)

    def cache_prefix(self, prefix: str) -> int:
        body = {"text": prefix, "sampling_params": {"max_new_tokens": 0}}
        return int(self._post("/generate", body)["meta_info"]["prompt_tokens"])

    def flush_cache(self) -> bool:
        return self._client.post(self.base_url + "/flush_cache").status_code == 200

    def get_server_info(self) -> dict[str, Any]:
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        self._client.close()

    # -- scoring through /generate (servers without /score_continuations) -----------------
    def _score_by_generate(
        self, prefix: str, choices: list[str], unconditional: bool
    ) -> list[ChoiceScores]:
        """Two calls as the wire contract allows: the prefix alone (its token count, and it
        is cached), then every prefix + choice with prompt logprobs from two tokens before
        the prefix's end, so a token the choice merges into is scored with the choice."""
        prompt_len = self.cache_prefix(prefix)
        start = max(prompt_len - 2, 0)
        body = {
            "text": [prefix + c for c in choices],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "return_text_in_logprobs": True,
            "logprob_start_len": start,
        }
        outs = self._post("/generate", body)
        spans = [
            _choice_span(o["meta_info"]["input_token_logprobs"], c, prompt_len - start)
            for o, c in zip(outs, choices)
        ]
        if not unconditional:
            return spans
        uncond = self._unconditional([span.token_ids for span in spans])
        return [replace(span, unconditional_logprobs=u) for span, u in zip(spans, uncond)]

    def _unconditional(self, spans: list[list[int]]) -> list[list[float | None]]:
        body = {
            "input_ids": spans,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        outs = self._post("/generate", body)
        return [[t[0] for t in o["meta_info"]["input_token_logprobs"]] for o in outs]

    # -- HTTP -----------------------------------------------------------------------------
    @staticmethod
    def _generate_body(text: str, params: SamplingParams) -> dict[str, Any]:
        return {"text": text, "sampling_params": params.to_native(), **params.logprob_fields()}

    def _get(self, route: str) -> Any:
        return _json(self._client.get(self.base_url + route))

    def _post(self, route: str, body: dict[str, Any]) -> Any:
        return _json(self._client.post(self.base_url + route, json=body))


def _choice_span(triples: list[list[Any]], choice: str, prefix_tokens: int) -> ChoiceScores:
    """The choice's own tokens among the prompt-logprob triples [logprob, id, text] that
    start `prefix_tokens` tokens before the prefix's end. Going by the tokens' texts, the
    span starts at the first token that reaches past the prefix (healed tokens: those of
    the span that begin inside it); where the texts do not add up, at the prefix's end."""
    texts = [t[2] for t in triples]
    if all(isinstance(t, str) for t in texts) and "".join(texts).endswith(choice):
        prefix_chars = len("".join(texts)) - len(choice)
        end, first = 0, len(triples) - 1
        for i, text in enumerate(texts):
            end += len(text)
            if end > prefix_chars:
                first = i
                break
        healed = max(prefix_tokens - first, 0)
    else:
        first, healed = min(prefix_tokens, len(triples) - 1), 0
    span = triples[first:]
    texts = [t[2] for t in span]
    known = all(isinstance(t, str) for t in texts)
    return ChoiceScores(
        [t[1] for t in span], [t[0] for t in span], None, healed, texts if known else None
    )


def _scores(c: dict[str, Any]) -> ChoiceScores:
    return ChoiceScores(
        c["token_ids"],
        c["logprobs"],
        c.get("unconditional_logprobs"),
        c.get("healed_tokens", 0),
        c.get("tokens"),  # a server of another engine may not give them
    )


def _json(response: httpx2.Response) -> Any:
    if response.status_code != 200:
        raise _error(response)
    return response.json()


def _error(response: httpx2.Response) -> BackendError:
    try:
        body = response.json()
        message = body.get("error", {}).get("message") if isinstance(body, dict) else None
        message = message or json.dumps(body)
    except ValueError:
        message = response.text
    return BackendError(message, response.status_code)


class Runtime:
    """A radixserve server started for this program (`radixserve serve` in a child process
    on a free port), stopped by `shutdown()` or at exit. Keyword arguments are the server's
    flags: `Runtime(model_path=..., max_total_tokens=20000, disable_radix_cache=True)`."""

    def __init__(
        self, model_path: str | None = None, launch_timeout: float = 300.0, **server_args: Any
    ) -> None:
        server_args.pop("log_level", None)  # radixserve logs at its own level
        self.port = int(server_args.pop("port", None) or _free_port())
        self.url = f"http://127.0.0.1:{self.port}"
        command = [sys.executable, "-m", "radixserve", "serve", "--port", str(self.port)]
        if model_path is not None:
            command += ["--model-path", str(model_path)]
        command += _flags(server_args)
        self._proc: subprocess.Popen | None = subprocess.Popen(command, start_new_session=True)
        atexit.register(self.shutdown)
        api_key = server_args.get("api_key")
        self._wait_ready(launch_timeout, {"Authorization": f"Bearer {api_key}"} if api_key else {})
        self.endpoint = RuntimeEndpoint(self.url, api_key=api_key)

    def _wait_ready(self, timeout: float, headers: dict[str, str]) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                self.shutdown()
                raise RuntimeError("the radixserve server exited while starting (see its log)")
            try:
                ready = httpx2.get(self.url + "/health_generate", headers=headers, timeout=30)
                if ready.status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.5)
        self.shutdown()
        raise TimeoutError(f"the radixserve server was not ready within {timeout} s")

    def cache_prefix(self, prefix: str) -> int:
        return self.endpoint.cache_prefix(prefix)

    def shutdown(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)  # the server and its children drain and exit
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        deadline = time.monotonic() + 10
        while _group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)  # never leave an orphan
        proc.wait()
        if hasattr(self, "endpoint"):
            self.endpoint.shutdown()


def _flags(args: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        else:
            out += [flag, str(value)]
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
