"""One training system measured in this process: build, warm up, time steps, report.

Every system trains the same GPT (`elixir_ray.model.gpt`) on the same random tokens with AdamW,
so the only difference is how parameters, gradients and optimizer states are placed and moved.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from elixir_ray.engine.device import resolve_device
from elixir_ray.model.gpt import build_gpt, init_gpt_weights

SYSTEMS = ("reference", "fsdp2_offload", "deepspeed_z3_offload", "elixir_ray")


@dataclass
class BenchShape:
    name: str
    d_model: int
    n_layers: int
    n_heads: int
    vocab_size: int
    seq_len: int
    micro_batch: int
    activation_checkpointing: bool
    dtype: str  # "bfloat16" on GPU; "float32" for the CPU smoke run

    def model_shape(self) -> dict:
        return dict(d_model=self.d_model, n_layers=self.n_layers, n_heads=self.n_heads,
                    vocab_size=self.vocab_size, seq_len=self.seq_len)


SHAPES = {
    # the numerics run's shape: small enough for hundreds of steps in a minute on one GPU
    "gpt-124m": BenchShape("gpt-124m", 768, 12, 12, 50304, 1024, 8, False, "bfloat16"),
    "gpt-1.5b": BenchShape("gpt-1.5b", 1600, 48, 25, 50304, 1024, 8, False, "bfloat16"),
    "gpt-4b": BenchShape("gpt-4b", 3072, 36, 24, 50304, 1024, 8, True, "bfloat16"),
    "gpt-10b": BenchShape("gpt-10b", 4096, 50, 32, 50304, 1024, 8, True, "bfloat16"),
    # 15.4B parameters: its fp32 master weights and AdamW moments alone (185 GB) exceed one H200's
    # 139 GiB, and its host's 128 GiB, so it trains only with both holding part of the state
    "gpt-15b": BenchShape("gpt-15b", 5120, 48, 40, 50304, 1024, 8, True, "bfloat16"),
    "smoke": BenchShape("smoke", 128, 2, 4, 257, 64, 4, False, "float32"),
}


@dataclass
class SystemResult:
    system: str
    shape: str
    device: str
    cap_bytes: Optional[int]
    params: int
    step_seconds: float
    tokens_per_s: float
    tflops: float
    peak_device_bytes: int
    peak_host_bytes: int
    final_loss: float
    # the timed steps' own times (seconds, in order; on CUDA from an event queued at each step's
    # start to the next one's, the last to the window's end): step_seconds is their median, and
    # mean_step_seconds the window's length over the steps
    step_times: list = field(default_factory=list)
    mean_step_seconds: Optional[float] = None
    # the gradient clipping every system trains with (the run config's optim.max_grad_norm, 1.0 by
    # default; None: none): with it elixir_ray's CPU updates start at step(), not in the backward
    max_grad_norm: Optional[float] = None
    # every step's loss, warm-up and timed, in order (read after the timed window: no sync inside it)
    losses: list = field(default_factory=list)
    # the token dataset the batches came from (None: random tokens)
    data: Optional[str] = None
    # the loss of the first warm-up step: every system trains the same GPT from the same batch, so
    # a first loss apart from the reference's means a different model or initialisation, and a final
    # one apart from it after a matching first means a different training
    first_loss: Optional[float] = None
    # whether the GPT's loss took the head's logits a slice of rows at a time (`GPT.slices_loss`:
    # every system but DeepSpeed, whose hooks on the head take them whole); None where the result
    # does not say (results written before the field existed, which took them whole)
    sliced_loss: Optional[bool] = None
    # FSDP2 offload on a GPU only: whether its host memory was pinned (its default, asynchronous
    # gradient copies) or pageable (`--fsdp2-pageable`, blocking copies); None otherwise (on the
    # CPU FSDP2 offloads nothing)
    fsdp2_pinned: Optional[bool] = None
    # CUDA: the allocator's peak reserved bytes, and how often it had to free its cache and retry an
    # allocation (each retry synchronises the device: under a cap, a cause of slow steps to look for)
    peak_reserved_bytes: int = 0
    alloc_retries: int = 0
    # CUDA: the peak while building (elixir_ray's planning times kernels and measures copies within
    # the cap), kept apart so that peak_device_bytes is the training steps' own
    peak_build_device_bytes: int = 0
    # elixir_ray only: mean seconds per step by category, measured in extra steps run with the
    # engine's StepTimer on (its device syncs slow a step, so these are not the steps timed above);
    # the categories add up to breakdown_step_seconds, the mean wall time of those timed steps
    breakdown: dict = field(default_factory=dict)
    breakdown_step_seconds: Optional[float] = None
    # seconds per step of work on elixir_ray's background thread (CPU AdamW): it overlaps the
    # breakdown's categories, so it is not part of their sum; what it failed to hide is cpu_adam_wait
    background: dict = field(default_factory=dict)
    # elixir_ray only: the searched plan's predictions, to set beside the measured figures above
    predicted_step_seconds: Optional[float] = None
    predicted_peak_bytes: Optional[int] = None
    # elixir_ray only: the plan it ran (layout, predicted memory and time by part, and in its notes the
    # hardware rates the prediction rests on), so a gap between prediction and measurement can be traced
    plan: dict = field(default_factory=dict)
    # elixir_ray only: the measured steps' events (engine/timing.py), as [category, start s, end s,
    # chunk, elements] from the first step's start: each CPU update, each wait on one, the marks
    timeline: list = field(default_factory=list)
    # elixir_ray only: the pool's counts per timed step (engine_stats: fetches, prefetches, evictions,
    # prefetch_lead, untraced_accesses; blocks_over_plan as it ended), to tell prefetched loads from
    # loads made on demand
    pool: dict = field(default_factory=dict)
    # CUDA: the caching allocator's calls to the driver over the timed steps (ALLOCATOR_COUNTS, per
    # step). A cudaFree (and a sync of all streams) blocks the host until the device is idle: in
    # steady training there should be none
    allocator: dict = field(default_factory=dict)
    # elixir_ray only: one more step under torch's profiler, as [name, calls, milliseconds]: the
    # engine's own ranges ("elixir.fetch", "elixir.settle", ...: inclusive host time, waits in them
    # included) and the CUDA runtime calls that take the host's time (self time), longest first;
    # "step" is that step's wall time. It says which engine calls hold the training thread
    host_profile: list = field(default_factory=list)
    # every system: one more step with Python's profiler on the training thread (`python_profile`):
    # ["step", Python calls, wall ms, 0] first, then [function, calls, self ms, inclusive ms] by self
    # time. Where a step is bound by the host (the device waits for it), this says which Python
    python_profile: list = field(default_factory=list)
    # every system: CPU seconds per timed step of the training thread (time.thread_time) and of the
    # whole process (time.process_time: elixir_ray's background CPU updates too). A training thread
    # busy for about the whole step bounds it with its own work (Python, launches); one busy for
    # much less of a step the device did not fill waits instead (a lock, the GIL, a sleep). A CUDA
    # sync (cudaEventSynchronize, .item()) spins by default, so a wait for the device counts as busy:
    # python_profile's C-function rows say how long those took
    host_thread_cpu_seconds: Optional[float] = None
    process_cpu_seconds: Optional[float] = None
    # elixir_ray only: how long its last timed step's work ran after the compute stream finished
    # that step, outside the timed window: its CPU updates, and its side streams' copies before them
    # (the next step's forward would wait for them, as the first timed step waited for the warm-up's;
    # a training run pays them once, at its end)
    last_updates_seconds: Optional[float] = None
    skipped: Optional[str] = None

    def to_dict(self) -> dict:
        return asdict(self)


def model_flops_per_step(shape: BenchShape, params: int) -> float:
    """6·N·tokens for the matmuls plus attention's 12·L·B·T²·d; recomputation is not counted."""
    tokens = shape.micro_batch * shape.seq_len
    return 6 * params * tokens + 12 * shape.n_layers * shape.micro_batch * shape.seq_len**2 * shape.d_model


