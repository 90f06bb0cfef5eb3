"""The EPSes of a job over several boxes (``--nodes N``): one torch.distributed gloo group,
joined by the env:// contract (MASTER_ADDR, MASTER_PORT, the box's rank, N), in ``replicate``
mode: every box holds the master and optimizer state of every layer.

When a layer's gradient is complete on a box (its local workers' parts), the engine updating
it sums the parts into an fp32 buffer and all-reduces that across the boxes at once, so the
transfer of layer l overlaps the workers' backward of layer l-1 and the update stays eager.
Every box then checks and updates the layer from the same summed gradient, in the same code:
the replicas stay bitwise identical (checked every ``box_check_every`` steps) and every
decision made from the gradient (overflow skip, global-norm clipping) is the same everywhere.

Collectives must be issued in one order on every box; engines finish layers in the order the
backward sends them, which the ``Sequence`` makes canonical: step by step, from the last layer
to the first (a layer dropped in a step is passed over). A box that dies or is cut off makes
the others' collective fail within ``box_timeout``: the update fails, the EPS stops updating
and tells its workers why, and the job fails on every box.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from .config import BoxesConfig

log = logging.getLogger("eps_server")


class BoxLost(RuntimeError):
    """A cross-box collective failed or timed out: another box died or is cut off."""


class Sequence:
    """The canonical order of the cross-box collectives: (step, layer) with steps ascending
    and, within a step, layers descending; keys announced as skipped are passed over."""

    def __init__(self, layers: int, start: Callable[[], int]):
        self.layers = layers
        self._start = start  # the step the box's first collective belongs to, asked then
        self.next: tuple[int, int] | None = None  # (a checkpoint loaded after construction)
        self._skipped: set[tuple[int, int]] = set()
        self._cv = threading.Condition()
        self.broken: BaseException | None = None

    def wait_turn(self, key: tuple[int, int], timeout: float) -> None:
        with self._cv:
            self._begin()
            if not self._cv.wait_for(lambda: self.next == key or self.broken is not None,
                                     timeout):
                raise BoxLost(f"layer {key[1]} of step {key[0]} waited {timeout:g} s for its "
                              f"turn behind layer {self.next[1]} of step {self.next[0]}")
            if self.broken is not None:
                raise BoxLost(f"an earlier cross-box reduction failed: {self.broken}")

    def done(self, key: tuple[int, int]) -> None:
        with self._cv:
            assert self.next == key, (self.next, key)
            self._advance()

    def skip(self, key: tuple[int, int]) -> None:
        with self._cv:
            self._begin()
            self._skipped.add(key)
            self._advance(move=False)

    def fail(self, e: BaseException) -> None:
        with self._cv:
            self.broken = self.broken or e
            self._cv.notify_all()

    def _begin(self) -> None:
        if self.next is None:
            self.next = (self._start(), self.layers - 1)

    def _advance(self, move: bool = True) -> None:
        if move:
            self.next = self._after(self.next)
        while self.next in self._skipped:
            self._skipped.discard(self.next)
            self.next = self._after(self.next)
        self._cv.notify_all()

    def _after(self, key: tuple[int, int]) -> tuple[int, int]:
        t, layer = key
        return (t, layer - 1) if layer > 0 else (t + 1, self.layers - 1)


class CrossBox:
    """This EPS's membership of the boxes' group (``join`` blocks until every box is there)."""

    def __init__(self, cfg: BoxesConfig, layers: int, start: Callable[[], int], masters):
        self.cfg = cfg
        self.sequence = Sequence(layers, start)
        self._masters = masters  # layer -> its fp32 master (the replica checksums)
        self.reduce_seconds = 0.0  # time engines waited on cross-box reductions
        self.checks = 0

    @staticmethod
    def join(cfg: BoxesConfig) -> None:
        """The rendezvous: box 0 serves the store on master_port; every box connects."""
        import torch.distributed as dist

        if cfg.master_addr in ("127.0.0.1", "localhost", "::1"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the group's pairs on loopback
        log.info("box %d of %d: joining the boxes' group at %s:%d (up to %g s)", cfg.node_rank,
                 cfg.nodes, cfg.master_addr, cfg.master_port, cfg.box_timeout)
        try:
            dist.init_process_group(
                "gloo", init_method="env://" if cfg.rendezvous == "env" else
                f"tcp://{cfg.master_addr}:{cfg.master_port}", rank=cfg.node_rank,
                world_size=cfg.nodes, timeout=datetime.timedelta(seconds=cfg.box_timeout))
        except Exception as e:  # the store's timeout, a port in use, an unreachable box 0
            raise BoxLost(f"box {cfg.node_rank} could not join the {cfg.nodes} boxes at "
                          f"{cfg.master_addr}:{cfg.master_port} within {cfg.box_timeout:g} s: "
                          f"{e}") from None

    def reduce(self, layer: int, t: int, grad: torch.Tensor) -> None:
        """All-reduce (sum) ``grad``, this box's fp32 sum of layer ``layer``'s gradient of step
        ``t``, in its turn; every ``box_check_every`` steps, at a step's first layer, the
        replicas are compared first. Raises BoxLost."""
        import torch.distributed as dist

        key = (t, layer)
        t0 = time.perf_counter()
        try:
            self.sequence.wait_turn(key, self.cfg.box_timeout)
            every = self.cfg.box_check_every
            if layer == self.sequence.layers - 1 and (not self.checks or every and
                                                      t % every == 0):
                self._compare(t)  # always at a box's first step: a restart's checkpoints
            dist.all_reduce(grad)
        except BoxLost as e:
            self.sequence.fail(e)
            raise
        except Exception as e:  # gloo: a peer gone (connection closed) or the timeout
            lost = BoxLost(f"the reduction of layer {layer}, step {t} across {self.cfg.nodes} "
                           f"boxes failed (a box died or is cut off?): {e}")
            self.sequence.fail(lost)
            raise lost from None
        self.sequence.done(key)
        self.reduce_seconds += time.perf_counter() - t0

    def skip(self, layer: int, t: int) -> None:
        self.sequence.skip((t, layer))

    def fail(self, why: str) -> BoxLost:
        """Stop this box's collectives (an engine waiting for its turn gives up at once);
        returns the error, for its caller to raise."""
        lost = BoxLost(why)
        self.sequence.fail(lost)
        return lost

    @property
    def lost(self) -> str | None:
        """Why the boxes' collectives failed (then this EPS should stop), or None."""
        broken = self.sequence.broken
        return None if broken is None else str(broken)

    def _compare(self, t: int) -> None:
        """Every layer is at version t here (the step's updates wait their turn behind this
        one): the boxes' checksums of their masters must be equal."""
        import torch.distributed as dist

        mine = torch.tensor([t] + [checksum(m) for m in self._masters], dtype=torch.int64)
        every = [torch.empty_like(mine) for _ in range(self.cfg.nodes)]
        dist.all_gather(every, mine)
        self.checks += 1
        steps = [int(other[0]) for other in every]
        if len(set(steps)) > 1:
            raise BoxLost(f"the boxes are at different steps {steps} (box by box): they "
                          "resumed from different checkpoints")
        bad = sorted({int(i) - 1 for other in every for i in torch.nonzero(other != mine)})
        if bad:
            raise BoxLost(f"the replicas differ at step {t} in layers {bad}: box "
                          f"{self.cfg.node_rank}'s checksums are not every box's")
        log.info("step %d: the %d boxes' replicas are identical", t, self.cfg.nodes)

    @staticmethod
    def close() -> None:
        """Leave the boxes' group, if this process joined one."""
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # a group whose peers are gone: nothing left to tidy
                pass


def checksum(master: torch.Tensor) -> int:
    """Sum of the fp32 bit patterns as int64 (exact, order-free): equal replicas, equal sums."""
    return int(master.view(torch.int32).sum(dtype=torch.int64))
