"""Triton over HTTP with binary tensors or shared memory: the only module that imports tritonclient.

Transports (SHIM_TRANSPORT), what a request sends and how:
    http       FP32 tensors [N, 3, 224, 224] in the HTTP body, to the model (resnet50)
    shm        the same tensors through system shared memory: only a small JSON header on the wire
    uint8      the cropped pixels [N, 224, 224, 3] UINT8 (4x fewer bytes) to the ensemble that
               normalises them in Triton (resnet50_uint8 = normalize -> resnet50)
    uint8-shm  the pixels through shared memory
    encoded    (opt-in, never chosen by auto) the upload's bytes as they came, UINT8 [1, n], one image per
               request from the request thread, to the ensemble that decodes, resizes, crops and normalises
               them in Triton (<model>_encoded = <model>_decode -> <model>, generated from the description; its
               readiness checks the decode step's parameters against the description); an upload app/sniff.py
               keeps in the shim goes as FP32 tensors over HTTP to the model, like `http`
    auto       (the default) pixels when Triton normalises on a GPU (the ensemble's normalize step is
               KIND_GPU), tensors otherwise; shared memory when Triton can map this host's /dev/shm
               (a registration of a probe region succeeds), HTTP otherwise
A worker settles its transport once, on its first readiness check or request. Shared memory that
stops working (a Triton restart forgets registrations) is registered again; if that fails the worker
goes on over HTTP, logged once. /readyz and the metric shim_transport say which transport is in use.
A region pair is never written while a request that used it may still be in Triton (app/backends/regions.py),
and the shared memory calls carry the key of Triton's restricted APIs (`admin_headers`), when it has one.

tritonclient's HTTP client is not thread-safe and breaks when carried across a fork, so each thread
gets its own client, made on first use in the process that uses it. Readiness checks use clients of
their own with short timeouts, so that /readyz answers within about SHIM_READINESS_TIMEOUT_S even when
Triton hangs. The model's tensor names, dtypes and dims come from Triton's metadata and are checked
against what the transport sends; every tritonclient error leaves this module as one of the shim's own.
"""

from __future__ import annotations

import http.client
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from app import metrics
from app.backends import shm
from app.backends.base import ENCODED, FP32, UINT8, Readiness
from app.backends.ensemble import pin_problem
from app.backends.regions import Pair, SenderPairs
from app.description import compare_parameters
from app.errors import BackendError, BackendTimeout, BackendUnavailable, DecodeRefused, ModelMismatch
from app.preprocess import Prepared
from app.settings import TRANSPORTS

log = logging.getLogger(__name__)
T = TypeVar("T")
NAME = "triton"
# Triton answers 400 with these words when the model is absent or not (yet) loaded.
UNAVAILABLE_MARKERS = ("unknown model", "not ready", "no available versions", "not found", "unavailable")
SPEC_RECHECK_S = 5.0  # readiness re-reads the model's metadata at most this often (a reload may change it)
NUMPY = {FP32: np.float32, UINT8: np.uint8}
TRITON_DTYPE = {FP32: "FP32", UINT8: "UINT8"}
# What triton_repo/<model>_decode/1/model.py puts in the error of an upload its decoder refuses.
REFUSED_MARKER = "[decode_refused]"


@dataclass(frozen=True)
class ModelSpec:
    input_name: str
    output_name: str
    max_batch_size: int
    versions: tuple[str, ...]


@dataclass(frozen=True)
class Route:
    """A settled transport: which model gets which tensors, and over which channel."""

    transport: str
    model: str
    kind: str  # FP32 or UINT8
    shm: bool
    why: str  # how it was chosen, for /readyz
    version: str = ""  # the version asked of `model`: the pin for the classifier, never for an ensemble

    def image_shape(self, crop: tuple[int, int]) -> tuple[int, int, int]:
        """Per image: FP32 [3, height, width] or UINT8 [height, width, 3] (a crop may be non-square)."""
        height, width = crop
        return (3, height, width) if self.kind == FP32 else (height, width, 3)


