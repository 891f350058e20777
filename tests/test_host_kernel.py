"""The one-pass C kernel for host chunks (elixir_ray/engine/host_kernel.py) against torch's fused
CPU Adam, the arithmetic the engine is checked against everywhere else; and its build: cached,
never half-written, and a clear fallback where no compiler works."""

import itertools
import os
import subprocess
import sys

import pytest
import torch

from elixir_ray.engine.host_kernel import _compiler, host_adam_kernel
from elixir_ray.engine.adam_step import AdamCall, AdamTensors
from elixir_ray.engine.optimizer import TileScratch, host_update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N = 1 << 18

kernel = host_adam_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="no C compiler here: the engine runs torch's passes")


def _state(low: bool, upload: bool, seed: int = 1) -> list:
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(N, generator=g)
    m, v = torch.randn(N, generator=g) * 1e-3, torch.rand(N, generator=g) * 1e-4
    grad = torch.randn(N, generator=g) * 1e-2
    return [master, grad.bfloat16() if low else grad, m, v, torch.zeros(N, dtype=torch.bfloat16) if upload else None]


@needs_kernel
@pytest.mark.parametrize("low,upload,decoupled,factor", [
    (low, upload, decoupled, factor)
    for low, upload, decoupled, factor in itertools.product([True, False], [True, False], [True, False], [1.0, 0.37])
    if low or factor == 1.0])  # a clip factor is for low-precision gradients only
def test_the_kernel_gives_torchs_bits_over_whole_vectors(low, upload, decoupled, factor):
    """Over a segment that torch's vector loop covers whole, the C kernel and torch's fused Adam
    (gradient widened, clip factor applied, weight decay AdamW's or Adam's, master cast to bf16)
    agree to the bit, over four steps with moments that grow."""
    ours, theirs = _state(low, upload), _state(low, upload)
    for step in range(4):
        call = AdamCall(segments=((0, N),), step=step, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                        decoupled=decoupled)
        host_update([call], AdamTensors(*theirs), grad_factor=factor, scratch=TileScratch(), kernel=None)
        host_update([call], AdamTensors(*ours), grad_factor=factor, kernel=kernel)
    for name, a, b in zip(["master", "grad", "exp_avg", "exp_avg_sq", "upload"], ours, theirs):
        if a is not None:
            assert torch.equal(a, b), name
    if upload:
        assert torch.equal(ours[4], ours[0].bfloat16())


@needs_kernel
def test_ragged_segments_match_to_rounding_and_the_upload_copy_covers_the_gaps():
    """Segments that start and end anywhere (the parameters of one param group inside a chunk), two
    calls with their own hyper-parameters, gaps between them: torch's scalar tails round a few
    elements in double, so those may differ by a rounding; nothing outside the segments changes,
    and the upload copy is the new master everywhere, gaps included."""
    ours, theirs = _state(True, True), _state(True, True)
    before = ours[0].clone()
    calls = [AdamCall(segments=((3, 1001), (5000, 70_001)), step=2, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                      weight_decay=0.1, decoupled=True),
             AdamCall(segments=((1001, 4000), (70_001, N - 5)), step=7, lr=3e-4, beta1=0.8, beta2=0.99, eps=1e-6,
                      weight_decay=0.0, decoupled=True)]
    host_update(calls, AdamTensors(*theirs), grad_factor=0.5, scratch=TileScratch(), kernel=None)
    host_update(calls, AdamTensors(*ours), grad_factor=0.5, kernel=kernel)
    for a, b in zip(ours[:4], theirs[:4]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12)
    untouched = torch.ones(N, dtype=torch.bool)
    for call in calls:
        for lo, hi in call.segments:
            untouched[lo:hi] = False
    assert untouched.sum() == 3 + 1000 + 5 and torch.equal(ours[0][untouched], before[untouched])
    assert torch.equal(ours[4], ours[0].bfloat16())


@needs_kernel
@pytest.mark.parametrize("claim", [0, 16, 4000, 1 << 18, 1 << 62])
@pytest.mark.parametrize("threads", [1, 3, 4])
def test_threads_claiming_blocks_give_the_bits_of_one_thread(claim, threads):
    """However the elements are split among the update's threads (blocks claimed as each thread
    is free, of any size, rounded up to whole cache lines; or an even share each), each element's
    arithmetic is the same: the bits of one thread over the whole call, ragged segments included."""
    from elixir_ray.engine.host_kernel import HostAdamKernel

    segments = ((3, 1001), (5000, 70_001), (70_001, N - 5))
    call = AdamCall(segments, 2, 1e-3, 0.9, 0.95, 1e-8, 0.1, True)  # the third update
    one, split = _state(True, True), _state(True, True)
    HostAdamKernel(kernel.path, claim=0).update(AdamTensors(*one), call, 0.5, 1)
    HostAdamKernel(kernel.path, claim=claim).update(AdamTensors(*split), call, 0.5, threads)
    for name, a, b in zip(["master", "grad", "exp_avg", "exp_avg_sq", "upload"], one, split):
        assert torch.equal(a, b), name


def test_a_bad_claim_is_refused():
    from elixir_ray.engine.host_kernel import HostAdamKernel

    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="claim must be an int >= 0"):
            HostAdamKernel("unused.so", claim=bad)


