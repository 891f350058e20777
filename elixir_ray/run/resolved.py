"""The run's config resolved once: what the checks before the run, the controller and the outputs read.

Resolving a config reads files (the builtin dataset is built on its first use, a `model.hf` config
is parsed by transformers), and building its model, even on the meta device, takes seconds for a
large one: each is done here, once per run, rather than by every check that needs it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping, Optional, Union

from elixir_ray.config import RunConfig, config_from_dict, load_config, resolve_model_shape
from elixir_ray.data.dataset import resolve_data_uri
from elixir_ray.errors import ConfigError

if TYPE_CHECKING:
    import torch.nn as nn

    from elixir_ray.cluster.placement import WorkerShape  # the cluster package imports Ray


def as_config(config: Union[RunConfig, dict, str], overrides: Optional[list[str]] = None) -> RunConfig:
    if isinstance(config, RunConfig):
        return config_from_dict(config.to_dict(), overrides) if overrides else config
    if isinstance(config, dict):
        return config_from_dict(config, overrides)
    if isinstance(config, (str, os.PathLike)):
        return load_config(str(config), overrides)
    raise ConfigError(f"train() takes a RunConfig, a dict or a YAML path, got {type(config).__name__}")


@dataclass(frozen=True)
class MetaModel:
    """The configured model built on the meta device (no memory), and what the checks read of it."""

    module: nn.Module
    checkpoint_shapes: Mapping[str, tuple]  # the model tensors a checkpoint of this run holds
    parameters: int  # distinct parameters (tied weights once)


@dataclass(frozen=True)
class ResolvedRun:
    """One run's config with everything derived from it resolved: `config` holds the absolute data
    and eval paths (or `builtin`), so the workers read what the driver checked."""

    config: RunConfig
    model_shape: Mapping[str, int]  # resolve_model_shape(config.model)
    data_uri: str  # config.data.path: `builtin` resolved, a local path made absolute
    eval_uri: Optional[str]  # config.eval.path, a local path made absolute; None without evaluation
    worker_shape: Optional[WorkerShape] = None  # set by sized_for() once the run has its Ray cluster

    @functools.cached_property
    def meta_model(self) -> MetaModel:
        """Built on first use: only some checks need it (a `--resume`, a local checkpoint directory,
        a `model.hf` step to trace)."""
        from elixir_ray.model.factory import build_model, checkpoint_shapes_of

        module = build_model(self.config, device="meta")
        # read before any check traces a step of the module
        return MetaModel(module=module, checkpoint_shapes=MappingProxyType(checkpoint_shapes_of(module)),
                         parameters=sum(p.numel() for p in module.parameters()))

    def placed_in(self, placement) -> "ResolvedRun":
        """The run with its workers in bundles reserved elsewhere (a `GivenPlacement`: a Ray Tune
        trial's): one rank per bundle, on GPUs when the bundles hold a GPU (or a part of one), each
        with as many threads as its bundle has whole CPUs (at least one)."""
        from elixir_ray.cluster.placement import WorkerShape

        specs = [placement.placement_group.bundle_specs[i] for i in placement.bundle_indices]
        # each rank's threads are its bundle's CPUs: the bundles beside it (other trials') hold the rest
        return dataclasses.replace(self, worker_shape=WorkerShape(
            num_workers=len(specs), use_gpu=any(spec.get("GPU", 0) > 0 for spec in specs),
            cpus_per_worker=max(1, int(min(spec.get("CPU", 1) for spec in specs)))))

    def sized_for(self, resources: dict) -> "ResolvedRun":
        """The run with its workers sized against a Ray cluster's resources (`ray.cluster_resources()`)."""
        from elixir_ray.cluster.placement import resolve_worker_shape

        return dataclasses.replace(self, worker_shape=resolve_worker_shape(self.config, resources))


def resolve_run(cfg: RunConfig) -> ResolvedRun:
    """Resolve `cfg`'s data and eval paths and its model's shape. The files are opened by the checks
    (`preflight.check_data`), not here. `builtin` stays in the config: each worker builds the corpus
    on its own node (the driver's cache path is no path on another node), and the workers check
    that theirs is the driver's (`cluster.shared_storage`)."""
    uri = resolve_data_uri(cfg.data.path, cfg.data.cache_dir)
    if "://" not in uri:
        uri = os.path.abspath(uri)
    if cfg.data.path != "builtin":
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=uri))
    eval_uri = cfg.eval.path
    if eval_uri is not None:
        eval_uri = eval_uri if "://" in eval_uri else os.path.abspath(eval_uri)
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, path=eval_uri))
    return ResolvedRun(config=cfg, model_shape=MappingProxyType(resolve_model_shape(cfg.model)), data_uri=uri,
                       eval_uri=eval_uri)
