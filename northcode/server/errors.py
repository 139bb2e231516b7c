"""RequestError and the OpenAI error body every failure is sent as: {"error": {message, type, param, code}}."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses; becomes an HTTP error with the OpenAI error body."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400, code: str | None = None,
                 error_type: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code
        self.error_type = error_type or _default_type(status)
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.error_type, self.param, self.code)


def error_body(message: str, error_type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def _default_type(status: int) -> str:
    kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
             503: "server_overloaded"}
    return kinds.get(status, "server_error")
