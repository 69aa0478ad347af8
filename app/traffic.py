"""The traffic flag: which mode is in force, shared by every gunicorn worker through one JSON file.

Each worker re-reads the file when it changes (checked at most every SHIM_FLAG_POLL_S on the request
path), so a switch reaches every worker within that bound, without a restart. Writers (the admin API,
the automatic rollback, or a person with an editor) replace the file atomically. A file that does not
parse is reported and ignored: the last good state stays in force.

Canary assignment is sticky: the targeting key is hashed with MurmurHash3 (as Unleash does for its
gradual rollouts) into a bucket 0-99, and the clients whose bucket is below the canary percent go to
Triton, so raising the percent only adds clients.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mmh3

from app import metrics
from app.errors import FlagNotWritable, InvalidTraffic
from app.settings import Mode

log = logging.getLogger(__name__)
CANARY_GROUP = "flask-triton-shim"  # hashed with the key: another rollout with other keys gets other buckets
CHANGES = ("mode", "canary_percent", "shadow_percent", "reason")  # what a writer may ask for
AUDIT = ("updated_by", "updated_at")  # set by whoever writes the file: the server, never the admin API's client
MAX_TEXT = 500  # characters of a reason or an audit field kept
Clock = Callable[[], float]


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
    source: str = "env"  # env (the SHIM_* settings), flag-file, or local (this worker only)
    updated_by: str = ""  # admin-api, auto-rollback, or whoever wrote the file
    updated_at: str = ""
    reason: str = ""

    def with_changes(self, changes: dict[str, Any], *, updated_by: str) -> TrafficState:
        """A new state from a partial update by `updated_by` (the admin API, the rollback); validates it.

        Only CHANGES are accepted: who changed it and when are the server's to say, never the client's.
        """
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
        return self._validated(changes, updated_by=_text(data, "updated_by", "file"),
                               updated_at=_text(data, "updated_at", ""))

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
    def __init__(self, path: Path | None, default: TrafficState, poll_s: float,
                 clock: Clock = time.monotonic) -> None:
        self.path = path
        self._clock = clock
        self._default = default
        self._poll_s = poll_s
        self._state = default
        self._seen: tuple[int, int, int] | None = None  # (inode, size, mtime) of the file last read
        self._checked = 0.0
        self._error: str | None = None
        self._lock = threading.Lock()
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
        """Apply a partial update for every worker: write the file atomically, then use it here at once."""
        if self.path is None:
            raise InvalidTraffic("run-time switching is off: set SHIM_FLAG_FILE")
        state = self.current().with_changes(changes, updated_by=updated_by)
        body = {k: v for k, v in state.to_json().items() if k != "source"}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
            with os.fdopen(fd, "w") as handle:
                json.dump(body, handle, indent=2)
            os.replace(tmp, self.path)
        except OSError as e:  # e.g. a ConfigMap mount: read-only by design
            raise FlagNotWritable(f"cannot write the flag file {self.path} ({e.strerror}); if it is mounted from "
                                  "a Kubernetes ConfigMap, change the ConfigMap instead (README: Scale out on "
                                  "Kubernetes)") from e
        with self._lock:
            self._checked = self._clock()
            self._reload()
        return self._state

    def override(self, changes: dict[str, Any], *, updated_by: str) -> TrafficState:
        """Apply a change in this worker only, until the flag file next changes (it cannot be written)."""
        with self._lock:
            self._set(replace(self._state.with_changes(changes, updated_by=updated_by), source="local"))
            return self._state

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
            data = json.loads(self.path.read_text()) if self.path else {}
            if not isinstance(data, dict):
                raise InvalidTraffic("the flag file must hold a JSON object")
            state = self._default.from_file(data)
        except (OSError, ValueError, InvalidTraffic) as e:
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
        self._state = state
        self._publish(state)

    @staticmethod
    def _publish(state: TrafficState) -> None:
        for mode in Mode:
            for source in ("env", "flag-file", "local"):
                metrics.TRAFFIC_MODE.labels(mode.value, source).set(
                    1 if (mode, source) == (state.mode, state.source) else 0)
        metrics.CANARY_PERCENT.set(state.canary_percent)
