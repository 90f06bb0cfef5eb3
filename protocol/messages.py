"""Every message of the l2l wire protocol, as typed frozen dataclasses (see SPEC.md).

A message travels as ``[kind byte][msgpack body][tensor frames...]``: the kind byte picks the
class from ``REGISTRY``, the body maps its fields. ``codec.decode`` checks every field's type
against the annotations below, then the class's range checks (``__post_init__``): a handler
only sees well-formed messages. A request's ``req_id`` (the client's) comes back in its reply."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from .box_info import BoxInfo
from .lifecycle import IDENTITY
from .tensors import ITEMSIZES, Manifest
from .worker_info import WorkerInfo, WorkerReport

PROTOCOL_VERSION = 8  # what each version added: SPEC.md, "Versions"
ANY_RANK = -1  # Hello.rank: take the lowest free rank (workers started as identical replicas)

ROLES = ("worker", "observer")  # an observer (l2l-ctl) sends control requests, holds no rank
TRANSPORTS = ("shm", "frames")  # shm: same box, tensors in shared memory; frames: tensor bytes
WHICH = ("compute", "master", "trained")  # a Fetch's copy: served, fp32 master, its trained part
ERROR_CODES = (
    "bad_message",  # malformed frames, wrong types, out-of-range fields
    "protocol_version",  # Hello with another protocol version
    "manifest_mismatch",  # Hello whose manifest hash differs from the server's model
    "not_registered",  # request from a peer that has not said Hello
    "bad_request",  # well-formed but not valid now (wrong step, unknown layer, duplicate push...)
    "not_ready",  # the model has not been initialised yet
    "busy",  # this connection has too many requests waiting; retry once replies came
    "rank_taken",  # Hello for a rank a live connection holds; retry once it is declared dead
    "resource",  # the server's machine refused a resource (shared memory, a file)
    "internal",  # a bug in the server; the request had no effect
)
MAX_RANKS = 4096
REGION_DTYPES = (*sorted(ITEMSIZES), "int64", "uint8")  # layer dtypes, versions, stash bytes
MAX_STR = 4096
REGISTRY: dict[int, type[Message]] = {}

# Body limits: a request needs well under 1 KiB (tensor bytes travel as frames); a Hello may
# carry a manifest; replies come from the server.
SMALL_BODY = 4 << 10
MANIFEST_BODY = 4 << 20
REPLY_BODY = 1 << 20


def message(kind: int, frames: tuple[int, int] = (0, 0), body: int = SMALL_BODY):
    """Register a message class under its one-byte kind; ``frames`` = (min, max) tensor frames,
    ``body`` = the largest msgpack body accepted."""

    def wrap(cls):
        if kind in REGISTRY or not (0 < kind < 256):
            raise RuntimeError(f"bad or duplicate message kind {kind}")
        cls = dataclass(frozen=True, kw_only=True)(cls)
        cls.KIND = kind
        cls.FRAMES = frames
        cls.BODY_LIMIT = body
        REGISTRY[kind] = cls
        return cls

    return wrap


def _require(ok: bool, field: str, what: str) -> None:
    if not ok:
        raise FieldError(field, what)


class FieldError(ValueError):
    """A field failed validation; ``field`` names it for the Error reply."""

    def __init__(self, field: str, what: str):
        super().__init__(f"{field}: {what}")
        self.field, self.what = field, what


@dataclass(frozen=True, kw_only=True)
class Message:
    KIND: ClassVar[int]
    FRAMES: ClassVar[tuple[int, int]]
    BODY_LIMIT: ClassVar[int]
    req_id: int

    def __post_init__(self) -> None:
        _require(0 <= self.req_id < 1 << 63, "req_id", "must be in [0, 2**63)")
        self.check()

    def check(self) -> None:
        """Per-class range checks; raise FieldError."""


@dataclass(frozen=True, kw_only=True)
class RegionInfo:
    """A shared-memory region: its name (without the leading '/') and size in bytes."""

    name: str
    nbytes: int
    dtype: str

    def __post_init__(self) -> None:
        _require(0 < len(self.name) <= 200 and "/" not in self.name, "name", "bad region name")
        _require(self.nbytes >= 0, "nbytes", "must be >= 0")
        _require(self.dtype in REGION_DTYPES, "dtype", f"must be one of {REGION_DTYPES}")


# ----------------------------------------------------------------------------- handshake


@message(1, body=MANIFEST_BODY)
class Hello(Message):
    """First request of every worker. ``manifest`` is sent so the first worker can bootstrap.
    An ``observer`` (a control client) holds no rank: rank, world_size and the model fields are
    ignored, and it is answered with an Ack."""

    protocol_version: int
    rank: int = 0
    world_size: int = 1
    manifest_hash: str = ""
    manifest: Manifest | None = None
    transport: str = "shm"
    grad_dtype: str = "compute"  # a dtype name, or "compute": the server's compute dtype
    pid: int = 0
    host: str = ""
    role: str = "worker"
    process: str = ""  # lifecycle.process_identity(): "" if it cannot be told
    samples_per_step: int = 0  # every worker's micro-batches of a step (0: not said)

    def check(self) -> None:
        _require(self.role in ROLES, "role", f"must be one of {ROLES}")
        _require(1 <= self.world_size <= MAX_RANKS, "world_size", f"must be in [1, {MAX_RANKS}]")
        _require(self.rank == ANY_RANK or 0 <= self.rank < self.world_size, "rank",
                 f"must be in [0, world_size) or {ANY_RANK} (any free rank)")
        _require(self.transport in TRANSPORTS, "transport", f"must be one of {TRANSPORTS}")
        _require(self.grad_dtype in (*ITEMSIZES, "compute"), "grad_dtype",
                 f"must be one of {sorted(ITEMSIZES)} or 'compute'")
        _require(len(self.manifest_hash) <= 100, "manifest_hash", "too long")
        _require(0 <= self.samples_per_step < 1 << 40, "samples_per_step", "out of range")
        _require(len(self.host) <= 255 and self.host.isprintable(), "host",
                 "must be at most 255 printable characters (it is logged and shown)")
        _require(not self.process or IDENTITY.fullmatch(self.process) is not None, "process",
                 "must be boot_id:pidns:pid:start_time")


@message(2, body=REPLY_BODY)
class Welcome(Message):
    """Reply to Hello: where the model lives and which step to run next. A worker replacing a
    dead one of its rank (``rejoined``) resumes the step that one was in: ``pushed`` are the
    layers whose gradient (or skip) for ``step`` the EPS already has from this rank."""

    protocol_version: int
    run_id: str
    step: int  # the step this worker runs next
    init_layers: tuple[int, ...]  # layers this worker must send with InitLayer (bootstrap)
    compute_dtype: str  # dtype of the served copy and of the worker's compute
    grad_dtype: str  # dtype of this worker's pushed gradients (Hello's, resolved)
    master: RegionInfo  # fp32 master weights (flat layout)
    compute: RegionInfo | None  # compute-precision copy; None when it is the master itself
    grads: RegionInfo | None  # this rank's gradient slots (shm transport only)
    grad_slots: int
    grad_slot_numel: int
    world_size: int
    optimizer: dict[str, str | int | float | bool]  # for display and summaries
    # shm transport: int64 version per layer, mirrored by the EPS (read-only for workers)
    versions: RegionInfo | None = None
    pushed: tuple[int, ...] = ()
    rejoined: bool = False  # this rank was held before in this run (a replacement)
    heartbeat_interval: float = 0.0  # send a Heartbeat this often (s); the EPS's timeout / 4
    # shm transport, recovery on: the previous version of layers updated in an unfinished step
    retained: RegionInfo | None = None
    rank: int = 0  # the rank this connection holds (Hello's, or the one assigned for ANY_RANK)
    data_step: int = 0  # the data's origin: samples consumed before step data_step
    data_samples: int = 0  # (step s starts at data_samples + (s - data_step) * samples a step)


@message(3, body=REPLY_BODY)
class Error(Message):
    """Any request may be answered by an Error instead of its usual reply."""

    code: str
    message: str
    field: str = ""

    def check(self) -> None:
        _require(self.code in ERROR_CODES, "code", f"must be one of {ERROR_CODES}")


@message(4)
class Ack(Message):
    """Generic success reply."""


# ----------------------------------------------------------------------------- weights


@message(5, frames=(1, 1))
class InitLayer(Message):
    """Initial values of one layer, one frame in its flat layout: its trainable prefix in
    fp32, its frozen tensors in ``frozen_dtype`` (fp32 or the compute dtype: SPEC.md)."""

    layer: int
    frozen_dtype: str = "float32"

    def check(self) -> None:
        _require(self.layer >= 0, "layer", "must be >= 0")
        _require(self.frozen_dtype in ITEMSIZES, "frozen_dtype", f"not in {sorted(ITEMSIZES)}")


@message(6)
class Fetch(Message):
    """Ask for ``layer`` at version >= ``min_version``; answered when that version exists. A
    server with recovery on answers ``min_version`` itself while it retains it (the layer was
    updated in a step some worker has not finished)."""

    layer: int
    min_version: int
    which: str = "compute"

    def check(self) -> None:
        _require(self.layer >= 0, "layer", "must be >= 0")
        _require(self.min_version >= 0, "min_version", "must be >= 0")
        _require(self.which in WHICH, "which", f"must be one of {WHICH}")


@message(7, frames=(0, 1), body=REPLY_BODY)
class LayerReady(Message):
    """Reply to Fetch. shm transport: read ``nbytes`` at ``offset`` of ``region``; frames
    transport: the bytes are the one tensor frame (``region`` is empty)."""

    layer: int
    version: int
    region: str
    offset: int
    nbytes: int
    dtype: str
    loss_scale: float = 1.0  # fp16: multiply this step's loss by it (gradients come back scaled)


# ----------------------------------------------------------------------------- gradients


@message(8, frames=(0, 1))
class PushGrad(Message):
    """A worker's gradient of ``layer`` for ``step``: summed over its micro-batches and already
    normalised by the global minibatch. shm: in grad slot ``slot``; frames: ``slot`` = -1 and
    the bytes are the one tensor frame. Both are in the layer's flat layout, dtype ``dtype``.
    ``skip``: the worker skipped the layer this step (LayerDrop): no gradient, ``slot`` -1;
    when every rank skipped it, its version advances without an update."""

    step: int
    layer: int
    rank: int
    slot: int
    dtype: str
    skip: bool = False

    def check(self) -> None:
        _require(self.step >= 0, "step", "must be >= 0")
        _require(self.layer >= 0, "layer", "must be >= 0")
        _require(0 <= self.rank < MAX_RANKS, "rank", "out of range")
        _require(self.slot >= -1, "slot", "must be >= -1")
        _require(not self.skip or self.slot == -1, "slot", "must be -1 with skip")
        _require(self.dtype in ITEMSIZES, "dtype", f"must be one of {sorted(ITEMSIZES)}")


@message(9)
class GradAck(Message):
    """The gradient has been reduced; its slot may be reused."""

    step: int
    layer: int
    slot: int


# ----------------------------------------------------------------------------- control


@message(10, body=2 * SMALL_BODY)
class Save(Message):
    """Write a checkpoint of the server's state (after the last complete step) to ``path``."""

    path: str

    def check(self) -> None:
        _require(0 < len(self.path) <= MAX_STR, "path", "must be a non-empty path")


