"""CPU time of whole process trees over a measured window, read from /proc (Linux): standard library only.

A group is named by its root PIDs (the shim's gunicorn master, tritonserver, the legacy app's master, the
floor's processes, the load generator's processes); its members are the roots and all their descendants
at the moment of each snapshot, found from the parent PIDs in /proc/<pid>/stat. A snapshot holds each
member's utime + stime and cutime + cstime in clock ticks (os.sysconf('SC_CLK_TCK') per second), and
the group's CPU over a window is the change between two snapshots:

  * a member alive at both ends counts end - start;
  * a member that appears during the window (a respawned gunicorn worker, a python-backend stub) counts
    from 0;
  * a member that exits during the window loses its own /proc entry. When its parent (a member too)
    reaps it, the kernel adds the child's whole utime + stime (and the time of the grandchildren it
    reaped) to the parent's cutime + cstime; so the window also counts the members' cutime + cstime
    deltas, minus what each exited member had already used at the start (counted before the window,
    not in it). A member reaped by a process outside the tree (reparented to init after its parent
    died) or not yet reaped at the end (a zombie keeps its utime/stime in /proc/<pid>/stat, so it is
    still counted as alive) is the only case this misses; none of the measured servers does that.

Every snapshot is taken by the one process that knows when the window opens and closes: the load
generator's child for the HTTP rows (bench/loadgen.py), the orchestrator for the floor.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Stat:
    ppid: int
    own: int  # utime + stime, ticks
    children: int  # cutime + cstime: reaped children's time, ticks


def read_stat(pid: int) -> Stat | None:
    """One process's /proc/<pid>/stat, or None when it is gone. The name (field 2) may hold spaces and
    parentheses: everything after the last ')' is split."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return None
    fields = text[text.rindex(b")") + 2:].split()
    # fields[0] is field 3 (state): ppid is field 4, utime/stime 14/15, cutime/cstime 16/17.
    return Stat(ppid=int(fields[1]), own=int(fields[11]) + int(fields[12]),
                children=int(fields[13]) + int(fields[14]))


def process_table() -> dict[int, Stat]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := read_stat(int(entry))) is not None:
            table[int(entry)] = stat
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
    """Per group: {pid: (own ticks, reaped children's ticks)} of every member at one moment; and the whole
    machine's (busy, idle) ticks from /proc/stat, summed over its CPUs."""

    groups: dict[str, dict[int, tuple[int, int]]] = field(default_factory=dict)
    machine: tuple[int, int] = (0, 0)


def machine_ticks() -> tuple[int, int]:
    """(busy, idle) ticks of all CPUs since boot: /proc/stat's first line (user nice system idle iowait irq
    softirq steal ...; guest time is already inside user)."""
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal, idle + iowait


def snapshot(groups: Mapping[str, Iterable[int]]) -> Snapshot:
    table = process_table()
    return Snapshot({name: {pid: (table[pid].own, table[pid].children) for pid in descendants(roots, table)}
                     for name, roots in groups.items()}, machine_ticks())


MACHINE = "machine"  # the whole machine's busy CPU, beside the groups: what the groups do not explain is
                     # other work (the benchmark's orchestrator, anything else running on the machine)


def window_seconds(start: Snapshot, end: Snapshot) -> dict[str, dict[str, float]]:
    """Per group: CPU seconds used between the snapshots, and how many processes the group had; plus
    MACHINE: every CPU's busy and idle seconds."""
    out = {}
    for name, at_end in end.groups.items():
        at_start = start.groups.get(name, {})
        ticks = 0
        for pid, (own, reaped) in at_end.items():
            own0, reaped0 = at_start.get(pid, (0, 0))  # appeared during the window: from 0
            ticks += (own - own0) + (reaped - reaped0)
        ticks -= sum(own0 for pid, (own0, _) in at_start.items() if pid not in at_end)  # exited: see above
        out[name] = {"cpu_s": max(ticks, 0) / CLOCK_TICKS, "processes": len(at_end),
                     "processes_at_start": len(at_start)}
    if start.machine != (0, 0):
        out[MACHINE] = {"cpu_s": (end.machine[0] - start.machine[0]) / CLOCK_TICKS,
                        "idle_s": (end.machine[1] - start.machine[1]) / CLOCK_TICKS}
    return out


def find_pids(match: Callable[[list[str]], bool]) -> list[int]:
    """PIDs whose command line (argv) satisfies `match`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
        except OSError:
            continue
        if argv and match(argv):
            found.append(int(entry))
    return found


def children_of(pid: int) -> list[int]:
    return sorted(p for p, stat in process_table().items() if stat.ppid == pid)


def wait_idle(roots: Iterable[int], busy_below: float = 0.1, interval_s: float = 0.3, timeout_s: float = 60) -> float:
    """Wait until the process trees under `roots` use less than `busy_below` of one core over `interval_s`
    (a server whose first worker answers while the others still import torch is not ready to be measured);
    returns the seconds waited. Gives up quietly after timeout_s."""
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
