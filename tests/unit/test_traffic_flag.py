"""The traffic flag: sticky buckets, the flag file every worker follows, and what a writer may set."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from app.errors import FlagNotWritable, InvalidTraffic
from app.settings import Mode
from app.traffic import TrafficFlag, TrafficState, bucket
from tests.support import ROOT, FakeClock

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

KEYS = [f"user-{i}" for i in range(10_000)]
POLL_S = 0.5


def test_buckets_are_deterministic_across_processes() -> None:
    mine = [bucket(k) for k in KEYS[:50]]
    code = "from app.traffic import bucket; print([bucket(f'user-{i}') for i in range(50)])"
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(other.stdout) == mine  # no per-process hash seed, unlike Python's hash()
    assert all(0 <= b < 100 for b in mine)


def test_bucket_values_are_pinned_across_mmh3_releases() -> None:
    """Which clients are in the canary must not move when mmh3 is upgraded (pyproject.toml bounds it, the
    lock pins it): MurmurHash3 x86_32 as published (its test vectors), and the buckets it gives these keys."""
    import mmh3

    assert mmh3.hash("", seed=0, signed=False) == 0
    assert mmh3.hash("hello", seed=0, signed=False) == 0x248BFA47
    assert mmh3.hash("The quick brown fox jumps over the lazy dog", seed=0, signed=False) == 0x2E4FF723
    keys = {"": 53, "client-1": 90, "client-2": 44, "10.0.0.7": 12, "user@example.com": 37,
            "tenant-42:user-7": 65, "\u00fcn\u00efc\u00f6d\u00e9": 33}
    assert {key: bucket(key) for key in keys} == keys


def test_ten_percent_of_ten_thousand_keys_is_ten_percent_and_raising_it_only_adds_keys() -> None:
    at_10 = {k for k in KEYS if bucket(k) < 10}
    at_30 = {k for k in KEYS if bucket(k) < 30}
    assert 8.5 <= len(at_10) / len(KEYS) * 100 <= 11.5, len(at_10)
    assert 28.5 <= len(at_30) / len(KEYS) * 100 <= 31.5, len(at_30)
    assert at_10 <= at_30, "raising the share moved a key away from Triton"


def test_flag_file_switches_keeps_the_last_good_state_and_falls_back_to_settings(tmp_path: Path) -> None:
    path, clock = tmp_path / "traffic.json", FakeClock()
    flag = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=POLL_S, clock=clock)
    assert (flag.current().mode, flag.current().source) == (Mode.TRITON, "env")

    state = flag.write({"mode": "canary", "canary_percent": 25, "reason": "ramp"}, updated_by="shim-traffic")
    assert (state.mode, state.canary_percent, state.source, state.updated_by) == (Mode.CANARY, 25, "flag-file",
                                                                                  "shim-traffic")
    other_worker = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=POLL_S, clock=clock)
    assert other_worker.current() == state

    path.write_text("{not json")
    assert other_worker.current() == state, "within the poll interval the file is not read again"
    clock.advance(POLL_S)
    assert other_worker.current() == state, "a broken file must not change the mode"
    assert "ignored, last good state kept" in (other_worker.error or "")

    path.write_text(json.dumps({"mode": "legacy"}))
    clock.advance(POLL_S)
    assert other_worker.current().mode is Mode.LEGACY and other_worker.error is None

    path.unlink()
    clock.advance(POLL_S)
    assert other_worker.current().mode is Mode.TRITON and other_worker.current().source == "env"


@pytest.mark.parametrize("bad", [{"mode": "purple"}, {"canary_percent": 101}, {"canary_percent": "10"},
                                 {"shadow_percent": True}, {"colour": "red"}, {"mode": ["triton"]},
                                 {"reason": 5}, {"reason": "x" * 501}])
def test_invalid_updates_are_refused_with_a_reason(tmp_path: Path, bad: dict) -> None:
    flag = TrafficFlag(tmp_path / "t.json", TrafficState(mode=Mode.TRITON), poll_s=POLL_S)
    with pytest.raises(InvalidTraffic):
        flag.write(bad, updated_by="test")
    assert not (tmp_path / "t.json").exists()


@pytest.mark.parametrize("field", ["updated_by", "updated_at", "source"])
def test_a_writer_cannot_say_who_when_or_where_a_change_came_from(tmp_path: Path, field: str) -> None:
    flag = TrafficFlag(tmp_path / "t.json", TrafficState(mode=Mode.TRITON), poll_s=POLL_S)
    with pytest.raises(InvalidTraffic, match=f"unknown fields '{field}'"):
        flag.write({"mode": "legacy", field: "auto-rollback"}, updated_by="shim-traffic")
    assert not (tmp_path / "t.json").exists()
    state = flag.write({"mode": "legacy"}, updated_by="shim-traffic")
    assert state.updated_by == "shim-traffic" and state.updated_at.startswith("20")


def test_a_flag_file_written_by_hand_keeps_its_audit_fields_within_bounds(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"mode": "legacy", "updated_by": "alice", "updated_at": "yesterday"}))
    flag = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=POLL_S)
    assert (flag.current().updated_by, flag.current().updated_at) == ("alice", "yesterday")
    path.write_text(json.dumps({"mode": "canary", "updated_by": "x" * 5_000_000}))
    clock = FakeClock()
    huge = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=POLL_S, clock=clock)
    assert huge.current().mode is Mode.TRITON and "5,000,000 characters" in (huge.error or "")


def test_a_configmap_style_flag_is_followed_and_a_read_only_one_is_refused_with_a_reason(tmp_path: Path) -> None:
    """Kubernetes mounts a ConfigMap as symlinks into a timestamped folder and swaps `..data` to update it."""
    mount, clock = tmp_path / "traffic", FakeClock()
    mount.mkdir()

    def publish(version: str, body: dict) -> None:
        folder = mount / f"..{version}"
        folder.mkdir()
        (folder / "traffic.json").write_text(json.dumps(body))
        (mount / "..data_tmp").symlink_to(folder.name)
        (mount / "..data_tmp").rename(mount / "..data")  # atomic, as kubelet's AtomicWriter does

    publish("2026_01", {"mode": "triton"})
    (mount / "traffic.json").symlink_to("..data/traffic.json")
    flag = TrafficFlag(mount / "traffic.json", TrafficState(mode=Mode.LEGACY), poll_s=POLL_S, clock=clock)
    assert flag.current().mode is Mode.TRITON
    publish("2026_02", {"mode": "canary", "canary_percent": 5})
    clock.advance(POLL_S)
    assert (flag.current().mode, flag.current().canary_percent) == (Mode.CANARY, 5)

    read_only = TrafficFlag(Path("/proc/flask-triton-shim/traffic.json"), TrafficState(mode=Mode.LEGACY),
                            poll_s=POLL_S)  # /proc refuses new files even to root, as a ConfigMap mount does
    with pytest.raises(FlagNotWritable, match="change the ConfigMap instead"):
        read_only.write({"mode": "triton"}, updated_by="shim-traffic")
    assert read_only.current().mode is Mode.LEGACY


def test_a_flag_path_through_a_regular_file_keeps_the_settings_and_says_why(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where a folder should be")
    flag = TrafficFlag(blocker / "traffic.json", TrafficState(mode=Mode.CANARY, canary_percent=5), poll_s=POLL_S)
    assert (flag.current().mode, flag.current().source) == (Mode.CANARY, "env")  # start-up goes on
    assert "cannot be read" in (flag.error or "") and "settings' mode is in force" in (flag.error or "")
