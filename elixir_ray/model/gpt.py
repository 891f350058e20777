"""A GPT-2 family decoder: tied embeddings, pre-LayerNorm blocks, `scaled_dot_product_attention`.

`GPT.forward(batch)` takes token windows of length seq_len + 1 and returns the mean next-token
loss, so that a training step is `loss = model(batch); loss.backward()` whatever wraps the model.
Build it under `torch.device("meta")` to get the shape of a huge model without memory;
`init_gpt_weights` then initialises any submodule on its own (the engine materialises chunk by chunk).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# per block, what backward recomputes instead of keeping: nothing; the norms and the GELU (whose
# outputs are 6 of the 16 hidden-size units a block saves per token, for a few memory-bound
# kernels); or the whole block (its forward again, matmuls included: a third more compute)
CHECKPOINT_MODES = ("none", "selective", "full")


def checkpoint_mode(value) -> str:
    """A block's mode from a mask entry: True is "full", False "none", or one of CHECKPOINT_MODES."""
    if isinstance(value, bool):
        return "full" if value else "none"
    if value not in CHECKPOINT_MODES:
        raise ValueError(f"activation checkpointing mode {value!r} is not one of {', '.join(CHECKPOINT_MODES)} "
                         f"(or True / False)")
    return value


@dataclass
class GPTConfig:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 257
    seq_len: int = 128
    dropout: float = 0.0
    activation_checkpointing: bool | str = False  # every block's mode: False/"none", "selective", True/"full"


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.is_residual_projection = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attend(self.qkv(x))

    def attend(self, qkv: torch.Tensor) -> torch.Tensor:
        """Attention and the output projection, from the query-key-value projection."""
        b, t, d = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        q, k, v = qkv.split(d, dim=2)
        q, k, v = (y.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.down = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.down.is_residual_projection = True
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.project(self.up(x)))

    def project(self, u: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(u, approximate="tanh"))


def _then(first: nn.Module, second: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return second(first(x))


_PIECE = dict(use_reentrant=False, preserve_rng_state=False)  # a selective block's checkpointed pieces


def _warn_if_early_stop_is_off() -> None:
    if getattr(torch.utils.checkpoint, "_enable_checkpoint_early_stop", None) is False:
        warnings.warn("activation checkpointing's early stop is off (set_checkpoint_early_stop(False)): "
                      "selectively checkpointed GPT blocks rerun their matmuls in backward, which costs what "
                      "recomputing whole blocks does and frees less", stacklevel=3)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, selective: bool = False) -> torch.Tensor:
        """`selective`: keep for backward only what the matmuls and attention take and make, and
        recompute each norm's and the GELU's output there (the same result and gradients).

        Each of the three checkpointed pieces ends in a matmul whose inputs are the last thing it
        saves, so recomputation stops before that matmul runs (torch's early stop, on unless
        `torch.utils.checkpoint.set_checkpoint_early_stop(False)` turns it off, which would rerun
        the matmuls too; that is warned about). No piece draws random numbers, so none keeps the
        RNG state. The pieces call `attn.attend` and `mlp.project`, not the modules `attn` and
        `mlp`: hooks on those two (not on their layers) do not fire in this mode.
        """
        if not (selective and torch.is_grad_enabled()):
            x = x + self.attn(self.ln1(x))
            return x + self.mlp(self.ln2(x))
        _warn_if_early_stop_is_off()
        x = x + self.attn.attend(checkpoint(_then, self.ln1, self.attn.qkv, x, **_PIECE))
        u = checkpoint(_then, self.ln2, self.mlp.up, x, **_PIECE)
        return x + self.mlp.drop(checkpoint(self.mlp.project, u, **_PIECE))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        self._checkpointing = [checkpoint_mode(cfg.activation_checkpointing)] * cfg.n_layers
        if self.wte.weight.device.type != "meta":
            self.apply(lambda m: init_gpt_weights(m, cfg.n_layers))

    checkpointing_modes = CHECKPOINT_MODES  # what set_checkpointing takes per block (the planner reads it)

    def checkpointing(self) -> list[str]:
        """Per block, what backward recomputes instead of keeping: "none", "selective" (the layer
        norms and the GELU; matmul and attention inputs and outputs are kept) or "full" (the whole block)."""
        return list(self._checkpointing)

    def set_checkpointing(self, mask: list) -> None:
        """Per block a mode of `checkpointing_modes`, or True ("full") / False ("none")."""
        if len(mask) != len(self.blocks):
            raise ValueError(f"checkpointing mask has {len(mask)} entries, the model has {len(self.blocks)} blocks")
        self._checkpointing = [checkpoint_mode(x) for x in mask]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        training = self.training and torch.is_grad_enabled()
        for block, mode in zip(self.blocks, self._checkpointing):
            if mode == "full" and training:
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x, selective=mode == "selective" and training)
        return self.head(self.ln_f(x))

    def forward(self, batch: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Mean cross-entropy. `batch` holds seq_len+1 tokens per row unless `targets` is given."""
        if targets is None:
            batch, targets = batch[:, :-1], batch[:, 1:]
        logits = self.logits(batch)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def init_gpt_weights(module: nn.Module, n_layers: int) -> None:
    """GPT-2 initialisation for one module; residual projections are scaled down by depth."""
    if isinstance(module, nn.Linear):
        std = 0.02
        if getattr(module, "is_residual_projection", False):
            std = 0.02 / math.sqrt(2 * n_layers)
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def build_gpt(shape: dict, activation_checkpointing: bool | str = False, dropout: float = 0.0,
              device: str | torch.device | None = None) -> GPT:
    cfg = GPTConfig(
        d_model=shape["d_model"], n_layers=shape["n_layers"], n_heads=shape["n_heads"],
        vocab_size=shape["vocab_size"], seq_len=shape["seq_len"], dropout=dropout,
        activation_checkpointing=activation_checkpointing,
    )
    if device is None:
        return GPT(cfg)
    with torch.device(device):
        return GPT(cfg)
