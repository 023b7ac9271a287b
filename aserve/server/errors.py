"""OpenAI-style error bodies, and the Starlette exception handlers that answer with them.

Every error the server sends has one shape, vLLM's flavour of OpenAI's:

    {"error": {"message": "...", "type": "BadRequestError", "param": "n", "code": 400}}

`type` names the HTTP status the way the `openai` SDK names its exceptions and `code` is the
status. Routes raise `ServerError` (or let a `pydantic.ValidationError` escape);
`EXCEPTION_HANDLERS` turns those, malformed bodies, Starlette's own 404/405 and anything
unexpected (500, logged, never a traceback in the body) into that shape.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus
from typing import Any

from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
    504: "TimeoutError",
}
_MAX_ERRORS_SHOWN = 3
_MAX_INPUT_CHARS = 60


def error_type(status: int) -> str:
    """`BadRequestError` for 400, `NotFoundError` for 404, …; derived from the phrase otherwise."""
    if status in _ERROR_TYPES:
        return _ERROR_TYPES[status]
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        return "Error"
    name = "".join(word.capitalize() for word in phrase.replace("-", " ").split())
    return name if name.endswith("Error") else name + "Error"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo

    @classmethod
    def of(cls, message: str, status: int = 400, param: str | None = None) -> ErrorResponse:
        return cls(error=ErrorInfo(message=message, type=error_type(status), param=param,
                                   code=status))


class ServerError(Exception):
    """An error a route answers with: `raise ServerError("...", 404)`."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.headers = headers

    @classmethod
    def from_value_error(cls, exc: ValueError, status: int = 400) -> ServerError:
        """For `ValueError`s of `SamplingParams` / the processor, whose messages start with the
        field they are about ("top_k must be ..."): that word becomes `param`."""
        message = str(exc)
        first = message.split(" ", 1)[0]  # a field, or a dotted path to one
        ok = all(part.isidentifier() for part in first.split(".")) and first.islower()
        param = first if ok else None
        return cls(message, status, param)


def error_response(message: str, status: int = 400, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse.of(message, status, param)
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _path(loc: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in loc)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_INPUT_CHARS else text[:_MAX_INPUT_CHARS - 3] + "..."


def _describe(error: dict[str, Any]) -> str:
    path, kind = _path(error["loc"]), error["type"]
    if kind == "value_error":  # raised by our validators: the message names the field
        text = str(error["ctx"]["error"])
        return text if not path or path in text else f"{path}: {text}"
    if kind == "json_invalid" or not path:
        return error["msg"]
    if kind == "missing":
        return f"{path}: Field required"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"{path}: Input should be an object, got {_short(error['input'])}"
    return f"{path}: {error['msg']}, got {_short(error['input'])}"


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message naming each bad field (the first few), and the first one's path."""
    errors = exc.errors(include_url=False)
    message = "; ".join(_describe(e) for e in errors[:_MAX_ERRORS_SHOWN])
    if len(errors) > _MAX_ERRORS_SHOWN:
        message += f" (and {len(errors) - _MAX_ERRORS_SHOWN} more errors)"
    param = _path(errors[0]["loc"]) if errors and errors[0]["loc"] else None
    return message, param


def validation_error_response(exc: ValidationError) -> JSONResponse:
    message, param = describe_validation_error(exc)
    return error_response(message, 400, param)


async def handle_server_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServerError)
    return error_response(exc.message, exc.status, exc.param, exc.headers)


async def handle_validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ValidationError)
    return validation_error_response(exc)


async def handle_malformed_body(request: Request, exc: Exception) -> JSONResponse:
    """`json.JSONDecodeError` / `UnicodeDecodeError` from `await request.json()`."""
    return error_response(f"The request body is not valid JSON: {exc}", 400)


async def handle_http_exception(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own 404 (no such route), 405 (wrong method), …, in the same shape."""
    assert isinstance(exc, HTTPException)
    message = exc.detail
    if exc.status_code == 404:
        message = f"{exc.detail}: {request.method} {request.url.path}"
    return error_response(message, exc.status_code, headers=exc.headers)


async def handle_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything else: logged with its traceback, answered 500 without it."""
    logger.exception("Unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(f"Internal server error: {type(exc).__name__}: {_short_text(exc)}", 500)


def _short_text(exc: Exception, limit: int = 500) -> str:
    text = str(exc)
    return text if len(text) <= limit else text[:limit - 3] + "..."


EXCEPTION_HANDLERS = {
    ServerError: handle_server_error,
    ValidationError: handle_validation_error,
    json.JSONDecodeError: handle_malformed_body,
    UnicodeDecodeError: handle_malformed_body,
    HTTPException: handle_http_exception,
    Exception: handle_unexpected_error,
}
