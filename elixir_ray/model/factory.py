"""Building the configured model, the built-in GPT or a Hugging Face causal LM (`model.hf`): on the
meta device for planning and the engine, or plainly for references; and what is traced and trained
with it (sample inputs, the loss of a batch of token windows)."""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch
import torch.nn as nn

from elixir_ray.config import RunConfig, resolve_model_shape
from elixir_ray.errors import ConfigError
from elixir_ray.model.gpt import build_gpt, checkpoint_mode, init_gpt_weights

# (model, tokens, targets=None) -> mean loss: tokens hold seq_len+1 per row unless targets are given
LossOf = Callable[[nn.Module, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


def build_model(cfg: RunConfig, device: torch.device | str | None = None) -> nn.Module:
    m = cfg.model
    if m.hf is not None:
        from elixir_ray.model.hf import build_hf

        return build_hf(m.hf, checkpoint_mode(m.activation_checkpointing) == "full", device)
    return build_gpt(resolve_model_shape(m), m.activation_checkpointing, m.dropout, device)


def init_fn_for(cfg: RunConfig, model: nn.Module) -> Callable[[nn.Module], None]:
    """Initialises one module of `model` (what the engine materialises a meta-built model with)."""
    if cfg.model.hf is not None:
        from elixir_ray.model.hf import hf_init_fn

        return hf_init_fn(model)
    n_layers = resolve_model_shape(cfg.model)["n_layers"]
    return lambda module: init_gpt_weights(module, n_layers)


def empty_model(cfg: RunConfig, device: torch.device | str) -> nn.Module:
    """The configured model with uninitialised weights on `device`, built without a copy on the host
    first, its tied weights tied."""
    model = build_model(cfg, device="meta").to_empty(device=device)
    if cfg.model.hf is not None:
        model.tie_weights()  # to_empty makes a new tensor per module: tie them again
    else:
        model.head.weight = model.wte.weight
    return model


def init_reference_model(cfg: RunConfig) -> nn.Module:
    """The initial weights every rank materialises, built the plain way (for references and tests)."""
    model = empty_model(cfg, "cpu")
    torch.manual_seed(cfg.train.seed)
    model.apply(init_fn_for(cfg, model))  # the order the engine materialises modules in
    return model


def check_model_step(cfg: RunConfig, device_type: Optional[str] = None, *,
                     meta_model: Optional[nn.Module] = None) -> None:
    """One training step of a `model.hf` model, traced on the meta device at micro-batch 1, on the
    driver before any worker starts. transformers builds models whose fields disagree (a
    num_key_value_heads that does not divide num_attention_heads) that fail only in their forward;
    without this the workers would start, profile, and fail with a traceback. The trace runs at the
    compute dtype of a run on `device_type` ("cuda" or "cpu"); where that is not known yet, the
    model passes when a step traces at either dtype the run could use. About a second for a 7B
    model; the built-in GPT's fields are all checked when the config is read. `meta_model`: the
    config's model built on the meta device by the caller (for its other checks), traced first;
    a further dtype traces a model built here."""
    if cfg.model.hf is None:
        return
    from elixir_ray.engine.trace import trace_step
    from elixir_ray.run_plan import resolve_dtype

    if device_type is None and cfg.cluster.use_gpu is not None:
        device_type = "cuda" if cfg.cluster.use_gpu else "cpu"
    dtypes = list(dict.fromkeys(resolve_dtype(cfg.train.dtype, t) for t in ([device_type] if device_type
                                                                           else ["cpu", "cuda"])))
    seq_len = resolve_model_shape(cfg.model)["seq_len"]
    first = None
    for dtype in dtypes:
        model = meta_model if meta_model is not None else build_model(cfg, device="meta")
        meta_model = None
        try:
            trace_step(model, sample_inputs(cfg, 1), trace_loss(cfg), dtype=getattr(torch, dtype))
            return
        except Exception as exc:  # noqa: BLE001 - whatever the model raises, say it before the run starts
            first = first or (dtype, exc)
    dtype, exc = first
    lines = str(exc).splitlines()
    raise ConfigError(f"model.hf: transformers builds {type(model).__name__} from these fields, but one training "
                      f"step of it fails, traced on the meta device ({seq_len} tokens, {dtype}): "
                      f"{type(exc).__name__}: {lines[0] if lines else ''}. Fields that disagree fail this way (a "
                      f"num_key_value_heads that does not divide num_attention_heads), as does a model whose step "
                      f"the engine cannot trace") from exc


def sample_batch(cfg: RunConfig, micro_batch: int, device: str = "cpu") -> torch.Tensor:
    seq_len = resolve_model_shape(cfg.model)["seq_len"]
    return torch.zeros((micro_batch, seq_len + 1), dtype=torch.long, device=device)


def sample_inputs(cfg: RunConfig, micro_batch: int) -> Union[tuple, dict]:
    """What the engine and the planner trace one step of: the inputs `loss_of(cfg)` calls the model with."""
    tokens = sample_batch(cfg, micro_batch)
    if cfg.model.hf is not None:
        from elixir_ray.model.hf import hf_sample_inputs

        return hf_sample_inputs(tokens)
    return (tokens,)


def trace_loss(cfg: RunConfig) -> Optional[Callable]:
    """The trace's `loss_fn`: None where the model returns its loss itself (the built-in GPT)."""
    if cfg.model.hf is not None:
        from elixir_ray.model.hf import hf_trace_loss

        return hf_trace_loss
    return None


def _gpt_loss(model: nn.Module, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
    return model(tokens) if targets is None else model(tokens, targets)


def loss_of(cfg: RunConfig) -> LossOf:
    """The mean next-token loss of a batch of token windows, for the configured model."""
    if cfg.model.hf is not None:
        from elixir_ray.model.hf import hf_loss

        return hf_loss
    return _gpt_loss


def expected_checkpoint_shapes(cfg: RunConfig) -> dict[str, tuple]:
    """The model tensors a checkpoint must hold for this config, from a meta-device build (no memory)."""
    return checkpoint_shapes_of(build_model(cfg, device="meta"))


def checkpoint_shapes_of(model: nn.Module) -> dict[str, tuple]:
    """The model tensors a checkpoint of `model` holds, by their names there."""
    return {f"model/{k}": tuple(v.shape) for k, v in model.state_dict().items()}
