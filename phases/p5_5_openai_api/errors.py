"""Every refusal in OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`.

A route raises `APIError` (`param` names the field at fault); the handlers `add_error_handlers(app)`
installs give a body that fails validation, a bad path and a crash the same shape.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from phases.p5_5_openai_api import protocol as P


class APIError(Exception):
    """A refusal a route raises: its status, and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers


def _error(status: int, message: str, type: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(P.error_body(message, type, param, code), status_code=status, headers=headers)


async def on_api_error(request: Request, e: APIError):
    return _error(e.status, e.message, e.type, e.param, e.code, e.headers)


async def on_invalid_request(request: Request, e: RequestValidationError):
    err = e.errors()[0] if e.errors() else {}
    if err.get("type") == "json_invalid":
        return _error(400, f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}",
                      "invalid_request_error")
    param = ".".join(str(p) for p in err.get("loc", []) if p != "body") or None
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    return _error(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param)


async def on_http_error(request: Request, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return _error(e.status_code, str(e.detail), kind)


async def on_crash(request: Request, e: Exception):
    return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_invalid_request)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_crash)
