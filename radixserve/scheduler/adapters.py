"""The scheduler's side of LoRA serving: which adapter uids requests may name, what each
namespaces the prefix cache by, loads read off the scheduler's thread, and unloads that
wait for the requests using them.

A load reads and checks the folder on a thread of its own (a large adapter, or a slow or
hung file system, would otherwise stop every running request's steps meanwhile); the
scheduler serves on, and installs the adapter between two steps once it is read. No request
names it before: the edge holds its name back until the load is answered.

Uids come from the edge (one per load, never reused), so every data-parallel replica
agrees on them. A request's prefix-cache namespace is its adapter's digest, not its uid:
K/V depend on the weights alone, so an adapter loaded again (under any name) finds its
cached prefixes, and one whose weights changed never finds the old ones.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable
from concurrent.futures import Future

from radixserve.core.messages import ControlReply, ControlReq, LoraUpdate
from radixserve.core.req import Req
from radixserve.lora.adapter import LoraAdapter, LoraError
from radixserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)


class AdapterNotLoaded(ValueError):
    """The request names an adapter unloaded before it got here (sent just before)."""


class Adapters:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        lora = runner.config.lora
        # the most distinct adapters running requests may use (None: LoRA not served)
        self.per_batch = lora.max_loras_per_batch if lora.enabled else None
        self.unloading: dict[int, list[ControlReq]] = {}  # uid → the ops waiting on it
        self.loading: dict[int, tuple[ControlReq, Future[LoraAdapter]]] = {}  # uid → its load

    def attach(self, req: Req) -> None:
        """Namespace the request's prefix-cache lookups by its adapter (AdapterNotLoaded if
        it names one that is not, or no longer, loaded)."""
        if not req.lora_id:
            return
        lora = self.runner.lora
        adapter = None if lora is None else lora.adapters.get(req.lora_id)
        if adapter is None:  # (one being unloaded still serves the requests sent before)
            raise AdapterNotLoaded(
                "the request's LoRA adapter was unloaded before the request was admitted"
            )
        req.extra_key = adapter.cache_key

    def namespaces(self) -> dict[Hashable, list[int]]:
        """The prefix cache's namespaces (`extra_key`s) as requests name them: the uids of
        the loaded adapters under each (one per adapter, but the same weights loaded twice
        share theirs), and None's, the base model's: 0."""
        spaces: dict[Hashable, list[int]] = {None: [0]}
        lora = self.runner.lora
        for uid, adapter in lora.adapters.items() if lora is not None else ():
            if uid not in self.unloading:  # (the dispatcher has dropped its mirror)
                spaces.setdefault(adapter.cache_key, []).append(uid)
        return spaces

    def load(self, msg: ControlReq) -> ControlReply | None:
        """Start reading the adapter on a thread (`finish_loads` answers), or answer now
        where none may be loaded."""
        args = msg.args
        try:
            self.runner.check_lora_room(pending=len(self.loading))
        except LoraError as e:
            return self._failed(msg, e)
        future: Future[LoraAdapter] = Future()
        self.loading[args["uid"]] = (msg, future)
        threading.Thread(
            target=_read,
            args=(self.runner, args["name"], args["path"], future),
            name=f"lora-load-{args['uid']}",
            daemon=True,  # a hung read never holds the process at its exit
        ).start()
        return None

    def finish_loads(self) -> list[ControlReply]:
        """Install the adapters read since the last call; their loads' answers."""
        replies = []
        for uid, (msg, future) in list(self.loading.items()):
            if not future.done():
                continue
            del self.loading[uid]
            try:
                adapter = future.result()
                self.runner.add_lora(uid, adapter)  # (to the device: memory may run out)
            except Exception as e:
                replies.append(self._failed(msg, e))
                continue
            replies.append(
                ControlReply(msg.call_id, lora=LoraUpdate(True, f"loaded {adapter.name}"))
            )
        return replies

    @staticmethod
    def _failed(msg: ControlReq, error: Exception) -> ControlReply:
        name = msg.args["name"]
        if isinstance(error, (LoraError, OSError)):  # a bad folder, or one this model cannot serve
            logger.warning("LoRA adapter %s not loaded: %s", name, error)
            message = str(error)
        else:  # a fault of this load alone (a file nobody checked for it, memory): it fails,
            # the scheduler serves on
            logger.error("LoRA adapter %s not loaded", name, exc_info=error)
            message = f"loading the adapter failed: {type(error).__name__}: {error}"
        return ControlReply(msg.call_id, lora=LoraUpdate(False, message))

    def unload(self, msg: ControlReq) -> ControlReply | None:
        """Unload once no live request uses the adapter (`settle` answers). An adapter
        still being read (the edge undoing a load it stopped waiting for: a read that hangs
        on its file system) is abandoned: its slot is free at once, its load is answered
        now as failed (returned), and what the read brings, if it ever ends, is dropped."""
        uid = msg.args["uid"]
        self.unloading.setdefault(uid, []).append(msg)
        abandoned = self.loading.pop(uid, None)
        if abandoned is None:
            return None
        logger.warning("LoRA adapter %s: its load was undone before it was read", uid)
        message = "the load was undone before the adapter's folder was read (it took too long)"
        return ControlReply(abandoned[0].call_id, lora=LoraUpdate(False, message))

    def settle(self, live: Iterable[Req]) -> list[ControlReply]:
        """Unload the adapters no live request uses any more; their ops' answers."""
        used = {req.lora_id for req in live}
        replies = []
        for uid in [u for u in self.unloading if u not in used]:
            self.runner.unload_lora(uid)
            for msg in self.unloading.pop(uid):
                replies.append(ControlReply(msg.call_id, lora=LoraUpdate(True, "unloaded")))
        return replies


def _read(runner: ModelRunner, name: str, path: str, future: Future[LoraAdapter]) -> None:
    try:
        future.set_result(runner.read_lora(name, path))
    except BaseException as e:  # answered as the load's failure by finish_loads
        future.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))