def peak_host_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _single_rank_group(backend: str) -> None:
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        # DeepSpeed reads the launcher's variables even when the group already exists
        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(name, value)
        dist.init_process_group(backend, rank=0, world_size=1)


def _note(what: str, since: float) -> None:
    """A line in the system's log as its build goes: a peer that is stopped by a time limit says
    how far it got (DeepSpeed ran over 150 s there on the H100 without a line, 2026-11-27)."""
    print(f"[{time.perf_counter() - since:6.1f} s] {what}", flush=True)


def _check_tied(model, system: str) -> None:
    """Refuse to benchmark a GPT whose `head.weight` is no longer `wte.weight`.

    A plain `to_empty` makes a new tensor per module and unties them (`init_reference_model`
    ties them again); FSDP2's `to_empty` keeps the tie, since it swaps each sharded parameter's
    data in place, and re-tying after `fully_shard` would leave FSDP's bookkeeping of the shared
    parameter stale. So the tie made in `GPT.__init__` must survive, and this checks that it did:
    untied, the model has vocab·d more parameters and a different loss than every other system.
    """
    if model.head.weight is not model.wte.weight:
        raise RuntimeError(f"{system}: head.weight and wte.weight are no longer tied after to_empty")


def _build(system: str, shape: BenchShape, device: torch.device, cap_bytes: Optional[int], plan=None,
           memory_margin: Optional[float] = None, fsdp2_pin_memory: bool = True,
           max_grad_norm: Optional[float] = None):
    """(step function taking a batch and returning the loss, parameter count, StepTimer or None).

    The timer, for elixir_ray, is its engine's (`model.store.timer`), disabled until
    `step_breakdown` turns it on for its own steps. `fsdp2_pin_memory=False` gives FSDP2's CPU
    offload pageable memory, so that its gradients cross to the host in blocking copies. That is
    how `tests/test_bench_peers.py` tells a race in FSDP2's asynchronous gradient offload from
    any other cause of the training that went wrong on the H100 (torch fixed races of that kind
    in 2026 for HSDP and for gradient hooks, pytorch#180665 and #180666; the GPU machine has
    torch 2.11). The benchmark runs FSDP2's default, pinned. `max_grad_norm`: every system clips its gradients'
    global norm to it before each update (None: no clipping), each the way its own API does.
    """
    dtype = getattr(torch, shape.dtype)
    autocast = dtype != torch.float32

    if system == "reference":
        # built empty, then initialised module by module as FSDP2 and elixir_ray initialise theirs:
        # every system draws its weights from the same generator state in the same order (a plain
        # build would first draw nn.Linear's own initialisation, and start from other weights)
        model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta").to_empty(device=device)
        model.head.weight = model.wte.weight  # to_empty makes a tensor per module: tie them again
        model.apply(lambda m: init_gpt_weights(m, shape.n_layers))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")

        def step(batch):
            with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                loss = model(batch)
            loss.backward()
            _clip(model, max_grad_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        step.model = model  # for a check that a peer trains what this trains (tests/test_bench_peers.py)
        return step, model.num_parameters(), None

    if system == "fsdp2_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        _single_rank_group("nccl" if device.type == "cuda" else "gloo")
        model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta")
        kwargs = {}
        if device.type == "cuda":  # FSDP2 offloads only from a GPU; on CPU it runs unsharded
            kwargs = dict(offload_policy=CPUOffloadPolicy(pin_memory=fsdp2_pin_memory),
                          mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32))
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
        model.to_empty(device="cpu" if device.type == "cuda" else device)
        _check_tied(model, system)
        model.apply(lambda m: init_gpt_weights(m, shape.n_layers))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(batch):
            loss = model(batch)
            loss.backward()
            _clip(model, max_grad_norm)  # over the sharded gradients (DTensors), where FSDP2 keeps them
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        step.model = model
        return step, sum(p.numel() for p in model.parameters()), None

    if system == "deepspeed_z3_offload":
        import deepspeed  # noqa: F401  (an ImportError marks the system skipped)

        if device.type != "cuda":
            raise RuntimeError("DeepSpeed ZeRO-3 offload needs a GPU")
        _single_rank_group("nccl")
        config = {
            "train_micro_batch_size_per_gpu": shape.micro_batch, "gradient_accumulation_steps": 1,
            "bf16": {"enabled": dtype == torch.bfloat16},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "gradient_clipping": max_grad_norm or 0.0,  # DeepSpeed's 0: none
            "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                  "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True},
        }
        # as DeepSpeed's own ZeRO-3 examples (and the H100 anchor, 2.454 s a step) build a model:
        # each layer partitioned to the host as it is made, never the whole fp32 model in one place
        started = time.perf_counter()
        _note("DeepSpeed: building the model under zero.Init", started)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = build_gpt(shape.model_shape(), shape.activation_checkpointing)
        # the GPT's own initialisation (its `apply` in __init__) holds: zero.Init gathers the partitioned
        # parameters for `apply` (checked with DeepSpeed 0.19.8 on the CPU: embeddings std 0.02,
        # residual projections 0.01 for the smoke GPT's 2 layers)
        _note("DeepSpeed: initialize (its CPU Adam compiles itself with ninja and nvcc on a machine's first use, "
              "about a minute)", started)
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        _note("DeepSpeed: ready; warm-up and timed steps follow", started)

        def step(batch):
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
            return loss
        step.model = model
        return step, sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()), None

    if system == "elixir_ray":
        from elixir_ray.wrapping import wrap

        model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta")
        params = model.num_parameters()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        # drawn from a generator of its own: the global one must be where the reference's build found it,
        # so that init_fn, run over the modules as the reference's build runs it, draws the same weights
        sample = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1),
                               generator=torch.Generator().manual_seed(0))
        wrapped, wopt = wrap(model, opt, sample_inputs=(sample,), device_memory=cap_bytes, plan=plan,
                             dtype=dtype, device=device, init_fn=lambda m: init_gpt_weights(m, shape.n_layers),
                             accumulation_steps=1,  # one backward per step: without clipping, CPU updates start in it
                             max_grad_norm=max_grad_norm, memory_margin=memory_margin)

        step = engine_step(wrapped, wopt)
        step.model = model
        return step, params, wrapped.store.timer

    raise ValueError(f"unknown system {system!r} (choose from {', '.join(SYSTEMS)})")


