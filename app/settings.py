"""Every setting of the shim: one frozen, typed object read from SHIM_* variables, validated at start."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from app.errors import SettingsError

__all__ = ["Mode", "Settings", "SettingsError"]
T = TypeVar("T")
PREFIX = "SHIM_"
TRANSPORTS = ("fp32", "uint8", "encoded")  # app/backends/triton/__init__.py says what each does
# Transports that are gone, and what replaces each (shared memory and `auto`: bench/RESULTS.md).
REPLACED_TRANSPORTS = {"http": "fp32", "shm": "fp32", "uint8-shm": "uint8", "auto": "fp32"}
# SHIM_* names that are not settings of the shim but are read elsewhere, so never a typo: the first name of
# SHIM_MODE, the model export's (modelrepo/export.py, compose's model-export), compose's build argument
# and bench/gpu_host.sh's shim address. Any other unknown SHIM_* name stops start-up (a typo would be ignored).
NOT_SETTINGS = frozenset({"SHIM_BACKEND", "SHIM_MODEL_WEIGHTS", "SHIM_MODEL_ARCH", "SHIM_WITH_LEGACY", "SHIM_URL"})
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP field name (RFC 9110 token)
_ADMIN_KEY = re.compile(r"^[A-Za-z0-9._~+/-]{16,}$")  # no ',', ':', '=' or space: Triton's flag syntax


class Mode(enum.StrEnum):
    """Where /predict traffic goes (see app/routing.py)."""

    LEGACY = "legacy"    # the in-process PyTorch model, as before the migration
    TRITON = "triton"    # Triton answers every request
    SHADOW = "shadow"    # legacy answers; a share of requests is also sent to Triton and compared
    CANARY = "canary"    # a sticky share of clients is answered by Triton, the rest by legacy


MODES_USING_LEGACY = frozenset({Mode.LEGACY, Mode.SHADOW, Mode.CANARY})  # they need the legacy backend


def _env(name: str) -> str:
    return PREFIX + name.upper()


@dataclass(frozen=True, kw_only=True)
class Settings:
    # Triton
    triton_url: str = "127.0.0.1:8000"
    model_name: str = "resnet50"
    model_version: str = ""  # "" = the version Triton's policy serves (the newest, by default)
    triton_connect_timeout_s: float = 1.0
    transport: str = "fp32"  # fp32 | uint8 | encoded: how images travel to Triton
    uint8_model: str = ""  # the ensemble that takes pixels (uint8 transports); "" = <model_name>_uint8
    encoded_model: str = ""  # the ensemble that decodes uploads (the encoded transport); "" = <model_name>_encoded
    triton_timeout_s: float = 10.0  # the longest a request waits for its answer (batch queue + Triton), 504 beyond
    readiness_timeout_s: float = 1.0  # /readyz answers within about this, 503 when Triton does not
    # Triton's restricted APIs (shared memory, model repository, ...): the header and key they need
    triton_admin_header: str = "triton-admin-key"
    triton_admin_key: str = field(default="", repr=False)
    triton_admin_key_file: Path | None = None  # the key in a file (a Docker or Kubernetes secret), read at start
    # Batching inside one worker
    max_batch_size: int = 32  # also capped by the model's own max_batch_size
    batch_delay_ms: float = 2.0  # the longest a request waits for others while more are on their way
    batch_senders: int = 2  # Triton requests in flight at once per worker
    # The model: its description is <model_repository>/<model_name>/model.toml (app/description.py)
    model_repository: Path = Path("triton_repo")
    # The legacy in-process path
    legacy_model_path: Path | None = None  # None: <model folder>/1/model.pt
    legacy_threads: int = 0  # torch intra-op threads; 0 = torch's default
    labels_path: Path | None = None  # None: the description's labels file
    # Traffic (the initial state; a flag file changes it at run time in every worker)
    mode: Mode = Mode.TRITON
    flag_file: Path | None = None  # app/gunicorn_conf.py makes a per-run file when unset
    flag_poll_s: float = 0.5  # how stale a worker's view of the flag file may be
    canary_percent: int = 0
    canary_header: str = "X-User-Id"  # sticky canary key; the client address when absent
    proxy_hops: int = 0  # trusted proxies in front that append to X-Forwarded-For; 0: the peer is the client
    shadow_percent: int = 100
    shadow_max_inflight: int = 4  # per worker; more shadow requests are skipped, never queued
    shadow_timeout_s: float = 5.0
    shadow_tolerance: float = 1e-3  # largest score difference that still counts as a match
    shadow_log_per_minute: int = 10  # mismatch samples logged per worker per minute
    override_header: bool = False  # honour X-Shim-Backend: legacy|triton on a request (QA)
    fallback: bool = False  # answer from legacy when Triton fails (needs the legacy model in each worker)
    breaker_failures: int = 5  # consecutive Triton failures that open the circuit
    breaker_reset_s: float = 10.0  # how long the circuit stays open before one probe request
    auto_rollback: bool = False  # canary share to 0 when Triton's error rate passes the threshold
    rollback_error_rate: float = 0.2
    rollback_window_s: float = 60.0
    rollback_min_requests: int = 20
    admin_token: str = field(default="", repr=False)  # bearer token of PUT /admin/traffic; empty: API off
    # Capture of accepted uploads, to replay them (python -m report); off unless a folder is set
    capture_dir: Path | None = None
    capture_per_minute: int = 60  # per worker
    capture_max_mb: float = 1024.0  # the folder's size; the oldest files go first
    # The request contract
    top_k: int = 0  # 0: the description's top_k
    max_upload_mb: float = 16.0
    max_image_pixels: int = 40_000_000  # larger images are refused before they are decoded
    # Serving
    host: str = "0.0.0.0"
    port: int = 5000
    workers: int = 2
    threads: int = 72  # gunicorn threads per worker: more than max_pending, so health checks always find one
    # /predict requests a worker holds at once; one more gets 503 + Retry-After. Per worker, and the kernel
    # spreads keep-alive connections over workers unevenly: leave room for a worker's more-than-fair share.
    max_pending: int = 64
    decode_slots: int = 2  # requests of a worker that decode and preprocess at once, in arrival order
    retry_after_s: int = 1  # what the 503 of a full worker tells clients to wait
    # host:port (UDP) where gunicorn's master receives the access log of the nginx in front (deploy/nginx) and
    # counts nginx's answers in /metrics (app/proxy_log.py). Empty: off.
    proxy_log_address: str = ""
    log_level: str = "INFO"
    _admin_key_read: str = field(default="", init=False, repr=False, compare=False)  # from the key file

    def __post_init__(self) -> None:
        host, _, port = self.triton_host_port.rpartition(":")
        _check(bool(host) and port.isdigit() and "/" not in host, "triton_url", self.triton_url,
               "host:port, e.g. 127.0.0.1:8000 or triton:8000")
        _check(bool(self.model_name), "model_name", self.model_name, "a model name")
        if self.transport in REPLACED_TRANSPORTS:
            raise SettingsError(f"SHIM_TRANSPORT={self.transport} is gone (shared memory and auto were removed): "
                                f"set SHIM_TRANSPORT={REPLACED_TRANSPORTS[self.transport]}")
        _check(self.transport in TRANSPORTS, "transport", self.transport, " | ".join(TRANSPORTS))
        _check(self.model_version == "" or self.model_version.isdigit(), "model_version", self.model_version,
               "empty (the served version) or a version number")
        for name in ("triton_connect_timeout_s", "triton_timeout_s", "readiness_timeout_s", "max_upload_mb",
                     "capture_max_mb"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "a number > 0")
        for name in ("flag_poll_s", "shadow_timeout_s", "breaker_reset_s", "rollback_window_s"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "a number > 0")
        _check(0 <= self.shadow_tolerance <= 1, "shadow_tolerance", self.shadow_tolerance, "a number from 0 to 1")
        _check(0 < self.rollback_error_rate <= 1, "rollback_error_rate", self.rollback_error_rate,
               "a share of failed requests above 0 and at most 1 (0.2 = 20%); 0 would roll back after successes")
        _check(bool(self.canary_header.strip()), "canary_header", self.canary_header, "a header name")
        _check(self.admin_token == "" or len(self.admin_token) >= 16, "admin_token", "<hidden>",
               "empty (admin API off) or at least 16 characters")
        _check(0 <= self.batch_delay_ms <= 1000, "batch_delay_ms", self.batch_delay_ms, "0 to 1000")
        for name, low, high in [("max_batch_size", 1, 1024), ("batch_senders", 1, 64), ("top_k", 0, 1000),
                                ("port", 1, 65535), ("workers", 1, 256), ("threads", 1, 1024),
                                ("max_pending", 1, 1024), ("decode_slots", 1, 256), ("retry_after_s", 1, 3600),
                                ("capture_per_minute", 1, 100_000),
                                ("legacy_threads", 0, 1024), ("max_image_pixels", 1, 1 << 31),
                                ("canary_percent", 0, 100), ("shadow_percent", 0, 100),
                                ("shadow_max_inflight", 1, 256), ("shadow_log_per_minute", 0, 10000),
                                ("breaker_failures", 1, 10000), ("rollback_min_requests", 1, 1 << 20),
                                ("proxy_hops", 0, 16)]:
            value = getattr(self, name)
            _check(low <= value <= high, name, value, f"a whole number from {low} to {high}")
        _check(self.threads >= self.max_pending + 2, "threads", self.threads,
               f"at least SHIM_MAX_PENDING + 2 = {self.max_pending + 2}, so that health checks always find a thread")
        log_host, _, log_port = self.proxy_log_address.rpartition(":")
        _check(self.proxy_log_address == "" or (bool(log_host) and log_port.isdigit() and 0 < int(log_port) < 65536),
               "proxy_log_address", self.proxy_log_address, "empty (off) or host:port, e.g. 127.0.0.1:5140")
        _check(self.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR"}, "log_level", self.log_level,
               "DEBUG, INFO, WARNING or ERROR")
        _check(_HEADER_NAME.match(self.triton_admin_header) is not None, "triton_admin_header",
               self.triton_admin_header, "an HTTP header name, e.g. triton-admin-key")
        self._read_admin_key()

    def _read_admin_key(self) -> None:
        key, path = self.triton_admin_key, self.triton_admin_key_file
        if path is not None:
            if key:
                raise SettingsError("SHIM_TRITON_ADMIN_KEY and SHIM_TRITON_ADMIN_KEY_FILE are both set: set one")
            try:
                key = path.read_text().strip()
            except OSError as e:
                raise SettingsError(f"SHIM_TRITON_ADMIN_KEY_FILE={str(path)!r} cannot be read ({e.strerror}): "
                                    "mount the secret there, or unset it") from None
            if not key:
                raise SettingsError(f"SHIM_TRITON_ADMIN_KEY_FILE={str(path)!r} is empty: it must hold Triton's "
                                    "admin key")
            object.__setattr__(self, "_admin_key_read", key)
        _check(not key or _ADMIN_KEY.match(key) is not None,
               "triton_admin_key_file" if path is not None else "triton_admin_key", "<hidden>",
               "at least 16 characters of letters, digits and ._~+/- (e.g. openssl rand -hex 16)")

    @property
    def description_path(self) -> Path:
        return self.model_repository / self.model_name / "model.toml"

    @property
    def triton_host_port(self) -> str:
        return self.triton_url.removeprefix("http://").rstrip("/")

    @property
    def triton_admin_headers(self) -> dict[str, str]:
        """The header Triton's restricted APIs (shared memory, model repository) need; {} when unrestricted."""
        key = self._admin_key_read or self.triton_admin_key
        return {self.triton_admin_header: key} if key else {}

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read SHIM_<FIELD> for every field; `overrides` win (tests pass their own values).

        An unknown SHIM_* name (a typo) stops start-up, naming the closest settings."""
        env = os.environ if environ is None else environ
        fields = [f for f in dataclasses.fields(cls) if f.init]
        _refuse_unknown(env, {_env(f.name) for f in fields})
        values: dict[str, Any] = {}
        for f in fields:
            if _env(f.name) not in env:
                continue
            values[f.name] = _parse(f.name, env[_env(f.name)], _field_type(f))
        if "mode" not in values and _env("backend") in env:  # SHIM_BACKEND=legacy|triton, the first name
            values["mode"] = _parse("backend", env[_env("backend")], Mode)
        return cls(**{**values, **overrides})


def _refuse_unknown(env: Mapping[str, str], known: set[str]) -> None:
    unknown = sorted(name for name in env if name.startswith(PREFIX) and name not in known | NOT_SETTINGS)
    if not unknown:
        return
    hints = []
    for name in unknown[:5]:
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        hints.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
    raise SettingsError(f"unknown setting{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}; the settings are "
                        "listed in README.md (Settings)")


def _field_type(f: dataclasses.Field[Any]) -> Callable[[str], Any]:
    defaults: dict[str, Callable[[str], Any]] = {"str": str, "int": int, "float": float, "Path": Path,
                                                  "Mode": Mode, "bool": _parse_bool, "Path | None": _optional_path}
    return defaults[str(f.type)]


def _parse(name: str, raw: str, kind: Callable[[str], T]) -> T:
    try:
        return kind(raw.strip())
    except ValueError:
        allowed = {int: "a whole number", float: "a number", Mode: " | ".join(Mode),
                   _parse_bool: "true or false"}.get(kind, "a valid value")
        raise SettingsError(f"{_env(name)}={raw!r} is not valid: expected {allowed}") from None


def _optional_path(raw: str) -> Path | None:
    return Path(raw) if raw else None


def _parse_bool(raw: str) -> bool:
    lowered = raw.lower()
    if lowered in {"1", "true", "yes", "on"}:
        return True
    if lowered in {"0", "false", "no", "off"}:
        return False
    raise ValueError(raw)


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise SettingsError(f"{_env(name)}={value!r} is not valid: expected {allowed}")
