"""One rank's training: model, optimizer, data slice and the step. No Ray here.

The cluster layer builds a `RankTrainer` inside each worker actor; tests build one directly in a
process. The step is data parallel: each rank computes the loss on its disjoint slice of the
global batch, gradients are averaged over the process group, clipped, and AdamW steps.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from elixir_ray.config import RunConfig, resolve_model_shape
from elixir_ray.data.dataset import BatchSampler, TokenDataset, resolve_data_uri
from elixir_ray.model.gpt import GPT, build_gpt
from elixir_ray.plan import Plan

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def lr_at(step: int, cfg: RunConfig) -> float:
    """Linear warm-up, then cosine decay to min_lr_ratio * lr at the last step."""
    o, total = cfg.optim, cfg.train.steps
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    span = max(1, total - o.warmup_steps)
    progress = min(1.0, (step - o.warmup_steps) / span)
    return o.lr * (o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices; leave norms, biases and (tied) embeddings' 1-D vectors undecayed."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        (decay if p.dim() >= 2 else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_model(cfg: RunConfig, device: torch.device | str | None = None) -> GPT:
    return build_gpt(resolve_model_shape(cfg.model), cfg.model.activation_checkpointing, cfg.model.dropout, device)


def expected_checkpoint_shapes(cfg: RunConfig) -> dict[str, tuple]:
    """The model tensors a checkpoint must hold for this config, from a meta-device build (no memory)."""
    model = build_model(cfg, device="meta")
    return {f"model/{k}": tuple(v.shape) for k, v in model.state_dict().items()}


@dataclass
class TrainState:
    """What advances each step and must be restored to continue a run exactly."""

    step: int = 0
    samples_consumed: int = 0


class RankTrainer:
    def __init__(self, cfg: RunConfig, plan: Plan, rank: int, device: torch.device,
                 group: dist.ProcessGroup | None = None):
        self.cfg, self.plan, self.rank, self.device, self.group = cfg, plan, rank, device, group
        self.world_size = plan.world_size
        torch.manual_seed(cfg.train.seed)  # every rank builds identical initial weights
        self.model = build_model(cfg).to(device)
        self.optimizer = torch.optim.AdamW(
            param_groups(self.model, cfg.optim.weight_decay), lr=cfg.optim.lr,
            betas=tuple(cfg.optim.betas), eps=cfg.optim.eps,
        )
        shape = resolve_model_shape(cfg.model)
        self.seq_len = shape["seq_len"]
        dataset = TokenDataset(resolve_data_uri(cfg.data.path, cfg.data.cache_dir))
        self.sampler = BatchSampler(dataset, self.seq_len, cfg.train.seed)
        self.state = TrainState()
        self.compute_dtype = DTYPES[plan.dtype]
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.compute_dtype == torch.float16)

    @property
    def global_batch(self) -> int:
        return self.plan.micro_batch * self.plan.grad_accum * self.world_size

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def micro_batch(self, micro_step: int) -> torch.Tensor:
        return self.sampler.rank_batch(
            self.state.samples_consumed, self.rank, self.plan.micro_batch, self.plan.grad_accum, micro_step
        ).to(self.device, non_blocking=True)

    def forward_backward(self, batch: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            loss = self.model(batch)
        self.scaler.scale(loss / self.plan.grad_accum).backward()
        return loss.detach()

    def _average_gradients(self) -> None:
        if self.world_size == 1:
            return
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.group)
        flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset: offset + g.numel()].view_as(g))
            offset += g.numel()

    def _mean_over_ranks(self, value: torch.Tensor) -> float:
        if self.world_size > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.group)
            value /= self.world_size
        return float(value)

    def step(self) -> dict:
        """One optimizer step over this rank's share of the global batch; returns its metrics."""
        start = time.perf_counter()
        lr = lr_at(self.state.step, self.cfg)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.plan.grad_accum):
            loss_sum += self.forward_backward(self.micro_batch(micro))
        self._average_gradients()
        self.scaler.unscale_(self.optimizer)
        max_norm = self.cfg.optim.max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), max_norm if max_norm is not None else float("inf")
        )
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self._mean_over_ranks(loss_sum / self.plan.grad_accum)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.state.step += 1
        self.state.samples_consumed += self.global_batch
        seconds = time.perf_counter() - start
        tokens = self.global_batch * self.seq_len
        return {
            "step": self.state.step, "loss": loss, "lr": lr, "grad_norm": float(grad_norm),
            "tokens": tokens, "step_seconds": seconds, "tokens_per_s": tokens / seconds,
            "samples_consumed": self.state.samples_consumed,
        }

    def state_tensors(self) -> dict[str, np.ndarray]:
        """This rank's training state as flat numpy arrays: weights, AdamW moments, RNG."""
        out: dict[str, np.ndarray] = {}
        for name, tensor in self.model.state_dict().items():
            out[f"model/{name}"] = tensor.detach().float().cpu().numpy()
        names = {id(p): n for n, p in self.model.named_parameters()}
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                st = self.optimizer.state.get(p)
                if not st:
                    continue
                out[f"optim/{names[id(p)]}/exp_avg"] = st["exp_avg"].float().cpu().numpy()
                out[f"optim/{names[id(p)]}/exp_avg_sq"] = st["exp_avg_sq"].float().cpu().numpy()
                out[f"optim/{names[id(p)]}/step"] = np.asarray([float(st["step"])], dtype=np.float32)
        out["rng/torch_cpu"] = torch.get_rng_state().numpy()
        if self.device.type == "cuda":
            out["rng/torch_cuda"] = torch.cuda.get_rng_state(self.device).numpy()
        return out

    def load_state_tensors(self, tensors: dict[str, np.ndarray], step: int, samples_consumed: int) -> None:
        """Restore what `state_tensors` produced, onto any world size (the tensors are whole)."""
        model_state = {k[len("model/"):]: torch.from_numpy(np.array(v)) for k, v in tensors.items()
                       if k.startswith("model/")}
        self.model.load_state_dict(model_state)
        names = {id(p): n for n, p in self.model.named_parameters()}
        self.optimizer.state.clear()
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                key = f"optim/{names[id(p)]}"
                if f"{key}/exp_avg" not in tensors:
                    continue  # never stepped (an unused parameter): torch keeps no state either
                self.optimizer.state[p] = {
                    "step": torch.tensor(float(tensors[f"{key}/step"][0]), dtype=torch.float32),
                    "exp_avg": torch.from_numpy(np.array(tensors[f"{key}/exp_avg"])).to(self.device),
                    "exp_avg_sq": torch.from_numpy(np.array(tensors[f"{key}/exp_avg_sq"])).to(self.device),
                }
        if "rng/torch_cpu" in tensors:
            torch.set_rng_state(torch.from_numpy(np.array(tensors["rng/torch_cpu"])))
        if "rng/torch_cuda" in tensors and self.device.type == "cuda":
            torch.cuda.set_rng_state(torch.from_numpy(np.array(tensors["rng/torch_cuda"])), self.device)
        self.state = TrainState(step=step, samples_consumed=samples_consumed)
