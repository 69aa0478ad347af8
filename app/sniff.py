"""The encoded transport's choice, per upload, from its header alone: forward the bytes, or decode them here.

Triton's `<model>_decode` step takes a JPEG whose pixels are RGB (YCbCr) or grayscale, baseline or progressive,
any chroma subsampling: the kinds that nvJPEG and libjpeg-turbo decode to what Pillow's convert("RGB") gives.
Anything else goes through today's CPU path in the shim, which also gives the contract's 400 / 413 answers,
exactly as before, for every upload it refuses. The reasons (the metric shim_encoded_cpu_path_total{reason},
whose labels app.metrics.ENCODED_REASONS lists):

    format       not a JPEG (PNG, WebP, GIF, BMP, TIFF, an MPO camera file ...): Pillow decodes it here
    jpeg_mode    a JPEG whose pixels are not RGB or grayscale (CMYK or YCCK: Pillow's own CMYK -> RGB rule)
    limits       over SHIM_MAX_IMAGE_PIXELS, or so elongated that the resize would be or that max_size leaves no
                 pixel across (the 413 comes from the CPU path)
    unreadable   empty, or a header Pillow refuses (the 400, or 413 for a bomb, comes from the CPU path)
    incomplete   a JPEG whose stream does not run through a scan to its EOI marker (cut short, EOI removed, no
                 scan): a GPU decoder (nvJPEG, the hardware decoder) fills in some that Pillow refuses, so the
                 shim answers them as the legacy app does (400 "image file is truncated", or 200 where Pillow reads
                 it); never counted as Triton's failure
    decoder_refused  Triton's decoder refused an upload sent to it (counted by app/service.py)

Reading the header costs about 20 us (Image.open reads the markers up to the first scan; nothing is decoded);
the completeness check walks the same markers and looks for EOI after the first scan (a bytes.rfind).
"""

from __future__ import annotations

import io
import struct

from PIL import Image, UnidentifiedImageError

from app.preprocess import ImageSpec, resized_size

FORMATS = frozenset({"JPEG"})
MODES = frozenset({"RGB", "L"})


def cpu_reason(data: bytes, spec: ImageSpec) -> str | None:
    """None when Triton can decode the upload as it came; otherwise why the shim decodes it itself."""
    if not data:
        return "unreadable"
    try:
        with Image.open(io.BytesIO(data)) as image:  # the header only
            kind, mode, (width, height) = image.format, image.mode, image.size
    except (UnidentifiedImageError, Image.DecompressionBombError, Image.DecompressionBombWarning, OSError,
            ValueError, SyntaxError, EOFError, struct.error):
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
