"""gunicorn settings for the shim: `gunicorn -c python:app.gunicorn_conf`. Everything comes from the SHIM_*
settings the app reads; a bad value stops the master before any worker starts, naming the variable.
"""

import os
import shutil
import sys
import tempfile
from typing import TYPE_CHECKING, Any

from app.capabilities import check_start, legacy_lacks
from app.description import resolve
from app.gunicorn_worker import Spread
from app.logs import gunicorn_logconfig
from app.malloc import few_arenas
from app.settings import Settings, SettingsError

if TYPE_CHECKING:
    from app.proxy_log import Supervisor

try:
    _settings = Settings.from_env()
    served = resolve(_settings)  # the model's description and labels: a wrong one stops the master too
    check_start(_settings, legacy_lacks(served.legacy_model_path))  # e.g. SHIM_MODE=legacy without torch
except SettingsError as _error:
    sys.stderr.write(f"flask-triton-shim: {_error}\n")
    sys.exit(2)

# Freed large buffers are reused from few malloc arenas, not kept one per thread (app/malloc.py).
few_arenas()

wsgi_app = "app:create_app()"
bind = f"0.0.0.0:{_settings.port}"
workers = _settings.workers
# gthread, except that a new connection goes to the worker holding fewest (app/gunicorn_worker.py).
worker_class = "app.gunicorn_worker.BalancedThreadWorker"
threads = _settings.threads
# Never preload: tritonclient's HTTP client breaks when created before a fork, and torch with it.
preload_app = False
timeout = 60
graceful_timeout = 20
keepalive = 5
accesslog = None  # the app logs every /predict as one JSON line with its request ID
errorlog = "-"
loglevel = _settings.log_level.lower()
logconfig_dict = gunicorn_logconfig(_settings.log_level)  # every line JSON: gunicorn's own and warnings too
logger_class = "app.gunicorn_logger.QuietAccessLogger"  # no access-line work for a line that is dropped
control_socket_disable = True  # gunicorn >= 25: several shims on one host would share one socket

# Folders made for this run only, removed when gunicorn exits.
_scratch: list[str] = []

# prometheus_client multiprocess mode: every worker writes its metrics to this folder.
if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="shim-metrics-")
    _scratch.append(os.environ["PROMETHEUS_MULTIPROC_DIR"])
_metrics_dir = os.environ["PROMETHEUS_MULTIPROC_DIR"]

# The traffic flag file all workers watch: unset, each run gets its own (a switch lasts until a restart).
if not os.environ.get("SHIM_FLAG_FILE"):
    _flag_dir = tempfile.mkdtemp(prefix="shim-traffic-")
    os.environ["SHIM_FLAG_FILE"] = os.path.join(_flag_dir, "traffic.json")
    _scratch.append(_flag_dir)


def on_starting(server: Any) -> None:
    """Values left by an earlier run would be added to this one's."""
    shutil.rmtree(_metrics_dir, ignore_errors=True)
    os.makedirs(_metrics_dir, exist_ok=True)


def post_worker_init(worker: Any) -> None:
    """gunicorn answers a request it cannot parse itself, with an HTML page: the contract's JSON instead."""
    from gunicorn import util

    from app.contract import server_error_response

    def write_error(sock: Any, status: int, reason: str, detail: str) -> None:
        util.write_nonblock(sock, server_error_response(status, reason, detail))

    util.write_error = write_error  # called by the worker's handle_error, after gunicorn's own logging


# Behind nginx (SHIM_PROXY_LOG_ADDRESS set): nginx's answers counted in /metrics by a process of the master's.
_proxy_log: "list[Supervisor]" = []


def when_ready(server: Any) -> None:
    if _settings.proxy_log_address:
        from app.proxy_log import Supervisor

        _proxy_log.append(Supervisor(_settings.proxy_log_address).start())


# Each worker's open connections, shared by the master's forks (a reload briefly runs old and new workers).
_spread = Spread(2 * _settings.workers + 2)


def pre_fork(server: Any, worker: Any) -> None:
    _spread.assign(worker)


def child_exit(server: Any, worker: Any) -> None:
    from app.metrics import mark_worker_dead

    _spread.release(worker)
    mark_worker_dead(worker.pid)


def worker_exit(server: Any, worker: Any) -> None:
    wsgi = getattr(worker, "wsgi", None)
    app = getattr(wsgi, "__wrapped__", wsgi)  # the Flask app, inside app/gunicorn_worker.py's wrapper
    shim = getattr(app, "extensions", {}).get("shim") if app is not None else None
    if shim is not None:
        shim.close()  # closes Triton connections, so Triton's own shutdown does not wait on them


def on_exit(server: Any) -> None:
    for supervisor in _proxy_log:
        supervisor.stop()
    for folder in _scratch:
        shutil.rmtree(folder, ignore_errors=True)
