"""Every setting of the shim: one frozen, typed object read from SHIM_* variables, validated at start."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from app.errors import SettingsError

__all__ = ["Mode", "Settings", "SettingsError"]
T = TypeVar("T")
PREFIX = "SHIM_"
TRANSPORTS = ("fp32", "uint8", "encoded")  # app/backends/triton/__init__.py says what each does
# Transports that are gone, and what replaces each (shared memory and `auto`: bench/RESULTS.md).
REPLACED_TRANSPORTS = {"http": "fp32", "shm": "fp32", "uint8-shm": "uint8", "auto": "fp32"}
SPARE_THREADS = 8  # gunicorn threads per worker beyond max_pending: health checks and /metrics always find one
# SHIM_* names read elsewhere (the export, compose's build argument, bench/gpu_host.sh), so never a typo; any
# other unknown SHIM_* name stops start-up (a typo would be ignored).
NOT_SETTINGS = frozenset({"SHIM_MODEL_WEIGHTS", "SHIM_MODEL_ARCH", "SHIM_WITH_LEGACY", "SHIM_URL"})
_FROM_MODEL = "read from the model's model.toml (SHIM_MODEL_REPOSITORY/SHIM_MODEL_NAME/model.toml); edit it there"
_CONSTANT = "a tuning constant now, in {}"
_NO_KEYS = "the shim makes no restricted Triton call since shared memory went (docs/security.md): unset it"
_TRAFFIC = "set it at run time with `shim-traffic set` (the flag file; on Kubernetes, the ConfigMap)"
# Names that were settings once: set in the environment, they stop start-up with what replaced them.
RETIRED: dict[str, str] = {
    "SHIM_BACKEND": "use SHIM_MODE (legacy | triton | shadow | canary)",
    "SHIM_UINT8_MODEL": "derived now: <SHIM_MODEL_NAME>_uint8",
    "SHIM_ENCODED_MODEL": "derived now: <SHIM_MODEL_NAME>_encoded",
    "SHIM_SHM_MODE": "shared memory is gone (bench/RESULTS.md): SHIM_TRANSPORT=fp32 or uint8 send over HTTP",
    "SHIM_LABELS_PATH": _FROM_MODEL + " ([labels])",
    "SHIM_LEGACY_MODEL_PATH": _FROM_MODEL + " (the legacy model file)",
    "SHIM_TOP_K": _FROM_MODEL + " (top_k)",
    "SHIM_MAX_IMAGE_PIXELS": _CONSTANT.format("app/preprocess.py (MAX_IMAGE_PIXELS, 40 M)"),
    "SHIM_TRITON_CONNECT_TIMEOUT_S": _CONSTANT.format("app/wiring.py (TRITON_CONNECT_TIMEOUT_S)"),
    "SHIM_READINESS_TIMEOUT_S": _CONSTANT.format("app/readiness.py (DEADLINE_S)"),
    "SHIM_BATCH_SENDERS": _CONSTANT.format("app/batching.py (triton_senders: instances / SHIM_WORKERS)"),
    "SHIM_DECODE_SLOTS": _CONSTANT.format("app/admission.py (DECODE_SLOTS)"),
    "SHIM_RETRY_AFTER_S": _CONSTANT.format("app/admission.py (RETRY_AFTER_S)"),
    "SHIM_FLAG_POLL_S": _CONSTANT.format("app/traffic.py (POLL_S)"),
    "SHIM_BREAKER_FAILURES": _CONSTANT.format("app/breaker.py (FAILURES)"),
    "SHIM_BREAKER_RESET_S": _CONSTANT.format("app/breaker.py (RESET_S)"),
    "SHIM_SHADOW_MAX_INFLIGHT": _CONSTANT.format("app/shadow.py (MAX_INFLIGHT)"),
    "SHIM_SHADOW_TIMEOUT_S": "derived now: a shadow call waits on Triton as long as a request, SHIM_TRITON_TIMEOUT_S",
    "SHIM_SHADOW_TOLERANCE": _CONSTANT.format("app/shadow.py (TOLERANCE)"),
    "SHIM_SHADOW_LOG_PER_MINUTE": _CONSTANT.format("app/shadow.py (LOGS_PER_MINUTE)"),
    "SHIM_ROLLBACK_ERROR_RATE": _CONSTANT.format("app/rollback.py (ERROR_RATE)"),
    "SHIM_ROLLBACK_WINDOW_S": _CONSTANT.format("app/rollback.py (WINDOW_S)"),
    "SHIM_ROLLBACK_MIN_REQUESTS": _CONSTANT.format("app/rollback.py (MIN_REQUESTS)"),
    "SHIM_CAPTURE_PER_MINUTE": _CONSTANT.format("app/capture.py (PER_MINUTE)"),
    "SHIM_CAPTURE_MAX_MB": _CONSTANT.format("app/capture.py (MAX_MB)"),
    "SHIM_THREADS": "derived now: SHIM_MAX_PENDING + 8 gunicorn threads per worker",
    "SHIM_HOST": "the shim listens on every interface (0.0.0.0:SHIM_PORT); narrow it with the container's network",
    "SHIM_LEGACY_THREADS": "torch reads OMP_NUM_THREADS for the legacy model's threads",
    "SHIM_CANARY_PERCENT": _TRAFFIC,
    "SHIM_SHADOW_PERCENT": _TRAFFIC,
    "SHIM_ADMIN_TOKEN": "the admin API is gone: " + _TRAFFIC,
    "SHIM_TRITON_ADMIN_KEY": _NO_KEYS,
    "SHIM_TRITON_ADMIN_KEY_FILE": _NO_KEYS,
    "SHIM_TRITON_ADMIN_HEADER": _NO_KEYS,
    "SHIM_OVERRIDE_HEADER": "the per-request X-Shim-Backend override is gone: " + _TRAFFIC,
}
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]+$")  # an HTTP field name (RFC 9110 token)


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
    """What a user sets (docs/settings.md); what model.toml says is read from it, tuning constants live in code."""

    # Triton
    triton_url: str = "127.0.0.1:8000"
    model_name: str = "resnet50"
    model_version: str = ""  # "" = the version Triton's policy serves (the newest, by default)
    transport: str = "fp32"  # fp32 | uint8 | encoded: how images travel to Triton
    triton_timeout_s: float = 10.0  # the longest a request waits for its answer (batch queue + Triton), 504 beyond
    # Batching inside one worker
    max_batch_size: int = 32  # also capped by the model's own max_batch_size
    batch_delay_ms: float = 2.0  # the longest a request waits for others while more are on their way
    # The model: its description is <model_repository>/<model_name>/model.toml (app/description.py)
    model_repository: Path = Path("triton_repo")
    # Traffic: the mode at start; the flag file (shim-traffic, or the ConfigMap) changes it at run time
    mode: Mode = Mode.TRITON
    flag_file: Path | None = None  # app/gunicorn_conf.py makes a per-run file when unset
    canary_header: str = "X-User-Id"  # sticky canary key; the client address when absent
    proxy_hops: int = 0  # trusted proxies in front that append to X-Forwarded-For; 0: the peer is the client
    fallback: bool = False  # answer from legacy when Triton fails (needs the legacy model in each worker)
    auto_rollback: bool = False  # canary share to 0 when Triton fails too many canary requests (app/rollback.py)
    # Capture of accepted uploads, to replay them (shim-report); off unless a folder is set
    capture_dir: Path | None = None
    # The request contract and serving
    max_upload_mb: float = 16.0
    port: int = 5000
    workers: int = 2
    # /predict requests a worker holds at once; one more gets 503 + Retry-After. Per worker, and the kernel
    # spreads keep-alive connections over workers unevenly: leave room for a worker's more-than-fair share.
    max_pending: int = 64
    # host:port (UDP) where gunicorn's master receives the access log of the nginx in front (deploy/nginx) and
    # counts nginx's answers in /metrics (app/proxy_log.py). Empty: off.
    proxy_log_address: str = ""
    log_level: str = "INFO"

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
        for name in ("triton_timeout_s", "max_upload_mb"):
            _check(getattr(self, name) > 0, name, getattr(self, name), "a number > 0")
        _check(_HEADER_NAME.match(self.canary_header) is not None, "canary_header", self.canary_header,
               "an HTTP header name, e.g. X-User-Id")
        _check(0 <= self.batch_delay_ms <= 1000, "batch_delay_ms", self.batch_delay_ms, "0 to 1000")
        for name, low, high in [("max_batch_size", 1, 1024), ("port", 1, 65535), ("workers", 1, 256),
                                ("max_pending", 1, 1024), ("proxy_hops", 0, 16)]:
            value = getattr(self, name)
            _check(low <= value <= high, name, value, f"a whole number from {low} to {high}")
        log_host, _, log_port = self.proxy_log_address.rpartition(":")
        _check(self.proxy_log_address == "" or (bool(log_host) and log_port.isdigit() and 0 < int(log_port) < 65536),
               "proxy_log_address", self.proxy_log_address, "empty (off) or host:port, e.g. 127.0.0.1:5140")
        _check(self.log_level.upper() in {"DEBUG", "INFO", "WARNING", "ERROR"}, "log_level", self.log_level,
               "DEBUG, INFO, WARNING or ERROR")

    @property
    def description_path(self) -> Path:
        return self.model_repository / self.model_name / "model.toml"

    @property
    def triton_host_port(self) -> str:
        return self.triton_url.removeprefix("http://").rstrip("/")

    @property
    def threads(self) -> int:
        """gunicorn threads per worker: more than max_pending, so that health checks and /metrics always find one."""
        return self.max_pending + SPARE_THREADS

    @property
    def max_upload_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read SHIM_<FIELD> for every field; `overrides` win (tests pass their own values).

        A retired SHIM_* name stops start-up naming what replaced it; an unknown one (a typo), the closest settings."""
        env = os.environ if environ is None else environ
        fields = [f for f in dataclasses.fields(cls) if f.init]
        _refuse_retired(env)
        _refuse_unknown(env, {_env(f.name) for f in fields})
        values: dict[str, Any] = {}
        for f in fields:
            if _env(f.name) not in env:
                continue
            values[f.name] = _parse(f.name, env[_env(f.name)], _field_type(f))
        return cls(**{**values, **overrides})


def _refuse_retired(env: Mapping[str, str]) -> None:
    retired = sorted(name for name in env if name in RETIRED)
    if retired:
        raise SettingsError("; ".join(f"{name} is no longer a setting: {RETIRED[name]}" for name in retired)
                            + " (docs/settings.md)")


def _refuse_unknown(env: Mapping[str, str], known: set[str]) -> None:
    unknown = sorted(name for name in env if name.startswith(PREFIX) and name not in known | NOT_SETTINGS)
    if not unknown:
        return
    hints = []
    for name in unknown[:5]:
        close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.6)
        hints.append(f"{name} (did you mean {' or '.join(close)}?)" if close else name)
    raise SettingsError(f"unknown setting{'s' if len(unknown) > 1 else ''}: {', '.join(hints)}; the settings are "
                        "listed in docs/settings.md")


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
