"""The learning-rate schedule's length across a `--resume`.

The schedule (warm-up, then cosine decay) is `optim.schedule_steps` long, train.steps when unset,
and a checkpoint keeps the length its run had. A run resumed with a higher train.steps (continuing
a good run further) keeps the checkpoint's length unless optim.schedule_steps says otherwise: its
learning rate goes on from where it was instead of jumping up the reshaped curve. Either way the
user is told in one line what the learning rate does at the first resumed step.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Optional

from elixir_ray.checkpoint import CheckpointError, list_checkpoints, read_manifest
from elixir_ray.run.resolved import ResolvedRun


def saved_schedule_steps(manifest: dict) -> Optional[int]:
    """The schedule length a checkpoint's run had (older checkpoints: read from its config)."""
    if isinstance(manifest.get("schedule_steps"), int):
        return manifest["schedule_steps"]
    config = manifest.get("config") or {}
    optim, train = config.get("optim") or {}, config.get("train") or {}
    length = optim.get("schedule_steps") or train.get("steps")
    return length if isinstance(length, int) and length > 0 else None


def newest_manifest(uri: str) -> Optional[dict]:
    """The manifest of the newest checkpoint at `uri` (one, or a directory of them) that reads."""
    for path in reversed(list_checkpoints(uri) or [uri]):
        try:
            return read_manifest(path)
        except CheckpointError:
            continue
    return None


def keep_schedule(run: ResolvedRun, uri: str) -> ResolvedRun:
    """`run` resumed from `uri`, its schedule length the checkpoint's unless optim.schedule_steps
    sets one; a length that changes on the resume is warned about, with the learning rate's jump."""
    from elixir_ray.trainer import lr_at, schedule_steps

    manifest = newest_manifest(uri)
    theirs = saved_schedule_steps(manifest) if manifest else None
    if theirs is None:
        return run
    cfg, step = run.config, int(manifest.get("step", 0))
    as_saved = dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, schedule_steps=theirs))
    before = lr_at(step - 1, as_saved) if step > 0 else None
    if cfg.optim.schedule_steps is None:
        if theirs == cfg.train.steps:
            return run
        stretched = lr_at(step, dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim,
                                                                                   schedule_steps=cfg.train.steps)))
        warnings.warn(f"--resume: the learning-rate schedule keeps the checkpoint's length of {theirs} steps "
                      f"(train.steps is {cfg.train.steps}): the lr goes on from {_lr(before)} at step {step} to "
                      f"{_lr(lr_at(step, as_saved))} at step {step + 1}; set optim.schedule_steps="
                      f"{cfg.train.steps} to stretch it to this run instead (the lr would then be {_lr(stretched)} "
                      f"at step {step + 1})", stacklevel=3)
        return dataclasses.replace(run, config=as_saved)
    if schedule_steps(cfg) != theirs:
        warnings.warn(f"--resume: optim.schedule_steps={cfg.optim.schedule_steps} changes the learning-rate "
                      f"schedule's length from the checkpoint's {theirs} steps: the lr jumps from {_lr(before)} at "
                      f"step {step} to {_lr(lr_at(step, cfg))} at step {step + 1} (unset optim.schedule_steps to "
                      f"keep the checkpoint's schedule)", stacklevel=3)
    return run


def _lr(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3g}"
