"""One rank's training: model, optimizer, data slice and the step, through the chunk engine. No Ray here.

The cluster layer builds a `RankTrainer` inside each worker actor; tests build one directly. The
model is built on the meta device and materialised straight into the engine's chunks with a
fixed seed, so every rank (and the plain-torch reference, see `init_reference_model`) starts from
the same weights. Each rank computes the loss on its disjoint slice of the global batch; the engine
averages gradients over the process group, clips them and runs AdamW per chunk.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional

import numpy as np
import torch
import torch.distributed as dist

from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.config import RunConfig, resolve_model_shape
from elixir_ray.data.dataset import BatchSampler, TokenDataset, resolve_data_uri
from elixir_ray.engine import EngineShard, engine_shard, layout_of, load_engine_state
from elixir_ray.errors import NonFiniteLossError
from elixir_ray.model.factory import build_model, init_fn_for, loss_of, sample_inputs, trace_loss
from elixir_ray.run_plan import RunPlan
from elixir_ray.wrapping import wrap

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EVAL_SEED = 0  # the order eval.windows are taken in: fixed, so a held-out set is the same for every run


def schedule_steps(cfg: RunConfig) -> int:
    """The learning-rate schedule's length: optim.schedule_steps, else train.steps."""
    return cfg.optim.schedule_steps or cfg.train.steps


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the schedule's last step (step
    `schedule_steps - 1`), also where that step is the only one after the warm-up; a schedule no
    longer than its warm-up ends before the decay starts, and steps past its end keep its last lr."""
    o, total = cfg.optim, schedule_steps(cfg)
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = total - 1 - o.warmup_steps
    progress = 1.0 if span <= 0 else min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; leave norms, biases and other 1-D vectors undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class TrainState:
    """What advances each step and must be restored to continue a run exactly."""

    step: int = 0
    samples_consumed: int = 0


class RankTrainer:
    def __init__(self, cfg: RunConfig, plan: RunPlan, rank: int, device: torch.device,
                 group: Optional[dist.ProcessGroup] = None, on_progress: Callable[[], None] = lambda: None):
        self.cfg, self.plan, self.rank, self.device = cfg, plan, rank, device
        self.on_progress = on_progress  # called within a step's long parts (evaluation)
        self.world_size = plan.world_size
        self.compute_dtype = DTYPES[plan.dtype]
        module = build_model(cfg, device="meta")
        base_opt = torch.optim.AdamW(param_groups(module, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                     betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
        torch.manual_seed(cfg.train.seed)  # every rank materialises identical initial weights
        self.loss_of = loss_of(cfg)
        self.model, self.optimizer = wrap(
            module, base_opt, sample_inputs=sample_inputs(cfg, plan.micro_batch), loss_fn=trace_loss(cfg),
            plan=Plan.from_dict(plan.engine) if plan.engine else None,
            memory_margin=None if plan.engine else cfg.engine.memory_margin,
            device_memory=plan.device_memory_bytes, process_group=group,
            max_grad_norm=cfg.optim.max_grad_norm, dtype=self.compute_dtype, device=device,
            init_fn=init_fn_for(cfg, module),
            # step() follows every grad_accum backward passes and the lr is set before the forward, so
            # host chunks may start their CPU update during the last backward (when nothing is clipped)
            accumulation_steps=plan.grad_accum,
        )
        self.seq_len = resolve_model_shape(cfg.model)["seq_len"]
        dataset = TokenDataset(resolve_data_uri(cfg.data.path, cfg.data.cache_dir))
        self.sampler = BatchSampler(dataset, self.seq_len, cfg.train.seed)
        self.eval_sampler = (BatchSampler(TokenDataset(cfg.eval.path, what="eval.path"), self.seq_len, EVAL_SEED)
                             if cfg.eval.path is not None else None)
        self.state = TrainState()
        self.stop_agreed = False  # set by step(): some rank asked to stop, and every rank knows it
        torch.manual_seed(cfg.train.seed + 1 + rank)  # dropout streams differ per rank, deterministically

    @property
    def global_batch(self) -> int:
        return self.plan.micro_batch * self.plan.grad_accum * self.world_size

    def micro_batch(self, micro_step: int) -> torch.Tensor:
        return self.sampler.rank_batch(
            self.state.samples_consumed, self.rank, self.plan.micro_batch, self.plan.grad_accum, micro_step
        ).to(self.device, non_blocking=True)

    def _mean_over_ranks(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of `value` (any shape, elementwise) over the ranks."""
        if self.world_size > 1:
            value = value.to(self.model.store.comm.device)
            self.model.store.comm.all_reduce_mean(value)
        return value

    def step(self, *, stop_requested: bool = False) -> dict:
        """One optimizer step over this rank's share of the global batch; returns its metrics.

        `stop_requested`: this rank was asked to stop. The request rides on the step's loss
        all-reduce, so after the step every rank has the same `stop_agreed`: all ranks end at the
        same step, where a rank stopping alone would leave the others waiting in the next step's
        collectives."""
        start = time.perf_counter()
        lr = lr_at(self.state.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.plan.grad_accum):
            loss = self.loss_of(self.model, self.micro_batch(micro))
            (loss / self.plan.grad_accum).backward()
            loss_sum += loss.detach().float()
        self.optimizer.step()
        self.optimizer.zero_grad()
        reduced = self._mean_over_ranks(torch.stack([loss_sum / self.plan.grad_accum,
                                                     torch.full((), float(stop_requested), device=self.device)]))
        loss, self.stop_agreed = float(reduced[0]), bool(reduced[1] > 0)
        if self.cfg.train.stop_on_nonfinite and not math.isfinite(loss):
            # the mean over the ranks: every rank raises here, at the same step, so none is left
            # waiting in a collective for the others
            raise NonFiniteLossError(self.state.step + 1, loss)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.state.step += 1
        self.state.samples_consumed += self.global_batch
        seconds = time.perf_counter() - start
        tokens = self.global_batch * self.seq_len
        return {
            "step": self.state.step, "loss": loss, "lr": lr,
            # None without clipping: the engine computes the norm only to clip by it (0.0 read as a zero gradient)
            "grad_norm": None if self.optimizer.last_grad_norm is None else float(self.optimizer.last_grad_norm),
            "tokens": tokens, "step_seconds": seconds, "tokens_per_s": tokens / seconds,
            "samples_consumed": self.state.samples_consumed,
            "eval_loss": self.evaluate() if self._evaluates_now() else None,  # not in the step's time
        }

    def _evaluates_now(self) -> bool:
        every, step = self.cfg.eval.every_steps, self.state.step
        return self.eval_sampler is not None and ((every and step % every == 0) or step == self.cfg.train.steps)

    @torch.no_grad()
    def evaluate(self) -> float:
        """The mean token loss over the first eval.windows of eval.path's windows (in a fixed shuffled
        order), dropout off: the same windows whatever the worker count or micro-batch, so that
        evaluations compare across restarts and runs.

        Each rank takes an equal share (rounded up, so every rank runs as many forwards: a sharded
        chunk's gather is a collective); positions past the last window are padding, their targets
        ignored. `on_progress` hears of each forward (a long evaluation is not a stalled rank)."""
        windows, world, mb = self.cfg.eval.windows, self.world_size, self.plan.micro_batch
        share = -(-windows // world)
        self.model.eval()
        try:
            total = torch.zeros((), dtype=torch.float64, device=self.device)
            for start in range(self.rank * share, (self.rank + 1) * share, mb):
                count = min(mb, (self.rank + 1) * share - start)
                rows = self.eval_sampler.samples(start, count)
                inputs, targets = rows[:, :-1], rows[:, 1:].clone()
                real = max(0, min(count, windows - start))  # rows before the padding
                targets[real:] = -100  # cross_entropy's ignore_index
                loss = self.loss_of(self.model, inputs.to(self.device, non_blocking=True),
                                    targets.to(self.device, non_blocking=True))
                if real:
                    total += loss.double() * (real * self.seq_len)
                self.on_progress()
        finally:
            self.model.train()
        return float(self._mean_over_ranks(total)) * world / (windows * self.seq_len)

    def state_shard(self, copy: bool = True, lazy: bool = False) -> Mapping[str, np.ndarray]:
        """This rank's part of the training state: its chunk slices, step counts and RNG (views of the
        host state with `copy=False`, see `engine_shard`; with `lazy`, each chunk's arrays are made
        when read, see `EngineShard`)."""
        out = EngineShard(self.model, copy=copy) if lazy else engine_shard(self.model, self.optimizer, copy=copy)
        out["rng/torch_cpu"] = torch.get_rng_state().numpy()
        if self.device.type == "cuda":
            out["rng/torch_cuda"] = torch.cuda.get_rng_state(self.device).numpy()
        return out

    def layout(self) -> dict:
        return layout_of(self.model)

    def load_state_tensors(self, tensors: dict[str, np.ndarray], step: int, samples_consumed: int) -> None:
        """Restore whole tensors (written by any world size); this rank keeps its own part."""
        load_engine_state(self.model, self.optimizer, tensors)
        rng = tensors.get(f"rng/rank{self.rank}/torch_cpu")
        if rng is not None:
            torch.set_rng_state(torch.from_numpy(np.array(rng)))
        rng = tensors.get(f"rng/rank{self.rank}/torch_cuda")
        if rng is not None and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.from_numpy(np.array(rng)), self.device)
        self.state = TrainState(step=step, samples_consumed=samples_consumed)
