"""The benchmark's parts that need no server: Triton variants, CPU accounting (psutil), the profile summary."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import cpu
from bench.profile import parse_raw, stages, top
from bench.report import cpu_split, cpu_split_lines
from tests.support import wait_until


def test_instances_variant_has_no_dynamic_batching(tmp_path: Path) -> None:
    """Configuration (2)'s repository, as bench/stack.py writes it for Triton: no batching, 2 instances."""
    from google.protobuf import text_format

    from bench import stack
    from devstack.cpu_repo import read_config

    model_pt = tmp_path / "model.pt"
    model_pt.write_bytes(b"not read")
    for variant, batching in ((stack.Variant("instances", 2, dynamic_batching=False), False),
                              (stack.Variant("batching", 2, dynamic_batching=True), True)):
        repo = stack.variant_repo(tmp_path / "repos", variant, model_pt)
        config = read_config(repo / "resnet50" / "config.pbtxt")
        assert config.HasField("dynamic_batching") is batching, text_format.MessageToString(config)
        assert [g.count for g in config.instance_group] == [2]
        assert (repo / "resnet50" / "1" / "model.pt").resolve() == model_pt.resolve()


# -- the pure parts -------------------------------------------------------------------------------------------

def test_cpu_window_counts_new_and_exited_processes() -> None:
    # Group "g": 10 (root) -> 11 (alive throughout), 12 (exits, reaped by 10), 13 (appears).
    start = cpu.Snapshot({"g": {10: (1.00, 0.0), 11: (0.50, 0.0), 12: (0.30, 0.0)}})
    end = cpu.Snapshot({"g": {10: (1.10, 0.45), 11: (0.70, 0.0), 13: (0.05, 0.0)}})
    # 10: +0.10 own, +0.45 reaped (12's whole 0.45 s) ; 11: +0.20 ; 13: +0.05 from 0 ; 12 had 0.30 before.
    got = cpu.window_seconds(start, end)["g"]
    assert got["cpu_s"] == pytest.approx(0.10 + 0.45 + 0.20 + 0.05 - 0.30)
    assert (got["processes"], got["processes_at_start"]) == (3, 3)


def test_cpu_snapshot_reads_this_process_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # a child that burns CPU until killed
    try:
        first = cpu.snapshot({"me": (os.getpid(),)})
        wait_until(lambda: cpu.window_seconds(first, cpu.snapshot({"me": (os.getpid(),)}))["me"]["cpu_s"] > 0.05,
                   30, "the child's CPU time to show in the tree's")
        assert child.pid in cpu.snapshot({"me": (os.getpid(),)}).groups["me"]
    finally:
        child.kill()
        child.wait()


def test_profile_summary_ranks_own_and_total_time(tmp_path: Path) -> None:
    source = tmp_path / "worker.py"
    source.write_text("def run():\n    item = queue.get(block=True)\n    handle(item)\n")
    w = f"run ({source}:2)"  # a thread blocked in queue.get: waiting, whatever py-spy thought
    raw = (f"run ({source}:3);handle (/x/site-packages/app.py:5);decode (/x/app/pre.py:9) 60\n"
           f"run ({source}:3);handle (/x/site-packages/app.py:5) 30\n"
           f"run ({source}:3);handle (/x/site-packages/app.py:5);to_tensor (/x/app/pre.py:20) 10\n"
           f"{w} 50\n")
    stacks, samples = parse_raw(raw)
    assert samples == 150
    ranked = top(stacks, limit=2)
    assert (ranked["working_samples"], ranked["waiting_samples"]) == (100, 50)
    assert [(e["function"], e["own_pct"]) for e in ranked["by_own"]] == [("decode (app/pre.py)", 60.0),
                                                                          ("handle (app.py)", 30.0)]
    assert [(e["function"], e["total_pct"]) for e in ranked["by_total"]] == [("handle (app.py)", 100.0),
                                                                             (f"run ({source})", 100.0)]


def test_the_triton_call_is_one_stage_whichever_code_moves_its_bytes() -> None:
    """The shim's own socket code for the infer call (app/backends/triton/) belongs to the Triton request, not to
    "other shim code", where it once hid a sixth of the working samples."""
    send = "_send (/x/app/batching.py:1);infer (/x/app/backends/triton/encoded.py:2)"
    raw = (f"{send};Wire._send (/x/app/backends/triton/wire.py:3) 30\n"
           f"{send};generate_request_body (/x/site-packages/tritonclient/http/_utils.py:4) 10\n"
           "predict (/x/app/api.py:5);Router.route (/x/app/routing.py:6) 10\n"
           "predict (/x/app/api.py:5);softmax (/x/app/scores.py:7) 50\n")
    shares = stages(parse_raw(raw)[0])
    assert (shares["Triton request: build, send, parse"], shares["other shim code"], shares["scores, top-k"]) == \
        (40.0, 10.0, 50.0)


