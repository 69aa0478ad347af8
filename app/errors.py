"""Every exception of the shim, in one tree. Each states its HTTP status and contract code; app/api.py
translates them into the contract's error body at the edge, and nowhere else. SettingsError and TrafficError are
not HTTP: start-up stops with the first's message; shim-traffic (or a worker's log) says the second's.
"""

from __future__ import annotations


class ShimError(Exception):
    status: int = 500
    code: str = "internal_error"
    default_message: str = "internal error"
    quiet: bool = False  # expected under load and counted in a metric: logged at INFO, not WARNING

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.default_message)

    @property
    def message(self) -> str:
        return str(self.args[0])

    def headers(self) -> dict[str, str]:
        """HTTP headers the answer carries besides the body."""
        return {}


class InvalidRequest(ShimError):
    status = 400
    code = "bad_request"
    default_message = "the request is not valid"


class MissingImage(InvalidRequest):
    code = "missing_image"
    default_message = "no image: send the file as multipart/form-data field 'image'"


class EmptyImage(InvalidRequest):
    code = "empty_image"
    default_message = "the uploaded image is empty"


class InvalidImage(InvalidRequest):
    code = "invalid_image"
    default_message = "the uploaded file is not a readable image"


class BrokenBody(InvalidRequest):
    code = "invalid_body"
    default_message = "the request body is incomplete or its chunked encoding is broken"


class TooLarge(ShimError):
    status = 413
    code = "too_large"
    default_message = "the upload is too large"


class Overloaded(ShimError):
    status = 503
    code = "overloaded"
    default_message = "the service is at capacity; retry later"
    quiet = True

    def __init__(self, message: str | None = None, *, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class BackendError(ShimError):
    status = 502
    code = "backend_error"
    default_message = "the inference backend failed"

    def __init__(self, message: str | None = None, *, backend: str = "none") -> None:
        super().__init__(message)
        self.backend = backend  # which backend failed: the request's metrics and logs name it

    def copy(self) -> BackendError:
        """The same error as a new object: each request of a failed batch raises its own."""
        twin = type(self)(self.message, backend=self.backend)
        twin.__cause__ = self.__cause__ or self
        return twin


class BackendUnavailable(BackendError):
    status = 503
    code = "backend_unavailable"
    default_message = "the inference backend is unavailable"


class CircuitOpen(BackendUnavailable):
    default_message = "the backend is failing: its circuit is open"


class ModelMismatch(BackendUnavailable):
    default_message = "Triton serves a model that does not take what the shim sends"


class BackendTimeout(BackendError):
    status = 504
    code = "backend_timeout"
    default_message = "the inference backend did not answer in time"


class SettingsError(ValueError):
    """A bad SHIM_* value: the message names the variable, what it got and what it allows."""


class TrafficError(Exception):
    """A traffic change refused (shim-traffic, the automatic rollback, a flag file): never an HTTP answer."""

    @property
    def message(self) -> str:
        return str(self)


class InvalidTraffic(TrafficError):
    pass


class FlagNotWritable(TrafficError):
    pass


class LegacyUnavailable(TrafficError):
    pass
