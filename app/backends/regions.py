"""The batch senders' shared memory region pairs, and when a pair may be written again.

A sender thread writes a batch into its input region, asks Triton, and reads the logits from its output
region. Once a call ends without Triton's answer (the client timed out, the connection broke mid-call, or
anything else after which Triton may still hold the request), Triton may still read that input region and
write that output region later: the pair is retired then and never written again. Its files are removed
and its mapping here closed (Triton keeps its own until it unregisters the region), its names are queued
to be unregistered from Triton (which refuses while the request is still in use, so that is retried), and
the thread's next batch gets a fresh pair with new names. Nothing here talks to Triton: the Triton backend
registers and unregisters through its own clients.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.backends import shm

RETRY_S = 1.0  # unregistering a retired region that Triton still holds is tried again at most this often
Clock = Callable[[], float]


@dataclass
class Pair:
    """A sender thread's input and output regions."""

    input: shm.Region
    output: shm.Region
    registered: bool = False
    retired: bool = False

    @property
    def names(self) -> tuple[str, str]:
        return self.input.name, self.output.name


class SenderPairs:
    """One live pair per sender thread; retired pairs' names until Triton has unregistered them."""

    def __init__(self, *, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._local = threading.local()
        self._lock = threading.Lock()
        self._live: list[Pair] = []
        self._to_unregister: list[str] = []
        self._tried_at = 0.0
        self._count = 0

    def current(self, make: Callable[[str], Pair]) -> Pair:
        """This thread's pair; a new one, `make(<n>)` with the next number, if it has none or retired it."""
        pair: Pair | None = getattr(self._local, "pair", None)
        if pair is not None and not pair.retired:
            return pair
        with self._lock:
            self._count += 1
            number = self._count
        pair = make(str(number))
        with self._lock:
            self._live.append(pair)
        self._local.pair = pair
        return pair

    def retire(self, pair: Pair) -> None:
        """Triton may still use this pair: never write it again, remove it here, unregister it later."""
        with self._lock:
            if pair.retired:
                return
            pair.retired = True
            if pair in self._live:
                self._live.remove(pair)
            if pair.registered:
                self._to_unregister.extend(pair.names)
        pair.input.close()
        pair.output.close()

    def due(self) -> list[str]:
        """Retired names to unregister now (at most every RETRY_S, so that a Triton that refuses is not
        asked on every batch); each is given back with `still_registered` if Triton still holds it."""
        with self._lock:
            if not self._to_unregister or self._clock() - self._tried_at < RETRY_S:
                return []
            self._tried_at = self._clock()
            names, self._to_unregister = self._to_unregister, []
            return names

    def still_registered(self, names: list[str]) -> None:
        with self._lock:
            self._to_unregister.extend(names)

    def drain(self) -> tuple[list[Pair], list[str]]:
        """Everything left, to be removed when the backend closes: the live pairs and the retired names."""
        with self._lock:
            live, self._live = self._live, []
            names, self._to_unregister = self._to_unregister, []
        return live, names
