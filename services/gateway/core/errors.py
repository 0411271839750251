"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with a status;
routes of another API (Anthropic's /v1/messages) register their own shape in `SHAPES`,
and every renderer of an error that knows its path (handlers, the body cap, the
catch-all) goes through `shaped`."""

from __future__ import annotations

from collections.abc import Callable

from fastapi.responses import JSONResponse

from common.messages import AdminCode

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "invalid_request_error", 405: "invalid_request_error", 409: "conflict_error",
         413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
         500: "server_error", 502: "server_error", 503: "service_unavailable_error",
         504: "timeout_error"}

# Supervisor admin error codes → HTTP status (DESIGN.md section 8), one row per failing
# AdminCode, plus the gateway's own (no supervisor).
ADMIN_STATUS: dict[str, int] = {
    AdminCode.BAD_REQUEST: 400, AdminCode.UNKNOWN_COMMAND: 400, AdminCode.NOT_FOUND: 404,
    AdminCode.CONFLICT: 409, AdminCode.ACTIVE_REQUESTS: 409, AdminCode.LAUNCH_FAILED: 502,
    AdminCode.TEARDOWN_FAILED: 500, AdminCode.REAP_BLOCKED: 409,
    AdminCode.SIGNATURE_MISMATCH: 409, AdminCode.TIMEOUT: 504, AdminCode.INTERNAL: 500,
    "unavailable": 503,  # the gateway's own; "timeout" (no reply in time) is AdminCode's
}
_unmapped = {c for c in AdminCode if c is not AdminCode.OK} - ADMIN_STATUS.keys()
if _unmapped:  # complete by construction: a new code cannot reach HTTP unmapped
    raise ImportError(f"ADMIN_STATUS has no row for {sorted(_unmapped)}")


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type_: str | None = None,
                 data: dict | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type_ or TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.data = data
        self.headers = headers

    def body(self) -> dict:
        err = {"message": self.message, "type": self.type, "param": self.param, "code": self.code}
        if self.data is not None:
            err["data"] = self.data
        return {"error": err}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_json(status: int, message: str, **kw) -> JSONResponse:
    return ApiError(status, message, **kw).response()


# Path prefix → how that API renders an error (registered by its routes module).
SHAPES: dict[str, Callable[[ApiError], JSONResponse]] = {}


def shaped(path: str, err: ApiError) -> JSONResponse:
    """`err` as the API that owns `path` renders errors: OpenAI's unless registered."""
    for prefix, render in SHAPES.items():
        if path == prefix or path.startswith(prefix + "/"):
            return render(err)
    return err.response()
