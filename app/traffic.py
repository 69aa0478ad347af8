"""The traffic flag: which mode is in force, shared by every gunicorn worker through one JSON file.

`shim-traffic set MODE ...` (main() below) or the mounted ConfigMap changes it; each worker re-reads it at most
every POLL_S. Writers lock `<flag file>.lock`, re-read, apply their change and replace the file atomically, so no
writer undoes another's; a file that does not parse or cannot be served is ignored (the last good state stays).
Canary assignment is sticky: MurmurHash3 of the targeting key into buckets 0-99 (docs/traffic.md).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mmh3

from app import metrics
from app.errors import FlagNotWritable, InvalidTraffic, LegacyUnavailable, SettingsError, TrafficError
from app.settings import MODES_USING_LEGACY, Mode

log = logging.getLogger(__name__)
CANARY_GROUP = "flask-triton-shim"  # hashed with the key: another rollout with other keys gets other buckets
CHANGES = ("mode", "canary_percent", "shadow_percent", "reason")  # what a writer may ask for
AUDIT = ("updated_by", "updated_at", "revision")  # the writer's to fill in, never asked for
MAX_TEXT = 500  # characters of a reason or an audit field kept
POLL_S = 0.5  # how stale a worker's view of the flag file may be
LOCK_WAIT_S = 5.0  # the longest a writer waits for another's lock (writers hold it for milliseconds)
Clock = Callable[[], float]
Lacks = Callable[[], str | None]  # what the legacy backend lacks here (torch, its model file), or None


def bucket(key: str) -> int:
    """The client's fixed bucket, 0-99."""
    return int(mmh3.hash(f"{CANARY_GROUP}:{key}", seed=0, signed=False)) % 100


def _now_utc() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True, kw_only=True)
class TrafficState:
    mode: Mode
    canary_percent: int = 0
    shadow_percent: int = 100
    source: str = "env"  # env (SHIM_MODE) or flag-file
    updated_by: str = ""  # shim-traffic (with the user), auto-rollback, or whoever wrote the file
    updated_at: str = ""
    reason: str = ""
    revision: int = 0  # one more for each write by the shim; 0 before the first

    def with_changes(self, changes: dict[str, Any], *, updated_by: str) -> TrafficState:
        """A new state from a partial update (CHANGES only) by `updated_by` (shim-traffic, the rollback)."""
        unknown = sorted(set(changes) - set(CHANGES))
        if unknown:
            raise InvalidTraffic(f"unknown fields {', '.join(repr(u[:40]) for u in unknown[:10])}: a traffic "
                                 f"update may set only {', '.join(CHANGES)}")
        return self._validated(changes, updated_by=updated_by, updated_at=_now_utc())

    def from_file(self, data: dict[str, Any]) -> TrafficState:
        """The state a flag file holds, on top of this (the settings'): its audit fields are kept, bounded."""
        unknown = sorted(set(data) - set(CHANGES) - set(AUDIT) - {"source"})
        if unknown:
            raise InvalidTraffic(f"unknown fields {', '.join(repr(u[:40]) for u in unknown[:10])}")
        changes = {k: v for k, v in data.items() if k in CHANGES}
        revision = data.get("revision", 0)
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 0:
            raise InvalidTraffic(f"revision must be a whole number >= 0, not {str(revision)[:40]!r}")
        state = self._validated(changes, updated_by=_text(data, "updated_by", "file"),
                                updated_at=_text(data, "updated_at", ""))
        return replace(state, revision=revision)

    def _validated(self, changes: dict[str, Any], *, updated_by: str, updated_at: str) -> TrafficState:
        try:
            mode = Mode(changes.get("mode", self.mode))
        except (ValueError, TypeError):
            raise InvalidTraffic(f"mode {str(changes.get('mode'))[:40]!r} is not one of {', '.join(Mode)}") from None
        canary, shadow = (self._percent(changes, name) for name in ("canary_percent", "shadow_percent"))
        return replace(self, mode=mode, canary_percent=canary, shadow_percent=shadow,
                       reason=_text(changes, "reason", ""), updated_by=updated_by[:MAX_TEXT],
                       updated_at=updated_at[:MAX_TEXT])

    def _percent(self, changes: dict[str, Any], name: str) -> int:
        value = changes.get(name, getattr(self, name))
        if isinstance(value, float) and value.is_integer():
            value = int(value)  # 62.0 is the same JSON number as 62 (an integer to JSON Schema too)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
            raise InvalidTraffic(f"{name} must be a whole number from 0 to 100, not {str(value)[:40]!r}")
        return value

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode.value}


