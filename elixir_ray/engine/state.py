"""The engine's training state: per-rank shards for checkpoints, whole tensors for restores.

`engine_shard` gives this rank's part (its slices of every chunk's master weights and AdamW
moments) plus the layout needed to put the parts together; `assemble` is a pure function that
joins the ranks' shards into whole tensors named as the trainer's checkpoints name them:
`model/<state_dict key>`, `optim/<param>/exp_avg`, `optim/<param>/exp_avg_sq`, `optim/<param>/step`.
`load_engine_state` takes whole tensors, so a checkpoint restores onto any number of ranks.
"""

from __future__ import annotations

import numpy as np
import torch

from elixir_ray.engine.chunks import write_slot
from elixir_ray.engine.optimizer import ChunkedAdam
from elixir_ray.engine.wrap import ChunkedModule


def layout_of(model: ChunkedModule) -> dict:
    keys_of: dict[int, list[str]] = {}
    buffers = []
    for key, t in model.module.state_dict(keep_vars=True).items():
        if id(t) in model.slot_by_param:
            keys_of.setdefault(id(t), []).append(key)
        else:
            buffers.append(key)
    return {
        "world": model.store.comm.world,
        "chunks": [{"size": c.size, "sharded": c.sharded} for c in model.store.chunks],
        "slots": [{"name": s.name, "keys": keys_of.get(id(s.param), [s.name]), "chunk": s.chunk,
                   "offset": s.offset, "numel": s.numel, "shape": list(s.shape)} for s in model.slots],
        "buffers": buffers,
    }


@torch.no_grad()
def engine_shard(model: ChunkedModule, optimizer: ChunkedAdam) -> dict[str, np.ndarray]:
    """This rank's slices; no collective, so every rank can hand its own part over independently."""
    with model.store.on_device():
        model.store.settle_all()  # updates still running on the background thread finish first
    out: dict[str, np.ndarray] = {}
    for c in model.store.chunks:
        out[f"chunk/{c.index}/master"] = c.master.detach().cpu().numpy().copy()
        if c.exp_avg is not None:
            out[f"chunk/{c.index}/exp_avg"] = c.exp_avg.detach().cpu().numpy().copy()
            out[f"chunk/{c.index}/exp_avg_sq"] = c.exp_avg_sq.detach().cpu().numpy().copy()
    out["slots/step"] = np.asarray([s.step for s in model.slots], dtype=np.int64)
    if model.store.comm.rank == 0:
        for key, t in model.module.state_dict(keep_vars=True).items():
            if id(t) not in model.slot_by_param:
                out[f"model/{key}"] = t.detach().float().cpu().numpy().copy()
    return out


def assemble(shards: list[dict[str, np.ndarray]], layout: dict) -> dict[str, np.ndarray]:
    """Whole tensors from every rank's shard (rank order), for a world-size-independent checkpoint."""
    out: dict[str, np.ndarray] = {}
    steps = shards[0]["slots/step"]
    for kind in ("master", "exp_avg", "exp_avg_sq"):
        full = {}
        for i, info in enumerate(layout["chunks"]):
            key = f"chunk/{i}/{kind}"
            if key not in shards[0]:
                continue
            parts = [s[key] for s in shards] if info["sharded"] and layout["world"] > 1 else [shards[0][key]]
            full[i] = np.concatenate(parts)
        for slot, step in zip(layout["slots"], steps):
            if slot["chunk"] not in full:
                continue
            value = full[slot["chunk"]][slot["offset"]: slot["offset"] + slot["numel"]].reshape(slot["shape"])
            if kind == "master":
                for key in slot["keys"]:
                    out[f"model/{key}"] = value.copy()
            elif step > 0:
                out[f"optim/{slot['name']}/{kind}"] = value.copy()
    for slot, step in zip(layout["slots"], steps):
        if step > 0:
            out[f"optim/{slot['name']}/step"] = np.asarray([float(step)], dtype=np.float32)
    for key in layout["buffers"]:
        out[f"model/{key}"] = shards[0][f"model/{key}"]
    return out


@torch.no_grad()
def engine_state(model: ChunkedModule, optimizer: ChunkedAdam) -> dict[str, np.ndarray]:
    """Whole tensors on one process (single rank, or for tests); see `assemble` for several ranks."""
    if model.store.comm.world != 1:
        raise ValueError("engine_state is for one rank; with several, gather engine_shard from each and assemble")
    return assemble([engine_shard(model, optimizer)], layout_of(model))


@torch.no_grad()
def load_engine_state(model: ChunkedModule, optimizer: ChunkedAdam, tensors: dict) -> None:
    """Restore from whole tensors (any world size wrote them); each rank keeps its own part."""
    model.load_state_dict({k[len("model/"):]: torch.as_tensor(np.array(v)) for k, v in tensors.items()
                           if k.startswith("model/")})
    for c in model.store.chunks:
        for s in c.slots:
            key = f"optim/{s.name}"
            if f"{key}/exp_avg" not in tensors:
                s.step = 0
                continue
            if c.exp_avg is None:
                c.exp_avg, c.exp_avg_sq = torch.zeros_like(c.master), torch.zeros_like(c.master)
            write_slot(c, c.exp_avg, s, _flat(tensors[f"{key}/exp_avg"]))
            write_slot(c, c.exp_avg_sq, s, _flat(tensors[f"{key}/exp_avg_sq"]))
            s.step = int(np.asarray(tensors[f"{key}/step"]).reshape(-1)[0])


def _flat(value) -> torch.Tensor:
    return torch.as_tensor(np.array(value, dtype=np.float32)).reshape(-1)
