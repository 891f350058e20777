"""Models and a plain-torch reference loop shared by the engine tests (and their spawned ranks)."""

import copy
import multiprocessing
import os
import tempfile
from functools import partial

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

VOCAB = 50


def _keep_matmuls(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) \
        else CheckpointPolicy.PREFER_RECOMPUTE


class Toy(nn.Module):
    """Tied weights, a branch never used, LayerNorm, and optional activation checkpointing
    (`ckpt`: "reentrant", "non-reentrant", or torch's "selective" with a policy that keeps matmul outputs)."""

    def __init__(self, d: int = 32, ckpt: str = ""):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.ln = nn.LayerNorm(d)
        self.l1 = nn.Linear(d, 2 * d)
        self.l2 = nn.Linear(2 * d, d)
        self.l3 = nn.Linear(d, 2 * d)
        self.l4 = nn.Linear(2 * d, d)
        self.unused = nn.Linear(d, d)  # an MoE-style branch no step takes
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self.ckpt = ckpt

    def _mlp(self, h, a, b):
        return h + b(torch.relu(a(h)))

    def forward(self, x):
        h = self.ln(self.emb(x[:, :-1]))
        for a, b in ((self.l1, self.l2), (self.l3, self.l4)):
            if self.ckpt == "selective":  # torch's selective checkpointing: its dispatch mode records ops
                h = checkpoint(self._mlp, h, a, b, use_reentrant=False,
                               context_fn=partial(create_selective_checkpoint_contexts, _keep_matmuls))
            elif self.ckpt and torch.is_grad_enabled():
                h = checkpoint(self._mlp, h, a, b, use_reentrant=self.ckpt == "reentrant")
            else:
                h = self._mlp(h, a, b)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


class Routed(nn.Module):
    """A mixture of experts routed by its input: expert e runs when the first row's token e is even,
    so a step can take experts the traced sample did not (`ckpt` as in Toy, around all experts)."""

    def __init__(self, d: int = 32, n_experts: int = 4, ckpt: str = ""):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
                                     for _ in range(n_experts))
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.ckpt = ckpt

    def _experts(self, h, picks):
        for e in picks:
            h = h + self.experts[e](h)
        return h

    def forward(self, x):
        h = self.emb(x[:, :-1])
        picks = [e for e in range(len(self.experts)) if int(x[0, e]) % 2 == 0]
        if self.ckpt and torch.is_grad_enabled():
            h = checkpoint(self._experts, h, picks, use_reentrant=self.ckpt == "reentrant")
        else:
            h = self._experts(h, picks)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


class LearnedRouter(nn.Module):
    """A mixture of experts whose router is trained: each token goes to the expert its router
    scores highest, so which experts a step uses depends on the weights (the trace cannot know it
    on the meta device) and differs between batches and ranks."""

    def __init__(self, d: int = 32, n_experts: int = 4, dropout: float = 0.0):
        super().__init__()
        self.dropout = dropout
        self.emb = nn.Embedding(VOCAB, d)
        self.router = nn.Linear(d, n_experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.ReLU(), nn.Linear(2 * d, d))
                                     for _ in range(n_experts))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, x):
        h = F.dropout(self.emb(x[:, :-1]), self.dropout, self.training).reshape(-1, self.emb.embedding_dim)
        weight, choice = self.router(h).softmax(-1).max(-1)
        out = h
        for e, expert in enumerate(self.experts):
            rows = torch.nonzero(choice == e).flatten()
            if rows.numel():
                out = out.index_add(0, rows, weight[rows, None] * expert(h[rows]))
        return F.cross_entropy(self.head(out), x[:, 1:].reshape(-1))


def param_groups(model: nn.Module, wd: float = 0.1) -> list[dict]:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    other = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": decay, "weight_decay": wd}, {"params": other, "weight_decay": 0.0}]


def batches(n: int, rows: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (rows, 9), generator=g) for _ in range(n)]


