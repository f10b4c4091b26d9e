"""OpenAI-style error responses."""

from __future__ import annotations

from fastapi.responses import JSONResponse


class APIError(Exception):
    """An error the client caused (4xx) or the service cannot serve now (503)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.message = message  # human-readable reason
        self.status = status  # HTTP status
        self.param = param  # the offending parameter, if one
        self.code = code  # machine-readable code
        self.err_type = err_type or _default_type(status)  # OpenAI error type
        self.headers = headers or {}  # extra response headers (Retry-After, WWW-Authenticate)


def _default_type(status: int) -> str:
    if status == 404:
        return "not_found_error"
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_response(err: APIError) -> JSONResponse:
    """The JSON body OpenAI clients parse: {"error": {message, type, param, code}}."""
    return JSONResponse(
        status_code=err.status,
        headers=err.headers or None,
        content={
            "error": {
                "message": err.message,
                "type": err.err_type,
                "param": err.param,
                "code": err.code,
            }
        },
    )
