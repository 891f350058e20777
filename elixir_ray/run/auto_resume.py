"""`--resume auto`: continue this run from its newest checkpoint when it has one, else start it.

A job resubmitted after its driver (or the head node) was lost runs the same command again: with
`--resume auto` it goes on from where the lost driver's run got to, and a first submission starts
afresh, so one command serves both.
"""

from __future__ import annotations

from typing import Optional

from elixir_ray.checkpoint import CheckpointError, list_checkpoints, read_manifest
from elixir_ray.config import RunConfig
from elixir_ray.run.outputs import shown

AUTO = "auto"  # the value of `resume` (and of --resume) that asks for this


def resolve_auto_resume(cfg: RunConfig) -> tuple[Optional[str], str]:
    """(what to resume from, or None to start afresh; the line that says which).

    This run's checkpoints are those in `checkpoint.uri` whose manifest names the run (`name`).
    When every readable checkpoint there is this run's, the directory itself is resumed from, so
    the restore falls back past a newest one whose files do not verify; where another run's share
    the directory (a shared `checkpoint.uri`), this run's newest is named alone."""
    uri = cfg.checkpoint_uri
    try:
        paths = list_checkpoints(uri)
    except (OSError, CheckpointError):  # an unreadable directory: nothing of this run's to continue
        paths = []
    own, others = [], 0
    for path in paths:
        try:
            manifest = read_manifest(path)
        except CheckpointError:  # unreadable: not a checkpoint to continue from
            continue
        if (manifest.get("config") or {}).get("name") == cfg.name:
            own.append((path, manifest.get("step")))
        else:
            others += 1
    if not own:
        return None, f"--resume auto: run {cfg.name!r} has no checkpoint in {shown(uri)}: starting afresh"
    path, step = own[-1]
    return (path if others else uri,
            f"--resume auto: continuing run {cfg.name!r} from its checkpoint of step {step} ({shown(path)})")
