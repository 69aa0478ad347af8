"""gunicorn's logger without the cost of an access line that is never written."""

from __future__ import annotations

import logging
from typing import Any

from gunicorn.glogging import Logger


class QuietAccessLogger(Logger):  # type: ignore[misc]
    """gunicorn builds every request's access-log atoms (the WSGI environ walked, headers copied, a
    strftime) whenever a logconfig is set, and only then hands the line to `gunicorn.access`, which drops it
    here (app/logs.py: the app writes its own line per /predict). Seen in a busy worker's profile under the
    GIL; skip the work when that logger would not write the line."""

    def access(self, resp: Any, req: Any, environ: dict[str, Any], request_time: Any) -> None:
        if self.access_log.isEnabledFor(logging.INFO):
            super().access(resp, req, environ, request_time)
