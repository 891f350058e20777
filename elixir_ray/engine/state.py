"""The engine's training state as whole tensors, for checkpoints that restore onto any world size.

Names follow the trainer's checkpoint convention: `model/<key>` for weights and buffers,
`optim/<param>/exp_avg`, `optim/<param>/exp_avg_sq` and `optim/<param>/step` for AdamW state.
Every rank must call these together when chunks are sharded (they gather and scatter).
"""

from __future__ import annotations

import numpy as np
import torch

from elixir_ray.engine.chunks import write_slot
from elixir_ray.engine.optimizer import ChunkedAdam
from elixir_ray.engine.wrap import ChunkedModule


@torch.no_grad()
def engine_state(model: ChunkedModule, optimizer: ChunkedAdam) -> dict[str, np.ndarray]:
    out = {f"model/{k}": v.numpy() for k, v in model.state_dict().items()}
    store = model.store
    for c in store.chunks:
        if c.exp_avg is None:
            continue
        m, v = store.full_of(c, c.exp_avg), store.full_of(c, c.exp_avg_sq)
        for s in c.slots:
            if s.step == 0:
                continue  # never updated: torch keeps no state for it either
            out[f"optim/{s.name}/exp_avg"] = m[s.offset: s.offset + s.numel].view(s.shape).numpy().copy()
            out[f"optim/{s.name}/exp_avg_sq"] = v[s.offset: s.offset + s.numel].view(s.shape).numpy().copy()
            out[f"optim/{s.name}/step"] = np.asarray([float(s.step)], dtype=np.float32)
    return out


@torch.no_grad()
def load_engine_state(model: ChunkedModule, optimizer: ChunkedAdam, tensors: dict) -> None:
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
