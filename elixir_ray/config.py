"""Run configuration: nested dataclasses loaded from YAML, with dotted `--set` overrides.

Every field is checked when the config is built, so a typo or a bad size fails with one line
naming the field and what is allowed, before Ray or any worker starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
import typing
import warnings
from importlib import resources
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

from elixir_ray.errors import ConfigError


@dataclass
class ModelConfig:
    """Which model to train: the built-in GPT (`size` picks a named shape; explicit fields override
    it), or a Hugging Face causal LM built from its config fields (`hf`)."""

    size: str = "tiny"
    d_model: Optional[int] = None
    n_layers: Optional[int] = None
    n_heads: Optional[int] = None
    vocab_size: Optional[int] = None
    seq_len: Optional[int] = None
    # every block: false (keep activations), "selective" (recompute the layer norms and the GELU; keep
    # what matmuls and attention take and make) or true / "full" (recompute the whole block)
    activation_checkpointing: typing.Union[bool, str] = False
    dropout: float = 0.0
    # a Hugging Face causal LM instead of the GPT: its transformers config fields (model_type first),
    # or the path of a config.json, read where the config is loaded; random initialisation, no download
    hf: typing.Union[dict, str, None] = None


@dataclass
class DataConfig:
    """Where tokens come from. `builtin` builds a corpus from this Python's standard library."""

    path: str = "builtin"
    cache_dir: Optional[str] = None  # where the builtin dataset is written; default ~/.cache/elixir_ray


@dataclass
class OptimConfig:
    lr: float = 1e-3
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1
    max_grad_norm: Optional[float] = 1.0
    # the learning-rate schedule's length in steps (warm-up, then cosine decay to its last step); None:
    # train.steps, or on --resume the length the checkpoint's run had, so that a continued run keeps it
    schedule_steps: Optional[int] = None


@dataclass
class TrainConfig:
    steps: int = 100
    micro_batch: int = 8  # sequences per worker per micro-step
    grad_accum: int = 1
    seed: int = 0
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    log_every: int = 10
    # a step whose loss is NaN or infinite ends the run there (no restart: it would repeat it)
    stop_on_nonfinite: bool = True


PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass
class ClusterConfig:
    num_workers: Optional[int] = None  # default: one per GPU, or 2 on a CPU-only cluster
    use_gpu: Optional[bool] = None  # default: use GPUs when the cluster has any
    # "auto": one CPU reserved per worker, and each rank's threads its share of its node's CPUs
    # (cluster/cpu_shares.py); a number: that many reserved per worker, and as many threads
    cpus_per_worker: typing.Union[int, str] = "auto"
    placement_strategy: str = "PACK"  # Ray's placement group strategy for the workers' bundles
    resources_per_worker: dict = field(default_factory=dict)  # custom Ray resources each worker's bundle asks for
    runtime_env: Optional[dict] = None  # the workers' Ray runtime_env (env_vars, pip, ...)
    # the fewest workers a run goes on with after losing some (None: all of num_workers, or 1 with
    # fault.elastic); it grows back to num_workers at a checkpoint when the resources return
    min_workers: Optional[int] = None
    namespace: str = "elixir_ray"
    placement_timeout_s: float = 60.0
    init_timeout_s: float = 120.0
    local_num_cpus: Optional[int] = None  # CPUs of the embedded cluster started when RAY_ADDRESS is unset


@dataclass
class EngineConfig:
    device_memory: Optional[str] = None  # e.g. "24GiB"; default: what the device has free
    search_checkpointing: bool = False  # let the planner choose activation checkpointing per block
    replicate: str = "auto"  # several workers: "auto" (searched), "all" chunks whole on every worker, "none"
    time_kernels: bool = True  # workers time the model's kernels for the plan (else compute from FLOPs)
    # fraction of the device budget the plan keeps back for the allocator; None: 0.1 on CUDA with the
    # allocator's expandable segments (the default), else 0.2 (engine/allocator.py)
    memory_margin: Optional[float] = None


