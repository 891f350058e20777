"""The engine's AdamW state in torch's own optimizer state-dict format.

Training loops save `optimizer.state_dict()` beside `model.state_dict()` and load both to resume;
with the engine the moments live in chunks (sharded across ranks, some on the host), so these
gather each parameter's whole moments into torch's layout and write back only this rank's part.
The result loads into a plain torch AdamW over the same parameters, and a plain AdamW's state
dict loads here. Every rank must call both when chunks are sharded (the gather is a collective).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from elixir_ray.engine.chunks import own_part, write_part

if TYPE_CHECKING:
    from elixir_ray.engine.optimizer import ChunkedAdam


def _indices(optimizer: "ChunkedAdam") -> dict[int, int]:
    """id(param) -> its number in torch's state dict: positions across the param groups, in order."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {id(p): i for i, p in enumerate(params)}


@torch.no_grad()
def optimizer_state_dict(optimizer: "ChunkedAdam") -> dict:
    store = optimizer.store
    index = _indices(optimizer)
    state = {}
    with store.on_device():
        store.settle_all()
        for c in store.chunks:
            stepped = [s for s in c.slots if s.group >= 0 and s.step > 0]
            if not stepped:
                continue
            avg, avg_sq = store.full_of(c, c.exp_avg), store.full_of(c, c.exp_avg_sq)
            for s in stepped:
                state[index[id(s.param)]] = {
                    "step": torch.tensor(float(s.step)),
                    "exp_avg": avg[s.offset: s.offset + s.numel].view(s.shape).clone(),
                    "exp_avg_sq": avg_sq[s.offset: s.offset + s.numel].view(s.shape).clone(),
                }
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [index[id(p)] for p in g["params"]]}
              for g in optimizer.param_groups]
    return {"state": state, "param_groups": groups}


def _check(optimizer: "ChunkedAdam", state_dict: dict) -> None:
    """Refuse a state dict that does not fit, before anything is written (as torch does)."""
    if not isinstance(state_dict, dict) or "state" not in state_dict or "param_groups" not in state_dict:
        raise ValueError("expected an optimizer state dict ({'state': ..., 'param_groups': ...}), as "
                         "optimizer.state_dict() returns")
    saved, groups = state_dict["param_groups"], optimizer.param_groups
    if len(saved) != len(groups):
        raise ValueError(f"the loaded state dict has {len(saved)} parameter groups, the optimizer has {len(groups)}")
    for i, (a, b) in enumerate(zip(saved, groups)):
        if len(a["params"]) != len(b["params"]):
            raise ValueError(f"parameter group {i} of the loaded state dict has {len(a['params'])} parameters, the "
                             f"optimizer's has {len(b['params'])}")
    position = {p: i for i, p in enumerate(q for g in saved for q in g["params"])}
    params = [p for g in groups for p in g["params"]]
    for key, entry in state_dict["state"].items():
        if key not in position:
            raise ValueError(f"the loaded state has parameter {key!r}, which no parameter group lists")
        p = params[position[key]]
        for kind in ("exp_avg", "exp_avg_sq"):
            value = entry.get(kind)
            if value is None or (tuple(value.shape) != tuple(p.shape) and not value.numel() == p.numel() == 1):
                raise ValueError(f"{kind} of parameter {key!r} in the loaded state has shape "
                                 f"{None if value is None else tuple(value.shape)}, the parameter {tuple(p.shape)}")
        if entry.get("max_exp_avg_sq") is not None:
            raise ValueError(f"parameter {key!r} has amsgrad state (max_exp_avg_sq), which elixir_ray does not support")


@torch.no_grad()
def load_optimizer_state_dict(optimizer: "ChunkedAdam", state_dict: dict) -> None:
    """Moments and step counts from a torch-format state dict (this rank keeps its part of each), and
    the groups' hyper-parameters, as torch's load_state_dict restores them."""
    optimizer.refuse_mid_update("load an optimizer state dict")
    _check(optimizer, state_dict)
    store = optimizer.store
    saved_ids = [q for g in state_dict["param_groups"] for q in g["params"]]
    key_of = {id(p): saved_ids[i] for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    with store.on_device():
        store.settle_all()
        for c in store.chunks:
            for s in c.slots:
                entry = state_dict["state"].get(key_of.get(id(s.param)))
                if entry is None and c.exp_avg is None:
                    s.step = 0
                    continue
                if c.exp_avg is None:
                    c.exp_avg, c.exp_avg_sq = torch.zeros_like(c.master), torch.zeros_like(c.master)
                lo, hi = own_part(c, s)
                if lo < hi:
                    for kind, target in (("exp_avg", c.exp_avg), ("exp_avg_sq", c.exp_avg_sq)):
                        # no state: zero moments, as torch starts a parameter's first step from
                        flat = (torch.zeros(s.numel) if entry is None else
                                torch.as_tensor(entry[kind]).detach().reshape(-1)).to("cpu", torch.float32)
                        write_part(c, target, s, lo, hi, flat[lo:hi])
                s.step = 0 if entry is None else int(torch.as_tensor(entry["step"]).item())
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})
