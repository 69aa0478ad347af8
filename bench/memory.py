"""`python -m bench --memory`: the peak memory of a shim worker under the worst input its limits accept.

One worker (SHIM_MODE=shadow: the legacy model loaded; other SHIM_* from this environment) gets SHIM_MAX_PENDING
uploads at once, each a MAX_IMAGE_PIXELS JPEG padded to just under the upload limit; SHIM_TRITON_TIMEOUT_S is
120 s so that no request leaves early. Peaks are the kernel's VmHWM; bench/RESULTS.md has the figures.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from PIL import Image

from app.admission import DECODE_SLOTS
from app.preprocess import MAX_IMAGE_PIXELS
from app.settings import Settings
from bench.stack import ROOT, standin_triton
from devstack import launch
from devstack.proxy import free_udp_port
from tests.sample_images import encode, photo

BOUNDARY = "benchmemoryboundary"


def status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def worst_image(max_pixels: int, max_upload_bytes: int) -> bytes:
    """A JPEG of max_pixels padded after its end marker to just under the upload limit (with the envelope)."""
    side = int(max_pixels ** 0.5)
    tile = photo(1024, 1024, seed=7)
    pixels = np.tile(tile, (side // 1024 + 1, side // 1024 + 1, 1))[:side, :side]
    data = encode(Image.fromarray(pixels), "JPEG", quality=85)
    room = max_upload_bytes - 4096 - len(data)
    if room < 0:
        raise SystemExit(f"a {side}x{side} JPEG is {len(data):,} bytes, over the upload limit: lower its quality")
    return data + b"\0" * room  # Pillow stops at the end marker; the body is still the full size


def multipart(image: bytes) -> bytes:
    head = (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"image\"; filename=\"worst.jpg\"\r\n"
            "Content-Type: image/jpeg\r\n\r\n").encode()
    return head + image + f"\r\n--{BOUNDARY}--\r\n".encode()


def post(port: int, body: bytes, timeout_s: float) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/predict", body=body,
                     headers={"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"})
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return 0
    finally:
        conn.close()


def main(args: argparse.Namespace) -> int:
    given = {k: v for k, v in os.environ.items() if k.startswith("SHIM_")}
    settings = Settings.from_env(given)
    uploads = args.uploads or settings.max_pending
    pixels = args.pixels or MAX_IMAGE_PIXELS
    upload_bytes = int(args.upload_mb * 2**20) if args.upload_mb else settings.max_upload_bytes
    legacy_model = ROOT / "triton_repo" / "resnet50" / "1" / "model.pt"  # what its model.toml names
    if not legacy_model.is_file():
        raise SystemExit(f"{legacy_model} is missing: run `make export` (the legacy model is part of the worst case)")
    with standin_triton("bench-memory-", given.get("SHIM_TRANSPORT") == "encoded") as (work, _, triton):
        env = {**given, "SHIM_TRITON_URL": triton.http_url,  # triton_repo's model.toml: labels, legacy model
               "SHIM_MODE": given.get("SHIM_MODE", "shadow"),
               "SHIM_WORKERS": "1", "SHIM_PROXY_LOG_ADDRESS": f"127.0.0.1:{free_udp_port()}",
               "SHIM_TRITON_TIMEOUT_S": "120"}
        shim = launch.start_shim(work, env)
        try:
            shim.wait("/readyz", timeout_s=300)
            master = shim.process.pid
            kids = psutil.Process(master).children()
            (worker,) = [c.pid for c in kids if "app.proxy_log" not in " ".join(c.cmdline())]
            (counter,) = [c.pid for c in kids if "app.proxy_log" in " ".join(c.cmdline())]
            idle = status_kib(worker, "VmRSS")
            body = multipart(worst_image(pixels, upload_bytes))
            print(f"memory: {uploads} uploads of {len(body) / 2**20:.1f} MiB at once, each a {pixels / 1e6:.1f} MP "
                  f"JPEG; SHIM_MAX_PENDING {settings.max_pending}, decode slots {DECODE_SLOTS}; "
                  f"SHIM_MODE={env['SHIM_MODE']} (legacy model {legacy_model.name}, "
                  f"{legacy_model.stat().st_size / 2**20:.0f} MiB, loaded in legacy, shadow and canary)",
                  flush=True)
            statuses: dict[int, int] = {}
            started = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(uploads) as pool:
                for _ in range(args.rounds):
                    for status in pool.map(lambda _: post(shim.port, body, 600), range(uploads)):
                        statuses[status] = statuses.get(status, 0) + 1
            elapsed = time.monotonic() - started
            figures: dict[str, Any] = {
                "worker_idle_rss_mib": idle / 1024,
                "worker_peak_rss_mib": status_kib(worker, "VmHWM") / 1024,
                "master_peak_rss_mib": status_kib(master, "VmHWM") / 1024,
                "counter_peak_rss_mib": status_kib(counter, "VmHWM") / 1024,
                "answers": statuses, "seconds": round(elapsed, 1),
            }
        finally:
            shim.stop()
    workers = settings.workers
    peak, idle_mib = figures["worker_peak_rss_mib"], figures["worker_idle_rss_mib"]
    own = figures["master_peak_rss_mib"] + figures["counter_peak_rss_mib"]
    # Behind nginx the pod holds SHIM_MAX_PENDING uploads in all, at worst in one worker; alone, each worker may
    behind_nginx = own + peak + (workers - 1) * idle_mib
    alone = own + workers * peak
    figures.update(pod_behind_nginx_mib=behind_nginx, pod_without_nginx_mib=alone)
    print(json.dumps(figures, indent=1))
    print(f"memory: a worker: {idle_mib:.0f} MiB ready, {peak:.0f} MiB at its peak; the master and the counter of "
          f"nginx's answers {own:.0f} MiB. SHIM_WORKERS={workers}, behind nginx: {behind_nginx:.0f} MiB at worst "
          f"({own:.0f} + {peak:.0f} + {workers - 1} x {idle_mib:.0f}); without nginx: {alone:.0f} MiB "
          f"({own:.0f} + {workers} x {peak:.0f}). Answers {statuses} in {elapsed:.0f} s", flush=True)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench --memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--memory", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rounds", type=int, default=2, help="rounds of SHIM_MAX_PENDING uploads at once (default 2)")
    p.add_argument("--model-pt", type=Path, help="the legacy model (default triton_repo/resnet50/1/model.pt)")
    p.add_argument("--uploads", type=int, help="uploads at once (default SHIM_MAX_PENDING)")
    p.add_argument("--pixels", type=int, help="pixels of each upload's image (default app.preprocess.MAX_IMAGE_PIXELS)")
    p.add_argument("--upload-mb", type=float, help="each upload's size (default SHIM_MAX_UPLOAD_MB)")
    return p.parse_args(argv)
