"""The scheduler's side of LoRA serving: which adapter uids requests may name, what each
namespaces the prefix cache by, and unloads that wait for the requests using them.

Uids come from the edge (one per load, never reused), so every data-parallel replica
agrees on them. A request's prefix-cache namespace is its adapter's digest, not its uid:
K/V depend on the weights alone, so an adapter loaded again (under any name) finds its
cached prefixes, and one whose weights changed never finds the old ones.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from radixserve.core.messages import ControlReply, ControlReq, LoraUpdate
from radixserve.core.req import Req
from radixserve.lora.adapter import LoraError
from radixserve.model.runner import ModelRunner

logger = logging.getLogger(__name__)


class AdapterNotLoaded(ValueError):
    """The request names an adapter unloaded before it got here (sent just before)."""


class Adapters:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.unloading: dict[int, list[ControlReq]] = {}  # uid → the ops waiting on it

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

    def load(self, msg: ControlReq) -> ControlReply:
        args = msg.args
        try:
            self.runner.load_lora(args["uid"], args["name"], args["path"])
        except (LoraError, OSError) as e:  # a bad folder, or one this model cannot serve
            logger.warning("LoRA adapter %s not loaded: %s", args["name"], e)
            return ControlReply(msg.call_id, lora=LoraUpdate(False, str(e)))
        except Exception as e:  # a fault of this load alone (a file nobody checked for it,
            # memory): it fails, the scheduler serves on
            logger.exception("LoRA adapter %s not loaded", args["name"])
            message = f"loading the adapter failed: {type(e).__name__}: {e}"
            return ControlReply(msg.call_id, lora=LoraUpdate(False, message))
        return ControlReply(msg.call_id, lora=LoraUpdate(True, f"loaded {args['name']}"))

    def unload(self, msg: ControlReq) -> None:
        """Unload once no live request uses the adapter (`settle` answers)."""
        self.unloading.setdefault(msg.args["uid"], []).append(msg)

    def settle(self, live: Iterable[Req]) -> list[ControlReply]:
        """Unload the adapters no live request uses any more; their ops' answers."""
        used = {req.lora_id for req in live}
        replies = []
        for uid in [u for u in self.unloading if u not in used]:
            self.runner.unload_lora(uid)
            for msg in self.unloading.pop(uid):
                replies.append(ControlReply(msg.call_id, lora=LoraUpdate(True, "unloaded")))
        return replies
