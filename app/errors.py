"""The shim's exceptions. Each states its HTTP status and contract code; app/api.py translates them.

    ShimError (500 internal_error)
    ├── InvalidRequest (400)            the client sent something the contract refuses
    │   ├── MissingImage                no multipart field `image`
    │   ├── EmptyImage                  the file is empty
    │   └── InvalidImage                not a decodable image
    ├── Unauthorized (401)              admin API without a bearer token
    ├── Forbidden (403)                 admin API with a wrong token, or switched off
    ├── TooLarge (413)                  upload bytes or image pixels over the limits
    └── BackendError (502)              a backend failed to answer
        ├── BackendUnavailable (503)    unreachable, not ready, circuit open
        └── BackendTimeout (504)        no answer within the timeout
"""

from __future__ import annotations


class ShimError(Exception):
    status: int = 500
    code: str = "internal_error"
    default_message: str = "internal error"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.default_message)

    @property
    def message(self) -> str:
        return str(self.args[0])


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


class Unauthorized(ShimError):
    status = 401
    code = "unauthorized"
    default_message = "this endpoint needs 'Authorization: Bearer <SHIM_ADMIN_TOKEN>'"


class Forbidden(ShimError):
    status = 403
    code = "forbidden"
    default_message = "the token is not valid"


class TooLarge(ShimError):
    status = 413
    code = "too_large"
    default_message = "the upload is too large"


class BackendError(ShimError):
    status = 502
    code = "backend_error"
    default_message = "the inference backend failed"


class BackendUnavailable(BackendError):
    status = 503
    code = "backend_unavailable"
    default_message = "the inference backend is unavailable"


class BackendTimeout(BackendError):
    status = 504
    code = "backend_timeout"
    default_message = "the inference backend did not answer in time"
