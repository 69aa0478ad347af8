"""shim-report IMAGES: writes report.md, report.html and results.csv into --out and prints report.md's path;
exit 0 GO, 1 NO-GO, 2 no verdict (report/__init__.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
import warnings
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import NoReturn, TextIO

from app.errors import SettingsError
from app.settings import TRANSPORTS, Settings
from report import EXIT_GO, EXIT_NO_GO, EXIT_USAGE
from report.compare import Outcome, summarize
from report.render import Report, write
from report.replay import InProcess, Unusable, find_files, first_image, replay
from report.verdict import Thresholds, judge, percent

PROG = "python -m report"
DEFAULTS = Thresholds()


def share(text: str) -> float:
    """0.999 or 99.9%."""
    try:
        return float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a share (0.999 or 99.9%)") from None


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line, not argparse's whole usage: a pipeline's log shows what to fix."""
        self.exit(EXIT_USAGE, f"migration report: {message} (see {PROG} --help)\n")


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Before a step of the ramp: replay a folder of images through the legacy path and the Triton "
                    "path and judge the answers: GO (exit 0), NO-GO (1), no verdict (2: bad arguments, no image, "
                    "an endpoint that does not answer).",
        epilog="defaults come from the shim's SHIM_* settings and the model's model.toml, so that the command runs "
               "as-is inside the shim's image (docs/migration-report.md).")
    p.add_argument("images", type=Path, help="a folder of images (searched recursively; a capture works as is)")
    p.add_argument("--out", type=Path, help="where report.md, report.html and results.csv go "
                                            "(default: report-<UTC time> in the current folder)")
    own = p.add_argument_group("both backends in this process")
    own.add_argument("--triton-url", help="Triton's HTTP host:port (default: SHIM_TRITON_URL)")
    own.add_argument("--legacy-model", type=Path, help="the TorchScript file (default: the model.toml's)")
    own.add_argument("--labels", type=Path, help="the labels file (default: the model.toml's)")
    own.add_argument("--transport", choices=TRANSPORTS, help="how tensors travel to Triton (default: SHIM_TRANSPORT)")
    own.add_argument("--model", help="Triton's model name (default: SHIM_MODEL_NAME)")
    own.add_argument("--model-repository", type=Path,
                     help="where <model>/model.toml, the model's description, is (default: SHIM_MODEL_REPOSITORY)")
    own.add_argument("--model-version", help="Triton's model version (default: SHIM_MODEL_VERSION, the served one)")
    own.add_argument("--top-k", type=int, help="classes compared per answer (default: the model.toml's top_k)")
    run = p.add_argument_group("the run")
    run.add_argument("--concurrency", type=int, default=1, help="images in flight at once (default 1)")
    run.add_argument("--timeout", type=float, help="seconds one call may take (default: SHIM_TRITON_TIMEOUT_S)")
    run.add_argument("--warm-up", type=int, default=3, help="uncounted calls per backend before the run (default 3)")
    run.add_argument("--verbose", action="store_true", help="log the backends' INFO lines on stderr")
    gate = p.add_argument_group("thresholds of the verdict (every one must hold for GO)")
    gate.add_argument("--min-top1-agreement", type=share, default=DEFAULTS.min_top1_agreement,
                      help="share of compared images with the same top-1 class (default 0.999)")
    gate.add_argument("--min-topk-overlap", type=share, default=DEFAULTS.min_topk_overlap,
                      help="mean share of legacy's top-k in Triton's top-k (default 0.99)")
    gate.add_argument("--max-score-diff", type=float, default=DEFAULTS.max_score_diff,
                      help="99th percentile over images of an image's largest probability difference (default 0.01)")
    gate.add_argument("--max-p99-ratio", type=float, default=DEFAULTS.max_p99_ratio,
                      help="Triton's p99 latency / legacy's (default 1.2)")
    gate.add_argument("--max-errors", type=int, default=DEFAULTS.max_errors,
                      help="failed calls of either backend, fallbacks included (default 0)")
    return p


