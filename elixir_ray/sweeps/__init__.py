"""Sweeps: many runs of one config over a search space, as Ray Tune trials (`elixir_ray.sweep`).

`spec.py` checks what the user asks for (a SWEEP.yaml or `sweep(...)`'s arguments) and `space.py`
its search space; `packing.py` sizes a trial's placement group (and packs trials onto a GPU);
`trial.py` is the Tune trainable that runs one trial's controller in that placement group;
`schedulers.py` builds Tune's scheduler; `api.py` runs the sweep and `results.py` writes what it
leaves. Ray Tune is imported only when a sweep runs.
"""