@needs_kernel
def test_a_nan_gradient_poisons_what_torch_would_and_the_copy_says_nan():
    ours, theirs = _state(True, True), _state(True, True)
    for s in (ours, theirs):
        s[1][10] = float("nan")
    call = AdamCall(segments=((0, N),), step=0, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                    decoupled=True)
    host_update([call], AdamTensors(*theirs), scratch=TileScratch(), kernel=None)
    host_update([call], AdamTensors(*ours), kernel=kernel)
    assert torch.isnan(ours[0][10]) and torch.isnan(ours[4][10].float())
    assert torch.equal(torch.isnan(ours[0]), torch.isnan(theirs[0]))


@needs_kernel
def test_a_mismatched_tensor_is_refused_before_anything_is_written():
    master, grad, m, v, up = _state(True, True)
    before = master.clone()
    with pytest.raises(ValueError, match="exp_avg_sq must be a contiguous torch.float32 host tensor"):
        kernel.update(AdamTensors(master, grad, m, v[::2], up), AdamCall(((0, N // 2),), 0, 1e-3, 0.9, 0.95, 1e-8, 0.0,
                                                                        True), 1.0, 2)
    with pytest.raises(ValueError, match="reach outside"):
        kernel.update(AdamTensors(master, grad, m, v, up), AdamCall(((0, N + 1),), 0, 1e-3, 0.9, 0.95, 1e-8, 0.0, True),
                      1.0, 2)
    assert torch.equal(master, before)
    with pytest.raises(ValueError, match="sum_of_squares takes a contiguous bf16 or fp32 host tensor"):
        kernel.sum_of_squares(grad.double(), 2)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, **env})


def test_the_build_is_cached_and_leaves_no_temporary_file(tmp_path):
    """The first build compiles into the cache under a temporary name and renames it, its checksum
    beside it; the next returns the same file without compiling (its modification time unchanged)."""
    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    code = ("import os; from elixir_ray.engine.host_kernel import build_host_kernel, _compiler; "
            "p = build_host_kernel(_compiler()); print(p, os.stat(p).st_mtime_ns)")
    first = _python(code, ELIXIR_RAY_KERNEL_CACHE=str(tmp_path))
    second = _python(code, ELIXIR_RAY_KERNEL_CACHE=str(tmp_path))
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert first.stdout == second.stdout and first.stdout.startswith(str(tmp_path))
    library = os.path.basename(first.stdout.split()[0])
    assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == [library, f"{library}.sha256"]


def test_a_cached_library_that_does_not_match_its_checksum_is_built_again(tmp_path, monkeypatch):
    """A damaged or replaced library in the cache is never loaded: the build says so in one warning
    and compiles it again; one without its checksum (a cache written otherwise) likewise."""
    import hashlib
    import warnings

    from elixir_ray.engine.host_kernel import HostAdamKernel, build_host_kernel

    cc = _compiler()
    if cc is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("ELIXIR_RAY_KERNEL_CACHE", str(tmp_path))
    path = build_host_kernel(cc)
    good = open(path, "rb").read()
    assert open(f"{path}.sha256").read() == f"{hashlib.sha256(good).hexdigest()}  {os.path.basename(path)}\n"
    with open(path, "r+b") as f:  # tampered: one byte of the code changed
        f.seek(len(good) // 2)
        f.write(bytes([good[len(good) // 2] ^ 0xFF]))
    with pytest.warns(RuntimeWarning, match=r"^elixir_ray: the cached host AdamW kernel .*\.so does not match "
                                            r"its checksum: building it again$"):
        assert build_host_kernel(cc) == path
    assert open(path, "rb").read() == good
    os.remove(f"{path}.sha256")
    with pytest.warns(RuntimeWarning, match=r"\.so has no checksum beside it: building it again"):
        build_host_kernel(cc)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt with its checksum: loaded without a word
        HostAdamKernel(build_host_kernel(cc))


@pytest.mark.parametrize("env,said", [
    ({"CC": "false"}, "the one-pass host AdamW kernel did not build"),
    ({"ELIXIR_RAY_HOST_KERNEL": "torch"}, None),
])
def test_without_the_kernel_the_engine_runs_torchs_passes(env, said, tmp_path):
    """A compiler that fails warns once and falls back to torch; ELIXIR_RAY_HOST_KERNEL=torch asks for
    torch's passes without a word. Either way the update still runs and matches torch."""
    code = ("import warnings, torch; warnings.simplefilter('always');\n"
            "from elixir_ray.engine.host_kernel import host_adam_kernel\n"
            "from elixir_ray.engine.adam_step import AdamCall, AdamTensors\n"
            "from elixir_ray.engine.optimizer import host_update\n"
            "assert host_adam_kernel() is None\n"
            "p, g, m, v = torch.ones(8), torch.ones(8), torch.zeros(8), torch.zeros(8)\n"
            "host_update([AdamCall(((0, 8),), 0, 0.1, 0.9, 0.99, 1e-8, 0.0, True)], AdamTensors(p, g, m, v))\n"
            "print(p[0].item())")
    out = _python(code, ELIXIR_RAY_KERNEL_CACHE=str(tmp_path), **env)
    assert out.returncode == 0, out.stderr
    assert abs(float(out.stdout) - 0.9) < 1e-6
    assert (said in out.stderr) if said else ("RuntimeWarning" not in out.stderr)


def test_a_bad_kernel_choice_is_one_clear_error(tmp_path):
    out = _python("from elixir_ray.engine.host_kernel import host_adam_kernel; host_adam_kernel()",
                  ELIXIR_RAY_HOST_KERNEL="fast", ELIXIR_RAY_KERNEL_CACHE=str(tmp_path))
    assert out.returncode != 0 and "ELIXIR_RAY_HOST_KERNEL='fast': expected 'c'" in out.stderr
