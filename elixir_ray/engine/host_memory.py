"""HostArena: the host chunks' state in one allocation per dtype, page-locked at exactly its size.

Host chunks' masters, gradients, AdamW moments and upload copies must be pinned so that copies to
and from the GPU are asynchronous. torch's pinned allocator rounds every allocation up to a power
of two, so one pinned tensor per chunk and kind can take up to twice its size in page-locked RAM,
which cannot be swapped: a 4B-parameter model's 64 GiB of host state could lock over 100 GiB. So
each dtype's state is one plain allocation, registered with the driver (`cudaHostRegister`) as
is, and every chunk's tensors are slices of it. Without a GPU nothing is pinned and the slices
are ordinary host memory, which is how the layout is tested on a CPU.
"""

from __future__ import annotations

import weakref

import torch


def _unregister(pointers: list[int], device: torch.device) -> None:
    """Undo the registration, on the arena's device (from a thread whose current device is another,
    a CUDA call would create a context there), once the copies to or from these pages still queued
    on the device have finished (a gradient on its way down, state coming back from a device update).
    At interpreter exit the CUDA runtime may already be unloading; its errors then are harmless."""
    if not pointers:
        return
    try:
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)
            cudart = torch.cuda.cudart()
            for ptr in pointers:
                cudart.cudaHostUnregister(ptr)
    except RuntimeError:
        pass


def clear_cuda_error() -> bool:
    """Reset the CUDA runtime's last error on this thread, which a failed cudaHostRegister leaves set:
    torch checks it after its next kernel launch and would raise it there, at an unrelated op of a
    program that caught the refusal and went on. torch's cudart binding has no cudaGetLastError,
    so it is called in the runtime library torch loaded (a shared one in its wheels). False when
    there is none to call."""
    try:
        import ctypes

        with open("/proc/self/maps") as maps:
            libraries = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
        for path in libraries:
            ctypes.CDLL(path).cudaGetLastError()
        return bool(libraries)
    except (OSError, AttributeError):
        return False


class HostArena:
    """Hands out zero-filled slices of one buffer per dtype; `numels` says how many elements of each.

    The registration is undone when the arena is collected; slices still held elsewhere then stay
    valid, as ordinary (pageable) host memory.
    """

    def __init__(self, numels: dict[torch.dtype, int], device: torch.device = torch.device("cpu")):
        self.buffers = {dtype: torch.zeros(n, dtype=dtype) for dtype, n in numels.items() if n > 0}
        self.used = {dtype: 0 for dtype in self.buffers}
        self.pinned = False
        if device.type == "cuda" and self.buffers:  # page-locked for the GPU's asynchronous copies
            self._register(device)

    def _register(self, device: torch.device) -> None:
        cudart = torch.cuda.cudart()
        done = []
        for buf in self.buffers.values():
            ptr, nbytes = buf.data_ptr(), buf.numel() * buf.element_size()
            err = cudart.cudaHostRegister(ptr, nbytes, 1)  # cudaHostRegisterPortable: pinned for every context
            if int(err) != 0:
                _unregister(done, device)
                cleared = clear_cuda_error()
                raise RuntimeError(
                    f"could not page-lock {nbytes / 2**30:.1f} GiB of host memory for the optimizer state "
                    f"(cudaHostRegister error {int(err)}): free host memory, or give the device more memory so "
                    f"that less state lives on the host"
                    + ("" if cleared else " (the next CUDA call may raise this error once more)"))
            done.append(ptr)
        self.pinned = True
        weakref.finalize(self, _unregister, done, device)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        start = self.used[dtype]
        if start + numel > self.buffers[dtype].numel():
            raise ValueError(f"host arena for {dtype} exhausted: {start + numel} > {self.buffers[dtype].numel()}")
        self.used[dtype] = start + numel
        return self.buffers[dtype][start: start + numel]
