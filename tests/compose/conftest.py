"""The compose stack's checks: only under `make compose-test` (tests/compose/driver.py), never in `make test`.

They need a docker engine and the images that tests/compose/driver.py builds first, so `pytest` skips this
folder at collection unless COMPOSE_STACK=1 (which the driver sets). By hand, after a `make compose-test`
left the images: `COMPOSE_STACK=1 .venv/bin/pytest tests/compose` (with a running engine).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.compose.driver import Stack, StageError, busy_ports

collect_ignore_glob = [] if os.environ.get("COMPOSE_STACK") == "1" else ["test_*.py"]


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """docker-compose.yml with tests/compose/ci.yml, up and healthy; down with its volumes afterwards."""
    busy = busy_ports()
    if busy:
        pytest.fail(f"host port(s) {busy} are in use: the stack cannot publish its ports")
    running = Stack()
    try:
        running.up()
    except StageError as e:  # every test needs the stack: one message, not one error per test
        running.down()
        pytest.exit(f"docker compose up did not reach healthy: {e}", returncode=1)
    try:
        yield running
    finally:
        running.down()
