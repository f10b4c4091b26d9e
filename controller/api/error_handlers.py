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
    """APIError as is; validation errors as 400, HTTP errors with their status, anything else
    as 500 (logged with its traceback)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return error_response(APIError(message, 400, param))

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
