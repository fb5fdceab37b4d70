"""Errors the server answers with, in the OpenAI shape:
`{"error": {"message", "type", "param", "code"}}`."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str | None = None,
        param: str | None = None,
        code: str | int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "server_error")
        self.param = param
        self.code = code if code is not None else status

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    503: "service_unavailable",
}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


# The scheduler's refusals (core/errors.py) as HTTP statuses.
REJECTION_STATUS = {"invalid": 400, "duplicate_rid": 400, "queue_full": 503}


class EngineUnavailable(APIError):
    """The engine is down, draining, or full: 503."""

    def __init__(self, message: str) -> None:
        super().__init__(503, message)


class _ErrorFields(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorBody(BaseModel):
    """The body of every error answer, as OpenAPI documents it."""

    error: _ErrorFields


# Every route's documented error answers (FastAPI would document its own 422 instead).
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    "4XX": {
        "model": ErrorBody,
        "description": "Invalid request (400), bad API key (401), unknown route or model (404)",
    },
    503: {"model": ErrorBody, "description": "The engine is starting, down, draining or full"},
}
