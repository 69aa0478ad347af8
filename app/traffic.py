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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mmh3

from app import metrics
from app.errors import InvalidRequest, ShimError
from app.settings import Mode

log = logging.getLogger(__name__)
CANARY_GROUP = "flask-triton-shim"  # hashed with the key: another rollout with other keys gets other buckets


class InvalidTraffic(InvalidRequest):
    code = "invalid_traffic"
    default_message = "the traffic update is not valid"


class FlagNotWritable(ShimError):
    status = 409
    code = "flag_not_writable"
    default_message = "the traffic flag file cannot be written here"


def bucket(key: str) -> int:
    """The client's fixed bucket, 0-99."""
    return int(mmh3.hash(f"{CANARY_GROUP}:{key}", seed=0, signed=False)) % 100


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
        """A new state from a partial update (JSON from the admin API or the file); validates it."""
        unknown = set(changes) - {"mode", "canary_percent", "shadow_percent", "reason", "updated_by", "updated_at",
                                  "source"}
        if unknown:
            raise InvalidTraffic(f"unknown fields {sorted(unknown)}: expected mode, canary_percent, "
                                 "shadow_percent, reason")
        try:
            mode = Mode(changes.get("mode", self.mode))
        except ValueError:
            raise InvalidTraffic(f"mode {changes.get('mode')!r} is not one of {', '.join(Mode)}") from None
        canary, shadow = (self._percent(changes, name) for name in ("canary_percent", "shadow_percent"))
        return replace(self, mode=mode, canary_percent=canary, shadow_percent=shadow,
                       reason=str(changes.get("reason", ""))[:500],
                       updated_by=str(changes.get("updated_by", updated_by)),
                       updated_at=str(changes.get("updated_at") or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))

    def _percent(self, changes: dict[str, Any], name: str) -> int:
        value = changes.get(name, getattr(self, name))
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 100:
            raise InvalidTraffic(f"{name} must be a whole number from 0 to 100, not {value!r}")
        return value

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "mode": self.mode.value}


class TrafficFlag:
    def __init__(self, path: Path | None, default: TrafficState, poll_s: float) -> None:
        self.path = path
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
        now = time.monotonic()
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
            self._checked = time.monotonic()
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
            state = self._default.with_changes(data, updated_by="file")
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
