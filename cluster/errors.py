"""HTTP errors in the OpenAI shape, and readable messages for request validation errors."""

from __future__ import annotations

import math
import re
from typing import Any

from fastapi.responses import JSONResponse
from lockserve.cluster.protocol import FIELD_TYPES, ErrorInfo, ErrorResponse
from pydantic import BaseModel, ValidationError

ERROR_TYPES = {401: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error"}


class APIError(Exception):
    """An error answered to the client as ``{"error": {...}}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after = retry_after  # seconds; sent as Retry-After (a 503 the client may retry)

    def info(self) -> ErrorInfo:
        return ErrorInfo(message=self.message, type=error_type(self.status), param=self.param, code=self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        body = ErrorResponse(error=self.info()).model_dump()
        headers = dict(headers or {})
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        return JSONResponse(body, status_code=self.status, headers=headers or None)


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "server_error"


def param_of(message: str) -> str | None:
    """The field a contract ValueError names: ``"max_tokens (-1) must be >= 1"`` -> ``"max_tokens"``."""
    match = re.match(r"^([A-Za-z_][\w.\[\]]*) \(", message)
    return match.group(1).removesuffix("[]") if match else None


def _field_names(models: list[type[BaseModel]]) -> set[str]:
    names: set[str] = set()
    seen: set[type[BaseModel]] = set()
    while models:
        model = models.pop()
        if model in seen:
            continue
        seen.add(model)
        for name, info in model.model_fields.items():
            names.add(name)
            for arg in _types_in(info.annotation):
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    models.append(arg)
    return names


def _types_in(annotation: Any) -> list[Any]:
    args = list(getattr(annotation, "__args__", ()) or ())
    found = [annotation]
    for arg in args:
        found.extend(_types_in(arg))
    return found


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> tuple[str, str | None]:
    """(message, param) for the first problem of a request body, naming the field path and value.

    Union branches appear in pydantic locations as type tags (``prompt.list[int].0``);
    they are dropped from the path, and for union fields a plain description of the
    accepted types replaces pydantic's per-branch message.
    """
    item = err.errors(include_url=False)[0]
    fields = _field_names([model])
    parts, tagged = [], False
    extra = item["type"] == "extra_forbidden"  # then the last part is the unknown key itself
    for k, part in enumerate(item["loc"]):
        if isinstance(part, int):
            parts.append(f"[{part}]")
        elif part in fields or (extra and k == len(item["loc"]) - 1):
            parts.append(f".{part}" if parts else part)
        else:
            tagged = True
    path = "".join(parts) or "body"
    param = str(item["loc"][0]) if item["loc"] else None
    if item["type"] == "missing":
        return f"{path}: field required", param
    if extra:
        return f"{path}: unknown field", param
    got = _short(item.get("input"))
    if tagged and path in FIELD_TYPES:
        return f"{path} must be {FIELD_TYPES[path]} (got {got})", param
    reason = item["msg"].removeprefix("Value error, ")
    return f"{path}: {reason} (got {got})", param


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
