"""The front-end report's wrk cross-check of the shim rows, the GPU-host estimates (cores x 1000 / the shim's CPU ms
per image, alone and with Triton's front: estimates, not measurements) and the encoded target (its shim CPU per
image <= 0.4 x that of the best tensor transport, the same run).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

ENCODED_TARGET = 0.4
HOST_TARGET = 10_000  # images/s through /predict on one 16-core GPU host (issue 29)
TENSOR_TRANSPORTS = ("fp32", "uint8")


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def encoded_checks(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency with an encoded row and a tensor row: the ratio of their shim CPU per image."""
    out = []
    for c in sorted({r["concurrency"] for r in rows if r.get("kind") == "shim"}):
        at = {r["transport"]: r for r in rows if r.get("kind") == "shim" and r["concurrency"] == c}
        tensors = {t: at[t]["cpu_ms_per_image"].get("shim") for t in TENSOR_TRANSPORTS if t in at}
        tensors = {t: v for t, v in tensors.items() if v}
        encoded = at.get("encoded", {}).get("cpu_ms_per_image", {}).get("shim")
        if not tensors or not encoded:
            continue
        best = min(tensors, key=lambda t: tensors[t])
        ratio = encoded / tensors[best]
        out.append({"concurrency": c, "best_tensor_transport": best, "best_tensor_cpu_ms": tensors[best],
                    "encoded_cpu_ms": encoded, "ratio": ratio, "bound": ENCODED_TARGET,
                    "met": ratio <= ENCODED_TARGET})
    return out


def triton_front_ms(rows: Sequence[dict[str, Any]]) -> float | None:
    """Triton's CPU per image serving ready tensors (the direct row): its front's cost, the model's included."""
    values = [r["cpu_ms_per_image"].get("triton") for r in rows if r.get("kind") == "direct"]
    values = [v for v in values if v]
    return min(values) if values else None


def host_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """16 cores x 1000 / the host's CPU ms per image on the encoded route: the shim and nginx as deployed (the row
    behind nginx) and Triton's front (the direct row), each measured; then each shim row without nginx."""
    front = triton_front_ms(rows)
    encoded = [r for r in rows if r.get("kind") in ("proxied", "shim") and r["transport"] == "encoded"
               and r["cpu_ms_per_image"].get("shim")]
    if not encoded or front is None:
        return []
    out = ["", "```"]
    for r in sorted(encoded, key=lambda r: (r["kind"] != "proxied", r["concurrency"])):
        parts = {"shim": r["cpu_ms_per_image"]["shim"], "nginx": r["cpu_ms_per_image"].get("nginx"),
                 "Triton's front": front}
        named = {k: v for k, v in parts.items() if v}
        host = 16 * 1000 / sum(named.values())
        what = "as deployed, behind nginx" if r["kind"] == "proxied" else "the shim without nginx"
        out.append(f"{'PASS' if host >= HOST_TARGET else 'NOT MET'} c={r['concurrency']}, {what}: 16-core GPU host, "
                   f"16 x 1000 / ({' + '.join(f'{k} {v:.2f}' for k, v in named.items())}) = {host:,.0f} images/s "
                   f"(target >= {HOST_TARGET:,}; an estimate until the device kit measures it)")
    return [*out, "```"]


def lines(rows: Sequence[dict[str, Any]], cores: int, wrk_note: str | None) -> list[str]:
    shims = [r for r in rows if r.get("kind") == "shim"]
    if not shims:
        return []
    out = ["## The shim rows: wrk beside the Python load generator, CPU per image, a GPU host's estimate", "",
           "Each shim row measured twice, one window after the other: by the Python load generator (above) and by "
           f"wrk (`bench/wrk.py`, the same bodies). `GPU host (estimate)` = {cores} cores x 1000 / the shim's CPU ms "
           "per image, with Triton's share on a GPU (not a measurement); `per 16 cores` the same for 16 cores; "
           "`with Triton's front` also counts Triton's CPU per image in the direct row (its HTTP front and the "
           "near-free model: an upper bound for the front); the lines under the table count the shim and nginx "
           "as deployed (the row behind nginx) first.", ""]
    if wrk_note:
        out += [wrk_note, ""]
    out += ["| row | clients | images/s (Python) | images/s (wrk) | wrk / Python | shim CPU ms/img (Python) | "
            "shim CPU ms/img (wrk) | Triton CPU ms/img (Python) | Triton CPU ms/img (wrk) | wrk's own CPU ms/img | "
            "GPU host (estimate), images/s | per 16 cores (estimate) | per 16 cores, with Triton's front (estimate) |",
            "| --- | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: | --: |"]
    front = triton_front_ms(rows)
    for r in shims:
        w = r.get("wrk") or {}
        wcpu = w.get("cpu_ms_per_image") or {}
        shim_cpu = r["cpu_ms_per_image"].get("shim")
        estimate = cores * 1000 / shim_cpu if shim_cpu else None
        ratio = w["qps"] / r["qps"] if w.get("qps") and r.get("qps") else None
        out.append(f"| {r['label']} | {r['concurrency']} | {_f(r['qps'], 1)} | {_f(w.get('qps'), 1)} | {_f(ratio)} | "
                   f"{_f(shim_cpu)} | {_f(wcpu.get('shim'))} | {_f(r['cpu_ms_per_image'].get('triton'))} | "
                   f"{_f(wcpu.get('triton'))} | {_f(wcpu.get('wrk'))} | {_f(estimate, 0)} | "
                   f"{_f(16 * 1000 / shim_cpu if shim_cpu else None, 0)} | "
                   f"{_f(16 * 1000 / (shim_cpu + front) if shim_cpu and front else None, 0)} |")
    errors = [r["label"] for r in shims
              if (r.get("wrk") or {}).get("non_2xx") or (r.get("wrk") or {}).get("socket_errors")]
    if errors:
        out += ["", f"wrk saw errors (non-2xx answers or socket errors) for: {', '.join(errors)}."]
    out += host_lines(rows)
    checks = encoded_checks(rows)
    if checks:
        out += ["", "```"]
        for chk in checks:
            out.append(f"c={chk['concurrency']}: {'PASS' if chk['met'] else 'NOT MET'} shim CPU per image with "
                       f"encoded / with the best tensor transport ({chk['best_tensor_transport']}) = "
                       f"{chk['encoded_cpu_ms']:.2f} / {chk['best_tensor_cpu_ms']:.2f} = {chk['ratio']:.2f} "
                       f"(target <= {chk['bound']})")
        out.append("```")
    return [*out, ""]