@message(11)
class Status(Message):
    """Ask for the server's state."""


@message(12, body=REPLY_BODY)
class StatusReply(Message):
    run_id: str
    step: int  # steps completed by every layer (= the next step to run)
    versions: tuple[int, ...]
    world_size: int
    ranks: tuple[int, ...]  # ranks that said Hello and not Bye
    stats: dict[str, int | float | str]
    workers: tuple[WorkerInfo, ...] = ()
    updated_ms: tuple[int, ...] = ()  # per layer: ms since its version last changed (-1: never)
    boxes: tuple[BoxInfo, ...] = field(default=(), metadata={"omit_default": True})  # --nodes


@message(13)
class Bye(Message):
    """A worker leaves; ``done`` says it finished its job (vs. aborting)."""

    rank: int
    done: bool


# ----------------------------------------------------------------------------- stash

MAX_ARENA_BYTES = 1 << 40


@message(14)
class StashArena(Message):
    """Ask for (or resize) this worker's stash arena: EPS-owned shared memory where the worker
    keeps its boundary activations between forward and backward (``--stash eps``)."""

    nbytes: int

    def check(self) -> None:
        _require(0 < self.nbytes <= MAX_ARENA_BYTES, "nbytes", f"must be in (0, {MAX_ARENA_BYTES}]")


