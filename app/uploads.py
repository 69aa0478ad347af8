"""The uploaded image out of a multipart/form-data body: a fast path, and werkzeug for everything odd.

werkzeug's pure-Python parser holds the GIL about a millisecond on a 120 KB photo, more than the hop to Triton;
a well-formed body is cut with bytes.find instead, and anything else goes to werkzeug, so the answers stay its own.
No Flask here: bytes and a content type in, bytes out.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

from werkzeug.formparser import FormDataParser
from werkzeug.http import parse_options_header

from app.errors import MissingImage, TooLarge

_PLAIN_ENCODINGS = {"", "binary", "8bit", "7bit"}


class _Unusual(Exception):
    """The fast path cannot tell: let werkzeug decide."""


def image_from_form(body: bytes, content_type: str, field: str, *, max_parts: int, max_field_bytes: int) -> bytes:
    """The bytes of the first file part named `field`; MissingImage when there is none."""
    mimetype, options = parse_options_header(content_type)
    if mimetype != "multipart/form-data" or not options.get("boundary"):
        raise MissingImage()
    try:
        found = _fast(body, options["boundary"].encode("latin-1"), field, max_parts, max_field_bytes)
    except (_Unusual, UnicodeError):
        found = _werkzeug(body, content_type, field, max_parts, max_field_bytes)
    if found is None:
        raise MissingImage()
    return found


def _parts(body: bytes, boundary: bytes) -> Iterator[tuple[bytes, int, int]]:
    """(headers, start, end) of each part of a well-formed body; _Unusual for anything else."""
    delimiter = b"--" + boundary
    position = body.find(delimiter)
    if position < 0 or (position > 0 and body[position - 2:position] != b"\r\n"):
        raise _Unusual()
    while True:
        after = position + len(delimiter)
        if body[after:after + 2] == b"--":
            return  # the closing delimiter; what follows is the epilogue
        if body[after:after + 2] != b"\r\n":
            raise _Unusual()
        headers_end = body.find(b"\r\n\r\n", after + 2)
        end = _next_delimiter(body, delimiter, after + 2)
        if headers_end < 0 or end < headers_end + 4:
            raise _Unusual()  # headers that do not end before the next delimiter, or an unterminated part
        yield body[after + 2:headers_end], headers_end + 4, end
        position = end + 2


def _next_delimiter(body: bytes, delimiter: bytes, start: int) -> int:
    """Where the next CRLF + delimiter begins at or after `start` (-1: none). werkzeug also ends a part at a
    delimiter after a lone LF or CR: there, _Unusual (fuzzing found bodies cut otherwise). One scan of the part."""
    at = body.find(delimiter, start)
    while at >= 0:
        before = body[at - 2:at]
        if before == b"\r\n":
            return at - 2
        if before[-1:] in (b"\n", b"\r"):
            raise _Unusual()
        at = body.find(delimiter, at + 1)  # the delimiter's text inside a line: data, for werkzeug too
    return -1


def _fast(body: bytes, boundary: bytes, field: str, max_parts: int, max_field_bytes: int) -> bytes | None:
    """Every part is checked before one is returned: werkzeug keeps no part of a body that breaks later."""
    found = None
    for count, (raw, start, end) in enumerate(_parts(body, boundary), start=1):
        if count > max_parts:
            raise TooLarge(f"the form is too large: more than {max_parts:,} form parts")
        headers = _headers(raw)
        if headers.get("content-transfer-encoding", "").strip().lower() not in _PLAIN_ENCODINGS:
            raise _Unusual()
        disposition, params = parse_options_header(headers.get("content-disposition", ""))
        if disposition != "form-data":
            raise _Unusual()
        if "filename" not in params:
            if end - start > max_field_bytes:
                raise TooLarge(f"the form is too large: a field that is not a file is over {max_field_bytes:,} bytes")
        elif found is None and params.get("name") == field:
            found = body[start:end]
    return found


def _headers(raw: bytes) -> dict[str, str]:
    headers = {}
    for line in raw.decode("utf-8").split("\r\n"):
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip() or "\r" in line or "\n" in line:
            raise _Unusual()  # werkzeug breaks lines at a lone CR or LF too
        headers[name.lower()] = value.strip()
    return headers


def _in_memory(*args: object, **kwargs: object) -> io.BytesIO:
    return io.BytesIO()


def _werkzeug(body: bytes, content_type: str, field: str, max_parts: int, max_field_bytes: int) -> bytes | None:
    # The body is in memory already (within the upload limit): its parts may be too, and a part of a body
    # that turns out broken is then not a temporary file left open.
    parser = FormDataParser(stream_factory=_in_memory, max_form_memory_size=max_field_bytes,
                            max_form_parts=max_parts, silent=True)
    mimetype, options = parse_options_header(content_type)
    _, _, files = parser.parse(io.BytesIO(body), mimetype, len(body), options)
    upload = files.get(field)
    if upload is None:
        return None
    try:
        data: bytes = upload.read()
        return data
    finally:
        for _, item in files.items(multi=True):  # every part spooled to a file, duplicates included
            item.close()

