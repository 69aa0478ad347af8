"""(c) A hung Triton: tritonserver stopped with SIGSTOP for 12 s (longer than SHIM_TRITON_TIMEOUT_S) under 8
clients, through nginx. /readyz must say 503 within its own deadline from one deadline into the hang on (a
check under way repeats the latest answer until then: app/readiness.py), no request may wait
longer than SHIM_TRITON_TIMEOUT_S, and after SIGCONT /predict and /readyz must answer 200 within 2 s."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

from app.readiness import DEADLINE_S as READINESS_DEADLINE_S
from bench.loadgen import Job, LoadGenerator, multipart_request
from devstack import promtext
from tests.hostile.clients import HOST, Answer, HealthPoller, percentile, predict
from tests.hostile.conftest import Figures, Stack

CLIENTS = 8
BEFORE_S = 3.0
STOP_S = float(os.environ.get("HOSTILE_STOP_S", "12"))
AFTER_S = 6.0
RECOVERY_S = 2.0
MARGIN_S = 0.5  # nginx and the client, on top of the shim's own deadlines


def test_a_hung_triton_gives_fast_503s_and_recovers_within_2_s(healthy: Stack, figures: Figures) -> None:
    stack = healthy
    settings = stack.settings
    upload = multipart_request(HOST, stack.proxy_port, "/predict", "image", "test.jpg", "image/jpeg", stack.image)
    job = Job(HOST, stack.proxy_port, (upload,), expect=b'"predictions"', concurrency=CLIENTS, warmup_s=0.5,
              duration_s=BEFORE_S + STOP_S + AFTER_S, timeout_s=60)
    recovered: Answer | None = None
    with LoadGenerator() as generator, concurrent.futures.ThreadPoolExecutor(1) as pool, \
            HealthPoller(stack.proxy_port, interval_s=0.25, timeout_s=10) as health:
        load = pool.submit(generator.run, job)
        time.sleep(0.5 + BEFORE_S)  # the timeline of the scenario: load first, then the stop
        try:
            os.kill(stack.triton_pid, signal.SIGSTOP)
            stopped = time.monotonic()
            time.sleep(STOP_S)  # the hang itself: its length is the scenario
            circuit = promtext.maximum(promtext.scrape(stack.shim.url + "/metrics", timeout_s=5), "shim_circuit_open",
                                       backend="triton")
        finally:
            # Read before the signal: a poll that Triton answered after SIGCONT ends after this instant, even when
            # this thread waits for the GIL between the kill and its next clock read (seen in CI: 200 in 0.96 s).
            resuming = time.monotonic()
            os.kill(stack.triton_pid, signal.SIGCONT)
        resumed = time.monotonic()
        while time.monotonic() - resumed < 10:  # /predict again: requests that start after SIGCONT
            answer = predict(stack.proxy_port, stack.image, timeout_s=15)
            if answer.status == 200:
                recovered = answer
                break
        outcome = load.result()

    ready = health.answers["/readyz"]
    # app/readiness.py: while a check is under way, other callers get the latest answer until that check has
    # waited past the deadline, so a "ready" may be repeated for one deadline after the hang began; from then
    # on every poll must be a 503 within the deadline.
    during = [a for a in ready if stopped + READINESS_DEADLINE_S + 0.05 <= a.started
              and a.started + a.seconds < resuming]
    after = [a for a in ready if a.started >= resumed and a.status == 200]
    ready_again = after[0].started + after[0].seconds - resumed if after else float("inf")
    predict_again = recovered.started + recovered.seconds - resumed if recovered else float("inf")
    statuses: dict[str, int] = {}
    for e in outcome.errors:
        statuses[e or "200"] = statuses.get(e or "200", 0) + 1
    longest = max(outcome.latencies)

    scenario = "c Triton SIGSTOP (nginx)"
    figures.add(scenario, f"/readyz while stopped ({len(during)} polls): statuses",
                ", ".join(sorted({str(a.status or a.error) for a in during})) or "none")
    figures.add(scenario, "/readyz while stopped: p50 / max",
                f"{percentile([a.seconds for a in during], 50) * 1000:.0f} / "
                f"{max((a.seconds for a in during), default=0) * 1000:.0f} ms "
                f"(the readiness deadline {READINESS_DEADLINE_S:g} s)")
    figures.add(scenario, "/healthz max while stopped", f"{max(health.latencies('/healthz')) * 1000:.0f} ms")
    figures.add(scenario, f"{CLIENTS} clients: answers", ", ".join(f"{k} x{v}" for k, v in sorted(statuses.items())))
    figures.add(scenario, "longest request", f"{longest:.2f} s (SHIM_TRITON_TIMEOUT_S {settings.triton_timeout_s:g} s)")
    figures.add(scenario, "circuit open at the end of the stop", "yes" if circuit else "no")
    figures.add(scenario, "after SIGCONT: /predict 200 / /readyz 200 after",
                f"{predict_again:.2f} s / {ready_again:.2f} s")

    assert during, "no /readyz poll fell within the stop"
    slow_or_wrong = [(a.status, a.error, round(a.seconds, 2)) for a in during
                     if a.status != 503 or a.seconds > READINESS_DEADLINE_S + MARGIN_S]
    assert not slow_or_wrong, f"/readyz while Triton hung (want 503 within {READINESS_DEADLINE_S:g} s): " \
                              f"{slow_or_wrong}"
    assert set(statuses) <= {"200", "HTTP 503", "HTTP 504"}, statuses
    assert longest <= settings.triton_timeout_s + 1.0, f"a request waited {longest:.1f} s"
    assert predict_again <= RECOVERY_S, f"/predict answered 200 again {predict_again:.2f} s after SIGCONT"
    assert ready_again <= RECOVERY_S, f"/readyz answered 200 again {ready_again:.2f} s after SIGCONT"
