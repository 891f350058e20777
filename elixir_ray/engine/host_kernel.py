"""The one-pass CPU job for host chunks (host_adam.c), compiled where it runs and called through ctypes.

Why: the host-chunk job bounds the step on every capped GPU run measured so far (the background
thread busy for 0.95 of a gpt-4b step), and it is bound by host memory traffic. Through torch it
makes three passes (widen the bf16 gradient, fused Adam, cast the master into the upload copy),
about 40 bytes per parameter; the C kernel makes one, 28 bytes.

How: the source ships in the package. The first process that needs it compiles it with the C
compiler (`cc`, or $CC) at -O3 for this CPU (-march=native), into a cache folder keyed by the
source, the compiler and the CPU's flags ($ELIXIR_RAY_KERNEL_CACHE, else ~/.cache/elixir_ray),
written under a temporary name and renamed, so concurrent workers never load a half-written file.
Beside it goes its sha256 (`<library>.sha256`, as `sha256sum` writes it); later processes load
the cached library only when it still matches, and build it again (one warning says why) when it
does not: a damaged or replaced file is never loaded into a worker. A checksum is not a signature:
whoever can write the cache folder can write both (docs/security.md), so the folder is made
private to its user. ctypes drops the GIL for the call, and the C side runs
its range on POSIX threads, so no OpenMP team spins beside torch's.

Where no compiler works, or with ELIXIR_RAY_HOST_KERNEL=torch, the engine keeps torch's path (one
warning says why); the two agree to fp32 rounding (tests/test_host_kernel.py).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import numbers
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from typing import Optional

import torch

from elixir_ray.engine.adam_step import AdamCall, AdamTensors

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "host_adam.c")
KERNEL_ENV = "ELIXIR_RAY_HOST_KERNEL"  # "c" (the default) or "torch"
CACHE_ENV = "ELIXIR_RAY_KERNEL_CACHE"
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared", "-pthread"]


CLAIM = 1 << 18  # elements an update's thread claims at a time (host_adam.c: about a millisecond of its time)


class HostAdamKernel:
    """The loaded library: `update` runs the job over one Adam call's segments of a chunk's shard,
    its threads claiming `claim` elements at a time (0: an even share each, for benchmarks that set
    the two side by side)."""

    def __init__(self, path: str, claim: int = CLAIM):
        if isinstance(claim, bool) or not isinstance(claim, numbers.Integral) or claim < 0:
            raise ValueError(f"claim must be an int >= 0 (elements a thread claims at a time; 0: even shares), "
                             f"got {claim!r}")
        self.path, self.claim = path, int(claim)
        lib = ctypes.CDLL(path)
        fn = lib.elixir_host_adam
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64), ctypes.c_int, ctypes.c_int64,
                       ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double, ctypes.c_double,
                       ctypes.c_int, ctypes.c_double, ctypes.c_int, ctypes.c_int64]
        self._fn = fn
        squares = lib.elixir_sum_squares
        squares.restype = ctypes.c_double
        squares.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int]
        self._squares = squares

    @staticmethod
    def handles(master: torch.Tensor, grad: torch.Tensor, upload: Optional[torch.Tensor]) -> bool:
        """What the kernel is written for: fp32 state in host memory, a bf16 or fp32 gradient, a bf16
        upload copy or none (an fp16 one, say, goes through torch)."""
        return (master.device.type == "cpu" and master.dtype == torch.float32
                and grad.dtype in (torch.bfloat16, torch.float32)
                and (upload is None or upload.dtype == torch.bfloat16))

    def update(self, tensors: AdamTensors, call: AdamCall, grad_factor: float, threads: int) -> None:
        """One Adam(W) step, `call`, over its segments ((lo, hi) pairs) of a chunk's shard, 1-D
        contiguous host tensors of one length (`call.step` updates before this one)."""
        master, grad, exp_avg, exp_avg_sq, upload = (tensors.master, tensors.grad, tensors.exp_avg,
                                                     tensors.exp_avg_sq, tensors.upload)
        n = master.numel()
        for name, t, dtype in (("master", master, torch.float32), ("grad", grad, grad.dtype),
                               ("exp_avg", exp_avg, torch.float32), ("exp_avg_sq", exp_avg_sq, torch.float32),
                               ("upload", upload, torch.bfloat16)):
            if t is not None and (t.numel() != n or not t.is_contiguous() or t.dtype != dtype
                                  or t.device.type != "cpu"):
                raise ValueError(f"host_adam kernel: {name} must be a contiguous {dtype} host tensor of "
                                 f"{n} elements, got {tuple(t.shape)} {t.dtype} on {t.device}")
        pairs = [(int(lo), int(hi)) for lo, hi in call.segments if hi > lo]
        if any(lo < 0 or hi > n for lo, hi in pairs):
            raise ValueError(f"host_adam kernel: segments {pairs} reach outside the {n} elements")
        if not pairs:
            return
        bounds = (ctypes.c_int64 * (2 * len(pairs)))(*(x for pair in pairs for x in pair))
        self._fn(master.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16), exp_avg.data_ptr(),
                 exp_avg_sq.data_ptr(), upload.data_ptr() if upload is not None else None, bounds, len(pairs),
                 int(call.step + 1), float(call.lr), float(call.beta1), float(call.beta2), float(call.eps),
                 float(call.weight_decay), int(bool(call.decoupled)), float(grad_factor), int(threads), self.claim)

    def sum_of_squares(self, x: torch.Tensor, threads: int) -> float:
        """Sum of squares of a contiguous bf16 or fp32 host tensor, each element squared and summed in
        double (a gradient's share of the global norm)."""
        if x.device.type != "cpu" or not x.is_contiguous() or x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"host_adam kernel: sum_of_squares takes a contiguous bf16 or fp32 host tensor, got "
                             f"{x.dtype} on {x.device}")
        return float(self._squares(x.data_ptr(), int(x.dtype == torch.bfloat16), x.numel(), int(threads)))


