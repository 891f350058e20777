"""A GPT-2 family decoder: tied embeddings, pre-LayerNorm blocks, `scaled_dot_product_attention`.

`GPT.forward(batch)` takes token windows of length seq_len + 1 and returns the mean next-token
loss, so that a training step is `loss = model(batch); loss.backward()` whatever wraps the model.
Build it under `torch.device("meta")` to get the shape of a huge model without memory;
`init_gpt_weights` then initialises any submodule on its own (the engine materialises chunk by chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 257
    seq_len: int = 128
    dropout: float = 0.0
    activation_checkpointing: bool = False


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.proj.is_residual_projection = True
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
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
        return self.drop(self.down(F.gelu(self.up(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


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
        self._checkpointing = [bool(cfg.activation_checkpointing)] * cfg.n_layers
        if self.wte.weight.device.type != "meta":
            self.apply(lambda m: init_gpt_weights(m, cfg.n_layers))

    def checkpointing(self) -> list[bool]:
        """Per block: recompute its activations in backward instead of keeping them."""
        return list(self._checkpointing)

    def set_checkpointing(self, mask: list[bool]) -> None:
        if len(mask) != len(self.blocks):
            raise ValueError(f"checkpointing mask has {len(mask)} entries, the model has {len(self.blocks)} blocks")
        self._checkpointing = [bool(x) for x in mask]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than model.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block, recompute in zip(self.blocks, self._checkpointing):
            if recompute and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
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


def build_gpt(shape: dict, activation_checkpointing: bool = False, dropout: float = 0.0,
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
