"""The EPS core's control requests: Save (l2l-ctl save), SetHyper (l2l-ctl set), a worker's
stash arena, and Status (l2l-ctl status): a mixin of EpsCore (core.py)."""

from __future__ import annotations

import logging

from protocol.messages import (
    ArenaReady,
    HyperAck,
    RegionInfo,
    Save,
    SetHyper,
    StashArena,
    Status,
    StatusReply,
    WorkerInfo,
)

from . import checkpoint
from .config import with_changes
from .errors import RequestError
from .jobs import Requester
from .peers import check_control, check_one_box
from .replies import Out
from .stats import model_memory, peak_memory_bytes

log = logging.getLogger("eps_server")


def set_hyper(cfg, registered: bool, msg: SetHyper) -> HyperAck:
    """SetHyper's changes applied to ``cfg.optimizer`` (the core's, or the lobby's before the
    model exists); its reply."""
    check_control(cfg, registered)
    check_one_box(cfg, "change hyperparameters")
    try:
        cfg.optimizer = with_changes(cfg.optimizer, msg.changes)
    except (ValueError, TypeError) as e:
        raise RequestError("bad_request", str(e), "changes") from None
    return HyperAck(req_id=msg.req_id, optimizer=cfg.optimizer.as_dict())


class ControlRequests:
    def _save(self, identity: bytes, msg: Save, frames) -> list[Out]:
        check_control(self.cfg, identity in self.peers)
        check_one_box(self.cfg, "save")
        try:  # a path this process cannot write is refused now, with the OS's reason
            checkpoint.check_writable(msg.path, self.store.manifest_hash)
        except ValueError as e:
            raise RequestError("bad_request", str(e), "path") from None
        if not self.store.initialised:
            raise RequestError("not_ready", "nothing to save: the model is not initialised")
        self.scheduler.request_save(msg.path, Requester(identity, msg.req_id))
        return []

    def _set_hyper(self, identity: bytes, msg: SetHyper, frames) -> list[Out]:
        ack = set_hyper(self.cfg, identity in self.peers, msg)
        log.info("hyperparameters changed: %s", msg.changes)  # used from the next update
        return [Out(identity, ack)]

    def _stash_arena(self, identity: bytes, msg: StashArena, frames) -> list[Out]:
        peer = self.peers.worker(identity)
        try:
            region = self.store.stash_region(peer.rank, msg.nbytes)
        except OSError as e:
            raise RequestError("resource", f"cannot allocate a stash arena of {msg.nbytes} "
                               f"bytes: {e}", "nbytes") from None
        log.info("stash arena of %.1f MiB for rank %d", msg.nbytes / 2**20, peer.rank)
        return [Out(identity, ArenaReady(req_id=msg.req_id, region=RegionInfo(
            name=region.name, nbytes=region.nbytes, dtype="uint8")))]

    def status_stats(self) -> dict:
        stats = {**self.stats.snapshot(), **peak_memory_bytes(), "lr": self.cfg.optimizer.lr,
                 "lr_now": self.cfg.optimizer.lr_at(max(self.store.step, 0)),
                 "params": self.store.manifest.num_params,
                 "loss_scale": self.scheduler.scaler.scale,
                 **model_memory(self.store, [m.optimizer for m in self.engines.layers],
                                self.buffers, self._rss_before)}
        if self.engines.boxes is not None:  # engine time in cross-box collectives
            stats.update(self.engines.boxes.stats())
        if self.broken:
            stats["broken"] = self.broken
        return stats

    def _status(self, identity: bytes, msg: Status, frames) -> list[Out]:
        now = self.peers.clock()
        workers = tuple(WorkerInfo(rank=p.rank, pid=p.pid, host=p.host,
                                   step=self.data.resume_point(p.rank)[0],
                                   silent=round(now - p.last_seen, 3), report=p.report)
                        for p in sorted(self.peers.snapshot(), key=lambda p: p.rank) if p.worker)
        return [Out(identity, StatusReply(
            req_id=msg.req_id, run_id=self.run_id, step=max(self.store.step, 0),
            versions=tuple(self.store.versions), world_size=self.cfg.world_size,
            ranks=self.peers.ranks(), stats=self.status_stats(), workers=workers,
            updated_ms=tuple(int(1000 * (now - t)) if t is not None else -1
                             for t in self.data.published_at)))]