class Progress:
    """A progress line on stderr when it is a terminal: files done, disagreements, errors, rate."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total, self.stream = total, stream
        self.enabled = stream.isatty()
        self.done = self.differs = self.errors = self.skipped = 0
        self._started = self._drawn = time.monotonic()

    def __call__(self, outcome: Outcome) -> None:
        self.done += 1
        self.skipped += outcome.skipped is not None
        self.differs += outcome.agreement is not None and not outcome.agreement.same_top1
        self.errors += sum(a is not None and not a.ok for a in (outcome.legacy, outcome.triton))
        now = time.monotonic()
        if self.enabled and (now - self._drawn >= 0.1 or self.done == self.total):
            self._drawn = now
            filled = int(30 * self.done / max(1, self.total))
            rate = self.done / max(1e-9, now - self._started)
            self.stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} files, "
                              f"top-1 differs {self.differs}, errors {self.errors}, skipped {self.skipped}, "
                              f"{rate:.1f} files/s ")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.done:
            self.stream.write("\n")


def make_source(args: argparse.Namespace, p: argparse.ArgumentParser) -> InProcess:
    overrides = {"triton_url": args.triton_url, "transport": args.transport, "model_name": args.model,
                 "model_version": args.model_version, "triton_timeout_s": args.timeout,
                 "model_repository": args.model_repository}
    try:
        settings = Settings.from_env(**{k: v for k, v in overrides.items() if v is not None})
    except SettingsError as e:
        flag = {"triton_url": "--triton-url", "model_version": "--model-version", "triton_timeout": "--timeout"}
        message = str(e)
        for name, option in flag.items():
            message = message.replace(f"SHIM_{name.upper()}=", f"{option} / SHIM_{name.upper()}=")
        p.error(message)
    if args.top_k is not None and args.top_k < 1:
        p.error("--top-k must be at least 1")
    return InProcess(settings, k=args.top_k, legacy_model=args.legacy_model, labels=args.labels)


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)  # a usage error exits 2 here
    # The legacy backend loads TorchScript as the legacy app did; torch >= 2.10 calls torch.jit deprecated.
    warnings.filterwarnings("ignore", message=r".*torch\.jit.* is deprecated", category=FutureWarning)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="migration report: %(levelname)s %(name)s: %(message)s")
    try:
        thresholds = Thresholds(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Thresholds)})
    except ValueError as e:
        p.error(str(e))
    for bad, message in [(args.concurrency < 1, "--concurrency must be at least 1"),
                         (args.warm_up < 1, "--warm-up must be at least 1: the warm-up checks that both paths answer"),
                         (args.timeout is not None and args.timeout <= 0, "--timeout must be > 0"),
                         (not args.images.is_dir(), f"{args.images} is not a folder")]:
        if bad:
            p.error(message)
    files = find_files(args.images)
    if not files:
        p.error(f"{args.images} holds no file")
    started = datetime.now(UTC)
    out = args.out or Path(f"report-{started:%Y%m%d-%H%M%S}")
    source: InProcess | None = None
    try:
        source = make_source(args, p)
        first = first_image(files, source.spec)
        if first is None:
            raise Unusable(f"none of the {len(files)} files under {args.images} is an image the shim reads")
        source.check()
        source.warm_up(first, calls=args.warm_up)
        clock = time.monotonic()
        progress = Progress(len(files), sys.stderr)
        try:
            outcomes = replay(source, files, concurrency=args.concurrency, on_outcome=progress)
        finally:
            progress.close()
        seconds = time.monotonic() - clock
        summary = summarize(outcomes)
        verdict = judge(summary, thresholds, k=source.k)
        report = Report(started=started, seconds=seconds, folder=args.images, header=source.describe(),
                        thresholds=thresholds, k=source.k, concurrency=args.concurrency, warm_up=args.warm_up,
                        outcomes=outcomes, summary=summary, verdict=verdict)
        paths = write(report, out)
    except Unusable as e:
        print(f"migration report: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("migration report: interrupted; no report written", file=sys.stderr)
        return 130
    finally:
        if source is not None:
            source.close()
    agreement = "n/a" if summary.top1_agreement is None else percent(summary.top1_agreement)
    failed = f" (failed: {', '.join(verdict.failed)})" if not verdict.go else ""
    print(f"migration report: {verdict.label}{failed}: {summary.compared} of {summary.images} images compared, top-1 "
          f"agreement {agreement}, errors {summary.error_total}, {summary.skipped} skipped; {paths['html']}",
          file=sys.stderr)
    print(paths["markdown"])
    return EXIT_GO if verdict.go else EXIT_NO_GO


if __name__ == "__main__":
    sys.exit(main())
