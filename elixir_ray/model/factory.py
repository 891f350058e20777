"""Building the configured GPT: on the meta device for planning and the engine, or plainly for references."""

from __future__ import annotations

import torch

from elixir_ray.config import RunConfig, resolve_model_shape
from elixir_ray.model.gpt import GPT, build_gpt, init_gpt_weights


def build_model(cfg: RunConfig, device: torch.device | str | None = None) -> GPT:
    return build_gpt(resolve_model_shape(cfg.model), cfg.model.activation_checkpointing, cfg.model.dropout, device)


def init_fn_for(cfg: RunConfig):
    n_layers = resolve_model_shape(cfg.model)["n_layers"]
    return lambda module: init_gpt_weights(module, n_layers)


def init_reference_model(cfg: RunConfig) -> GPT:
    """The initial weights every rank materialises, built the plain way (for references and tests)."""
    model = build_model(cfg, device="meta").to_empty(device="cpu")
    model.head.weight = model.wte.weight  # to_empty makes a new tensor per module: tie them again
    torch.manual_seed(cfg.train.seed)
    model.apply(init_fn_for(cfg))  # the order the engine materialises modules in
    return model


def sample_batch(cfg: RunConfig, micro_batch: int, device: str = "cpu") -> torch.Tensor:
    seq_len = resolve_model_shape(cfg.model)["seq_len"]
    return torch.zeros((micro_batch, seq_len + 1), dtype=torch.long, device=device)


def expected_checkpoint_shapes(cfg: RunConfig) -> dict[str, tuple]:
    """The model tensors a checkpoint must hold for this config, from a meta-device build (no memory)."""
    model = build_model(cfg, device="meta")
    return {f"model/{k}": tuple(v.shape) for k, v in model.state_dict().items()}
