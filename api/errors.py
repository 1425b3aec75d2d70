"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status code."""

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error", 504: "server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def not_found(kind: str, object_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"No {kind} found with id '{object_id}'.", param=param, code="not_found")


def invalid(message: str, param: str | None = None, code: str | None = "invalid_value") -> APIError:
    return APIError(400, message, param=param, code=code)


def _body(status: int, message: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return JSONResponse(_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status,
                            headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0]
        if any(_union_member(p) for p in first.get("loc", ())):
            # A value matching no member of a union fails once per member: the deepest failure says what is wrong
            # (an image part inside a message list, rather than "input should be a string").
            field = first["loc"][:2]
            first = max((e for e in errors if e["loc"][:2] == field), key=lambda e: len(e["loc"]))
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path", "header")
               and not _union_member(p)]
        param = ".".join(loc) or None
        message = f"Invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
        return JSONResponse(_body(400, message, param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return JSONResponse(_body(exc.status_code, str(exc.detail), None, None), status_code=exc.status_code)


def _union_member(part) -> bool:
    """Pydantic's name for the member of a union in an error's location ('str', 'list[Message]', ...), which is no
    part of the field's path."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "dict", "list"))


class DeclaredBodyLimit:
    """Refuse a request whose declared Content-Length is over the limit before reading any of it, in OpenAI's
    error shape. (FastAPI's max_body_size stays as the backstop for bodies sent without a length.)"""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_bytes:
                message = f"The request body is larger than the limit of {self.max_bytes} bytes."
                response = JSONResponse(_body(413, message, None, "request_too_large"), status_code=413)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