def test_the_shims_cpu_split_adds_up_to_its_process_trees_cpu() -> None:
    shim = {"cpu_request_ms": 9.0, "cpu_decode_ms": 3.0, "cpu_preprocess_ms": 3.5, "cpu_postprocess_ms": 0.3,
            "cpu_send_ms": 1.0}
    row = {"kind": "shim", "label": "shim [uint8]", "concurrency": 16, "cpu_ms_per_image": {"shim": 11.0},
           "breakdown": {"shim": shim}}
    split = cpu_split(row)
    assert split is not None
    assert split["rest of request"] == pytest.approx(9.0 - 3.0 - 3.5)  # postprocess is the senders' (per batch)
    assert split["outside the app"] == pytest.approx(11.0 - 9.0 - 1.0 - 0.3)
    assert sum(v for k, v in split.items() if k != "front") == pytest.approx(11.0)
    table = "\n".join(cpu_split_lines([row]))
    assert "| shim [uint8] | 16 | 11.00 | 3.00 | 3.50 | 0.30 | 2.50 | 1.00 | 0.70 | 4.50 |" in table
    # A shim without the counters (an older commit) gets no split rather than made-up numbers.
    assert cpu_split({**row, "breakdown": {"shim": {}}}) is None and cpu_split_lines([{**row, "breakdown": {}}]) == []


@pytest.mark.parametrize("threads", [9, 16, 72, 200])
def test_every_thread_layout_the_bench_asks_for_is_one_the_shim_starts_with(threads: int) -> None:
    from app.settings import SPARE_THREADS, Settings
    from bench.stack import shim_layout

    settings = Settings.from_env(shim_layout(2, threads))  # raises SettingsError for a layout it refuses
    assert (settings.workers, settings.threads) == (2, threads)
    assert settings.max_pending == threads - SPARE_THREADS


def test_the_memory_benchmarks_upload_is_the_largest_the_limits_accept() -> None:
    """bench/memory.py's worst input: an image of exactly the pixel limit, in a body just under the upload
    limit, which the shim's own upload reader and decoder take (small limits here, the defaults there)."""
    import io

    from PIL import Image

    from app.preprocess import ImageSpec, decode
    from app.uploads import image_from_form
    from bench.memory import BOUNDARY, multipart, worst_image

    limit = 1 << 20
    body = multipart(worst_image(250_000, limit))
    assert limit - 4096 <= len(body) <= limit
    image = image_from_form(body, f"multipart/form-data; boundary={BOUNDARY}", "image", max_parts=1000,
                            max_field_bytes=limit)
    assert Image.open(io.BytesIO(image)).size == (500, 500)
    assert decode(image, ImageSpec(max_pixels=250_000)).size == (500, 500)


def test_the_front_end_benchmarks_decode_step_is_near_free_and_passes_the_start_up_checks(tmp_path: Path) -> None:
    """bench --frontend's encoded rows: the decode step keeps its config (interface, parameters) and its ensemble,
    runs near_free_decode.py, and devstack's checks before Triton starts accept it (a stale decode.py they refuse)."""
    from devstack.cpu_repo import check_model_files, read_config
    from devstack.errors import EmbeddedTritonError
    from modelrepo.standin import write_standin_repo

    repo = write_standin_repo(tmp_path / "repo", near_free_decode=True)
    source = Path(__file__).resolve().parents[2] / "triton_repo"
    assert {"resnet50_decode", "resnet50_encoded"} <= {p.name for p in repo.iterdir()}
    code = (repo / "resnet50_decode" / "1" / "model.py").read_text()
    assert code == (source.parent / "modelrepo" / "triton_models" / "near_free_decode.py").read_text()
    assert read_config(repo / "resnet50_decode" / "config.pbtxt") == read_config(
        source / "resnet50_decode" / "config.pbtxt")
    check_model_files(repo)
    (repo / "resnet50_decode" / "1" / "model.py").write_text(code + "\n# edited by hand\n")
    with pytest.raises(EmbeddedTritonError, match="decode step"):
        check_model_files(repo)
    assert "resnet50_decode" not in {p.name for p in write_standin_repo(tmp_path / "plain").iterdir()}