def _clip(model, max_grad_norm: Optional[float]) -> None:
    if max_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm, foreach=True)


def bench_batches(shape: BenchShape, count: int, device: torch.device, data: Optional[str] = None) -> list[torch.Tensor]:
    """`count` batches, a new one for each step, the same for every system: windows of the token
    dataset `data` ("builtin": the standard-library corpus) in the order a run seeded 0 reads them,
    or random tokens drawn from a generator of their own, seeded 0 (so a system's own use of the
    global one changes nothing)."""
    if data is not None:
        from elixir_ray.data.dataset import BatchSampler, TokenDataset, resolve_data_uri
        from elixir_ray.errors import ConfigError

        dataset = TokenDataset(resolve_data_uri(data, None), what="--data")
        if dataset.vocab_size > shape.vocab_size:
            raise ConfigError(f"--data {data!r} has a vocabulary of {dataset.vocab_size}, more than the {shape.name} "
                              f"shape's {shape.vocab_size}")
        sampler = BatchSampler(dataset, shape.seq_len, seed=0)
        return [sampler.samples(i * shape.micro_batch, shape.micro_batch).to(device) for i in range(count)]
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1), generator=generator).to(device)
            for _ in range(count)]


def engine_step(model, optimizer):
    """One training step through the chunk engine (`wrap`'s model and optimizer), as the benchmark
    times it, with what the benchmark reads beside it: the plan, the pool's counts, and `settle`,
    which waits for the background thread's CPU updates."""
    def step(batch):
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss
    step.plan = model.plan
    step.pool_counts = lambda: dict(model.store.counts)
    step.settle = model.store.settle_all
    return step