CHECKPOINT_VIA = ("auto", "object_store", "storage")


@dataclass
class CheckpointConfig:
    uri: Optional[str] = None  # default: <output_dir>/<name>/checkpoints
    every_steps: int = 0  # 0: only the final checkpoint
    keep: int = 2
    # how a checkpoint leaves the workers: "object_store" (a snapshot there, persisted in the
    # background), "storage" (each worker writes its shard straight to `uri`), "auto" (the object
    # store unless the state is more than half of it)
    via: str = "auto"


@dataclass
class FaultConfig:
    max_restarts: int = 3
    detect_timeout_s: float = 60.0  # a rank silent this long (or a stalled collective) counts as failed
    wait_for_resources_s: float = 60.0  # how long a restart waits for the full set of workers
    elastic: bool = False  # with fewer workers available, re-plan for them instead of failing


@dataclass
class EvalConfig:
    path: Optional[str] = None  # a held-out token dataset (as data.path); None: no evaluation
    every_steps: int = 50  # evaluate every N steps and after the last (0: only after the last)
    # held-out windows per evaluation, shared out among the workers: the same windows every time,
    # whatever the worker count, micro-batch or seed, so that evaluations (and runs) compare
    windows: int = 64


@dataclass
class RunConfig:
    name: str = "run"
    output_dir: str = "runs"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)

    @property
    def run_dir(self) -> str:
        return os.path.join(self.output_dir, self.name)

    @property
    def checkpoint_uri(self) -> str:
        return self.checkpoint.uri or f"{self.run_dir}/checkpoints"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _is_dataclass_type(tp) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string", dict: "a mapping"}


def _coerce(path: str, value: Any, tp) -> Any:
    """Convert a YAML value to the field's type, or say which field is wrong and why."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Union:  # Optional[X], or a choice of types (the first that takes the value)
        inner = [a for a in args if a is not type(None)]
        if value is None and len(inner) < len(args):
            return None
        if len(inner) == 1:
            return _coerce(path, value, inner[0])
        for tp_ in inner:
            try:
                return _coerce(path, value, tp_)
            except ConfigError:
                pass
        raise ConfigError(f"{path}: expected {' or '.join(_TYPE_WORDS.get(t, t.__name__) for t in inner)}, "
                          f"got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if not isinstance(value, (int, float)):
            try:
                return float(value)  # YAML reads "1e-3" as a string
            except (TypeError, ValueError):
                raise ConfigError(f"{path}: expected a number, got {value!r}") from None
        return float(value)
    if tp is str:
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{path}: expected a string, got {value!r}")
        return str(value)
    if tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return dict(value)
    if tp is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return tuple(_coerce(f"{path}[{i}]", v, float) for i, v in enumerate(value))
    return value


def _build(cls, data: Any, prefix: str):
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix[:-1] or 'config'}: expected a mapping, got {data!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in names:
            raise ConfigError(f"unknown config key '{path}' (allowed under '{prefix[:-1] or 'top level'}': {', '.join(names)})")
        tp = hints[key]
        if _is_dataclass_type(tp):
            kwargs[key] = _build(tp, value, f"{path}.")
        else:
            kwargs[key] = _coerce(path, value, tp)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"--set {dotted}: '{part}' is not a section")
        node = child
    node[parts[-1]] = value


class DuplicateKeyError(ConfigError):
    """A YAML mapping gives one key twice: YAML's loaders keep the last value without a word."""

    def __init__(self, key, first_line: int, line: int):
        self.key, self.first_line, self.line = key, first_line, line
        where = f"line {line}" if line == first_line else f"lines {first_line} and {line}"
        super().__init__(f"the key {key!r} is given twice in one mapping ({where}): give it once")


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping giving one key twice (DuplicateKeyError, naming the key
    and both lines); a merge (`<<: *base`) may still be overridden by a key of the mapping itself."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise DuplicateKeyError(key, seen[key], line)
                    seen[key] = line
                except TypeError:  # an unhashable key: SafeLoader refuses it itself
                    continue
        return super().construct_mapping(node, deep=deep)