def check_model(meta: dict[str, Any], config: dict[str, Any], *, image_shape: Sequence[int], classes: int,
                where: str, datatype: str = "FP32", parameters: Mapping[str, str] | None = None) -> ModelSpec:
    """The model's metadata against what the shim sends ([N, *image_shape] of `datatype`) and expects back;
    the preprocessing `parameters` its config serves (generated from the model's description) against the
    shim's own description, where it serves them."""
    want_in = f"{datatype} [-1, {', '.join(map(str, image_shape))}]"
    inp, out = _image_in_logits_out(meta, classes=classes, where=where, want_in=want_in, sender="the shim")
    in_shape = list(inp["shape"])
    if inp["datatype"] != datatype or len(in_shape) != 4 or in_shape[1:] != list(image_shape):
        raise ModelMismatch(f"{where} input '{inp['name']}' is {inp['datatype']} {in_shape}; the shim sends {want_in}",
                            backend=NAME)
    _check_parameters(config, parameters or {}, where=where)
    max_batch = int(config.get("max_batch_size", 0)) or (in_shape[0] if in_shape[0] > 0 else 1)
    return ModelSpec(inp["name"], out["name"], max_batch, tuple(meta.get("versions", [])))


def _image_in_logits_out(meta: dict[str, Any], *, classes: int, where: str, want_in: str,
                         sender: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's one input and its one output, that output checked: FP32 [-1, classes], a score per label."""
    if len(meta.get("inputs", [])) != 1 or len(meta.get("outputs", [])) != 1:
        raise ModelMismatch(f"{where} has {len(meta.get('inputs', []))} inputs and {len(meta.get('outputs', []))} "
                            f"outputs; {sender} needs one image input ({want_in}) and one logits output", backend=NAME)
    (inp,), (out,) = meta["inputs"], meta["outputs"]
    out_shape = list(out["shape"])
    if out["datatype"] != "FP32" or len(out_shape) != 2 or out_shape[1] != classes:
        raise ModelMismatch(f"{where} output '{out['name']}' is {out['datatype']} {out_shape}; the shim expects "
                            f"FP32 [-1, {classes}] (one score per label in its labels file)", backend=NAME)
    return inp, out


def _check_parameters(config: dict[str, Any], wanted: Mapping[str, str], *, where: str, every: bool = False) -> None:
    """The `parameters` a config serves against the shim's description (app.description.compare_parameters)."""
    served = {k: str(v.get("string_value", "")) for k, v in config.get("parameters", {}).items() if isinstance(v, dict)}
    differ = compare_parameters(served, wanted, every=every, described="the shim's description")
    if differ:
        raise ModelMismatch(f"{where} was generated from another description: {'; '.join(differ)}. Regenerate its "
                            "repository (modelrepo/export.py), or point SHIM_MODEL_REPOSITORY at the one it serves",
                            backend=NAME)


def decode_step_of(config: dict[str, Any], *, model: str, where: str) -> str:
    """The encoded ensemble's decode step: the one step that is not `model`, the model the shim serves, which the
    ensemble must feed (else its answers would be another model's)."""
    steps = [str(step.get("model_name", "")) for step in config.get("ensemble_scheduling", {}).get("step", [])]
    others = [name for name in steps if name != model]
    if model not in steps or len(others) != 1:
        raise ModelMismatch(f"{where} runs {' -> '.join(steps) or 'no ensemble steps'}; the encoded transport needs a "
                            f"decode step -> {model}, the model the shim serves (SHIM_MODEL_NAME / SHIM_ENCODED_MODEL)",
                            backend=NAME)
    return others[0]


def check_encoded_model(meta: dict[str, Any], config: dict[str, Any], *, classes: int, where: str) -> ModelSpec:
    """The encoded transport's ensemble: one UINT8 [-1, -1] input (a batch of byte strings; the shim sends one
    of n bytes) and one FP32 [-1, classes] output."""
    want = "UINT8 [-1, -1] (one upload's bytes per request)"
    inp, out = _image_in_logits_out(meta, classes=classes, where=where, want_in=want, sender="the encoded transport")
    if inp["datatype"] != "UINT8" or list(inp["shape"]) != [-1, -1]:
        raise ModelMismatch(f"{where} input '{inp['name']}' is {inp['datatype']} {list(inp['shape'])}; the encoded "
                            f"transport sends {want}", backend=NAME)
    return ModelSpec(inp["name"], out["name"], int(config.get("max_batch_size", 0)) or 1,
                     tuple(meta.get("versions", [])))


class _Clients:
    """One tritonclient per thread of the process that made it, all closed together."""

    def __init__(self, url: str, *, connect_timeout_s: float, network_timeout_s: float) -> None:
        self._url = url
        self._timeouts = {"connection_timeout": connect_timeout_s, "network_timeout": network_timeout_s}
        self.network_timeout_s = network_timeout_s
        self._pid = os.getpid()
        self._local = threading.local()
        self._all: list[httpclient.InferenceServerClient] = []
        self._lock = threading.Lock()

    def get(self) -> httpclient.InferenceServerClient:
        if os.getpid() != self._pid:
            raise RuntimeError("TritonBackend was created before a fork; create the app in each worker "
                               "(gunicorn without --preload)")
        client: httpclient.InferenceServerClient | None = getattr(self._local, "client", None)
        if client is None:
            client = httpclient.InferenceServerClient(self._url, **self._timeouts)
            self._local.client = client
            with self._lock:
                self._all.append(client)
        return client

    def drop(self) -> None:
        """After a transport error the connection state is unknown: this thread's next call starts afresh."""
        client = getattr(self._local, "client", None)
        self._local.client = None
        if client is not None:
            with self._lock:
                if client in self._all:
                    self._all.remove(client)
            client.close()

    def close(self) -> None:
        with self._lock:
            clients, self._all = self._all, []
        for client in clients:
            client.close()


class TritonBackend:
    name = NAME

    def __init__(self, *, url: str, model: str, version: str, connect_timeout_s: float, network_timeout_s: float,
                 readiness_timeout_s: float, image_shape: Sequence[int], classes: int, max_batch_size: int,
                 transport: str = "http", uint8_model: str = "", shm_mode: int = 0o600,
                 parameters: Mapping[str, str] | None = None, encoded_model: str = "",
                 decode_parameters: Mapping[str, str] | None = None, encoded_refusal: str | None = None,
                 admin_headers: Mapping[str, str] | None = None) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r} is not one of {', '.join(TRANSPORTS)}")
        self.url, self.model, self.version = url, model, version
        self.uint8_model = uint8_model or f"{model}_uint8"
        self._parameters = dict(parameters or {})  # the description's preprocessing, as its configs carry it
        self.encoded_model = encoded_model or f"{model}_encoded"
        # The encoded transport: what its decode step must serve (the description's pixel-changing preprocessing),
        # or why the description cannot be served that way (then readiness says so and nothing is sent).
        self._decode_parameters = dict(decode_parameters) if decode_parameters is not None else None
        self._encoded_refusal = encoded_refusal
        self._crop = (int(image_shape[-2]), int(image_shape[-1]))  # (height, width)
        self._classes, self._max_batch = classes, max_batch_size
        self._wanted = transport
        self._shm_mode = shm_mode
        self._admin = dict(admin_headers or {})  # the shared memory API's key, when Triton restricts it
        self._clients = _Clients(url, connect_timeout_s=connect_timeout_s, network_timeout_s=network_timeout_s)
        self._probes = _Clients(url, connect_timeout_s=min(connect_timeout_s, readiness_timeout_s),
                                network_timeout_s=readiness_timeout_s)
        self._route: Route | None = None
        self._route_lock = threading.Lock()
        self._spec: ModelSpec | None = None  # the model that takes tensors (the encoded ensemble's: below)
        self._encoded_spec: ModelSpec | None = None
        self._spec_checked = 0.0
        self._mismatch_logged = False
        self._pairs = SenderPairs()  # the sender threads' shared memory regions
        self._owner: shm.Owner | None = None  # made in the process that uses shared memory
        self._owner_lock = threading.Lock()
        self._swept = False

    # -- the Backend protocol ------------------------------------------------------------------------------

    @property
    def max_batch_size(self) -> int:
        spec = self._spec
        return min(self._max_batch, spec.max_batch_size) if spec else self._max_batch

    @property
    def input_kind(self) -> str:
        """What a request thread should prepare: the settled route's, or the wanted transport's until then."""
        if self._route is not None:
            return self._route.kind
        return UINT8 if self._wanted.startswith("uint8") else ENCODED if self._wanted == ENCODED else FP32

    @property
    def transport(self) -> str:
        return self._route.transport if self._route is not None else f"{self._wanted} (not settled yet)"

    def start(self) -> None:
        """Nothing to load: the first call in each thread makes its client; metadata comes on first use."""

    def ready(self) -> Readiness:
        """The model ready on Triton, its metadata checked (again, every few seconds: a reload may change it)."""
        try:
            route = self._settle(self._probes, wait=False)
            if not self._call(self._probes, lambda c: c.is_model_ready(route.model, route.version)):
                return Readiness(False, f"{self._where(route)} is not ready")
            spec = self._spec
            if spec is None or time.monotonic() - self._spec_checked > SPEC_RECHECK_S:
                spec = self._fetch_spec(self._probes, route)
        except BackendError as e:
            return Readiness(False, e.message)
        return Readiness(True, f"{self._where(route)} is ready (versions {', '.join(spec.versions) or '?'}, "
                               f"max batch {spec.max_batch_size}); transport {route.transport}: {route.why}")

    def infer(self, images: Sequence[Prepared], request_ids: Sequence[str]) -> npt.NDArray[np.float32]:
        route = self._settle(self._clients)
        if route.kind == ENCODED:
            return self._infer_encoded(route, images, request_ids)
        spec = self._spec or self._fetch_spec(self._clients, route)
        # Every request ID of the batch (at most 32 x 128 characters): Triton's logs and answer carry them.
        request_id = ",".join(request_ids)
        if route.shm:
            try:
                return self._infer_shm(route, spec, images, request_id)
            except _ShmLost as e:
                route = self._give_up_shm(route, str(e))
        return self._infer_http(route, spec, _stack(images, route.kind), request_id)

    def close(self) -> None:
        live, retired = self._pairs.drain()
        try:
            self._unregister_at_exit([name for pair in live if pair.registered for name in pair.names] + retired)
            for pair in live:
                pair.input.close()
                pair.output.close()
        finally:
            if self._owner is not None and self._owner.pid == os.getpid():
                self._owner.release()
            self._clients.close()
            self._probes.close()

    def _unregister_at_exit(self, names: list[str]) -> None:
        """With a client of its own and short timeouts: the worker is exiting."""
        if not names:
            return
        client = httpclient.InferenceServerClient(self.url, connection_timeout=1, network_timeout=2)
        try:
            for name in names:
                try:
                    client.unregister_system_shared_memory(name, headers=self._admin)
                except (InferenceServerException, OSError, http.client.HTTPException) as e:
                    log.info("could not unregister %s from Triton: %s", name, e)
        finally:
            client.close()

    # -- choosing the transport ----------------------------------------------------------------------------

    def _settle(self, clients: _Clients, *, wait: bool = True) -> Route:
        route = self._route
        if route is not None:
            return route
        if not self._route_lock.acquire(blocking=wait):  # readiness never waits behind a request that settles it
            raise BackendUnavailable(f"{self._where()}: the transport is being chosen", backend=NAME)
        try:
            if self._route is None:
                self._route = self._choose(clients)
                log.info("Triton transport: %s (%s)", self._route.transport, self._route.why,
                         extra={"transport": self._route.transport})
                metrics.publish_transport(self._route.transport)
            return self._route
        finally:
            self._route_lock.release()

    def _choose(self, clients: _Clients) -> Route:
        """Settle the transport; raises (and settles nothing) while Triton does not answer."""
        self._call(clients, lambda c: c.is_server_live())
        wanted = self._wanted
        if wanted == ENCODED and self._encoded_refusal:
            error = ModelMismatch(self._encoded_refusal, backend=NAME)
            self._log_mismatch(error)
            raise error
        if wanted == ENCODED:
            return Route(transport=ENCODED, model=self.encoded_model, kind=ENCODED, shm=False,
                         why=f"SHIM_TRANSPORT=encoded: JPEG uploads as they came to {self.encoded_model}, which "
                             f"decodes them; other images as FP32 tensors over HTTP to {self.model}")
        if wanted == "auto":
            pixels, why_kind = self._normalises_on_gpu(clients)
            shared, why_channel = self._shm_works(clients)
        else:
            pixels, why_kind = wanted.startswith("uint8"), f"SHIM_TRANSPORT={wanted}"
            shared, why_channel = False, ""
            if wanted.endswith("shm"):
                shared, why_channel = self._shm_works(clients)
                if not shared:
                    log.error("SHIM_TRANSPORT=%s, but %s: sending over HTTP", wanted, why_channel)
        kind = UINT8 if pixels else FP32
        transport = {(FP32, False): "http", (FP32, True): "shm", (UINT8, False): "uint8",
                     (UINT8, True): "uint8-shm"}[(kind, shared)]
        return Route(transport=transport, model=self.uint8_model if pixels else self.model, kind=kind, shm=shared,
                     version="" if pixels else self.version,
                     why="; ".join(w for w in (why_kind, why_channel) if w))

    def _normalises_on_gpu(self, clients: _Clients) -> tuple[bool, str]:
        """auto: send pixels only when Triton normalises them on a GPU; on a CPU that work costs the same there."""
        try:
            config = self._call(clients, lambda c: c.get_model_config(self.uint8_model))
            steps = config.get("ensemble_scheduling", {}).get("step", [])
            first = steps[0]["model_name"] if steps else self.uint8_model
            first_config = config if not steps else self._call(clients, lambda c: c.get_model_config(first))
        except BackendError as e:
            if not _answered(e):
                raise
            return False, f"tensors: no usable {self.uint8_model} ({e.message.split(': ', 1)[-1]})"
        kinds = {g.get("kind", "KIND_AUTO") for g in first_config.get("instance_group", [])}
        if "KIND_GPU" in kinds:
            problem = pin_problem(config, ensemble=self.uint8_model, classifier=self.model, pin=self.version)
            if problem:
                return False, f"tensors: {problem.split(': set ', 1)[0]}"
            return True, f"pixels: {first} normalises them on a GPU"
        return False, f"tensors: {first} would normalise them on {'/'.join(sorted(kinds)) or 'KIND_AUTO'}"

    def _shm_works(self, clients: _Clients) -> tuple[bool, str]:
        """Can Triton map this host's /dev/shm? Register a small probe region and see."""
        try:
            removed = shm.sweep_files()  # leftovers of owners that are gone, in this /dev/shm
            region = self._owner_here().create("probe", 64, self._shm_mode)
        except OSError as e:
            return False, f"HTTP: no shared memory here ({e})"
        try:
            self._call(clients, partial(_register, region=region, headers=self._admin))
            self._call(clients, partial(_unregister, name=region.name, headers=self._admin))
        except BackendError as e:
            if not _answered(e):
                raise
            why = e.message.split(": ", 1)[-1]
            if "restricted" in why.lower():  # Triton runs with --http-restricted-api=shared-memory,...:<key>
                return False, (f"HTTP: Triton's shared memory API wants its admin key ({why}); set "
                               "SHIM_TRITON_ADMIN_KEY or SHIM_TRITON_ADMIN_KEY_FILE (and SHIM_TRITON_ADMIN_HEADER)")
            return False, f"HTTP: Triton cannot map this host's /dev/shm ({why})"
        finally:
            region.close()
        self._sweep(clients, removed)  # Triton maps this /dev/shm: its registry's leftovers are ours to judge
        return True, "shared memory: Triton maps this host's /dev/shm"

    def _owner_here(self) -> shm.Owner:
        """This process's owner of shared memory regions (its lock says it is alive), made on first use."""
        with self._owner_lock:
            if self._owner is None or self._owner.pid != os.getpid():
                self._owner = shm.Owner()
            return self._owner

    def _give_up_shm(self, route: Route, reason: str) -> Route:
        with self._route_lock:
            if self._route is route:
                self._route = Route(transport="uint8" if route.kind == UINT8 else "http", model=route.model,
                                    kind=route.kind, shm=False, why=f"{route.why}; then HTTP: {reason}",
                                    version=route.version)
                log.error("shared memory stopped working (%s): this worker sends over HTTP from now on", reason)
                metrics.publish_transport(self._route.transport)
            return self._route if self._route is not None else route

    # -- sending ----------------------------------------------------------------------------------------------

    def _tensor_route(self, route: Route) -> Route:
        """Where the encoded transport sends the images it decoded in the shim: FP32 over HTTP to the model."""
        return Route(transport="http", model=self.model, kind=FP32, shm=False, why=route.why, version=self.version)

    def _infer_encoded(self, route: Route, images: Sequence[Prepared],
                       request_ids: Sequence[str]) -> npt.NDArray[np.float32]:
        """Uploads that carry their bytes, one Triton request each; the others as one FP32 batch."""
        tensor_route = self._tensor_route(route)
        rows: list[npt.NDArray[np.float32] | None] = [None] * len(images)
        decoded = [i for i, image in enumerate(images) if image.encoded is None]
        if decoded:
            spec = self._spec or self._fetch_spec(self._clients, route)
            logits = self._infer_http(tensor_route, spec, _stack([images[i] for i in decoded], FP32),
                                      ",".join(request_ids[i] for i in decoded))
            for i, row in zip(decoded, logits, strict=True):
                rows[i] = row
        for i, image in enumerate(images):
            if image.encoded is not None:
                rows[i] = self._send_encoded(route, image.encoded, request_ids[i])
        return np.stack([row for row in rows if row is not None])

    def _send_encoded(self, route: Route, data: bytes, request_id: str) -> npt.NDArray[np.float32]:
        spec = self._encoded_spec
        if spec is None:
            self._fetch_spec(self._clients, route)
            spec = self._encoded_spec
            assert spec is not None
        tensor = httpclient.InferInput(spec.input_name, [1, len(data)], "UINT8")
        tensor.set_data_from_numpy(np.frombuffer(data, dtype=np.uint8).reshape(1, -1), binary_data=True)
        wanted = httpclient.InferRequestedOutput(spec.output_name, binary_data=True)

        def send(client: httpclient.InferenceServerClient) -> Any:
            # NOTE: self.version (SHIM_MODEL_VERSION) is the classifier's, but here, as on the uint8 route, it names
            # a version of the ensemble: a pin of the classifier belongs inside the ensembles, in the one model step
            # modelrepo/generate.py's _model_step writes for both.
            try:
                return client.infer(route.model, [tensor], model_version=route.version, outputs=[wanted],
                                    request_id=request_id)
            except InferenceServerException as e:  # the decoder's refusal is the image's, not Triton's failure
                text = str(e.message() or e)
                if REFUSED_MARKER in text:
                    raise DecodeRefused(f"the uploaded file is not an image Triton's decoder reads ({text})") from e
                raise

        result = self._call(self._clients, send)
        self._log_answer(result, 1)
        row: npt.NDArray[np.float32] = self._checked(result.as_numpy(spec.output_name), 1, route)[0]
        return row

    def _infer_http(self, route: Route, spec: ModelSpec, batch: npt.NDArray[Any],
                    request_id: str) -> npt.NDArray[np.float32]:
        tensor = httpclient.InferInput(spec.input_name, list(batch.shape), TRITON_DTYPE[route.kind])
        tensor.set_data_from_numpy(batch, binary_data=True)
        wanted = httpclient.InferRequestedOutput(spec.output_name, binary_data=True)
        result = self._call(self._clients, lambda c: c.infer(route.model, [tensor], model_version=route.version,
                                                             outputs=[wanted], request_id=request_id))
        self._log_answer(result, len(batch))
        return self._checked(result.as_numpy(spec.output_name), len(batch), route)

    def _infer_shm(self, route: Route, spec: ModelSpec, images: Sequence[Prepared],
                   request_id: str) -> npt.NDArray[np.float32]:
        pair = self._thread_pair(route)
        n = len(images)
        shape = (n, *route.image_shape(self._crop))
        _stack(images, route.kind, out=pair.input.array(NUMPY[route.kind], shape))  # straight into the region
        tensor = httpclient.InferInput(spec.input_name, list(shape), TRITON_DTYPE[route.kind])
        tensor.set_shared_memory(pair.input.name, int(np.prod(shape)) * np.dtype(NUMPY[route.kind]).itemsize)
        wanted = httpclient.InferRequestedOutput(spec.output_name, binary_data=True)
        wanted.set_shared_memory(pair.output.name, n * self._classes * 4)

        def send() -> Any:
            try:
                return self._call(self._clients, lambda c: c.infer(route.model, [tensor], model_version=route.version,
                                                                   outputs=[wanted], request_id=request_id))
            except BaseException as e:
                if not (isinstance(e, BackendError) and _answered(e)):
                    self._pairs.retire(pair)  # Triton may still hold the request: it may read and write the pair
                raise

        try:
            result = send()
        except BackendError as e:
            if not _about_shm(e):
                raise
            try:  # Triton restarted and forgot the registrations: once more, then retry
                self._register(pair)
                result = send()
            except BackendError as again:
                if _about_shm(again):
                    raise _ShmLost(again.message) from again
                raise
        self._log_answer(result, n)
        return self._checked(pair.output.array(np.float32, (n, self._classes)).copy(), n, route)

    def _thread_pair(self, route: Route) -> Pair:
        """This sender thread's pair, registered; a fresh one after the last was retired."""
        self._unregister_retired()
        per_image = int(np.prod(route.image_shape(self._crop))) * np.dtype(NUMPY[route.kind]).itemsize

        def make(number: str) -> Pair:
            try:
                owner = self._owner_here()
                return Pair(owner.create(f"{number}_in", self._max_batch * per_image, self._shm_mode),
                            owner.create(f"{number}_out", self._max_batch * self._classes * 4, self._shm_mode))
            except OSError as e:
                raise _ShmLost(f"cannot make a shared memory region: {e}") from e

        pair = self._pairs.current(make)
        if not pair.registered:
            try:
                self._register(pair)
            except BackendError as e:
                if _answered(e):
                    raise _ShmLost(e.message) from e
                raise
        return pair

    def _register(self, pair: Pair) -> None:
        for region in (pair.input, pair.output):
            try:  # never registered twice: a stale registration of the same name goes first
                self._call(self._clients, partial(_unregister, name=region.name, headers=self._admin))
            except BackendError as e:
                if not _answered(e):
                    raise
            self._call(self._clients, partial(_register, region=region, headers=self._admin))
        pair.registered = True

    def _unregister_retired(self) -> None:
        """Unregister retired regions; Triton refuses while a request still uses one: that one waits."""
        names = self._pairs.due()
        for i, name in enumerate(names):
            try:
                self._call(self._clients, partial(_unregister, name=name, headers=self._admin))
            except BackendError as e:
                if not _answered(e):  # Triton does not answer: all of them wait for the next try
                    self._pairs.still_registered(names[i:])
                    return
                if "in use" in e.message:
                    self._pairs.still_registered([name])
                # Any other answer (an unknown region: Triton restarted) means it is not registered.

    def _sweep(self, clients: _Clients, removed: list[str]) -> None:
        """Once per backend: the registrations in Triton's registry of owners that are gone."""
        if self._swept:
            return
        try:
            status = self._call(clients, lambda c: c.get_system_shared_memory_status(headers=self._admin))
            names = [str(r.get("name", "")) for r in (status if isinstance(status, list) else [])]
            for name in shm.stale_names(names, missing_is_gone=True):
                self._call(clients, partial(_unregister, name=name, headers=self._admin))
                removed.append(name)
        except BackendError as e:
            if not _answered(e):
                raise
            log.warning("could not clear stale shared memory registrations: %s", e.message)
        self._swept = True
        if removed:
            log.info("removed %d shared memory regions left by processes that are gone", len(removed),
                     extra={"regions": sorted(set(removed))})

    # -- checking and translating ---------------------------------------------------------------------------

    def _where(self, route: Route | None = None) -> str:
        model, version = (route.model, route.version) if route is not None else (self.model, self.version)
        return f"Triton model '{model}'{f' version {version}' if version else ''} at {self.url}"

    def _checked(self, logits: npt.NDArray[Any] | None, n: int, route: Route) -> npt.NDArray[np.float32]:
        if logits is None or logits.shape != (n, self._classes):
            raise BackendError(f"{self._where(route)} answered {None if logits is None else list(logits.shape)} "
                               f"for a batch of {n}", backend=NAME)
        return np.asarray(logits, dtype=np.float32)

    @staticmethod
    def _log_answer(result: Any, n: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("Triton answered a batch of %d", n,
                      extra={"triton_request_id": result.get_response().get("id", "")})

    def _fetch_spec(self, clients: _Clients, route: Route) -> ModelSpec:
        """The metadata of the model the route sends to, checked; for the encoded transport the ensemble's,
        then the model's that takes its tensors (the returned spec, as for the other routes)."""
        if route.kind == ENCODED:
            meta = self._call(clients, lambda c: c.get_model_metadata(route.model, route.version))
            config = self._call(clients, lambda c: c.get_model_config(route.model, route.version))
            try:
                self._check_pin(config, route)
                encoded_spec = check_encoded_model(meta, config, classes=self._classes, where=self._where(route))
                step = decode_step_of(config, model=self.model, where=self._where(route))
                if self._decode_parameters is not None:  # its preprocessing, as issue 20's check of the model's
                    step_config = self._call(clients, lambda c: c.get_model_config(step))
                    _check_parameters(step_config, self._decode_parameters, every=True,
                                      where=f"Triton model '{step}' (the decode step of {route.model}) at {self.url}")
                self._encoded_spec = encoded_spec
            except ModelMismatch as e:
                self._encoded_spec = None
                self._log_mismatch(e)
                raise
            route = self._tensor_route(route)
        meta = self._call(clients, lambda c: c.get_model_metadata(route.model, route.version))
        config = self._call(clients, lambda c: c.get_model_config(route.model, route.version))
        try:
            if route.model != self.model:
                self._check_pin(config, route)
            spec = check_model(meta, config, image_shape=route.image_shape(self._crop), classes=self._classes,
                               where=self._where(route), datatype=TRITON_DTYPE[route.kind],
                               parameters=self._parameters)
        except ModelMismatch as e:
            self._log_mismatch(e)
            self._spec = None
            raise
        self._spec, self._spec_checked, self._mismatch_logged = spec, time.monotonic(), False
        return spec

    def _check_pin(self, config: dict[str, Any], route: Route) -> None:
        """An ensemble the route sends to must run the classifier version that SHIM_MODEL_VERSION pins."""
        problem = pin_problem(config, ensemble=route.model, classifier=self.model, pin=self.version)
        if problem:
            raise ModelMismatch(f"{self._where(route)}: {problem}", backend=NAME)

    def _log_mismatch(self, error: ModelMismatch) -> None:
        if not self._mismatch_logged:
            log.error("%s", error.message)  # once: readiness repeats it to whoever asks
            self._mismatch_logged = True

    def _call(self, clients: _Clients, call: Callable[[httpclient.InferenceServerClient], T]) -> T:
        """Run one tritonclient call on this thread's client; translate whatever it raises."""
        started = time.monotonic()
        try:
            return call(clients.get())
        except InferenceServerException as e:  # Triton answered, with an error
            text = str(e.message() or e)
            if any(marker in text.lower() for marker in UNAVAILABLE_MARKERS):
                self._spec = None  # whatever comes back may be another version: check it again
                raise BackendUnavailable(f"{self._where()} is unavailable: {text}", backend=NAME) from e
            if "timeout" in text.lower() or "deadline" in text.lower():
                raise BackendTimeout(f"{self._where()} timed out: {text}", backend=NAME) from e
            raise BackendError(f"{self._where()} failed the request: {text}", backend=NAME) from e
        except TimeoutError as e:
            clients.drop()
            if time.monotonic() - started < clients.network_timeout_s * 0.9:  # the connect timed out, not the call
                raise BackendUnavailable(f"{self._where()} accepts no connection (the connect timed out)",
                                         backend=NAME) from e
            raise BackendTimeout(f"{self._where()} did not answer within {clients.network_timeout_s:g} s",
                                 backend=NAME) from e
        except (OSError, http.client.HTTPException) as e:  # refused, reset, unreachable, DNS; closed mid-answer
            clients.drop()
            raise BackendUnavailable(f"{self._where()} is unreachable: {type(e).__name__}: {e}", backend=NAME) from e


def _register(client: httpclient.InferenceServerClient, *, region: shm.Region, headers: dict[str, str]) -> None:
    client.register_system_shared_memory(region.name, region.key, region.size, headers=headers)


def _unregister(client: httpclient.InferenceServerClient, *, name: str, headers: dict[str, str]) -> None:
    client.unregister_system_shared_memory(name, headers=headers)


def _answered(error: BackendError) -> bool:
    """Did Triton itself answer (with an error), rather than time out or refuse the connection?"""
    return isinstance(error.__cause__, InferenceServerException)


def _about_shm(error: BackendError) -> bool:
    return _answered(error) and "shared memory" in error.message.lower()


def _stack(images: Sequence[Prepared], kind: str, out: npt.NDArray[Any] | None = None) -> npt.NDArray[Any]:
    """The batch a route sends: the images' pixels (UINT8, HWC) or their FP32 tensors (CHW)."""
    arrays = [image.uint8() for image in images] if kind == UINT8 else [image.fp32() for image in images]
    return np.stack(arrays, out=out)


class _ShmLost(Exception):
    """Shared memory cannot be used (any more) by this worker: it goes on over HTTP."""
