"""CUDA side streams, events and host registration, with CPU fall-backs that do nothing.

On CUDA, copies (weights host->device, gradients and stash device->host) run on side streams.
The handshake follows FSDP2's event discipline rather than ``record_stream``:
- a copy into a buffer first waits on that buffer's *released* event (recorded on the compute
  stream after the last kernel that read it), then records a *ready* event;
- the compute stream waits on the ready event before its first kernel that reads the buffer.
On CPU every operation is synchronous in program order, so all of this reduces to no-ops.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h)
HOST_REGISTER_DEFAULT = 0
HOST_REGISTER_READ_ONLY = 8


class Streams:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None

    def event(self, stream=None):
        """An event recorded now on ``stream`` (default: the compute stream); None on CPU."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def wait(self, event, stream=None) -> None:
        """Make ``stream`` (default: compute) wait for ``event`` without blocking the host."""
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)
             ).wait_event(event)

    def on(self, stream):
        """Context: issue work on ``stream`` (no-op on CPU)."""
        return torch.cuda.stream(stream) if stream is not None else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def register_host(tensor: torch.Tensor, read_only: bool) -> bool:
    """Page-lock (pin) existing host memory, e.g. a whole shared-memory mapping, so copies to
    and from the GPU run at full speed and asynchronously. Returns False (and logs why) if the
    driver refuses: copies then still work, from pageable memory."""
    flags = HOST_REGISTER_READ_ONLY if read_only else HOST_REGISTER_DEFAULT
    err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(),
                                               tensor.numel() * tensor.element_size(), flags)
    code = int(getattr(err, "value", err))
    if code != 0:
        log.warning("cudaHostRegister failed (error %d); copies use pageable memory", code)
        return False
    return True


def unregister_host(tensor: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())
    code = int(getattr(err, "value", err))
    if code != 0:
        log.warning("cudaHostUnregister failed (error %d)", code)
