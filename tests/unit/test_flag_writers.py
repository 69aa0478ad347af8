"""Writers of the traffic flag never undo each other: every write applies on top of the latest file, under a
lock shared by every process, and gets its own revision; a stale If-Match is refused (412).
An automatic rollback without a flag file rolls back its own worker, and the request gets its own answer."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from app.settings import Mode
from app.traffic import TrafficFlag, TrafficState
from tests.support import ROOT
from tests.unit.test_api import ADMIN, make_app

ADMIN_WRITES = 150

ADMIN_WRITER = """
import sys
from pathlib import Path
from app.settings import Mode
from app.traffic import TrafficFlag, TrafficState
flag = TrafficFlag(Path(sys.argv[1]), TrafficState(mode=Mode.TRITON), poll_s=0.5)
for i in range(1, int(sys.argv[2]) + 1):
    flag.write({"shadow_percent": i % 100 or 100}, updated_by="admin-api")
"""
ROLLBACK_WRITER = """
import json, sys, time
from pathlib import Path
from app.rollback import AutoRollback
from app.settings import Mode
from app.traffic import TrafficFlag, TrafficState
path = Path(sys.argv[1])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # until the admin writer is under way
    try:
        if json.loads(path.read_text()).get("shadow_percent", 0) >= 10:
            break
    except ValueError:
        pass
flag = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=0.5)
rollback = AutoRollback(flag, error_rate=0.5, window_s=60, min_requests=4)
for _ in range(4):
    rollback.record(ok=False)
print(flag.current().canary_percent)
"""


def run(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_an_admin_change_and_an_automatic_rollback_in_other_processes_never_undo_each_other(tmp_path: Path) -> None:
    path = tmp_path / "traffic.json"
    path.write_text(json.dumps({"mode": "canary", "canary_percent": 20}))
    admin = run(ADMIN_WRITER, str(path), str(ADMIN_WRITES))
    rollback = run(ROLLBACK_WRITER, str(path))
    for process in (admin, rollback):
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
    final = json.loads(path.read_text())
    assert final["canary_percent"] == 0, f"the rollback was undone by an admin write: {final}"
    assert final["shadow_percent"] == ADMIN_WRITES % 100 or final["updated_by"] == "auto-rollback", final
    assert final["revision"] == ADMIN_WRITES + 1, "every write applies on top of the one before it"


def test_a_write_applies_on_top_of_the_file_not_this_workers_copy(tmp_path: Path) -> None:
    path = tmp_path / "traffic.json"
    mine = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=3600)  # its copy never goes stale by itself
    other = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=3600)
    mine.write({"mode": "canary", "canary_percent": 20}, updated_by="admin-api")
    other.write({"canary_percent": 0, "reason": "rollback"}, updated_by="auto-rollback")
    state = mine.write({"shadow_percent": 7}, updated_by="admin-api")
    assert (state.mode, state.canary_percent, state.shadow_percent, state.revision) == (Mode.CANARY, 0, 7, 3)


def test_if_match_with_a_stale_etag_is_refused_with_412_and_changes_nothing(tmp_path: Path) -> None:
    app = make_app(tmp_path)
    try:
        seen = app.client.get("/traffic")
        etag = seen.headers["ETag"]
        assert etag.startswith('"') and seen.json["revision"] == 0
        changed = app.client.put("/admin/traffic", json={"mode": "legacy"}, headers={**ADMIN, "If-Match": etag})
        assert changed.status_code == 200, changed.json
        assert changed.headers["ETag"] != etag and changed.json["revision"] == 1
        stale = app.client.put("/admin/traffic", json={"mode": "triton"}, headers={**ADMIN, "If-Match": etag})
        assert stale.status_code == 412 and stale.json["error"] == "precondition_failed", stale.json
        assert "GET /traffic" in stale.json["message"]
        assert app.client.get("/traffic").json["mode"] == "legacy"
        current = app.client.get("/traffic").headers["ETag"]
        again = app.client.put("/admin/traffic", json={"mode": "triton"}, headers={**ADMIN, "If-Match": current})
        assert again.status_code == 200 and again.json["mode"] == "triton"
        anything = app.client.put("/admin/traffic", json={"mode": "legacy"}, headers={**ADMIN, "If-Match": "*"})
        assert anything.status_code == 200
    finally:
        app.flask.extensions["shim"].close()


def test_an_automatic_rollback_without_a_flag_file_rolls_this_worker_back_and_answers_the_request(
        tmp_path: Path) -> None:
    app = make_app(tmp_path, flag_file=None, mode=Mode.CANARY, canary_percent=100, fallback=True,
                   auto_rollback=True, rollback_min_requests=4, rollback_error_rate=0.5)
    app.triton.down = True
    try:
        for _ in range(6):
            answer = app.predict()
            assert answer.status_code == 200, answer.json  # legacy's answer, never a 400 from the rollback
            assert answer.headers["X-Shim-Backend"] == "legacy"
        view = app.client.get("/traffic").json
        assert (view["canary_percent"], view["source"], view["updated_by"]) == (0, "local", "auto-rollback")
        refused = app.client.put("/admin/traffic", json={"mode": "legacy"}, headers=ADMIN)
        assert refused.status_code == 409 and "SHIM_FLAG_FILE" in refused.json["message"], refused.json
    finally:
        app.flask.extensions["shim"].close()
