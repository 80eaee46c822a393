"""OpenAI's error shape, {"error": {"message", "type", "param", "code"}}, with
the HTTP status for each of our refusals (the gRPC status they carry)."""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

# gRPC status -> (HTTP status, OpenAI error type). OpenAI's own types: bad input
# is an invalid_request_error; 429 and 5xx carry the kind of failure.
_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
}


class HttpError(Exception):
    """A refusal at the HTTP edge, before or instead of a response."""

    def __init__(self, status: int, message: str, error_type: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.error_type, self.param, self.code = status, message, error_type, param, code

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str, param: str | None = None, field: str | None = None) -> HttpError:
        """field: the gRPC name the message opens with, said as the OpenAI param instead."""
        status, error_type = _BY_CODE.get(code, (500, "server_error"))
        if field and param and message.startswith(field):
            message = param + message[len(field):]
        return cls(status, message, error_type, param, code.name.lower() if status >= 429 else None)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def bad_request(message: str, param: str | None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", param)


def unauthorized(message: str) -> HttpError:
    return HttpError(401, message, "invalid_request_error", code="invalid_api_key")


def body_too_large(max_bytes: int) -> HttpError:
    return HttpError(413, f"the request body is over {max_bytes} bytes, the most this server accepts (--http-max-body-bytes)",
                     "invalid_request_error", code="request_too_large")


def body_too_slow(seconds: float) -> HttpError:
    return HttpError(408, f"the request body did not arrive in full within {seconds:g} s (--http-timeout-seconds)",
                     "invalid_request_error", code="request_timeout")


def model_not_found(model: str) -> HttpError:
    return HttpError(404, f"The model `{model}` does not exist.", "invalid_request_error", "model", "model_not_found")


def unavailable(message: str) -> HttpError:
    return HttpError.from_status(grpc.StatusCode.UNAVAILABLE, message)


def pydantic_param(loc: tuple) -> str | None:
    """A pydantic error location ("body", "messages", 0, "content") as OpenAI names
    the parameter: messages[0].content."""
    parts = [p for p in loc if p != "body"]
    # A union's member type names the branch pydantic tried, not a parameter.
    parts = [p for p in parts if not (isinstance(p, str) and ("[" in p or p in ("str", "int", "float", "bool")))]
    name = ""
    for part in parts:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return name or None


def validation_error(errors: list[dict]) -> HttpError:
    """The first of pydantic's complaints about a body, as a 400 naming its parameter."""
    if not errors:
        return bad_request("the request body is not valid", None)
    # A value_error is one of our own validators (a bound, a lone surrogate): where a union's
    # other member also failed (a string or a list?), it is the complaint that says why.
    first = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    param = pydantic_param(tuple(first.get("loc", ())))
    if first.get("type") == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param)
    if first.get("type") == "json_invalid":
        return bad_request(f"the request body is not valid JSON: {first.get('msg')}", None)
    message = str(first.get("msg")).removeprefix("Value error, ")
    return bad_request(f"{param}: {message}" if param else message, param)
