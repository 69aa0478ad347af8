"""Capture of accepted uploads: exactly what was accepted, bounded by rate and size, written atomically."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.capture import Capture
from tests.support import FakeClock, encode, photo
from tests.unit.test_api import JPEG, make_app

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton


def kept(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if not p.name.startswith("."))


def test_answered_uploads_are_kept_byte_for_byte_and_refused_ones_never(tmp_path: Path) -> None:
    folder = tmp_path / "capture"
    app = make_app(tmp_path, capture_dir=folder)
    png = encode(photo(300, 200, seed=3), "PNG")
    assert app.predict(JPEG, headers={"X-Request-ID": "req-1"}).status_code == 200
    assert app.predict(png, headers={"X-Request-ID": "req-2"}).status_code == 200
    assert app.predict(b"not an image", headers={"X-Request-ID": "req-3"}).status_code == 400
    app.triton.down = True
    assert app.predict(JPEG, headers={"X-Request-ID": "req-4"}).status_code == 503  # not answered: not kept
    files = kept(folder)
    assert [p.name.split("-", 1)[1] for p in files] == ["req-1.jpg", "req-2.png"]
    assert files[0].read_bytes() == JPEG and files[1].read_bytes() == png
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "no temporary file left"
    app.flask.extensions["shim"].close()


def test_the_rate_bound_skips_and_a_minute_later_keeps_again(tmp_path: Path) -> None:
    clock = FakeClock()
    capture = Capture(tmp_path, per_minute=3, max_bytes=1 << 30, clock=clock)
    assert [capture.offer(JPEG, f"r{i}") for i in range(5)] == [True, True, True, False, False]
    clock.advance(60)
    assert capture.offer(JPEG, "later")
    assert len(kept(tmp_path)) == 4


def test_the_size_bound_drops_the_oldest_first(tmp_path: Path) -> None:
    capture = Capture(tmp_path, per_minute=1000, max_bytes=len(JPEG) * 3, clock=FakeClock())
    for i in range(6):
        capture.offer(JPEG, f"r{i}")
    assert [p.name.split("-", 1)[1] for p in kept(tmp_path)] == ["r3.jpg", "r4.jpg", "r5.jpg"]


def test_a_folder_that_cannot_be_written_never_fails_a_request(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder should be")
    app = make_app(tmp_path, capture_dir=blocker / "capture")
    with caplog.at_level(logging.ERROR, logger="app.capture"):
        assert [app.predict().status_code for _ in range(3)] == [200, 200, 200]
    assert len([r for r in caplog.records if "cannot keep captured uploads" in r.getMessage()]) == 1
    app.flask.extensions["shim"].close()