def reference_run(model: nn.Module, data: list[torch.Tensor], steps: int, accum: int, max_norm: float | None,
                  lr: float = 1e-2, device: str = "cpu", with_optimizer: bool = False) -> tuple:
    """Plain torch AdamW: the losses and final state (on the host) the engine must reproduce, and
    with `with_optimizer` the optimizer's state dict too."""
    model = copy.deepcopy(model).to(device)
    # on a GPU torch's default is the foreach kernel: fused is the arithmetic the engine runs there
    opt = torch.optim.AdamW(param_groups(model), lr=lr, fused=True if device != "cpu" else None)
    losses = []
    for step in range(steps):
        total = 0.0
        for a in range(accum):
            loss = model(data[step * accum + a].to(device)) / accum
            loss.backward()
            total += loss.item()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return (losses, state, opt.state_dict()) if with_optimizer else (losses, state)


def train_side_by_side(engine, engine_opt, reference, reference_opt, data: list[torch.Tensor]) -> list[float]:
    """One step of the wrapped model and one of plain torch per batch; the absolute loss differences."""
    diffs = []
    for batch in data:
        a = engine(batch)
        a.backward()
        engine_opt.step()
        engine_opt.zero_grad()
        b = reference(batch)
        b.backward()
        reference_opt.step()
        reference_opt.zero_grad()
        diffs.append(abs(a.item() - b.item()))
    return diffs


def engine_run(model, opt, data: list[torch.Tensor], steps: int, accum: int, rank: int = 0,
               world: int = 1, device: str = "cpu") -> list[float]:
    """The same loop through the engine; each rank takes its slice of every global batch."""
    import torch.distributed as dist

    losses = []
    for step in range(steps):
        total = torch.zeros(())
        for a in range(accum):
            batch = data[step * accum + a]
            rows = batch.shape[0] // world
            loss = model(batch[rank * rows: (rank + 1) * rows].to(device)) / accum
            loss.backward()
            total += loss.detach().cpu()
        if world > 1:
            dist.all_reduce(total)
            total /= world
        opt.step()
        opt.zero_grad()
        losses.append(float(total))
    return losses


# What spawned ranks import, imported once by the server they are forked from (`spawn_ranks`)
RANK_IMPORTS = ["torch", "torch._dynamo", "torch.distributed", "numpy", "pytest", "elixir_ray.engine.wrap",
                "engine_models"]


def spawn_ranks(fn, args: tuple, nprocs: int) -> None:
    """`mp.spawn(fn, args=args, nprocs=nprocs)`, the ranks forked from a server process that imported
    RANK_IMPORTS once: a fresh interpreter per rank imports torch and the engine again, about 5 s of
    CPU a rank, most of a short two-rank test. The server (one per pytest process, started at its
    first call) runs no torch kernel, so it holds no thread pool a fork could break; a rank sees the
    environment as it was when the server started."""
    multiprocessing.set_forkserver_preload(RANK_IMPORTS)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def store_url(directory: str) -> str:
    """A rendezvous for spawned gloo ranks: a fresh file for torch's FileStore. A TCP port found free
    before the ranks start can be taken by another process before rank 0 binds it."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="pg-store-")
    os.close(fd)
    os.unlink(path)  # the store creates it; a name nobody else will use
    return f"file://{path}"


class CausalLMLoss(nn.Module):
    """A Hugging Face causal LM called with (ids, attention mask), returning its loss."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.m = lm

    def forward(self, ids, mask):
        return self.m(input_ids=ids, attention_mask=mask, labels=ids).loss


def train_pairs(model, opt, data: list[tuple]) -> list[float]:
    """One optimizer step per (ids, mask) pair; the losses."""
    losses = []
    for ids, mask in data:
        loss = model(ids, mask)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def count_updates_started_before_step(model, opt) -> list[int]:
    """Record, at every `opt.step()`, how many chunks' updates had already started (during the
    last backward): equality with torch alone holds as well when every update waits for step()."""
    started: list[int] = []
    step = opt.step

    def counting_step(*args, **kwargs):
        started.append(sum(1 for c in model.store.chunks if c.updated))
        return step(*args, **kwargs)

    opt.step = counting_step
    return started