@message(15, body=REPLY_BODY)
class ArenaReady(Message):
    """Reply to StashArena: the arena's region (created for this rank, mode 0600)."""

    region: RegionInfo


# ----------------------------------------------------------------------------- hyperparameters


@message(16)
class SetHyper(Message):
    """Change optimizer hyperparameters of a running server (lr, weight_decay, betas, eps,
    momentum, schedule, warmup_steps, total_steps, min_lr_ratio, clip_norm); they apply from the
    next layer update that starts. Answered with HyperAck carrying the whole new setting."""

    changes: dict[str, str | int | float | bool]

    def check(self) -> None:
        _require(0 < len(self.changes) <= 32, "changes", "must name 1..32 settings")


@message(17, body=REPLY_BODY)
class HyperAck(Message):
    optimizer: dict[str, str | int | float | bool]


# ----------------------------------------------------------------------------- liveness


@message(18)
class Heartbeat(Message):
    """A registered peer is alive (any request also counts); answered with an Ack. A peer
    silent for the server's heartbeat timeout is declared dead and its rank freed. A worker's
    carries its latest ``report`` once it has finished a step."""

    report: WorkerReport | None = None


# What a client may send; everything else is a reply and is refused when it arrives as one.
REQUESTS = (Hello, InitLayer, Fetch, PushGrad, Save, Status, Bye, StashArena, SetHyper,
            Heartbeat)
