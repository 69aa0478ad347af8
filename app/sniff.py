"""The encoded transport's choice, per upload, from its header alone: forward the bytes, or decode them here.

Only complete RGB or grayscale JPEGs with no unknown marker go to Triton's decode step (what nvJPEG and
libjpeg-turbo decode as Pillow does); the rest takes the shim's CPU path and its 400 / 413, each reason a label of
shim_encoded_cpu_path_total (docs/transports.md). The markers up to the first scan are read, and the scans' 0xFF
bytes: nothing is decoded.
"""

from __future__ import annotations

import numpy as np

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
    start = scan_start(data)
    end = data.rfind(EOI, start) if start is not None else -1
    if start is None or end < start:
        return "incomplete"
    if unknown_marker(data, start, end):
        return "corrupt"
    if not width or not height:
        return "limits"
    new_w, new_h = resized_size(width, height, spec.resize, spec.max_size)  # app.preprocess.crop's refusals
    if width * height > spec.max_pixels or new_w * new_h > spec.max_pixels or new_w < 1 or new_h < 1:
        return "limits"
    return None


SOI, EOI, SOS = b"\xff\xd8", b"\xff\xd9", 0xDA
STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})  # TEM and RSTn carry no length
# What libjpeg stops at with an error after 0xFF once a file's first scan has begun: a code of no marker (its
# read_markers' default case, JERR_UNKNOWN_MARKER), a second SOF or SOI (JERR_SOF_DUPLICATE, JERR_SOI_DUPLICATE).
# Pillow refuses each of these uploads (400), baseline or progressive; nvImageCodec's CPU decoder decodes around them.
SOF_CODES = [*range(0xC0, 0xC4), *range(0xC5, 0xCC), *range(0xCD, 0xD0)]  # 0xC4 is DHT, 0xCC is DAC
_UNKNOWN_AFTER_FF = np.zeros(256, dtype=bool)
_UNKNOWN_AFTER_FF[[*range(0x02, 0xC0), *SOF_CODES, 0xD8, 0xDE, 0xDF, *range(0xF0, 0xFE)]] = True


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


def unknown_marker(data: bytes, start: int, end: int) -> bool:
    """A byte after 0xFF in data[start:end] (the scans, up to the last EOI) that libjpeg stops at with an error
    (_UNKNOWN_AFTER_FF): Pillow refuses the upload, while nvImageCodec's CPU decoder decodes around it (7 of 150
    photos with 8 bytes changed in the scan). A valid scan stuffs every 0xFF with 0x00, so a valid JPEG has none;
    a table or comment between a progressive JPEG's scans might, and takes the CPU path, which answers as the
    legacy app does anyway."""
    scan = np.frombuffer(data, dtype=np.uint8, count=end - start, offset=start)
    return bool(_UNKNOWN_AFTER_FF[scan[1:][scan[:-1] == 0xFF]].any())
