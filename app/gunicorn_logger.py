"""gunicorn's logger without the cost of an access line that is never written."""

from __future__ import annotations

import logging
from typing import Any

from gunicorn.glogging import Logger


class QuietAccessLogger(Logger):  # type: ignore[misc]
    """gunicorn builds every request's access-log atoms (environ walked, headers copied, a strftime) before
    `gunicorn.access` drops the line (the app writes its own): seen in a busy worker's profile; skipped here."""

    def access(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> None:
        if self.access_log.isEnabledFor(logging.INFO):
            super().access(resp, req, environ, request_time)
