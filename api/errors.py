"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status code, for every
failure: the routes' own, FastAPI's validation, an unreachable Redis (503 with retry-after) and anything else."""

import logging
import re

import redis.exceptions
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kombu.exceptions import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error", 504: "server_error"}
# How long a client should wait before retrying while Redis is away (a restart from AOF takes seconds).
RETRY_AFTER_SECONDS = 2
# Redis (or the broker connection Celery publishes through) is unreachable, restarting or still loading.
OUTAGES = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OperationalError)

log = logging.getLogger("xpujobs.api")


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


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(_body(status, message, param, code), status_code=status, headers=headers)


def outage_response() -> JSONResponse:
    return error_response(503, "The service's store (Redis) is unreachable; retry shortly.",
                          code="service_unavailable", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


_LOCATIONS = {"body", "query", "path", "header"}
# pydantic names the member of a union it tried in the error's location (`n_epochs.int`, `input.list[Message]`,
# `lora.target_modules.literal['all-linear']`): not part of the param.
_UNION_MEMBER = re.compile(r"int|str|float|bool|bytes|dict|list|none|[A-Z]\w*"
                           r"|(literal|list|dict|tuple|set|frozenset|nullable|function-[a-z]+|[A-Z]\w*)\[.*\]")
# A form field named with brackets (`expires_after[seconds]`), as OpenAI's multipart calls send nested fields.
_FORM_FIELD = re.compile(r"([a-z_]+)\[([a-z_]+)\]")


def _union_member(part) -> bool:
    return isinstance(part, str) and bool(_UNION_MEMBER.fullmatch(part))


def _param(loc) -> str | None:
    parts = [str(p) for p in loc if p not in _LOCATIONS and not _union_member(p)]
    return ".".join(_FORM_FIELD.sub(r"\1.\2", p) for p in parts) or None


def _validation_response(exc: RequestValidationError) -> JSONResponse:
    problems = exc.errors()
    unknown = [p for p in problems if p.get("type") == "extra_forbidden"]
    first = (unknown or problems)[0]
    if not unknown and any(_union_member(p) for p in first.get("loc", ())):
        # A value matching no member of a union fails once per member: the deepest failure says what is wrong
        # (an image part inside a message list, rather than "input should be a string").
        field = first["loc"][:2]
        first = max((e for e in problems if e["loc"][:2] == field), key=lambda e: len(e["loc"]))
    param = _param(first.get("loc", ()))
    if unknown:
        names = ", ".join(sorted({_param(u["loc"]) or "?" for u in unknown}))
        return error_response(400, f"Unrecognized request argument supplied: {names}", param, "unknown_parameter")
    message = f"Invalid value for '{param}': {first.get('msg')}" if param else str(first.get("msg"))
    return error_response(400, message, param, "invalid_value")


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError):
        return _validation_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    async def _outage(request: Request, exc: Exception):
        log.warning("%s %s: Redis unreachable (%s)", request.method, request.url.path, exc)
        return outage_response()

    for outage in OUTAGES:
        app.add_exception_handler(outage, _outage)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("%s %s failed", request.method, request.url.path)
        return error_response(500, "The server had an error while processing your request.", code="server_error")


class BodyLimits:
    """Refuse an oversize body in OpenAI's error shape (413) before it is read into memory or spooled to disk:
    multipart uploads up to the upload limit, every other body (JSON) up to its own, much smaller limit. A body
    sent without a Content-Length is counted as it streams in. (FastAPI's max_body_size stays as the backstop.)"""

    def __init__(self, app, max_upload_bytes: int, max_json_bytes: int):
        self.app, self.max_upload_bytes, self.max_json_bytes = app, max_upload_bytes, max_json_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        multipart = headers.get(b"content-type", b"").lower().startswith(b"multipart/")
        limit = self.max_upload_bytes if multipart else self.max_json_bytes
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            return await self._too_large(limit, scope, receive, send)
        if multipart or length.isdigit():
            return await self.app(scope, receive, send)
        # No declared length: read the (small) body here, counting, and replay it to the app.
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._too_large(limit, scope, receive, send)
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed():
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)

    @staticmethod
    async def _too_large(limit: int, scope, receive, send):
        message = f"The request body is larger than the limit of {limit} bytes."
        await error_response(413, message, code="request_too_large")(scope, receive, send)
