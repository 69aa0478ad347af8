"""CPU time of whole process trees over a measured window, read with psutil (on Linux, from /proc).

A group is its root PIDs and their descendants at each snapshot; a member born in the window counts from 0. One
that exits is reaped by its parent (a member), whose children times then hold its whole time: so the window
counts the members' children-time deltas too, minus what each exited member had used before it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import psutil

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")  # the kernel counts CPU time in these: the figures' resolution


@dataclass(frozen=True)
class Stat:
    ppid: int
    own: float  # user + system, seconds
    children: float  # children_user + children_system: reaped children's time, seconds


def process_table() -> dict[int, Stat]:
    """Every process that can be read now (one that exits meanwhile, or that is not ours to read, is left out)."""
    table = {}
    for proc in psutil.process_iter(["ppid", "cpu_times"]):
        ppid, times = proc.info["ppid"], proc.info["cpu_times"]
        if ppid is not None and times is not None:
            table[proc.pid] = Stat(ppid=ppid, own=times.user + times.system,
                                   children=times.children_user + times.children_system)
    return table


def descendants(roots: Iterable[int], table: Mapping[int, Stat]) -> set[int]:
    """The roots that are alive and every process below them."""
    children: dict[int, list[int]] = {}
    for pid, stat in table.items():
        children.setdefault(stat.ppid, []).append(pid)
    members, todo = set(), [r for r in roots if r in table]
    while todo:
        pid = todo.pop()
        if pid not in members:
            members.add(pid)
            todo.extend(children.get(pid, ()))
    return members


@dataclass
class Snapshot:
    """Per group {pid: (own, reaped children's) seconds} of every member, and the machine's (busy, idle) seconds."""

    groups: dict[str, dict[int, tuple[float, float]]] = field(default_factory=dict)
    machine: tuple[float, float] = (0.0, 0.0)


def machine_seconds() -> tuple[float, float]:
    """(busy, idle) seconds of all CPUs since boot (guest time is inside user already)."""
    t = psutil.cpu_times()

    def get(name: str) -> float:
        return float(getattr(t, name, 0.0))

    busy = sum(get(n) for n in ("user", "nice", "system", "irq", "softirq", "steal"))
    return busy, get("idle") + get("iowait")


def snapshot(groups: Mapping[str, Iterable[int]]) -> Snapshot:
    table = process_table()
    return Snapshot({name: {pid: (table[pid].own, table[pid].children) for pid in descendants(roots, table)}
                     for name, roots in groups.items()}, machine_seconds())


MACHINE = "machine"  # the whole machine's CPU beside the groups: what they do not explain is other work


def window_seconds(start: Snapshot, end: Snapshot) -> dict[str, dict[str, float]]:
    """Per group: CPU seconds between the snapshots and its processes; MACHINE: all CPUs' busy and idle seconds."""
    out = {}
    for name, at_end in end.groups.items():
        at_start = start.groups.get(name, {})
        seconds = 0.0
        for pid, (own, reaped) in at_end.items():
            own0, reaped0 = at_start.get(pid, (0.0, 0.0))  # appeared during the window: from 0
            seconds += (own - own0) + (reaped - reaped0)
        seconds -= sum(own0 for pid, (own0, _) in at_start.items() if pid not in at_end)  # exited: see above
        out[name] = {"cpu_s": max(seconds, 0.0), "processes": len(at_end), "processes_at_start": len(at_start)}
    if start.machine != (0.0, 0.0):
        out[MACHINE] = {"cpu_s": end.machine[0] - start.machine[0], "idle_s": end.machine[1] - start.machine[1]}
    return out


def find_pids(match: Callable[[list[str]], bool]) -> list[int]:
    """PIDs whose command line (argv) satisfies `match`."""
    return [p.pid for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] and match(p.info["cmdline"])]


def children_of(pid: int) -> list[int]:
    try:
        return sorted(child.pid for child in psutil.Process(pid).children())
    except psutil.NoSuchProcess:
        return []


def wait_idle(roots: Iterable[int], busy_below: float = 0.1, interval_s: float = 0.3, timeout_s: float = 60) -> float:
    """Wait (at most timeout_s, quietly) until the trees under `roots` use under `busy_below` of a core."""
    roots = tuple(roots)
    started = time.monotonic()
    previous = snapshot({"g": roots})
    while time.monotonic() - started < timeout_s:
        time.sleep(interval_s)
        current = snapshot({"g": roots})
        if window_seconds(previous, current)["g"]["cpu_s"] < busy_below * interval_s:
            break
        previous = current
    return time.monotonic() - started