def _compiler() -> Optional[str]:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def _cache_dir() -> str:
    root = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "elixir_ray")
    return os.path.join(root, "kernels")


def _cpu_flags() -> str:
    """This CPU's feature flags: -march=native code built on one CPU may not run on another."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sha256_file(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checksum_path(library: str) -> str:
    return library + ".sha256"


def cached_library_problem(path: str) -> Optional[str]:
    """Why the cached library at `path` must not be loaded (no checksum beside it, or one it does
    not match), or None."""
    try:
        with open(checksum_path(path)) as f:
            expected = f.read().split(maxsplit=1)[:1]
    except OSError:
        return "has no checksum beside it"
    try:
        found = _sha256_file(path)
    except OSError as exc:
        return f"cannot be read ({exc})"
    return None if expected == [found] else "does not match its checksum"


def build_host_kernel(cc: str) -> str:
    """Compile host_adam.c for this CPU unless the cache has it, with a checksum that matches; the
    library's path."""
    with open(SOURCE, "rb") as f:
        source = f.read()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), " ".join(FLAGS).encode(),
                                     _cpu_flags().encode(), platform.machine().encode()])).hexdigest()[:16]
    folder = _cache_dir()
    path = os.path.join(folder, f"host_adam-{key}.so")
    if os.path.exists(path):
        problem = cached_library_problem(path)
        if problem is None:
            return path
        warnings.warn(f"elixir_ray: the cached host AdamW kernel {path} {problem}: building it again", RuntimeWarning)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".host_adam-", suffix=".so", dir=folder)
    os.close(fd)
    fd, tmp_sum = tempfile.mkstemp(prefix=".host_adam-", suffix=".sha256", dir=folder)
    os.close(fd)
    try:
        out = subprocess.run([cc, *FLAGS, "-o", tmp, SOURCE, "-lm"], capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"{cc} failed ({out.returncode}): {out.stderr.strip()[-1000:]}")
        with open(tmp_sum, "w") as f:
            f.write(f"{_sha256_file(tmp)}  {os.path.basename(path)}\n")
        # the checksum first, so that a library renamed into place always has one beside it
        os.replace(tmp_sum, checksum_path(path))
        os.replace(tmp, path)
    finally:
        for leftover in (tmp, tmp_sum):
            if os.path.exists(leftover):
                os.unlink(leftover)
    return path


@functools.lru_cache(maxsize=None)  # one build or load per process; the disk cache spans processes
def host_adam_kernel() -> Optional[HostAdamKernel]:
    """The compiled kernel, or None: turned off (ELIXIR_RAY_HOST_KERNEL=torch), or not buildable here
    (a warning says why, and torch's three passes run instead)."""
    choice = os.environ.get(KERNEL_ENV, "c").strip().lower()
    if choice == "torch":
        return None
    if choice != "c":
        raise ValueError(f"{KERNEL_ENV}={choice!r}: expected 'c' (the one-pass kernel, the default) or 'torch'")
    cc = _compiler()
    if cc is None:
        warnings.warn("elixir_ray: no C compiler (cc, or $CC) here, so host chunks are updated through torch in "
                      "three passes, slower than the one-pass kernel: install gcc to get it", RuntimeWarning)
        return None
    try:
        return HostAdamKernel(build_host_kernel(cc))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        warnings.warn(f"elixir_ray: the one-pass host AdamW kernel did not build ({exc}), so host chunks are "
                      f"updated through torch in three passes instead", RuntimeWarning)
        return None
