"""Who the client is, for its sticky canary side: the TCP peer, or what the trusted proxies saw; never what
the client writes into X-Forwarded-For itself."""

from __future__ import annotations

import io
from pathlib import Path

from app.settings import Mode
from app.traffic import bucket
from tests.support import encode, photo
from tests.unit.test_api import make_app, post_multipart

CANARY = 50
JPEG = encode(photo(64, 48, seed=9), "JPEG")


def legacy_side(prefix: str) -> str:
    """An address whose bucket is on the legacy side (>= CANARY)."""
    return next(a for a in (f"{prefix}.{i}" for i in range(1, 255)) if bucket(a) >= CANARY)


FORGED = [a for a in (f"203.0.113.{i}" for i in range(1, 255)) if bucket(a) < CANARY][:8]  # canary-side keys


def side(app: object, peer: str, forwarded: str | None) -> str:
    headers = {"X-Forwarded-For": forwarded} if forwarded is not None else {}
    client = app.flask.test_client()  # type: ignore[attr-defined]
    client.environ_base["REMOTE_ADDR"] = peer
    answer = post_multipart(client, {"image": (io.BytesIO(JPEG), "a.jpg")}, headers=headers)
    assert answer.status_code == 200, answer.json
    return str(answer.headers["X-Shim-Backend"])


def test_a_forged_x_forwarded_for_cannot_move_a_direct_client_to_the_canary(tmp_path: Path) -> None:
    app = make_app(tmp_path, mode=Mode.CANARY, canary_percent=CANARY)
    peer = legacy_side("198.51.100")
    try:
        assert side(app, peer, None) == "legacy"
        for forged in FORGED:
            assert side(app, peer, forged) == "legacy", f"X-Forwarded-For: {forged} chose the canary"
            assert side(app, peer, f"{forged}, 10.0.0.1") == "legacy"
    finally:
        app.flask.extensions["shim"].close()


def test_behind_one_trusted_proxy_the_address_it_saw_decides_not_what_the_client_prepended(tmp_path: Path) -> None:
    app = make_app(tmp_path, mode=Mode.CANARY, canary_percent=CANARY, proxy_hops=1)
    client = legacy_side("192.0.2")  # what nginx appends: the address it accepted the connection from
    try:
        assert side(app, "10.1.1.1", client) == "legacy"
        for forged in FORGED:  # the client sent "X-Forwarded-For: <forged>"; nginx appended the real address
            assert side(app, "10.1.1.1", f"{forged}, {client}") == "legacy", forged
        assert side(app, "10.1.1.1", FORGED[0]) == "triton", "the proxy's own entry is the client's address"
    finally:
        app.flask.extensions["shim"].close()


def test_with_two_proxies_the_second_entry_from_the_right_is_the_client(tmp_path: Path) -> None:
    app = make_app(tmp_path, mode=Mode.CANARY, canary_percent=CANARY, proxy_hops=2)
    client = legacy_side("192.0.2")
    try:
        assert side(app, "10.1.1.1", f"{FORGED[0]}, {client}, 10.2.2.2") == "legacy"
        assert side(app, "10.1.1.1", f"{FORGED[0]}, {client}") == "triton"  # the outer proxy saw FORGED[0]
    finally:
        app.flask.extensions["shim"].close()
