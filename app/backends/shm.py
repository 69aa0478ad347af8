"""System shared memory regions for the `shm` transports: files in /dev/shm that Triton maps by key.

Names say who owns a region, so that what a worker leaves behind is found and removed:

    shim_<host tag>_<pid>_<n>_<in|out>    (the file /dev/shm/<name>; Triton's region name is the same)

A worker makes its regions after gunicorn forks, one pair per sender thread, and removes them when it
exits; gunicorn's master removes those of a worker that was killed (app.backends.shm.forget_worker from
its child_exit hook), and every worker sweeps leftovers of dead processes of its host before it makes its
own. Nothing here imports tritonclient: registration goes through the Triton backend's client, the
master's clean-up through Triton's HTTP API with the standard library.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import re
import socket
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

log = logging.getLogger(__name__)
SHM_DIR = Path("/dev/shm")
PREFIX = "shim"
_NAME = re.compile(rf"^{PREFIX}_([0-9a-f]{{8}})_(\d+)_")


def host_tag() -> str:
    """Eight hex digits of this host's name: regions of two hosts (containers) sharing /dev/shm never clash."""
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:8]


def worker_prefix(pid: int | None = None) -> str:
    return f"{PREFIX}_{host_tag()}_{os.getpid() if pid is None else pid}_"


@dataclass
class Region:
    """One mapped region: `name` is both the /dev/shm file and Triton's name for it."""

    name: str
    size: int
    _map: mmap.mmap = field(repr=False)

    @property
    def key(self) -> str:
        return "/" + self.name  # what shm_open (and Triton's registration) takes

    def array(self, dtype: Any, shape: tuple[int, ...]) -> npt.NDArray[Any]:
        """A numpy view of the region's first bytes: writing into it is writing into the region."""
        return np.ndarray(shape, dtype=dtype, buffer=self._map)

    def close(self) -> None:
        with contextlib.suppress(BufferError):  # a view still alive: the mapping goes with the process
            self._map.close()
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / self.name).unlink()


def create(name: str, size: int, mode: int) -> Region:
    """A fresh region of `size` bytes; a leftover file of the same name (a dead process's) is replaced."""
    path = SHM_DIR / name
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # the name carries our pid: whatever holds it now is from a process that is gone
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.fchmod(fd, mode)  # not subject to the umask: Triton may run as another user (docker compose)
        os.ftruncate(fd, size)
        mapped = mmap.mmap(fd, size)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return Region(name, size, mapped)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_names(names: list[str]) -> list[str]:
    """Those of `names` made on this host by a process that no longer runs."""
    tag = host_tag()
    found = []
    for name in names:
        match = _NAME.match(name)
        if match and match.group(1) == tag and not _alive(int(match.group(2))):
            found.append(name)
    return found


def sweep_files() -> list[str]:
    """Remove /dev/shm files of dead processes of this host; return their names."""
    try:
        names = [p.name for p in SHM_DIR.iterdir() if p.name.startswith(PREFIX + "_")]
    except OSError:
        return []
    removed = []
    for name in stale_names(names):
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / name).unlink()
            removed.append(name)
    return removed


def forget_worker(triton_url: str, pid: int, timeout_s: float = 2.0) -> None:
    """gunicorn's master, after worker `pid` died: unregister its regions from Triton, remove its files.

    Best effort with short timeouts: a Triton that is down has no registrations to keep anyway.
    """
    prefix = worker_prefix(pid)
    for path in SHM_DIR.glob(prefix + "*"):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    base = f"http://{triton_url}/v2/systemsharedmemory"
    try:
        with urllib.request.urlopen(base + "/status", timeout=timeout_s) as response:
            regions = json.loads(response.read() or b"[]")
        for region in regions:
            if str(region.get("name", "")).startswith(prefix):
                request = urllib.request.Request(f"{base}/region/{region['name']}/unregister", data=b"",
                                                 method="POST")
                urllib.request.urlopen(request, timeout=timeout_s).close()
    except (OSError, ValueError) as e:  # unreachable, or not the JSON we know
        log.info("could not unregister the shared memory of worker %d from Triton: %s", pid, e)