def reference_parameters(shape: BenchShape) -> int:
    """The GPT's parameter count with tied embeddings, from a meta build (no memory)."""
    return build_gpt(shape.model_shape(), device="meta").num_parameters()


def run_system(system: str, shape: BenchShape, device: torch.device, cap_bytes: Optional[int],
               steps: int = 6, warmup: int = 3, plan=None, keep=None,
               memory_margin: Optional[float] = None, fsdp2_pin_memory: bool = True,
               max_grad_norm: Optional[float] = None, data: Optional[str] = None) -> SystemResult:
    """`plan` (elixir_ray only): run this Plan instead of searching one under the cap. `keep`, if
    given, is called with the result as it stands after the timed steps and again after the
    breakdown's steps, before the profiled one: a process that dies in the extra steps (a
    profiler's crash) still leaves what the timed steps measured. `memory_margin` (elixir_ray
    only, without `plan`): the share of the cap its plan search keeps back. `fsdp2_pin_memory`
    (FSDP2 only): False offloads to pageable memory (`_build`). `max_grad_norm`: every system's
    gradient clipping (None: none). `data`: the token dataset the batches come from (None: random
    tokens; `bench_batches`)."""
    torch.manual_seed(0)
    device = resolve_device(device)  # torch's per-device calls below refuse a bare "cuda"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if cap_bytes is not None:
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
        torch.cuda.reset_peak_memory_stats(device)
    step, params, timer = _build(system, shape, device, cap_bytes, plan, memory_margin, fsdp2_pin_memory,
                                 max_grad_norm)
    peak_build = 0
    if device.type == "cuda":
        peak_build = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)  # from here on, what training itself holds
        torch.cuda.reset_accumulated_memory_stats(device)  # and the allocator's retries in it alone
    expected = reference_parameters(shape)
    if params != expected:  # e.g. embeddings untied by a materialisation: a different model
        raise RuntimeError(f"{system} trains {params:,} parameters, the reference GPT has {expected:,}")
    batches = bench_batches(shape, warmup + steps, device, data)
    batch = batches[-1]  # the extra steps after the timed ones (breakdown, profiles) repeat the last
    losses = []  # detached, read after the timed window
    for i in range(warmup):  # back to back, as the timed steps run: the last leaves its work running into them
        losses.append(step(batches[i]).detach())
        if i == 0:
            float(losses[0])  # a sync, after the first only
    counts_before = step.pool_counts() if hasattr(step, "pool_counts") else {}
    allocator_before = allocator_counts(device)
    step_times, loss, thread_cpu, process_cpu, last_updates = _timed_window(step, batches[warmup:], device, timer,
                                                                            losses)
    seconds = statistics.median(step_times)
    losses = [float(x) for x in losses]
    pool = {k: v if k == "blocks_over_plan" else (v - counts_before[k]) / steps  # that one is a high-water mark
            for k, v in step.pool_counts().items()} if counts_before else {}
    allocator = {k: (v - allocator_before[k]) / steps for k, v in allocator_counts(device).items()}
    timeline = timeline_events(timer) if timer is not None else []
    tokens = shape.micro_batch * shape.seq_len
    peak_device = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    stats = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    peak_host = peak_host_bytes()  # both peaks before the breakdown's extra steps
    result = SystemResult(
        system=system, shape=shape.name, device=str(device), cap_bytes=cap_bytes, params=params,
        step_seconds=seconds, tokens_per_s=tokens / seconds,
        step_times=step_times, mean_step_seconds=sum(step_times) / steps, max_grad_norm=max_grad_norm,
        tflops=model_flops_per_step(shape, params) / seconds / 1e12,
        peak_device_bytes=peak_device, peak_host_bytes=peak_host, final_loss=float(loss.detach()),
        first_loss=losses[0], losses=losses, data=data, sliced_loss=step.model.slices_loss(),
        fsdp2_pinned=fsdp2_pin_memory if system == "fsdp2_offload" and device.type == "cuda" else None,
        peak_reserved_bytes=int(stats.get("reserved_bytes.all.peak", 0)), alloc_retries=int(stats.get("num_alloc_retries", 0)),
        peak_build_device_bytes=peak_build,
        predicted_step_seconds=getattr(getattr(step, "plan", None), "predicted_step_seconds", None),
        predicted_peak_bytes=getattr(getattr(step, "plan", None), "predicted_peak_bytes", None),
        plan=step.plan.to_dict() if hasattr(step, "plan") else {},
        timeline=timeline, pool=pool, allocator=allocator,
        host_thread_cpu_seconds=thread_cpu, process_cpu_seconds=process_cpu,
        last_updates_seconds=last_updates if hasattr(step, "settle") else None,
    )
    if timer is not None:  # elixir_ray: where its time goes, in extra steps after the timed ones
        if keep is not None:
            keep(result)
        result.breakdown, result.breakdown_step_seconds, result.background = step_breakdown(
            step, batch, device, timer, steps)
        if keep is not None:
            keep(result)
        result.host_profile = host_profile(step, batch, device)
    result.python_profile = python_profile(step, batch, device)
    return result