def test_the_gpu_host_estimate_counts_the_shim_and_nginx_as_deployed_and_tritons_front() -> None:
    from bench import frontcheck

    def row(kind: str, transport: str | None, cpu: dict[str, float]) -> dict[str, object]:
        return {"kind": kind, "transport": transport, "label": f"{kind} [{transport}]", "concurrency": 16,
                "qps": 100.0, "cpu_ms_per_image": cpu}

    rows = [row("shim", "encoded", {"shim": 1.0, "triton": 3.0}), row("direct", None, {"triton": 0.6})]
    text = "\n".join(frontcheck.lines(rows, 2, None))
    assert "| 16,000 | 10,000 |" in text  # 16 x 1000 / 1.0 alone, / (1.0 + 0.6) with the front
    assert ("PASS c=16, the shim without nginx: 16-core GPU host, 16 x 1000 / (shim 1.00 + Triton's front 0.60) = "
            "10,000") in text
    # Behind nginx the shim's own CPU counts as measured there, and nginx's beside it: that line comes first.
    rows.append(row("proxied", "encoded", {"shim": 1.1, "nginx": 0.3, "triton": 3.0}))
    estimates = [line for line in frontcheck.lines(rows, 2, None) if "16-core GPU host" in line]
    assert estimates[0] == ("NOT MET c=16, as deployed, behind nginx: 16-core GPU host, 16 x 1000 / (shim 1.10 + "
                            "nginx 0.30 + Triton's front 0.60) = 8,000 images/s (target >= 10,000; an estimate until "
                            "the device kit measures it)")
    assert estimates[1].startswith("PASS c=16, the shim without nginx")
    assert "16-core GPU host" not in "\n".join(frontcheck.lines(rows[:1], 2, None)), "no direct row: no front, no line"


def test_a_group_of_clients_kept_waiting_shows_in_the_client_spread() -> None:
    from bench.loadgen import Outcome
    from bench.report import summarize

    even = Outcome(window_s=10.0)
    held = Outcome(window_s=10.0)
    for k in range(40):
        client = k % 4
        even.record(float(k) / 10, float(k) / 10 + 0.1, 0.0, client=client)
        # clients 2 and 3 wait behind one long batch: three times as long as clients 0 and 1
        held.record(float(k) / 10, float(k) / 10 + (0.3 if client >= 2 else 0.1), 0.0, client=client)
    held.record(9.0, 9.5, 0.0, error="HTTP 503", client=0)  # an error is no answer: it does not count
    assert summarize(even)["client_spread"] == pytest.approx(1.0)
    assert summarize(held)["client_spread"] == pytest.approx(3.0)
    assert summarize(Outcome(window_s=10.0))["client_spread"] is None


def test_a_warm_up_too_short_for_the_clients_to_settle_is_named_with_one_that_is_long_enough() -> None:
    """Closed-loop clients at 2 s a request get 2 answers each from a 5 s warm-up: the window may hold the start."""
    from bench.loadgen import Outcome
    from bench.report import SETTLED_ANSWERS, short_warmup_notes, summarize

    slow = Outcome(window_s=20.0)
    for client in range(4):
        start = -5.0
        while start < 20.0:  # a request every 2 s; the first one of client 3 fails
            slow.record(start, start + 2.0, 0.0, error="HTTP 503" if (client, start) == (3, -5.0) else "",
                        client=client)
            start += 2.0
    row = {"label": "(3) shim", "concurrency": 4, **summarize(slow)}
    assert row["warmup_answers_fewest"] == 1, "client 3's failed answer is no answer"
    (note,) = short_warmup_notes([row], warmup_s=5.0)
    assert note.startswith("(3) shim, 4 clients: a client had 1 answer in the 5 s warm-up")
    assert "`--warmup 10` or more" in note  # 3 answers at the row's p50 of 2 s, in steps of 5 s

    settled = {**row, "warmup_answers_fewest": SETTLED_ANSWERS}
    assert short_warmup_notes([settled, {**row, "warmup_answers_fewest": None}], warmup_s=5.0) == []


def test_the_kit_knows_what_a_lent_machine_cannot_import(tmp_path: Path) -> None:
    """bench/kit_imports.py: the device kit's own imports (bench.stack needs psutil; tritonclient, ml-dtypes) are
    carried by a stage; a script whose stages lack them is told so, naming the module and its distribution. In a
    fresh interpreter, as the dry run's: pytest's own modules are not the kit's."""
    import json

    from bench.kit_imports import staged

    script = Path(__file__).resolve().parents[2] / "bench" / "device_check.sh"
    assert {"psutil", "ml-dtypes", "tritonclient", "flask", "nvidia-pytriton"} <= staged(script)
    lacking = tmp_path / "device_check.sh"
    lacking.write_text(script.read_text().replace(" psutil==7.2.2", "").replace(" ml-dtypes==0.5.4", ""))

    def unstaged(path: Path) -> object:
        code = ("import json, sys, pathlib, tritonclient.http, bench.stack; from bench.kit_imports import unstaged; "
                "print(json.dumps(unstaged(pathlib.Path(sys.argv[1]))))")
        run = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                             cwd=script.parents[1])
        assert run.returncode == 0, run.stderr[-2000:]
        return json.loads(run.stdout.strip().splitlines()[-1])

    assert unstaged(script) == {}
    assert unstaged(lacking) == {"ml_dtypes": ["ml-dtypes"], "psutil": ["psutil"]}
