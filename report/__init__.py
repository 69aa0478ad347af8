"""The migration report: replay a folder of images through the legacy path and the Triton path, compare
the answers, judge them against thresholds and write a report a change request can carry.

    python -m report IMAGES --triton-url HOST:8000 --legacy-model model.pt --labels labels.txt

Modules, in the order a run uses them: replay (the shim's two backends, in this process), compare (per-image metrics and
the run's summary), verdict (thresholds -> GO / NO-GO), svg (the plots), render (Markdown, HTML, CSV).
Exit codes: 0 GO, 1 NO-GO, 2 no verdict (a usage error: bad arguments, no readable image, an endpoint
that does not answer at the start).
"""

from __future__ import annotations

EXIT_GO, EXIT_NO_GO, EXIT_USAGE = 0, 1, 2