def _text(data: dict[str, Any], name: str, default: str) -> str:
    value = data.get(name, default)
    if not isinstance(value, str):
        raise InvalidTraffic(f"{name} must be a string")
    if len(value) > MAX_TEXT:
        raise InvalidTraffic(f"{name} is {len(value):,} characters long; the limit is {MAX_TEXT}")
    return value


class TrafficFlag:
    def __init__(self, path: Path | None, default: TrafficState, poll_s: float = POLL_S,
                 clock: Clock = time.monotonic, legacy_lacks: Lacks = lambda: None) -> None:
        self.path = path
        self._clock = clock
        self._legacy_lacks = legacy_lacks
        self._default = default
        self._poll_s = poll_s
        self._state = default
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime) of the file last read
        self._checked = 0.0
        self._error: str | None = None
        self._lock = threading.Lock()
        self.on_change: Callable[[TrafficState], None] = lambda state: None  # this worker's state changed
        self._publish(default)

    @property
    def error(self) -> str | None:
        return self._error

    def current(self) -> TrafficState:
        now = self._clock()
        if self.path is None or now - self._checked < self._poll_s:
            return self._state
        with self._lock:
            if now - self._checked >= self._poll_s:
                self._checked = now
                self._reload()
        return self._state

    def write(self, changes: dict[str, Any], *, updated_by: str) -> TrafficState:
        """A partial update for every worker, on the latest file under the writers' lock; used here at once."""
        if self.path is None:
            raise FlagNotWritable("run-time switching is off: there is no flag file (set SHIM_FLAG_FILE; "
                                  "app/gunicorn_conf.py makes one per run)")
        path = self.path
        try:
            with self._writers_lock(path):
                latest = self._latest()
                state = latest.with_changes(changes, updated_by=updated_by)
                state = replace(state, revision=latest.revision + 1, source="flag-file")
                self._check_backends(state)
                body = {k: v for k, v in state.to_json().items() if k != "source"}
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
                with os.fdopen(fd, "w") as handle:
                    json.dump(body, handle, indent=2)
                os.replace(tmp, path)
        except OSError as e:  # e.g. a ConfigMap mount: read-only by design
            raise FlagNotWritable(f"cannot write the flag file {path} ({e.strerror}); if it is mounted from "
                                  "a Kubernetes ConfigMap, change the ConfigMap instead (docs/settings.md)") from e
        with self._lock:
            self._checked = self._clock()
            self._reload()
        return state

    @staticmethod
    @contextlib.contextmanager
    def _writers_lock(path: Path) -> Iterator[None]:
        """An exclusive lock shared by every process that writes `path`, on the file `<path>.lock` beside it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            deadline = time.monotonic() + LOCK_WAIT_S
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise FlagNotWritable(f"another writer has held the lock on {path} for "
                                              f"{LOCK_WAIT_S:g} s; try again") from None
                    time.sleep(0.005)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _latest(self) -> TrafficState:
        """The state the file holds now (not this worker's copy, which may be a poll interval old)."""
        try:
            return self._read_file()
        except FileNotFoundError:
            return self._default
        except (OSError, ValueError, InvalidTraffic) as e:
            log.warning("flag file %s cannot be used (%s): the change applies to the last good state", self.path, e)
            return self._state

    def _read_file(self) -> TrafficState:
        """The flag file's state, validated (raises what reading, parsing or validating it raises)."""
        assert self.path is not None
        data = json.loads(self.path.read_text())
        if not isinstance(data, dict):
            raise InvalidTraffic("the flag file must hold a JSON object")
        return self._default.from_file(data)

    def _check_backends(self, state: TrafficState) -> None:
        """A mode that needs the legacy backend is refused where it cannot run (the image without torch)."""
        if state.mode in MODES_USING_LEGACY:
            lacks = self._legacy_lacks()
            if lacks:
                raise LegacyUnavailable(f"mode {state.mode.value} needs the legacy backend, which cannot run here: "
                                        f"{lacks}; stay in triton mode, or use an image built with "
                                        "WITH_LEGACY=1")

    def _reload(self) -> None:
        try:
            info = self.path.stat() if self.path else None
        except FileNotFoundError:
            info = None
        except OSError as e:  # e.g. a path through a regular file: the settings stay in force, and say why
            if self._error is None:
                log.error("flag file %s cannot be read (%s): the settings' mode stays in force", self.path, e)
            self._error = f"flag file {self.path} cannot be read ({e.strerror}); the settings' mode is in force"
            return
        if info is None:
            if self._seen is not None:  # the file was removed: back to the settings
                self._seen, self._error = None, None
                self._set(self._default)
            return
        key = (info.st_ino, info.st_size, info.st_mtime_ns)
        if key == self._seen:
            return
        self._seen = key
        try:
            state = self._read_file()
            self._check_backends(state)
        except (OSError, ValueError, InvalidTraffic, LegacyUnavailable) as e:
            self._error = f"flag file {self.path} ignored, last good state kept: {e}"
            log.error("%s", self._error)
            return
        self._error = None
        self._set(replace(state, source="flag-file"))

    def _set(self, state: TrafficState) -> None:
        if state != self._state:
            log.info("traffic mode %s (canary %d%%, shadow %d%%) from %s%s", state.mode.value, state.canary_percent,
                     state.shadow_percent, state.source, f": {state.reason}" if state.reason else "",
                     extra={"traffic": state.to_json()})
        changed, self._state = state != self._state, state
        self._publish(state)
        if changed:
            self.on_change(state)

    @staticmethod
    def _publish(state: TrafficState) -> None:
        for mode in Mode:
            for source in ("env", "flag-file"):
                metrics.TRAFFIC_MODE.labels(mode.value, source).set(
                    1 if (mode, source) == (state.mode, state.source) else 0)
        metrics.CANARY_PERCENT.set(state.canary_percent)


def main(argv: list[str] | None = None) -> int:
    """shim-traffic show | set MODE [--canary-percent N] [--shadow-percent N] [--reason TEXT]: the flag file
    (SHIM_FLAG_FILE, or --flag-file) every worker of the shim watches, read or changed under the writers' lock."""
    from app.capabilities import legacy_lacks
    from app.description import resolve
    from app.settings import Settings

    parser = argparse.ArgumentParser(prog="shim-traffic", description="Show or change where /predict traffic goes, "
                                     "for every worker, within half a second, without a restart.")
    parser.add_argument("--flag-file", type=Path, help="the flag file (default: $SHIM_FLAG_FILE)")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("show", help="print the flag file's state as JSON")
    change = commands.add_parser("set", help="change the mode (and shares) for every worker")
    change.add_argument("mode", choices=[m.value for m in Mode])
    change.add_argument("--canary-percent", type=int, help="share of clients (sticky) Triton answers in canary mode")
    change.add_argument("--shadow-percent", type=int, help="share of requests also sent to Triton in shadow mode")
    change.add_argument("--reason", default="", help="why, kept in the file and the shim's log")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        path = args.flag_file or settings.flag_file
        if path is None:
            raise SettingsError("no flag file: set SHIM_FLAG_FILE (as the shim has it) or pass --flag-file")
        served = resolve(settings)
        flag = TrafficFlag(path, TrafficState(mode=settings.mode), poll_s=0.0,
                           legacy_lacks=lambda: legacy_lacks(served.legacy_model_path))
        if args.command == "show":
            state = flag.current()
        else:
            changes: dict[str, Any] = {"mode": args.mode, "reason": args.reason}
            changes |= {k: v for k, v in (("canary_percent", args.canary_percent),
                                          ("shadow_percent", args.shadow_percent)) if v is not None}
            user = os.environ.get("USER") or os.environ.get("LOGNAME") or str(os.getuid())
            state = flag.write(changes, updated_by=f"shim-traffic ({user})")
    except (SettingsError, TrafficError) as e:
        sys.stderr.write(f"shim-traffic: {e}\n")
        return 2
    print(json.dumps(state.to_json(), indent=2))
    return 0