ALLOCATOR_COUNTS = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "num_alloc_retries")


def allocator_counts(device: torch.device) -> dict:
    """The CUDA caching allocator's running counts of driver calls (cudaMalloc, cudaFree), syncs of
    every stream, and retries after freeing its cache; {} off CUDA."""
    if device.type != "cuda":
        return {}
    stats = torch.cuda.memory_stats(device)
    return {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTS}


def host_profile(step, batch, device: torch.device, top: int = 16) -> list:
    """One step under torch's profiler (CUDA activity too where there is a device, for the runtime
    calls), its background updates waited for as in the timed steps: the engine's ranges by
    inclusive host time and the CUDA runtime calls by self time, [name, calls, ms] longest first,
    after ["step", 1, wall ms] (the ranges nest: `elixir.step` holds `elixir.dos_update`). The
    profiler slows the step; the shares are what it is for. Where the profiler cannot run here (no
    CUPTI), one row says why instead; an error of the step itself is raised."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        prof = profile(activities=activities)
        prof.start()
    except Exception as exc:
        return [[f"profiler failed: {type(exc).__name__}: {exc}", 0, 0.0]]
    try:
        _sync(device)
        start = time.perf_counter()
        step(batch)
        settle = getattr(step, "settle", None)
        if settle is not None:
            settle()
        _sync(device)
        seconds = time.perf_counter() - start
    finally:
        prof.stop()
    rows = []
    for e in prof.key_averages():
        if e.key.startswith("elixir."):
            rows.append([e.key, int(e.count), e.cpu_time_total / 1e3])
        elif e.key.startswith("cuda") and e.self_cpu_time_total > 0:
            rows.append([e.key, int(e.count), e.self_cpu_time_total / 1e3])
    rows.sort(key=lambda row: -row[2])
    return [["step", 1, seconds * 1e3]] + [[name, n, round(ms, 3)] for name, n, ms in rows[:top]]


def python_profile(step, batch, device: torch.device, top: int = 20) -> list:
    """One step under cProfile, which sees only this thread (the training thread; the background
    CPU updates are not in it): ["step", Python calls, wall ms, 0], then the `top` functions by
    self time as ["file:line(name)", calls, self ms, inclusive ms]. cProfile slows each Python call
    (about 2x for small ones), so the shares are what it is for; a C function (a torch op) counts
    its own time, the waits in it included."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    _sync(device)
    start = time.perf_counter()
    profiler.enable()
    try:
        step(batch)
        settle = getattr(step, "settle", None)
        if settle is not None:
            settle()
        _sync(device)
    finally:
        profiler.disable()
    seconds = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (primitive calls, calls, self s, inclusive s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])
    calls = sum(v[1] for v in stats.values())
    out = [["step", calls, round(seconds * 1e3, 3), 0.0]]
    for (filename, line, name), (_, n, self_s, incl_s, _) in rows[:top]:
        where = f"{os.path.basename(filename)}:{line}({name})" if filename != "~" else name
        out.append([where, n, round(self_s * 1e3, 3), round(incl_s * 1e3, 3)])
    return out


