"""The encoded transport's choice, per upload, from its header alone: forward the bytes, or decode them here.

Only complete RGB or grayscale JPEGs go to Triton's decode step (what nvJPEG and libjpeg-turbo decode as Pillow
does); the rest takes the shim's CPU path and its 400 / 413, each reason a label of shim_encoded_cpu_path_total
(docs/transports.md). About 20 us: the markers up to the first scan are read, nothing is decoded.
"""

from __future__ import annotations

from app.preprocess import ImageSpec, open_upload, resized_size

FORMATS = frozenset({"JPEG"})
MODES = frozenset({"RGB", "L"})


def cpu_reason(data: bytes, spec: ImageSpec) -> str | None:
    """None when Triton can decode the upload as it came; otherwise why the shim decodes it itself."""
    if not data:
        return "unreadable"
    try:
        with open_upload(data) as image:  # the header only
            kind, mode, (width, height) = image.format, image.mode, image.size
    except MemoryError:
        raise
    except Exception:  # any parser's failure (app.preprocess.decode): the CPU path gives its 400
        return "unreadable"
    if kind not in FORMATS:
        return "format"
    if mode not in MODES:
        return "jpeg_mode"
    if not complete_jpeg(data):
        return "incomplete"
    if not width or not height:
        return "limits"
    new_w, new_h = resized_size(width, height, spec.resize, spec.max_size)  # app.preprocess.crop's refusals
    if width * height > spec.max_pixels or new_w * new_h > spec.max_pixels or new_w < 1 or new_h < 1:
        return "limits"
    return None


SOI, EOI, SOS = b"\xff\xd8", b"\xff\xd9", 0xDA
STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM and RSTn carry no length


def scan_start(data: bytes) -> int | None:
    """Where the first scan's entropy-coded data begins, walking the marker segments from SOI; None when the
    stream ends (or hits EOI) before a scan: a JPEG with no image data."""
    if not data.startswith(SOI):
        return None
    at = 2
    while at + 4 <= len(data):
        if data[at] != 0xFF:
            return None
        marker = data[at + 1]
        if marker == 0xFF:  # fill bytes before a marker
            at += 1
            continue
        if marker in STANDALONE:
            at += 2
            continue
        if marker == EOI[1]:
            return None
        length = int.from_bytes(data[at + 2:at + 4], "big")
        if length < 2:
            return None
        at += 2 + length
        if marker == SOS:
            return at if at <= len(data) else None
    return None


def complete_jpeg(data: bytes) -> bool:
    """A scan, and an EOI marker after it (bytes after EOI are allowed: Pillow ignores them; an EXIF thumbnail's
    own EOI, before the scan, does not count). A cheap scan of the header and the tail, not a decode."""
    start = scan_start(data)
    return start is not None and data.rfind(EOI, start) >= start
