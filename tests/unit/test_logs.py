"""app/logs.py: lines below WARNING written in batches, never lost or written twice; request IDs drawn in bulk."""

from __future__ import annotations

import io
import logging
import os
import uuid
from pathlib import Path

from app.logs import BUFFER_BYTES, BufferedStreamHandler, JsonFormatter, new_request_id
from tests.support import wait_until


def handler_on(stream: io.TextIOBase, flush_s: float) -> tuple[BufferedStreamHandler, logging.Logger]:
    handler = BufferedStreamHandler(stream, flush_s=flush_s)  # type: ignore[arg-type]
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(f"test-logs-{uuid.uuid4().hex}")
    logger.propagate, logger.level = False, logging.INFO
    logger.addHandler(handler)
    return handler, logger


def messages(text: str) -> list[str]:
    import json

    return [json.loads(line)["message"] for line in text.splitlines()]


def test_info_lines_wait_and_a_warning_writes_them_first_in_order() -> None:
    stream = io.StringIO()
    handler, logger = handler_on(stream, flush_s=3600)
    logger.info("one")
    logger.info("two")
    assert stream.getvalue() == ""  # one write for many lines, not one per request
    logger.warning("three")
    assert messages(stream.getvalue()) == ["one", "two", "three"]
    logger.info("four")
    handler.flush()  # what logging.shutdown does when a worker exits
    assert messages(stream.getvalue()) == ["one", "two", "three", "four"]


def test_a_waiting_line_is_written_within_the_flush_interval_with_nothing_else_logged() -> None:
    stream = io.StringIO()
    _, logger = handler_on(stream, flush_s=0.05)
    logger.info("alone")
    wait_until(lambda: messages(stream.getvalue()) == ["alone"], 5, "the flusher to write the line")


def test_a_full_buffer_is_written_at_once() -> None:
    stream = io.StringIO()
    _, logger = handler_on(stream, flush_s=3600)
    big = "x" * 1000
    for _ in range(BUFFER_BYTES // 1000 + 1):
        logger.info(big)
    assert len(stream.getvalue()) >= BUFFER_BYTES


def test_a_forked_worker_never_writes_its_parents_waiting_lines_again(tmp_path: Path) -> None:
    path = tmp_path / "log"
    with path.open("w") as stream:
        handler, logger = handler_on(stream, flush_s=3600)  # type: ignore[arg-type]
        logger.info("parent, before the fork")
        pid = os.fork()
        if pid == 0:  # the child: a gunicorn worker that logs and exits
            logger.info("child")
            handler.flush()
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        handler.flush()
    assert sorted(messages(path.read_text())) == ["child", "parent, before the fork"]


def test_request_ids_are_uuid4s_unique_and_drawn_anew_in_a_forked_worker() -> None:
    ids = [new_request_id() for _ in range(1000)]  # several 4 KiB draws
    assert len(set(ids)) == 1000
    assert all(uuid.UUID(i).version == 4 and uuid.UUID(i).hex == i for i in ids)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(write, new_request_id().encode())
        os._exit(0)
    os.waitpid(pid, 0)
    child = os.read(read, 64).decode()
    os.close(read), os.close(write)
    assert child != new_request_id() and uuid.UUID(child).version == 4  # not the parent's next bytes