def parse_overrides(items: list[str]) -> dict:
    """Turn ['train.steps=50', ...] into a nested dict; values are read as YAML scalars."""
    if isinstance(items, (str, bytes)):  # one string would be read a character at a time
        raise ConfigError(f"overrides {items!r}: give a list of key=value strings, for example [{items!r}]")
    tree: dict = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key=value, for example train.steps=50")
        key, raw = item.split("=", 1)
        try:
            value = yaml.load(raw, Loader=UniqueKeyLoader) if raw.strip() else None
        except DuplicateKeyError as exc:
            raise ConfigError(f"--set {item!r}: the key {exc.key!r} is given twice: give it once") from None
        _set_dotted(tree, key.strip(), value)
    return tree


def config_keys_named(name: str) -> list[str]:
    """The dotted config keys whose last part is `name` (dashes read as underscores): what a user
    who typed `--steps` on the command line meant to --set."""
    name = name.replace("-", "_")

    def walk(cls, prefix: str):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if _is_dataclass_type(tp):
                yield from walk(tp, f"{prefix}{f.name}.")
            elif f.name == name:
                yield f"{prefix}{f.name}"
    return list(walk(RunConfig, ""))


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def config_from_dict(data: Optional[dict], overrides: Optional[list[str]] = None) -> RunConfig:
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"config: expected a mapping of sections (model:, train:, ...), got {data!r}")
    merged = _merge(_hf_file_read(data or {}), parse_overrides(overrides or []))
    cfg = _build(RunConfig, merged, "")
    if isinstance(cfg.model.hf, (str, dict)):  # a path given by --set, or a number YAML read (a folder's name)
        fields = _hf_file_read({"model": {"hf": cfg.model.hf}})["model"]["hf"]
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf=fields))
    validate(cfg)
    return cfg


def _hf_file_read(data: dict) -> dict:
    """`model.hf` given as a config.json path, read into its fields: before the overrides, so that
    `--set model.hf.num_hidden_layers=24` changes one field of the file's, and so that the workers
    get the fields, not a path they may not see. Numbers YAML read as strings (`1e-5`) become floats."""
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("hf"), (str, dict)):
        return data
    from elixir_ray.model.hf import numbers_read, read_hf_file

    hf = model["hf"]
    return {**data, "model": {**model, "hf": numbers_read(read_hf_file(hf) if isinstance(hf, str) else hf)}}


def shipped_file(folder: str, name: str, suffix: str) -> Optional[str]:
    """A file the package ships (configs/*.yaml, hardware/*.json), given by its bare name: an
    installed package has no jobs/ folder to point at. A name with a suffix or a folder is a path
    the user meant, and is never swapped for a shipped file."""
    if not name or "." in name or os.sep in name or (os.altsep and os.altsep in name):
        return None
    path = resources.files("elixir_ray") / folder / (name + suffix)
    if not path.is_file():
        return None
    # the user's own copy (edited, say) in the working directory is never silently swapped for the package's
    if os.path.exists(name + suffix) and not os.path.samefile(name + suffix, path):
        raise ConfigError(f"{name!r} names the {name + suffix} the package ships, and there is a {name + suffix} "
                          f"here too: give its path (./{name + suffix}) for yours")
    return str(path)


def shipped_names(folder: str, suffix: str) -> list[str]:
    return sorted(p.name[: -len(suffix)] for p in (resources.files("elixir_ray") / folder).iterdir()
                  if p.name.endswith(suffix))