def timeline_events(timer) -> list:
    """The timer's timeline as lists relative to its first event (microsecond resolution), and off;
    on CUDA with the device's marks beside the host's (`StepTimer.device_timeline`)."""
    events, timer.timeline = (timer.timeline or []) + timer.device_timeline(), None
    if not events:
        return []
    origin = min(e[1] for e in events)
    return [[c, round(a - origin, 6), round(b - origin, 6), chunk, n] for c, a, b, chunk, n in sorted(events, key=lambda e: e[1])]


def _timed_window(step, batches: list, device: torch.device, timer=None,
                  losses: Optional[list] = None) -> tuple[list, torch.Tensor, float, float, float]:
    """Seconds of each of `len(batches)` steps run back to back, one batch each, as a training loop
    runs them (with the last loss, the CPU seconds per step of this thread and of the process, and
    how long elixir_ray's last CPU updates ran after the clock stopped).

    The warm-up's steps run back to back too (only the first is synced, for its loss), and the
    window starts with no sync: the first timed step finds what a step of a long run finds, its
    predecessor's work still running (elixir_ray's CPU updates on their thread, its Deep Optimizer
    States copies, any system's queued kernels). On CUDA each step's time is the device's: an event
    queued on the current stream at each step's start and one after the last, so a step runs from
    the end of its predecessor's queued work to the end of its own, the device's waits for the host
    included. On the CPU it is the wall clock between step starts. Either way the window stops
    before elixir_ray's last CPU updates are waited for (`step.settle`): the next step's forward
    would wait for them, as the first timed step waited for the warm-up's. With `timer`
    (elixir_ray's), the steps' events go on its timeline, the last updates' included, and on CUDA
    the device's marks are placed from the closing event (`StepTimer.anchor`): a mark at the first
    step's start runs on the device only once the warm-up's work has, later than the host recorded it.

    The events' total is checked against the host's, which holds it (the host's clock starts before
    the opening event is queued and stops after the closing one has run): where it does not, the
    host's times are taken, with a warning, so that a broken clock gives longer figures, never
    shorter ones, and the run's measurement is kept. `losses`, if given, gets each step's loss,
    detached (not read: reading it would sync)."""
    if timer is not None:
        timer.timeline = []  # the measured steps' events, timed without device syncs
    cuda = device.type == "cuda"
    starts, events = [], []
    # the host's clocks start before the opening event is queued and stop after the closing one has
    # run, so the device's time lies inside the host's by construction
    start, thread_start, process_start = time.perf_counter(), time.thread_time(), time.process_time()
    loss = None
    for batch in batches:
        if timer is not None:
            timer.mark("step start")
        starts.append(time.perf_counter())
        if cuda:
            events.append(torch.cuda.Event(enable_timing=True))
            events[-1].record()
        loss = step(batch)
        if losses is not None:
            losses.append(loss.detach())
    if cuda:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
        events[-1].synchronize()
    end, thread_end, process_end = time.perf_counter(), time.thread_time(), time.process_time()
    times = [b - a for a, b in zip(starts, starts[1:] + [end])]
    if cuda:
        if timer is not None:  # the device marks are placed from here: the stream had run the last event by `end`
            timer.anchor(end, events[-1])
        device_times = [a.elapsed_time(b) / 1e3 for a, b in zip(events, events[1:])]
        # a tolerance for the two clocks' drift (parts per million) and their resolutions
        if 0 < sum(device_times) <= (end - start) * 1.001 + 1e-3 and min(device_times) > 0:
            times = device_times
        else:  # a broken clock gives the host's wall times (at least the device's), never shorter figures
            warnings.warn(f"the device's clock for the timed steps ({sum(device_times):.4f} s) is outside the "
                          f"host's ({end - start:.4f} s): the benchmark's event timing is broken; the host's "
                          f"time is taken")
    _sync(device)  # the other streams' work too (copies, Deep Optimizer States), before the updates are waited for
    settle = getattr(step, "settle", None)
    if settle is not None:
        settle()
    steps = len(batches)
    return (times, loss, (thread_end - thread_start) / steps, (process_end - process_start) / steps,
            time.perf_counter() - end)


