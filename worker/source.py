"""Where a worker's layers come from and its gradients go: the *layer source* the executor talks
to, and the EPS-backed one, assembled once when the worker joins.

    prefetch(layer, version)   start getting the weights of a later visit
    weights(layer, version)    the layer's flat weights, ready on the compute device
    release(layer, version)    the visit is done reading them (their buffer may be refilled)
    loss_scale(version)        the fp16 loss scale of that step (1.0 otherwise)
    grad_buffer(plan)          (slot, flat fp32 buffer) to accumulate the layer's gradient into
    push(step, plan, slot, buf), drain()   send it (asynchronously); wait for the step's acks
    skip(step, plan)           the layer is skipped this step (LayerDrop): no gradient
    stash_arena(nbytes)        EPS-owned shared memory for the stash (--stash eps); asked
                               again, larger, when entries outgrow it (padded text)
    release_arena(region)      an arena replaced by a larger one is no longer read
    tick()                     the loop made progress (heartbeats go on; see eps_client.py)
    redo(step, layers)         this rank's gradients of ``layers`` for ``step`` are in already
                               (a replacement): their weights must come from the EPS's answer

The same executor runs against weights held in-process (bench/local.py) for baselines.
``make_source`` picks, from the transport, the device and the precision, one locator, one
weight path (weights.py) and one gradient path (grads.py); nothing is re-decided per call.
"""

from __future__ import annotations

import platform
from typing import Protocol

import torch

from protocol.messages import StashArena, Welcome
from protocol.shm import Region
from protocol.tensors import DTYPES, LayerPlan, Layout
from protocol.trace import NULL, Tracer

from .config import WorkerConfig
from .eps_client import EpsClient
from .faults import parse_delays
from .grads import DeviceGrads, GradPath, SlotGrads, StagedGrads, ToFrame, ToSlot
from .regions import GradSlots, Regions
from .weights import BoardLocator, DeviceCopyWeights, FetchLocator, InPlaceWeights, WeightPath

STORE_ORDERED = ("x86_64", "AMD64", "i686", "i386")  # CPUs whose stores are seen in order


class LayerSource(Protocol):
    def prefetch(self, layer: int, version: int) -> None: ...
    def weights(self, layer: int, version: int) -> torch.Tensor: ...
    def release(self, layer: int, version: int) -> None: ...
    def loss_scale(self, version: int) -> float: ...
    def grad_buffer(self, plan: LayerPlan) -> tuple[int, torch.Tensor]: ...
    def push(self, step: int, plan: LayerPlan, slot: int, buf: torch.Tensor) -> None: ...
    def skip(self, step: int, plan: LayerPlan) -> None: ...
    def drain(self) -> None: ...
    def stash_arena(self, nbytes: int) -> Region: ...
    def release_arena(self, region: Region) -> None: ...
    def redo(self, step: int, layers: frozenset[int]) -> None: ...
    def tick(self) -> None: ...


class EpsSource:
    """L2Lp: fetches run one visit ahead, pushes are acknowledged in the background."""

    def __init__(self, client: EpsClient, regions: Regions, weights: WeightPath,
                 grads: GradPath):
        self.client, self.regions, self._weights, self._grads = client, regions, weights, grads

    @property
    def fast_fetches(self) -> int:
        """Layers located on the version board, without a round trip."""
        return self._weights.locator.fast_fetches

    def prefetch(self, layer: int, version: int) -> None:
        self._weights.prefetch(layer, version)

    def weights(self, layer: int, version: int) -> torch.Tensor:
        return self._weights.weights(layer, version)

    def release(self, layer: int, version: int) -> None:
        self._weights.release(layer, version)

    def loss_scale(self, version: int) -> float:
        return self._weights.loss_scale(version)

    def grad_buffer(self, plan: LayerPlan) -> tuple[int, torch.Tensor]:
        return self._grads.buffer(plan)

    def push(self, step: int, plan: LayerPlan, slot: int, buf: torch.Tensor) -> None:
        self._grads.push(step, plan, slot, buf)

    def skip(self, step: int, plan: LayerPlan) -> None:
        self._grads.skip(step, plan)

    def drain(self) -> None:
        self._grads.drain()

    def tick(self) -> None:
        self.client.tick()

    def redo(self, step: int, layers: frozenset[int]) -> None:
        # The served copy of a layer this rank pushed may be rewritten at any time: never read
        # it off the version board; the EPS answers with a copy (its retained version).
        self._weights.locator.ask |= {(layer, step) for layer in layers}

    def stash_arena(self, nbytes: int) -> Region:
        reply = self.client.call(StashArena, nbytes=nbytes)  # replaces (unlinks) the last one
        return self.regions.attach(reply.region, writable=True)

    def release_arena(self, region: Region) -> None:
        self.regions.detach(region)

    def close(self) -> None:
        self._weights.close()
        self._grads.close()
        self.regions.close()


