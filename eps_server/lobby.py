"""The EPS before it has a model, and where cores come from.

A server started with ``--load`` makes its core from the checkpoint before it listens. Else
the first worker's Hello carries the model's manifest: the lobby checks it, creates the model
(every shared-memory region, or none) and hands that Hello to the new core, which registers the
worker as the *initialiser*. Until then the lobby answers Status, SetHyper (applied to the
settings the core will start with) and observers' Hellos (handed to the core), and refuses the
rest.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from protocol.events import Starting
from protocol.messages import (
    REQUESTS,
    Ack,
    Bye,
    Hello,
    Message,
    Save,
    SetHyper,
    Status,
    StatusReply,
)
from protocol.tensors import Manifest

from . import checkpoint, rendezvous
from .box_settings import agree_on_settings
from .boxes import CrossBox
from .config import ServerConfig
from .control import set_hyper
from .core import EpsCore
from .errors import RequestError
from .layer_store import LayerStore
from .peers import Peer, check_control, check_hello, check_one_box
from .replies import Out, error_out
from .stats import EpsStats, peak_memory_bytes

log = logging.getLogger("eps_server")

MAX_OBSERVERS = 256  # control clients remembered before the model exists


def create_core(cfg: ServerConfig, manifest: Manifest, run_id: str, **kw) -> EpsCore:
    """A core for a new model: every region, or none (e.g. shared memory full)."""
    if cfg.save:  # (ValueError: refused before any region, before training)
        checkpoint.check_model(cfg.save, manifest.hash())
    store = LayerStore(manifest, run_id, cfg.compute_dtype, retain=cfg.recovery,
                       sharding=cfg.boxes.sharding)
    try:
        core = EpsCore(cfg, store, run_id=run_id, **kw)
    except BaseException:
        store.close()
        raise
    log.info("model: %d layers, %.2fM parameters, manifest %s", store.num_layers,
             manifest.num_params / 1e6, store.manifest_hash[:19])
    return core


def join_and_load(cfg: ServerConfig, run_id: str, joined: Callable[[], None], **kw
                  ) -> EpsCore | None:
    """Before serving: join the boxes (``--nodes``; then ``joined()``) and agree with them on
    the checkpoint to resume from; the core resumed from it (--load), else None. Each phase is
    announced (``notify``: Starting events), and the load's progress about once a second."""
    load, notify = cfg.load, kw.get("notify", lambda ev: None)
    if cfg.boxes.nodes > 1:  # every box's EPS is there before any serves
        notify(Starting(phase="joining", total=cfg.boxes.nodes, patience=cfg.boxes.box_timeout))
        rendezvous.join(cfg.boxes)
        agree_on_settings(cfg)
        load = CrossBox.agree_on_checkpoint(cfg.boxes, load)
        joined()
    return load_core(cfg, load, run_id, **kw) if load else None


def load_core(cfg: ServerConfig, path: str, run_id: str, **kw) -> EpsCore:
    """A core resumed from a checkpoint: master, optimizer state, loss scaler, step."""
    notify = kw.get("notify", lambda ev: None)  # (Starting: the launcher's patience)
    notify(Starting(phase="checking"))
    loaded = checkpoint.read_meta(path, lambda name: notify(Starting(phase="checking")))
    core = create_core(cfg, loaded.manifest, run_id, **kw)
    said = [0.0]

    def progress(done: int, total: int) -> None:
        if time.monotonic() - said[0] >= 1.0 or done == total:
            said[0] = time.monotonic()
            notify(Starting(phase="loading", done=done, total=total))
    saved = loaded.state.get("optimizer", {})
    try:
        checkpoint.load_into(loaded, core.store, [m.optimizer for m in core.engines.layers],
                             progress)
    except BaseException as e:
        core.close(final_save=False)
        if isinstance(e, ValueError) and str(e).startswith("optimizer state") and \
                saved.get("name", cfg.optimizer.name) != cfg.optimizer.name:
            raise ValueError(f"{e}: the checkpoint was trained with --optimizer {saved['name']}, "
                             f"whose state --optimizer {cfg.optimizer.name} cannot go on "
                             "from") from None
        raise
    was = saved.get("states", "fp32")
    if saved and was != cfg.optimizer.states:
        log.info("the checkpoint's optimizer moments are %s: converted to %s", was,
                 cfg.optimizer.states)
    if saved and {**saved, "states": cfg.optimizer.states} != cfg.optimizer.as_dict():
        log.warning("the checkpoint was trained with optimizer settings %s; continuing with "
                    "the ones given now: %s", saved, cfg.optimizer.as_dict())
    trained_in = loaded.state.get("precision", cfg.precision)
    if trained_in == "fp16":  # a scale found for this model in fp16 (GradScaler's state)
        core.scheduler.scaler.restore(loaded.state.get("loss_scaler", {}))
    elif cfg.precision == "fp16":
        log.info("the checkpoint was trained in %s: the loss scale starts at --loss-scale %g",
                 trained_in, cfg.loss_scale)
    step = int(loaded.state["step"])
    for layer in range(core.store.num_layers):
        core.store.publish(layer)
        core.store.set_version(layer, step)
    core.scheduler.loaded(loaded.path, step, loaded.state)
    core.saves.last = (loaded.path, step)  # what a failure says to restart from
    log.info("resumed from %s at step %d", loaded.path, step)
    return core


