"""The migration report: replay a folder of images through the legacy path and the Triton path, compare the
answers, judge them against thresholds (docs/migration-report.md). Modules in the order a run uses them:
replay, compare, verdict, svg, render. Exit codes: 0 GO, 1 NO-GO, 2 no verdict (a usage error)."""

from __future__ import annotations

EXIT_GO, EXIT_NO_GO, EXIT_USAGE = 0, 1, 2