def load_config(path: str, overrides: Optional[list[str]] = None) -> RunConfig:
    if not os.path.isfile(path):
        shipped = shipped_file("configs", path, ".yaml")  # a shipped name wins over a folder of that name here
        if shipped is None and os.path.isdir(path):
            raise ConfigError(f"config {path!r} is a directory: give a YAML file in it, or a config the package "
                              f"ships by name: {', '.join(shipped_names('configs', '.yaml'))}")
        if shipped is None:
            raise ConfigError(f"config file {path!r} does not exist (give a YAML file, or a config the package "
                              f"ships by name: {', '.join(shipped_names('configs', '.yaml'))})")
        path = shipped
    with open(path) as f:
        try:
            data = yaml.load(f, Loader=UniqueKeyLoader)
        except DuplicateKeyError as exc:
            raise ConfigError(f"config file {path!r}: {exc}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path!r} is not valid YAML: {exc}") from None
    if data is None:  # an empty file (or only comments): likely not the file meant
        warnings.warn(f"config file {path!r} is empty: every setting is its default", stacklevel=2)
    return config_from_dict(data, overrides)


_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _positive(path: str, value, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if value is None or value <= 0:
        raise ConfigError(f"{path} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite positive number, got {value!r}")


def _finite_at_least_zero(path: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):  # NaN compares false both ways: `value < 0` lets it by
        raise ConfigError(f"{path} must be a finite number >= 0, got {value!r}")


# The URI schemes pyarrow.fs.FileSystem.from_uri makes a filesystem for (besides its in-memory
# mock://, one process's own): where a path with another scheme is refused before any work starts.
URI_SCHEMES = ("file", "local", "s3", "gs", "gcs", "hdfs", "viewfs", "abfs", "abfss")
# The settings that name a file or directory through pyarrow.fs: a path, or a URI of URI_SCHEMES.
URI_FIELDS = ("data.path", "eval.path", "checkpoint.uri", "output_dir")


def _uri_fields(cfg: "RunConfig") -> list[tuple[str, str]]:
    """(field, value) of each URI_FIELDS setting that is set (data.path's `builtin` is no path)."""
    values = {"data.path": cfg.data.path, "eval.path": cfg.eval.path, "checkpoint.uri": cfg.checkpoint.uri,
              "output_dir": cfg.output_dir}
    return [(key, values[key]) for key in URI_FIELDS
            if values[key] is not None and not (key == "data.path" and values[key] == "builtin")]


def _check_uri_scheme(key: str, uri: str) -> None:
    if "://" not in uri:
        return
    scheme = uri.split("://", 1)[0].lower()
    if scheme not in URI_SCHEMES:
        raise ConfigError(f"{key} {uri!r}: pyarrow has no filesystem for the scheme {scheme + '://'!r} (give a local "
                          f"path, or a URI of {', '.join(s + '://' for s in URI_SCHEMES)})")


def check_storage(cfg: "RunConfig") -> None:
    """Make the filesystem of each URI setting (`s3://`, `gs://`, `hdfs://`...), as a run will: an
    object store without a network or credentials, hdfs:// without Java, or a malformed option is
    refused in one line naming the setting and pyarrow's cause. Contacts the store (an S3 bucket's
    region is looked up), so it is for the driver before the run starts, not for `validate`."""
    import pyarrow.fs as pafs

    for key, uri in _uri_fields(cfg):
        if "://" not in uri or uri.split("://", 1)[0].lower() in ("file", "local"):
            continue
        try:
            pafs.FileSystem.from_uri(uri)
        except Exception as exc:  # noqa: BLE001 - pyarrow's own errors, of several types
            cause = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise ConfigError(f"{key} {uri!r}: pyarrow cannot open its filesystem: {cause}") from None


def validate(cfg: RunConfig) -> None:
    """Range checks that need no cluster: sizes positive, names known, choices valid."""
    from elixir_ray.model.sizes import MODEL_SIZES

    if not cfg.name or "/" in cfg.name:
        raise ConfigError(f"name must be a non-empty string without '/', got {cfg.name!r}")
    m = cfg.model
    if m.size not in MODEL_SIZES:
        raise ConfigError(f"model.size {m.size!r} is unknown (allowed: {', '.join(MODEL_SIZES)})")
    for key in ("d_model", "n_layers", "n_heads", "vocab_size", "seq_len"):
        _positive(f"model.{key}", getattr(m, key), allow_none=True)
    from elixir_ray.model.gpt import checkpoint_mode

    try:
        checkpoint_mode(m.activation_checkpointing)
    except ValueError:
        raise ConfigError(f"model.activation_checkpointing must be true, false, selective, none or full, "
                          f"got {m.activation_checkpointing!r}") from None
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout must be in [0, 1), got {m.dropout}")
    if m.hf is not None:
        _validate_hf(m)
    else:
        shape = resolve_model_shape(m)
        if shape["d_model"] % shape["n_heads"]:
            raise ConfigError(
                f"model.d_model ({shape['d_model']}) must be divisible by model.n_heads ({shape['n_heads']})"
            )
    t = cfg.train
    for key in ("steps", "micro_batch", "grad_accum", "log_every"):
        _positive(f"train.{key}", getattr(t, key))
    if not 0 <= t.seed < 2**63:  # non-negative for numpy's data order; each rank's generator takes seed + 1 + rank
        raise ConfigError(f"train.seed must be a whole number from 0 to 2**63 - 1, got {t.seed}")
    if t.dtype not in _DTYPES:
        raise ConfigError(f"train.dtype {t.dtype!r} is unknown (allowed: {', '.join(_DTYPES)})")
    if t.dtype == "float16" and m.hf is not None:  # loss scaling needs the model to return the loss
        raise ConfigError("train.dtype float16 is for the built-in GPT (its loss is scaled inside the model); with "
                          "model.hf use bfloat16 (or auto: bfloat16 on GPUs) or float32")
    if cfg.eval.every_steps < 0:
        raise ConfigError(f"eval.every_steps must be >= 0 (0 evaluates only after the last step), "
                          f"got {cfg.eval.every_steps}")
    _positive("eval.windows", cfg.eval.windows)
    o = cfg.optim
    _positive("optim.lr", o.lr)
    _positive("optim.eps", o.eps)
    _positive("optim.max_grad_norm", o.max_grad_norm, allow_none=True)
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        raise ConfigError(f"optim.betas must be two numbers in [0, 1), got {list(o.betas)}")
    if o.weight_decay < 0:
        raise ConfigError(f"optim.weight_decay must be >= 0, got {o.weight_decay}")
    _finite_at_least_zero("optim.weight_decay", o.weight_decay)
    if o.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps must be >= 0, got {o.warmup_steps}")
    if not 0.0 <= o.min_lr_ratio <= 1.0:
        raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {o.min_lr_ratio}")
    _positive("optim.schedule_steps", o.schedule_steps, allow_none=True)
    c = cfg.cluster
    _positive("cluster.num_workers", c.num_workers, allow_none=True)
    if c.cpus_per_worker != "auto":
        if isinstance(c.cpus_per_worker, str):
            raise ConfigError(f"cluster.cpus_per_worker must be auto or a whole number of CPUs, got {c.cpus_per_worker!r}")
        _positive("cluster.cpus_per_worker", c.cpus_per_worker)
    if c.placement_strategy not in PLACEMENT_STRATEGIES:
        raise ConfigError(f"cluster.placement_strategy must be {', '.join(PLACEMENT_STRATEGIES[:-1])} or "
                          f"{PLACEMENT_STRATEGIES[-1]}, got {c.placement_strategy!r}")
    for name, amount in c.resources_per_worker.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory") or not isinstance(name, str):
            raise ConfigError(f"cluster.resources_per_worker names custom Ray resources; {name!r} is set by "
                              f"cluster.cpus_per_worker, cluster.use_gpu or Ray itself")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not 0 < amount < math.inf:
            raise ConfigError(f"cluster.resources_per_worker.{name} must be a positive amount, got {amount!r}")
    _positive("cluster.min_workers", c.min_workers, allow_none=True)
    if c.min_workers is not None and c.num_workers is not None and c.min_workers > c.num_workers:
        raise ConfigError(f"cluster.min_workers={c.min_workers} is above cluster.num_workers={c.num_workers}, the "
                          f"most a run has: lower it")
    _positive("cluster.placement_timeout_s", c.placement_timeout_s)
    _positive("cluster.init_timeout_s", c.init_timeout_s)
    _positive("cluster.local_num_cpus", c.local_num_cpus, allow_none=True)
    if cfg.engine.device_memory is not None:
        from elixir_ray.units import parse_bytes

        try:
            _positive("engine.device_memory", parse_bytes(cfg.engine.device_memory))
        except ValueError as exc:
            raise ConfigError(f"engine.device_memory: {exc}") from None
    margin = cfg.engine.memory_margin
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1):
        raise ConfigError(f"engine.memory_margin must be a fraction in [0, 1) of the device budget kept back for "
                          f"the allocator's fragmentation, got {margin!r} (default: 0.1 on CUDA, 0.2 on the CPU)")
    if cfg.engine.replicate not in ("auto", "all", "none"):
        raise ConfigError(f"engine.replicate must be auto, all or none, got {cfg.engine.replicate!r}")
    ck = cfg.checkpoint
    if ck.every_steps < 0:
        raise ConfigError(f"checkpoint.every_steps must be >= 0 (0 saves only at the end), got {ck.every_steps}")
    _positive("checkpoint.keep", ck.keep)
    if ck.via not in CHECKPOINT_VIA:
        raise ConfigError(f"checkpoint.via must be {', '.join(CHECKPOINT_VIA[:-1])} or {CHECKPOINT_VIA[-1]}, "
                          f"got {ck.via!r}")
    f = cfg.fault
    if f.max_restarts < 0:
        raise ConfigError(f"fault.max_restarts must be >= 0, got {f.max_restarts}")
    _positive("fault.detect_timeout_s", f.detect_timeout_s)
    if f.wait_for_resources_s < 0:
        raise ConfigError(f"fault.wait_for_resources_s must be >= 0, got {f.wait_for_resources_s}")
    _finite_at_least_zero("fault.wait_for_resources_s", f.wait_for_resources_s)
    for key, uri in _uri_fields(cfg):
        _check_uri_scheme(key, uri)