class Lobby:
    def __init__(self, cfg: ServerConfig, run_id: str, stats: EpsStats, **core_kw):
        self.cfg, self.run_id, self.stats, self.core_kw = cfg, run_id, stats, core_kw
        self.observers: dict[bytes, Peer] = {}

    def handle(self, peer: bytes, msg: Message, frames, key: bytes = b""
               ) -> tuple[EpsCore | None, list[Out]]:
        """(the new core if this request created the model, else None; the replies);
        ``key``: the peer's CURVE public key, if any."""
        try:
            if isinstance(msg, Hello) and msg.role == "observer":
                check_hello(self.cfg, msg)
                if len(self.observers) >= MAX_OBSERVERS:  # they never say Bye: forget the oldest
                    del self.observers[next(iter(self.observers))]
                self.observers[peer] = Peer.observer(peer, msg.pid, key)
                return None, [Out(peer, Ack(req_id=msg.req_id))]
            if isinstance(msg, Hello):
                return self._hello(peer, msg, frames, key)
            if isinstance(msg, Bye) and peer in self.observers:
                del self.observers[peer]
                return None, [Out(peer, Ack(req_id=msg.req_id))]
            return None, [self._other(peer, msg, key)]
        except RequestError as e:
            return None, [error_out(peer, msg.req_id, e.code, str(e), e.field)]
        except Exception as e:  # a bug: report it, keep serving
            log.exception("internal error handling %s", type(msg).__name__)
            return None, [error_out(peer, msg.req_id, "internal", f"{type(e).__name__}: {e}")]

    def _hello(self, peer: bytes, msg: Hello, frames, key: bytes):
        check_hello(self.cfg, msg)
        if msg.manifest is None:
            raise RequestError("not_ready", "the server has no model yet: the first worker "
                               "must send its manifest", "manifest")
        if msg.manifest.hash() != msg.manifest_hash:
            raise RequestError("bad_request", "manifest_hash does not match the manifest",
                               "manifest_hash")
        try:
            core = create_core(self.cfg, msg.manifest, self.run_id, initialiser=max(msg.rank, 0),
                               stats=self.stats, **self.core_kw)
        except OSError as e:
            raise RequestError("resource", f"cannot hold this model: {e}") from None
        except (RuntimeError, ValueError) as e:
            raise RequestError("bad_request", f"cannot hold this model: {e}",
                               "manifest") from None
        for observer in self.observers.values():
            core.peers.register(observer)
        return core, core.handle(peer, msg, frames, key)

    def _other(self, peer: bytes, msg: Message, key: bytes) -> Out:
        if isinstance(msg, Status):
            return Out(peer, StatusReply(
                req_id=msg.req_id, run_id=self.run_id, step=0, versions=(),
                world_size=self.cfg.world_size, ranks=(),
                stats={**self.stats.snapshot(), **peak_memory_bytes(),
                       "lr": self.cfg.optimizer.lr}))
        if isinstance(msg, SetHyper):
            return Out(peer, set_hyper(self.cfg, peer in self.observers, msg))
        if isinstance(msg, Save):
            check_control(self.cfg, peer in self.observers)
            check_one_box(self.cfg, "save")
            try:
                checkpoint.check_target(msg.path)
            except ValueError as e:
                raise RequestError("bad_request", str(e), "path") from None
            raise RequestError("not_ready", "nothing to save: the model is not initialised")
        if type(msg) not in REQUESTS:
            raise RequestError("bad_message", f"{type(msg).__name__} is not a request", "kind")
        raise RequestError("not_registered", "say Hello first")
