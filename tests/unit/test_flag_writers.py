"""Writers of the traffic flag (shim-traffic, the automatic rollback) never undo each other: every write applies
on top of the latest file, under a lock shared by every process, and gets its own revision."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from app.settings import Mode
from app.traffic import TrafficFlag, TrafficState
from tests.support import ROOT

OPERATOR_WRITES = 150

OPERATOR_WRITER = """
import sys
from pathlib import Path
from app.settings import Mode
from app.traffic import TrafficFlag, TrafficState
flag = TrafficFlag(Path(sys.argv[1]), TrafficState(mode=Mode.TRITON), poll_s=0.5)
for i in range(1, int(sys.argv[2]) + 1):
    flag.write({"shadow_percent": i % 100 or 100}, updated_by="shim-traffic")
"""
ROLLBACK_WRITER = """
import json, sys, time
from pathlib import Path
from app.rollback import AutoRollback
from app.settings import Mode
from app.traffic import TrafficFlag, TrafficState
path = Path(sys.argv[1])
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # until the operator's writer is under way
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


def test_an_operators_change_and_an_automatic_rollback_in_other_processes_never_undo_each_other(tmp_path: Path) -> None:
    path = tmp_path / "traffic.json"
    path.write_text(json.dumps({"mode": "canary", "canary_percent": 20}))
    operator = run(OPERATOR_WRITER, str(path), str(OPERATOR_WRITES))
    rollback = run(ROLLBACK_WRITER, str(path))
    for process in (operator, rollback):
        _, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
    final = json.loads(path.read_text())
    assert final["canary_percent"] == 0, f"the rollback was undone by an operator's write: {final}"
    assert final["shadow_percent"] == OPERATOR_WRITES % 100 or final["updated_by"] == "auto-rollback", final
    assert final["revision"] == OPERATOR_WRITES + 1, "every write applies on top of the one before it"


def test_a_write_applies_on_top_of_the_file_not_this_workers_copy(tmp_path: Path) -> None:
    path = tmp_path / "traffic.json"
    mine = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=3600)  # its copy never goes stale by itself
    other = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=3600)
    mine.write({"mode": "canary", "canary_percent": 20}, updated_by="shim-traffic")
    other.write({"canary_percent": 0, "reason": "rollback"}, updated_by="auto-rollback")
    state = mine.write({"shadow_percent": 7}, updated_by="shim-traffic")
    assert (state.mode, state.canary_percent, state.shadow_percent, state.revision) == (Mode.CANARY, 0, 7, 3)
