"""Why the scheduler refuses a request: typed errors, raised in one place (the scheduler
loop's admission) and mapped to a status at each edge (HTTP: 400 or 503; the in-process
Engine: the exception itself)."""

from __future__ import annotations

from typing import Literal

RejectionKind = Literal["invalid", "duplicate_rid", "queue_full"]


class RequestRejected(ValueError):
    kind: RejectionKind = "invalid"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the field at fault, where one is


class InvalidRequest(RequestRejected):
    """The request can never run on this engine (out-of-vocabulary ids, too long...)."""

    kind = "invalid"


class DuplicateRid(RequestRejected):
    """A live request already has this rid."""

    kind = "duplicate_rid"

    @classmethod
    def of(cls, rid: str) -> DuplicateRid:
        return cls(f"a request with rid {rid!r} is already running", "rid")


class QueueFull(RequestRejected):
    """The waiting queue is at --max-queued-requests: retry later."""

    kind = "queue_full"


REJECTIONS: dict[str, type[RequestRejected]] = {
    cls.kind: cls for cls in (InvalidRequest, DuplicateRid, QueueFull)
}


def rejection(kind: str, message: str, param: str | None = None) -> RequestRejected:
    """The typed error a `Rejected` message stands for."""
    return REJECTIONS.get(kind, RequestRejected)(message, param)
