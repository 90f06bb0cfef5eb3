"""CUDA side streams, events and host registration, with CPU fall-backs that do nothing.

On CUDA, copies (weights host->device, gradients and stash entries device->host, stash entries
back) run on side streams.
The handshake follows FSDP2's event discipline rather than ``record_stream``:
- a copy into a buffer first waits on that buffer's *released* event (recorded on the compute
  stream after the last kernel that read it), then records a *ready* event;
- the compute stream waits on the ready event before its first kernel that reads the buffer.
On CPU every operation is synchronous in program order, so all of this reduces to no-ops.
"""

from __future__ import annotations

import ctypes
import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

log = logging.getLogger(__name__)

# cudaHostRegister flags (cuda_runtime_api.h)
HOST_REGISTER_DEFAULT = 0
HOST_REGISTER_READ_ONLY = 8
# cudaDeviceAttr (driver_types.h): may memory mapped read-only be registered (flag above)?
ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113


class Streams:
    def __init__(self, device: torch.device, delays: dict[str, int] | None = None):
        self.device = device
        self.cuda = device.type == "cuda"
        self.h2d = torch.cuda.Stream(device) if self.cuda else None
        self.d2h = torch.cuda.Stream(device) if self.cuda else None
        # stash entries back to the device: apart from h2d, where a whole layer's weights
        # may be queued ahead (one micro-batch's input is wanted sooner)
        self.stash = torch.cuda.Stream(device) if self.cuda else None
        self.delays = delays or {}

    def stall(self, point: str, stream=None) -> None:
        """Testing (--cuda-delay): make ``stream`` (default: compute) spin before the work queued
        next at ``point``: a copy or kernel that misses an event wait then reads or overwrites
        a buffer at the wrong time, and the results differ. The host is never blocked."""
        cycles = self.delays.get(point)
        if self.cuda and cycles:
            with self.on(stream if stream is not None else
                         torch.cuda.current_stream(self.device)):
                torch.cuda._sleep(cycles)

    def event(self, stream=None, host_waits: bool = False):
        """An event recorded now on ``stream`` (default: the compute stream); None on CPU.
        ``host_waits``: a thread will synchronize on it, sleeping rather than spinning (a
        spinning thread takes a core from the EPS's optimizer on the same box)."""
        if not self.cuda:
            return None
        ev = torch.cuda.Event(blocking=host_waits)
        ev.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return ev

    def wait(self, event, stream=None) -> None:
        """Make ``stream`` (default: compute) wait for ``event`` without blocking the host."""
        if event is not None:
            (stream if stream is not None else torch.cuda.current_stream(self.device)
             ).wait_event(event)

    def pinned(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """Host memory the GPU copies to and from asynchronously (page-locked on CUDA)."""
        return torch.empty(shape, dtype=dtype, pin_memory=self.cuda)

    def on(self, stream):
        """Context: issue work on ``stream`` (no-op on CPU)."""
        return torch.cuda.stream(stream) if stream is not None else _Null()

    def thread_pool(self, name: str) -> ThreadPoolExecutor:
        """One helper thread (copies); on CUDA it works on this device: a new thread starts on
        device 0, and leaving a stream context there would create a context on GPU 0 for a
        worker of another GPU."""
        if not self.cuda:
            return ThreadPoolExecutor(1, name)
        return ThreadPoolExecutor(1, name, initializer=torch.cuda.set_device,
                                  initargs=(device_index(self.device),))


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
    nbytes = tensor.numel() * tensor.element_size()
    code = _code(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, flags))
    if code != 0:
        drain_cuda_error()
        log.warning("cudaHostRegister of %d bytes%s failed (CUDA error %d: %s); copies to and "
                    "from it use pageable memory, slower and synchronous", nbytes,
                    " (read-only)" if read_only else "", code, _describe(code))
        return False
    return True


def unregister_host(tensor: torch.Tensor) -> bool:
    code = _code(torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr()))
    if code != 0:
        drain_cuda_error()
        log.warning("cudaHostUnregister failed (CUDA error %d: %s)", code, _describe(code))
        return False
    return True


def _code(err) -> int:
    return int(getattr(err, "value", err))


def _describe(code: int) -> str:
    try:
        return torch.cuda.cudart().cudaGetErrorString(torch.cuda.cudart().cudaError(code))
    except Exception:  # older bindings take other argument types: the number says it all
        return "see cuda_runtime_api.h"


def device_index(device: torch.device) -> int:
    """The CUDA device's ordinal ("cuda" alone: the current device)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def read_only_registration_supported(device: torch.device) -> bool | None:
    """Whether ``device`` can register memory mapped read-only (None: cannot tell). Many x86
    machines cannot (cudaDevAttrHostRegisterReadOnlySupported is 0); there a read-only mapping
    cannot be registered at all, with any flags."""
    value = ctypes.c_int(0)
    for path in cudart_paths():
        try:
            fn = ctypes.CDLL(path).cudaDeviceGetAttribute
        except (OSError, AttributeError):
            continue
        if fn(ctypes.byref(value), ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED,
              device_index(device)) == 0:
            return bool(value.value)
        drain_cuda_error()
    return None


def drain_cuda_error() -> int:
    """Reset the CUDA runtime's pending error after a failed call made through torch's raw
    cudart binding (which has no cudaGetLastError). A failed cudaHostRegister leaves its error
    pending on this thread, and torch's next error check (e.g. after an unrelated kernel
    launch) would raise it as its own. The runtime torch loaded is found in /proc/self/maps;
    the error state is per runtime instance, so every copy mapped is drained. Returns how many
    were."""
    drained = 0
    for path in cudart_paths():
        try:
            ctypes.CDLL(path).cudaGetLastError()
            drained += 1
        except (OSError, AttributeError):
            continue
    if not drained:
        log.error("no CUDA runtime library found in this process to clear the error of the "
                  "failed call with (torch linked statically?): the next CUDA error check may "
                  "report it")
    return drained


def cudart_paths() -> list[str]:
    """Paths of the CUDA runtime libraries mapped into this process (stock torch wheels load
    libcudart.so.N, some builds a hashed libcudart-XXXX.so.N)."""
    paths: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip().removesuffix(" (deleted)")
                if "libcudart" in os.path.basename(path) and path not in paths:
                    paths.append(path)
    except OSError:
        pass
    return paths
