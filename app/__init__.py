"""flask-triton-shim: the legacy /predict API in front of NVIDIA Triton. gunicorn runs `app:create_app()`."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Mapping

    from flask import Flask

    from app.backends.base import Backend
    from app.settings import Settings


def create_app(settings: Settings | None = None, *, backends: Mapping[str, Backend] | None = None) -> Flask:
    """Wiring only: settings (from SHIM_* unless given), the shim's objects, the HTTP API. `backends`
    ({"triton": ..., "legacy": ...}) replaces the real ones: tests drive the whole app with fakes there."""
    from flask import Flask

    from app import api
    from app.logs import configure_logging
    from app.settings import Settings
    from app.wiring import build_shim

    settings = settings or Settings.from_env()
    configure_logging(settings.log_level)
    app = Flask(__name__)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_upload_bytes
    app.config["MAX_FORM_PARTS"] = 1000  # werkzeug's default, named: the 413 message quotes both
    app.config["MAX_FORM_MEMORY_SIZE"] = 500_000
    app.json.sort_keys = False  # type: ignore[attr-defined]  # answers keep the contract's key order
    app.extensions["shim"] = build_shim(settings, backends)
    api.register(app)
    if settings.proxy_hops:  # the client's address as the trusted proxies saw it; a client's own X-Forwarded-For
        from werkzeug.middleware.proxy_fix import ProxyFix  # entries are never used (left of what they added)

        app.wsgi_app = ProxyFix(app.wsgi_app, x_for=settings.proxy_hops)  # type: ignore[method-assign]
    return app
