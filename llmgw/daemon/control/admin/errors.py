"""The admin API's errors: AdminFail (status, message, the field it names) and the envelope every
error answer has (OpenAI's shape: message, type, param, code). Shared by the server and the
handler modules (admin/lifecycle.py, admin/facility.py)."""

from __future__ import annotations

from typing import Any

from llmgw.admin.schema import Problem

__all__ = ["CODES", "TYPES", "AdminFail", "admin_error_body", "invalid"]

CODES = {400: "invalid_request", 401: "unauthorized", 403: "forbidden", 404: "not_found",
         405: "method_not_allowed", 408: "request_timeout", 409: "conflict", 413: "payload_too_large",
         431: "headers_too_large", 500: "internal_error", 503: "store_unavailable"}
TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "method_not_allowed", 409: "conflict_error", 503: "service_unavailable"}


class AdminFail(Exception):
    """Raised by a handler: the answer's status and message, the parameter or field it names."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 problems: list[Problem] | None = None, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or CODES.get(status)
        self.problems = problems or []
        self.headers = headers or []


def invalid(problems: list[Problem], code: str) -> AdminFail:
    return AdminFail(400, "; ".join(map(str, problems)), param=problems[0].field or None, code=code,
                     problems=problems)


def admin_error_body(status: int, message: str, err_type: str) -> dict[str, Any]:
    """The envelope of errors the HTTP server itself makes (413, malformed requests, 500...)."""
    return {"error": {"message": message, "type": TYPES.get(status, err_type), "param": None,
                      "code": CODES.get(status)}}
