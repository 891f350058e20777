"""The run level: `elixir_ray.train(config)` from the driver's side.

`train.py` runs it: the config is resolved once (`resolved.py`) and checked before any worker starts
(`preflight.py`), the run claims its directories (`claim.py`), joins or starts Ray
(`embedded_ray.py`), and the cluster's controller trains; the metrics, the plan and the summary are
written by `outputs.py`. Nothing is imported here, so that one module can be imported alone.
"""
