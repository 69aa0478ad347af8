"""Leftover shared memory of a process that is gone is swept, whatever its host name and pid namespace
(a recreated container has a new host name, and pids repeat across containers); a live owner's is kept.

Ownership is a flock on the owner's lock file in /dev/shm: the kernel releases it when the process dies.
The other processes run in a UTS and pid namespace of their own (`unshare`, as another container sharing
this IPC namespace would) when this machine allows it, else as plain subprocesses.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from app.backends import shm
from app.backends.triton import TritonBackend
from devstack import EmbeddedTriton
from tests.support import ROOT

pytestmark = pytest.mark.triton
OTHER_HOST = "recreated-container"
# Makes an owner and a registered pair, as a worker would, then dies without cleaning up or lives on.
CONTAINER = """
import json, os, socket, sys, urllib.request
try:
    socket.sethostname({host!r})
except PermissionError:
    pass
from app.backends import shm
owner = shm.Owner()
region = owner.create("1_in", 4096, 0o666)
body = json.dumps({{"key": region.key, "offset": 0, "byte_size": region.size}}).encode()
request = urllib.request.Request("http://{url}/v2/systemsharedmemory/region/" + region.name + "/register",
                                 data=body, method="POST")
urllib.request.urlopen(request, timeout=30).close()
print(json.dumps({{"name": region.name, "pid": os.getpid(), "host": socket.gethostname()}}), flush=True)
if {die}:
    os._exit(0)  # gone, as a killed container's worker: its files and registration stay behind
sys.stdin.read()  # alive until the test closes its stdin
"""


def in_another_container(triton: EmbeddedTriton, *, die: bool) -> subprocess.Popen[str]:
    code = CONTAINER.format(host=OTHER_HOST, url=triton.http_url, die=die)
    isolate = ["unshare", "--uts", "--pid", "--fork"] if shutil.which("unshare") and _can_unshare() else []
    return subprocess.Popen([*isolate, sys.executable, "-c", code], cwd=ROOT, text=True, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _can_unshare() -> bool:
    return subprocess.run(["unshare", "--uts", "--pid", "--fork", "true"], capture_output=True).returncode == 0


def registered(triton: EmbeddedTriton) -> set[str]:
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/systemsharedmemory/status", timeout=30) as answer:
        return {r["name"] for r in json.loads(answer.read())}


def test_a_new_worker_sweeps_what_gone_owners_left_under_any_host_name_and_keeps_a_live_owners(
        triton: EmbeddedTriton) -> None:
    dead = in_another_container(triton, die=True)
    out, err = dead.communicate(timeout=60)
    assert dead.returncode == 0, err
    left = json.loads(out)
    live = in_another_container(triton, die=False)
    assert live.stdout is not None
    alive = json.loads(live.stdout.readline())
    try:
        if shutil.which("unshare") and _can_unshare():
            assert (left["host"], left["pid"]) == (OTHER_HOST, 1), left  # another host name, a repeated pid
        # Not asserted to be still there: any sweeper may have removed it already (the master of another shim
        # of this test session, when one of its workers exits). Whoever sweeps, it must go, and the live one stay.

        backend = TritonBackend(url=triton.http_url, model="resnet50", version="", connect_timeout_s=1,
                                network_timeout_s=30, readiness_timeout_s=10, image_shape=(3, 224, 224),
                                classes=1000, max_batch_size=8, transport="shm")
        try:
            state = backend.ready()  # settles the transport: the sweep comes first
            assert state.ready and backend.transport == "shm", state.detail
        finally:
            backend.close()
        assert not (shm.SHM_DIR / left["name"]).exists(), "the gone owner's region file is still there"
        assert left["name"] not in registered(triton), "the gone owner's registration is still there"
        gone = shm.owner_of(left["name"])
        assert gone is not None and not Path(shm.SHM_DIR / f"{shm.PREFIX}_{gone}{shm.LOCK_SUFFIX}").exists()
        assert (shm.SHM_DIR / alive["name"]).exists() and alive["name"] in registered(triton), "a live owner's"
    finally:
        live.communicate(timeout=60)  # closes its stdin: it exits, and leaves its region behind
        shm.forget_dead_owners(triton.http_url)  # as gunicorn's master would after it
    assert not (shm.SHM_DIR / alive["name"]).exists() and alive["name"] not in registered(triton)
