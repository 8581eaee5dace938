"""OpenAI's error body ``{"error": {"message", "type", "param", "code"}}`` for every refusal: the
server's own ``APIError``, pydantic's validation errors, the engine's ``RequestError`` and
Starlette's HTTP errors (404, 405, and 413 from the body limit), each by a registered handler."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InvariantInferError, RequestError


log = logging.getLogger("invariant_infer.server")

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
               405: "invalid_request_error", 409: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error"}
HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
# pydantic error types -> OpenAI error codes; protocol.py raises its custom errors under these codes
OPENAI_CODES = {"invalid_value", "invalid_type", "unsupported_parameter"}
VALIDATION_CODES = {"missing": "missing_required_parameter", "extra_forbidden": "unsupported_parameter"}


class APIError(InvariantInferError):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.type = ERROR_TYPES.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


class JSON(JSONResponse):
    """Logprobs are float32 values written as Python floats: repr round-trips them exactly.
    A -inf logprob is written as -Infinity (Python's json reads it). Text that is not valid Unicode
    (a lone surrogate a refusal quotes) is written with ASCII escapes, which JSON allows."""

    def render(self, content) -> bytes:
        try:
            return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()
        except UnicodeEncodeError:
            return json.dumps(content, separators=(",", ":")).encode()


def error_response(exc: APIError) -> JSON:
    return JSON(exc.body(), status_code=exc.status, headers=exc.headers)


def param_of(loc: tuple) -> str | None:
    """pydantic's location ``("body", "messages", 0, "content")`` -> ``"messages[0].content"``."""
    name = ""
    for part in loc[1:]:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


def validation_error(exc: RequestValidationError) -> APIError:
    """The first error, named by its field; a body that is not a JSON object has no field."""
    error = exc.errors()[0]
    kind, loc = error["type"], tuple(error.get("loc", ()))
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {error.get('ctx', {}).get('error', error['msg'])}",
                        code="invalid_json")
    if len(loc) <= 1:
        if kind == "string_unicode":  # a field name with a lone surrogate
            return APIError(400, "a field name in the body is not valid Unicode text", code="invalid_value")
        return APIError(400, "the request body must be a JSON object", code="invalid_json")
    param = param_of(loc)
    if kind == "extra_forbidden":
        message = f"unrecognized request argument: {param}"
    else:
        message = f"'{param}': {error['msg']}" if param else error["msg"]
    code = VALIDATION_CODES.get(kind) or (kind if kind in OPENAI_CODES else
                                          "invalid_type" if kind.endswith("_type") else "invalid_value")
    return APIError(400, message, param=param, code=code)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return error_response(validation_error(exc))

    @app.exception_handler(RequestError)
    async def engine_refusal(request: Request, exc: RequestError):
        return error_response(bad(str(exc), exc.param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(exc.status_code, str(exc.detail), code=HTTP_CODES.get(exc.status_code),
                                       headers=exc.headers))

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"))
