"""How the app maps exceptions to OpenAI-style error responses."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.api.errors import APIError, error_response
from controller.api.request_ids import HEADER, SCOPE_KEY

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    param = ".".join(loc) or None
    return f"{param or 'body'}: {first.get('msg', 'invalid value')}", param


def install_error_handlers(app: FastAPI) -> None:
    """APIError as is; validation errors as 400, HTTP errors with their status, text that
    cannot be encoded as 400, anything else as 500 (logged with its traceback).

    Starlette answers the handler of `Exception` and then re-raises, and uvicorn closes the
    connection of a request whose app raised: a client's keep-alive connection would die with
    its request. Every error a client's input can cause therefore has a handler of its own,
    which answers and keeps the connection."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(APIError(message, 400, param))

    @app.exception_handler(UnicodeError)
    async def _unencodable(request: Request, exc: UnicodeError):
        # Only client text gets here (a lone UTF-16 surrogate that JSON allowed): every text
        # the server makes is valid Unicode.
        log.info("unencodable text in a request to %s: %s", request.url.path, type(exc).__name__)
        message = "The request holds text that is not valid Unicode (a lone surrogate?)."
        return error_response(APIError(message, 400, code="invalid_unicode"))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        return error_response(APIError(str(exc.detail), exc.status_code))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        # Starlette runs this outside every middleware: the request id comes from the scope.
        ids = request.scope.get(SCOPE_KEY)
        rid = ids.public if ids is not None else None
        log.exception("unhandled error on %s", request.url.path, extra={"request_id": rid})
        response = error_response(APIError("Internal server error.", 500))
        if rid is not None:
            response.headers[HEADER] = rid
        return response