def _timed_step(step, batch, device: torch.device) -> tuple[float, torch.Tensor]:
    _sync(device)
    start = time.perf_counter()
    loss = step(batch)
    _sync(device)
    return time.perf_counter() - start, loss


def step_breakdown(step, batch, device: torch.device, timer, steps: int) -> tuple[dict, float, dict]:
    """Mean seconds per step in each of the timer's categories, over `steps` extra timed steps.

    Run after the throughput steps, with the timer on only here, because its device syncs
    slow a step down. "compute_and_waits" is not measured: it is each step's wall time minus
    its timed categories (forward and backward kernels, hooks, gradient clipping, waiting), so
    the categories add up to the mean step time returned alongside. The third value is the
    background thread's seconds per step (CPU AdamW), which overlap those categories.
    """
    walls, parts = [], []
    timer.enabled = True
    try:
        background_before = timer.background()
        for _ in range(max(1, steps)):
            before = timer.totals()
            seconds, _ = _timed_step(step, batch, device)
            after = timer.totals()
            walls.append(seconds)
            parts.append({k: after[k] - before[k] for k in after})
        step.settle()  # the last step's background updates belong to the timed steps
        background_after = timer.background()
    finally:
        timer.enabled = False
    n = len(walls)
    out = {k: sum(p[k] for p in parts) / n for k in parts[0]}
    out["compute_and_waits"] = sum(w - sum(p.values()) for w, p in zip(walls, parts)) / n
    background = {k: (background_after[k] - background_before[k]) / n for k in background_after}
    return out, sum(walls) / n, background
