"""Which backend answers a request: the traffic mode, applied per request."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from app.backends.base import Readiness
from app.batching import Admission, Batcher
from app.settings import Mode


@dataclass(frozen=True)
class RequestContext:
    request_id: str
    routing_key: str  # who the client is, for sticky canary assignment
    notes: dict[str, str] = field(default_factory=dict)  # what happened to it, for logs and metrics


@dataclass(frozen=True)
class Decision:
    mode: Mode
    backend: str  # the backend whose answer the client gets


class Router:
    def __init__(self, *, mode: Mode, batchers: dict[str, Batcher]) -> None:
        self._mode = mode
        self._batchers = batchers

    @property
    def mode(self) -> Mode:
        return self._mode

    def decide(self, ctx: RequestContext) -> Decision:
        backend = "legacy" if self._mode is Mode.LEGACY else "triton"
        return Decision(self._mode, backend)

    def infer(self, tensor: npt.NDArray[np.float32], ctx: RequestContext, decision: Decision,
              admission: Admission | None = None) -> npt.NDArray[np.float32]:
        return self._batchers[decision.backend].submit(tensor, ctx.request_id, admission)

    def readiness(self) -> tuple[bool, dict[str, Readiness]]:
        """Ready when the backend that answers in this mode can answer."""
        needed = "legacy" if self._mode is Mode.LEGACY else "triton"
        state = self._batchers[needed].backend.ready()
        return state.ready, {needed: state}

    def close(self) -> None:
        for batcher in self._batchers.values():
            batcher.close()
            batcher.backend.close()