class SerialSource(EpsSource):
    """--no-overlap: every fetch asked for when needed and every push waited for (the same
    loop without L2Lp, for comparison)."""

    def prefetch(self, layer: int, version: int) -> None:
        pass

    def push(self, step: int, plan: LayerPlan, slot: int, buf: torch.Tensor) -> None:
        super().push(step, plan, slot, buf)
        self.drain()


def make_source(client: EpsClient, welcome: Welcome, layout: Layout, cfg: WorkerConfig,
                device: torch.device, tracer: Tracer = NULL) -> EpsSource:
    cuda = device.type == "cuda"
    shm = cfg.transport == "shm"
    delays = parse_delays(cfg.cuda_delay)
    regions = Regions(pin=cuda, device=device)
    if shm:
        for info in (welcome.master, welcome.compute, welcome.retained):
            if info is not None:  # the GPU copies the served weights, not a master behind them
                regions.attach(info, writable=False,
                               pin=info is not welcome.master or welcome.compute is None)

    # Not with fp16 (each step's loss scale comes with its Fetch replies), nor on CPUs that
    # may reorder stores (the board relies on x86's ordering).
    locator = FetchLocator(client)
    if (shm and welcome.versions is not None and welcome.compute_dtype != "float16"
            and platform.machine() in STORE_ORDERED):
        board = regions.attach(welcome.versions, writable=False,
                               pin=False).tensor(torch.int64)  # read by the CPU only
        locator = BoardLocator(client, board, welcome.compute or welcome.master, layout)

    common = (locator, client, regions, layout)
    if cuda or cfg.copy_weights:
        weights: WeightPath = DeviceCopyWeights(*common, tracer=tracer, device=device,
                                                compute_dtype=welcome.compute_dtype,
                                                delays=delays)
    else:
        weights = InPlaceWeights(*common, tracer=tracer)

    # Micro-batch sums accumulate in fp32 whatever the wire dtype.
    wire = DTYPES[welcome.grad_dtype]
    kw = dict(rank=cfg.rank, dtype=welcome.grad_dtype, slots=welcome.grad_slots,
              timeout=cfg.eps_timeout, tracer=tracer)
    if shm and not cuda and wire == torch.float32:
        grads: GradPath = SlotGrads(client, layout, shared=GradSlots(regions, welcome, layout,
                                                                     wire), **kw)
    else:
        if shm:
            out: ToSlot | ToFrame = ToSlot(GradSlots(regions, welcome, layout, wire), cuda)
        else:
            staging = [torch.empty(layout.max_trainable_numel, dtype=wire, pin_memory=cuda)
                       for _ in range(welcome.grad_slots)] if cuda or wire != torch.float32 else []
            out = ToFrame(staging, cuda)
        if cuda:
            grads = DeviceGrads(client, layout, device=device, out=out, delays=delays, **kw)
        else:
            grads = StagedGrads(client, layout, device=device, out=out, **kw)
    return (EpsSource if cfg.overlap else SerialSource)(client, regions, weights, grads)
