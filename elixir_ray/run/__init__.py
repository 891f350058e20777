"""The run level: `elixir_ray.train(config)` from the driver's side, and what a run claims and writes."""