def _validate_hf(m: ModelConfig) -> None:
    """`model.hf` replaces the GPT's shape fields; the model's own config says what they would."""
    from elixir_ray.model.gpt import checkpoint_mode
    from elixir_ray.model.hf import check_hf

    for key in ("d_model", "n_layers", "n_heads", "vocab_size"):
        if getattr(m, key) is not None:
            raise ConfigError(f"model.{key} shapes the built-in GPT; with model.hf, set the model's own field "
                              f"in model.hf instead (for example model.hf.hidden_size)")
    if m.dropout:
        raise ConfigError("model.dropout is the built-in GPT's; with model.hf, set the model's own dropout fields "
                          "in model.hf (for example model.hf.attention_dropout)")
    mode = checkpoint_mode(m.activation_checkpointing)
    if mode == "selective":
        raise ConfigError("model.activation_checkpointing: selective is the built-in GPT's; with model.hf it is "
                          "true (the model's own gradient checkpointing) or false")
    check_hf(m.hf, resolve_model_shape(m)["seq_len"], mode == "full")


def resolve_model_shape(m: ModelConfig) -> dict:
    """The named size with any explicit fields laid over it. With `model.hf`, only `vocab_size` (the
    model's) and `seq_len` (the window length: `model.seq_len`, else the named size's)."""
    from elixir_ray.model.sizes import MODEL_SIZES

    if m.hf is not None:
        from elixir_ray.model.hf import hf_vocab_size

        return {"vocab_size": hf_vocab_size(m.hf), "seq_len": m.seq_len or MODEL_SIZES[m.size]["seq_len"]}
    shape = dict(MODEL_SIZES[m.size])
    for key in ("d_model", "n_layers", "n_heads", "vocab_size", "seq_len"):
        value = getattr(m, key)
        if value is not None:
            shape[key] = value
    return shape
