"""What the shim reads of a request body, and how it refuses one. No Flask here: WSGI environ only.

A body declared over the limit is refused before a byte is read; a broken one raises BrokenBody (400) wherever it
is read; a small body left unread is drained after the answer, so that keep-alive survives (a large or broken one
is left, and the server closes the connection).
"""

from __future__ import annotations

from typing import Any

from app.errors import BrokenBody, ShimError, TooLarge

BROKEN = "shim.body_broken"  # environ key: the body failed to read; nothing more may be read from it


class GuardedInput:
    """Wraps wsgi.input: any error of the server's reader becomes BrokenBody, once and for all."""

    def __init__(self, raw: Any, environ: dict[str, Any]) -> None:
        self._raw = raw
        self._environ = environ

    def read(self, size: int = -1) -> bytes:
        return self._guard(self._raw.read, size)

    def readline(self, size: int = -1) -> bytes:
        return self._guard(self._raw.readline, size)

    def __iter__(self) -> GuardedInput:
        return self

    def __next__(self) -> bytes:
        line = self.readline()
        if not line:
            raise StopIteration
        return line

    def _guard(self, read: Any, size: int) -> bytes:
        if self._environ.get(BROKEN):
            raise BrokenBody()
        try:
            data: bytes = read(size)
            return data
        except ShimError:
            raise
        except Exception as e:  # the server's reader: IOError, gunicorn's ParseException subclasses, ...
            self._environ[BROKEN] = True
            raise BrokenBody(f"the request body could not be read: {type(e).__name__}"
                             f"{f': {e}' if str(e) else ''}") from e


def guard(environ: dict[str, Any], limit: int) -> None:
    """Refuse a declared oversize body before reading it; make every later read translate errors."""
    declared = environ.get("CONTENT_LENGTH") or ""
    if declared.isdigit() and int(declared) > limit:
        environ[BROKEN] = True  # never read it: the server closes the connection after the answer
        raise TooLarge(f"the upload is too large: {int(declared):,} bytes declared, the limit is {limit:,} bytes")
    raw = environ.get("wsgi.input")
    if raw is not None and not isinstance(raw, GuardedInput):
        environ["wsgi.input"] = GuardedInput(raw, environ)


def drain(environ: dict[str, Any], limit: int) -> None:
    """Read and drop what is left of a body of at most `limit` bytes; leave anything else to the server."""
    declared = environ.get("CONTENT_LENGTH") or ""
    if environ.get(BROKEN) or not declared.isdigit() or int(declared) > limit:
        return  # broken, chunked (size unknown) or too large: the connection closes instead
    stream = environ.get("wsgi.input")
    remaining = int(declared)
    try:
        while stream is not None and remaining > 0:
            chunk = stream.read(min(remaining, 1 << 20))
            if not chunk:
                break
            remaining -= len(chunk)
    except ShimError:
        return  # broken on the way: the server closes the connection
