"""The EPSes of a job over several boxes (``--nodes N``): one torch.distributed gloo group,
joined in rendezvous.py (box 0's store at MASTER_ADDR:MASTER_PORT, the box's rank, N). In
``replicate`` mode every box holds the master and optimizer state of every layer; in ``shard``
mode (ZeRO-1 across the boxes) each holds 1/N of every layer's (protocol/shards.py), the
summed gradient is scattered (``reduce_shard``), each box updates its part, and the served copy
is gathered (``gather``).

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
and tells its workers why, and the job fails on every box. A shard job's checkpoints are the
boxes' together (shard_save.py, through ``agree``).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from .config import BoxesConfig
from .layer_math import Checked

log = logging.getLogger("eps_server")


AGREE_SLOTS = 64  # checkpoints a box offers when the boxes agree on one to resume from


class BoxLost(RuntimeError):
    """A cross-box collective failed or timed out: another box died or is cut off."""


# Shard mode's two collectives, built from gloo's fast ones: its reduce_scatter_tensor and
# all_gather_into_tensor take 2-4x the time of an all-reduce of the whole buffer (bench
# collectives: 256 MiB, 2 ranks, 16 cores: reduce-scatter 0.31 s, all-gather 0.34 s, all-reduce
# 0.15 s), while one broadcast per box moves a chunk at the all-reduce's pace or better.

def reduce_scatter(shard: torch.Tensor, grad: torch.Tensor, rank: int, group=None) -> None:
    """``shard`` = this box's chunk of the boxes' sum of ``grad`` (count x chunk); ``grad`` is
    left holding the whole sum."""
    import torch.distributed as dist

    dist.all_reduce(grad, group=group)
    shard.copy_(grad.view(-1, shard.numel())[rank])


def all_gather(out: torch.Tensor, mine: torch.Tensor, rank: int, group=None) -> None:
    """``out`` (count x chunk) = every box's ``mine``, in box order: each box broadcasts its
    chunk in turn (``group`` spans every box, so a box's rank in it is its global rank)."""
    import torch.distributed as dist

    chunks = out.view(-1, mine.numel())
    chunks[rank].copy_(mine)
    for r in range(chunks.shape[0]):
        dist.broadcast(chunks[r], src=r, group=group)


def gathered(row: torch.Tensor, nodes: int) -> list[torch.Tensor]:
    """Every box's ``row`` (one shape everywhere), in box order."""
    import torch.distributed as dist

    every = [torch.empty_like(row) for _ in range(nodes)]
    dist.all_gather(every, row)
    return every


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
    """This EPS's membership of the boxes' group (once joined: rendezvous.py).

    ``replicas``: what must be equal on every box, layer by layer (the checksums): the fp32
    masters in replicate mode, the served copies in shard mode. ``engines``: in shard mode,
    the engines whose all-gathers run on groups of their own (``gather``)."""

    def __init__(self, cfg: BoxesConfig, layers: int, start: Callable[[], int], replicas,
                 engines: int = 0, version: Callable[[int], int] | None = None):
        import torch.distributed as dist

        self.cfg = cfg
        self.sequence = Sequence(layers, start)
        self._replicas = replicas
        self._version = version or (lambda layer: 1 << 62)  # a layer's published version
        self.reduce_seconds = 0.0  # time engines waited on cross-box reductions
        self.gather_seconds = 0.0  # (shard) time engines spent in all-gathers
        self.checks = 0
        self._lost_at_stop: tuple[str | None] | None = None  # (lost before stop(),) once stopped
        # Shard mode: a layer's all-gather follows its update, on the engine that owns it.
        # One group per engine: each engine runs its jobs in the same order on every box (the
        # order the backward and the step's decision send them), so each group's collectives
        # match without the layers' global order, and a gather never waits for a reduction.
        timeout = datetime.timedelta(seconds=cfg.box_timeout)
        self._groups = [dist.new_group(backend="gloo", timeout=timeout)
                        for _ in range(engines)]

    @classmethod
    def of(cls, cfg: BoxesConfig, store, engines: int) -> CrossBox:
        """The membership of an EPS with ``store`` and ``engines`` engines."""
        sharded = store.sharding is not None
        replicas = [(store.compute if sharded else store.master)(i)
                    for i in range(store.num_layers)]
        return cls(cfg, store.num_layers, lambda: max(store.step, 0), replicas,
                   engines if sharded else 0, lambda layer: store.versions[layer])

    @staticmethod
    def engines(cfg) -> int:
        """Engines for ServerConfig ``cfg``: its math threads; in shard mode across boxes the
        most (every box must run the same engines, whatever its cores: ``gather``)."""
        from .engines import MAX_ENGINES

        return MAX_ENGINES if cfg.boxes.sharding is not None else cfg.math_threads

    @staticmethod
    def agree_on_checkpoint(cfg: BoxesConfig, load: str) -> str:
        """The checkpoint every box resumes from (after ``join``): the newest step that every
        box's ``load`` holds, which is not every box's latest when a box's last checkpoint
        failed (a full disk) or was cut off while the others' was written (keep >= 2
        checkpoints for this). "" when no box loads one. Raises ValueError when they cannot
        agree (a restart would not help), BoxLost when the boxes cannot be reached."""
        from protocol.checkpoints import held

        mine, unreadable = [], None
        try:  # (a box that cannot read its own still takes part: the others must hear it)
            mine = held(load)[:AGREE_SLOTS] if load else []
        except (OSError, ValueError) as e:
            unreadable = e
        row = torch.full((AGREE_SLOTS + 1,), -1, dtype=torch.int64)
        row[0] = int(bool(load))
        row[1:1 + len(mine)] = torch.tensor([step for step, _ in mine], dtype=torch.int64)
        try:
            every = gathered(row, cfg.nodes)
        except Exception as e:  # gloo: a peer gone (connection closed) or the timeout
            raise BoxLost(f"the boxes could not compare their checkpoints: {e}") from None
        if unreadable is not None:
            raise ValueError(f"--load {load}: {unreadable}")
        steps = [[s for s in other[1:].tolist() if s >= 0] for other in every]
        if not any(int(other[0]) for other in every):
            return ""
        said = "; ".join(f"box {r}: {f'steps {held_}' if int(every[r][0]) else 'no --load'}"
                         for r, held_ in enumerate(steps))
        common = set.intersection(*map(set, steps))
        if not common or not all(int(other[0]) for other in every):
            raise ValueError(f"the boxes hold no checkpoint of one step to resume from "
                             f"together ({said})")
        step = max(common)
        if step != mine[0][0]:
            log.warning("box %d: resuming from step %d, the newest checkpoint every box holds "
                        "(this box's latest is step %d; %s)", cfg.node_rank, step, mine[0][0],
                        said)
        return dict(mine)[step]

    def reduce(self, layer: int, t: int, grad: torch.Tensor) -> None:
        """All-reduce (sum) ``grad``, this box's fp32 sum of layer ``layer``'s gradient of step
        ``t``, in its turn; every ``box_check_every`` steps, at a step's first layer, the
        replicas are compared first. Raises BoxLost."""
        import torch.distributed as dist

        self._in_turn(layer, t, lambda: dist.all_reduce(grad))

    def reduce_shard(self, layer: int, t: int, grad: torch.Tensor, shard: torch.Tensor,
                     check: Callable[[], Checked]) -> Checked:
        """Shard mode: reduce-scatter ``grad`` (this box's fp32 sum of the layer's gradient,
        padded to count x chunk) into ``shard`` (this box's chunk of the boxes' sum), in its
        turn; ``check()`` checks the chunk, and the boxes' findings are summed, so every box
        decides (overflow, the norm for clipping) from the whole layer. Raises BoxLost."""
        import torch.distributed as dist

        def run() -> Checked:
            reduce_scatter(shard, grad, self.cfg.node_rank)
            mine = check()
            found = torch.tensor([mine.norm_sq, float(not mine.finite)], dtype=torch.float64)
            dist.all_reduce(found)
            # one part (the sum): a non-finite element anywhere is the sum's, as an overflow
            return Checked((), bool(found[1] > 0), float(found[0]))

        return self._in_turn(layer, t, run)

    def gather(self, engine: int, layer: int, mine: torch.Tensor, out: torch.Tensor) -> None:
        """Shard mode: all-gather every box's chunk of the layer's new served copy (``mine``,
        one chunk) into ``out`` (count x chunk), on ``engine``'s group. Raises BoxLost."""
        if self.sequence.broken is not None:
            raise BoxLost(f"an earlier cross-box reduction failed: {self.sequence.broken}")
        t0 = time.perf_counter()
        try:
            all_gather(out, mine, self.cfg.node_rank, self._groups[engine])
        except Exception as e:  # gloo: a peer gone (connection closed) or the timeout
            lost = BoxLost(f"the all-gather of layer {layer} across {self.cfg.nodes} boxes "
                           f"failed (a box died or is cut off?): {e}")
            self.sequence.fail(lost)
            raise lost from None
        self.gather_seconds += time.perf_counter() - t0

    def _in_turn(self, layer: int, t: int, run: Callable[[], Any]) -> Any:
        """``run()`` (collectives on the default group) in the turn of (t, layer)."""
        key = (t, layer)
        t0 = time.perf_counter()
        try:
            self.sequence.wait_turn(key, self.cfg.box_timeout)
            every = self.cfg.box_check_every
            if layer == self.sequence.layers - 1 and (not self.checks or every and
                                                      t % every == 0):
                self._compare(t)  # always at a box's first step: a restart's checkpoints
            result = run()
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
        return result

    def agree(self, mine: torch.Tensor, what: str) -> torch.Tensor:
        """Every box's ``mine`` (int64, one shape everywhere), stacked in box order: the
        boxes' checkpoints at a step boundary, while no engine runs. Raises BoxLost."""
        try:
            if self.lost is not None:
                raise BoxLost(f"an earlier cross-box reduction failed: {self.lost}")
            every = gathered(mine, self.cfg.nodes)
        except BoxLost as e:
            self.sequence.fail(e)
            raise
        except Exception as e:
            lost = BoxLost(f"{what} across {self.cfg.nodes} boxes failed (a box died or is "
                           f"cut off?): {e}")
            self.sequence.fail(lost)
            raise lost from None
        return torch.stack(every)

    def skip(self, layer: int, t: int) -> None:
        self.sequence.skip((t, layer))

    def fail(self, why: str) -> BoxLost:
        """Stop this box's collectives (an engine waiting for its turn gives up at once);
        returns the error, for its caller to raise."""
        lost = BoxLost(why)
        self.sequence.fail(lost)
        return lost

    def stats(self) -> dict:
        """Engine time in cross-box collectives (shard mode: gathers apart)."""
        return {"box_reduce_seconds": round(self.reduce_seconds, 6),
                "box_gather_seconds": round(self.gather_seconds, 6)}

    def stop(self) -> None:
        """The EPS stops: no engine is left waiting for its turn. What was lost before stays
        ``lost``; else the group still serves a shard job's final checkpoint (``agree``)."""
        lost = self.lost
        self.sequence.fail(BoxLost("the EPS is stopping"))
        self._lost_at_stop = (lost,)

    @property
    def lost(self) -> str | None:
        """Why the boxes' collectives failed (then this EPS should stop), or None."""
        if self._lost_at_stop is not None:
            return self._lost_at_stop[0]
        broken = self.sequence.broken
        return None if broken is None else str(broken)

    def _compare(self, t: int) -> None:
        """The boxes' checksums of their replicas must be equal, for every layer that each box
        has at version t. (Its step-t update waits its turn behind this one; but a layer that
        LayerDrop dropped in step t may still be taking its step t-1 update on another engine:
        its version is t once that is done.)"""
        ready = [int(self._version(i) >= t) for i in range(len(self._replicas))]
        sums = [checksum(m) if r else 0 for m, r in zip(self._replicas, ready)]
        mine = torch.tensor([t, *sums, *ready], dtype=torch.int64)
        every = gathered(mine, self.cfg.nodes)
        self.checks += 1
        steps = [int(other[0]) for other in every]
        if len(set(steps)) > 1:
            raise BoxLost(f"the boxes are at different steps {steps} (box by box): they "
                          "resumed from different checkpoints")
        bad = differing(every, len(self._replicas))
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


def differing(rows: list[torch.Tensor], layers: int) -> list[int]:
    """The layers whose checksums differ between the boxes' rows ([t, checksums, ready]),
    among those that every box had ready."""
    sums = torch.stack([row[1:1 + layers] for row in rows])
    ready = torch.stack([row[1 + layers:] for row in rows]).bool().all(dim=0)
    return [i for i in range(layers) if ready[i] and bool((sums[:, i] != sums[0, i]).any())]


def checksum(t: torch.Tensor) -> int:
    """Sum of the bit patterns as int64 (exact, order-free): equal replicas, equal sums."""
    return int(t.view(torch.int32 if t.element_size() == 4 else torch.int16)
               .sum(dtype=torch.int64))
