"""Error codes and the exceptions that carry them."""

from __future__ import annotations

from typing import ClassVar


class ErrorCode:
    """The closed set of error codes on the wire (documented in docs/protocol.md)."""

    PROTOCOL_ERROR = "protocol_error"
    FRAME_TOO_LARGE = "frame_too_large"
    VERSION_MISMATCH = "version_mismatch"
    AUTH_FAILED = "auth_failed"
    UNKNOWN_METHOD = "unknown_method"
    INVALID_PARAMS = "invalid_params"
    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"
    OS_ERROR = "os_error"
    UNSUPPORTED = "unsupported"
    LIMIT_EXCEEDED = "limit_exceeded"
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A broken frame or an illegal message: the connection cannot go on."""

    code: str

    def __init__(self, message: str, code: str = ErrorCode.PROTOCOL_ERROR) -> None:
        super().__init__(message)
        self.code = code


class LocalProtocolError(ProtocolError):
    """We tried to send something the protocol forbids (a bug on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids."""


class AgentError(Exception):
    """A typed error reply: code, human message and, for OS errors, the errno name."""

    default_code: ClassVar[str] = ErrorCode.INTERNAL

    def __init__(self, message: str, *, code: str | None = None, errno: str | None = None) -> None:
        super().__init__(message)
        self.code = code or self.default_code
        self.message = message
        self.errno = errno

    def __str__(self) -> str:
        if self.errno:
            return f"{self.errno}: {self.message}"
        return self.message

    @staticmethod
    def from_wire(code: str, message: str, errno: str | None) -> AgentError:
        """Build the most specific exception class for a received error."""
        cls = _BY_CODE.get(code, AgentError)
        return cls(message, code=code, errno=errno)


class ConnectionRefusedByAgent(AgentError):
    """The agent refused the connection (bad frame, handshake or protocol violation)."""

    default_code = ErrorCode.PROTOCOL_ERROR


class VersionMismatch(ConnectionRefusedByAgent):
    default_code = ErrorCode.VERSION_MISMATCH


class AuthenticationFailed(ConnectionRefusedByAgent):
    default_code = ErrorCode.AUTH_FAILED


class UnknownMethod(AgentError):
    default_code = ErrorCode.UNKNOWN_METHOD


class InvalidParams(AgentError):
    default_code = ErrorCode.INVALID_PARAMS


class Cancelled(AgentError):
    default_code = ErrorCode.CANCELLED


class NotFound(AgentError):
    default_code = ErrorCode.NOT_FOUND


class RemoteOSError(AgentError):
    """An OS call failed in the guest; ``errno`` names it (ENOENT, EACCES, ...)."""

    default_code = ErrorCode.OS_ERROR


class Unsupported(AgentError):
    default_code = ErrorCode.UNSUPPORTED


class LimitExceeded(AgentError):
    default_code = ErrorCode.LIMIT_EXCEEDED


_BY_CODE: dict[str, type[AgentError]] = {
    ErrorCode.PROTOCOL_ERROR: ConnectionRefusedByAgent,
    ErrorCode.FRAME_TOO_LARGE: ConnectionRefusedByAgent,
    ErrorCode.VERSION_MISMATCH: VersionMismatch,
    ErrorCode.AUTH_FAILED: AuthenticationFailed,
    ErrorCode.UNKNOWN_METHOD: UnknownMethod,
    ErrorCode.INVALID_PARAMS: InvalidParams,
    ErrorCode.CANCELLED: Cancelled,
    ErrorCode.NOT_FOUND: NotFound,
    ErrorCode.OS_ERROR: RemoteOSError,
    ErrorCode.UNSUPPORTED: Unsupported,
    ErrorCode.LIMIT_EXCEEDED: LimitExceeded,
}
