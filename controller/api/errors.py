"""OpenAI-style error responses, which always encode: whatever a message quotes of the client's
input (a lone UTF-16 surrogate in a model name, a 4 MB key) is made encodable and short."""

from __future__ import annotations

from fastapi.responses import JSONResponse

MAX_QUOTE = 100  # characters of a client's value an error message may quote
MAX_FIELD = 1000  # characters of any field of an error body (a param path can be a client key)


def encodable(text: str, limit: int = MAX_FIELD) -> str:
    """`text` cut to `limit` characters, with what UTF-8 cannot encode (lone surrogates)
    replaced, so that the response always encodes."""
    cut = text if len(text) <= limit else text[:limit] + "..."
    return cut.encode("utf-8", "replace").decode("utf-8")


def quote(value: object) -> str:
    """A client's value as an error message may show it: short and always encodable."""
    return encodable(str(value), MAX_QUOTE)


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
        content={"error": error_body(err)},
    )


def error_body(err: APIError) -> dict[str, str | None]:
    """The fields of an OpenAI error object, each one encodable."""
    return {
        "message": encodable(err.message),
        "type": err.err_type,
        "param": None if err.param is None else encodable(err.param),
        "code": err.code,
    }
