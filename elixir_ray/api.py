"""`elixir_ray.train(config) -> Result`: the whole run from the driver's side.

Everything that can be checked without workers (config, dataset, cluster size) is checked here
first, so bad input fails in a second with one line instead of after actors have started.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Optional, Union

import pyarrow as pa

from elixir_ray import storage
from elixir_ray.checkpoint import CheckpointError, check_compatible, list_checkpoints, read_manifest
from elixir_ray.checkpoint.store import STATE_BYTES_PER_PARAM, checkpoint_path_hint
from elixir_ray.config import RunConfig, config_from_dict, load_config, resolve_model_shape
from elixir_ray.data.dataset import (BatchSampler, TokenDataset, checkpoint_tokenizer_identity, count_tokens,
                                     data_tokenizer, resolve_data_uri, tokenizer_named, windows_in)
from elixir_ray.errors import ClusterError, ConfigError, nothing_left_to_train
from elixir_ray.metrics import metrics_table, read_metrics, write_metrics
from elixir_ray.model.factory import check_model_step
from elixir_ray.run.claim import claim_outputs
from elixir_ray.run_plan import RunPlan
from elixir_ray.progress import ProgressBar
from elixir_ray.units import format_bytes

log = logging.getLogger("elixir_ray")


@dataclass
class Result:
    metrics: pa.Table
    checkpoint_uri: Optional[str]  # the newest committed checkpoint; None if none could be written
    plan: RunPlan
    run_dir: str
    metrics_uri: str
    seconds: float
    restarts: list = dataclasses.field(default_factory=list)  # RestartRecord per recovery
    persist_errors: list = dataclasses.field(default_factory=list)
    snapshot_stalls: list = dataclasses.field(default_factory=list)
    checkpoint_via: str = ""  # "object_store" or "storage" (checkpoint.via, resolved)
    final_step: int = 0  # the last step trained
    checkpoint_step: Optional[int] = None  # the step checkpoint_uri holds
    start_step: int = 0  # the --resume checkpoint's step (the metrics hold the steps before it too)
    config: Optional[RunConfig] = None  # the config the run used, overrides applied (what a sweep compares)

    @property
    def final_loss(self) -> Optional[float]:
        """The training loss of the last step (None when no step ran)."""
        losses = self.metrics.column("loss").to_pylist() if self.metrics.num_rows else []
        return losses[-1] if losses else None

    @property
    def final_eval_loss(self) -> Optional[float]:
        """The held-out loss of the last evaluation (None without `eval.path`)."""
        if "eval_loss" not in self.metrics.column_names:
            return None
        values = [v for v in self.metrics.column("eval_loss").to_pylist() if v is not None]
        return values[-1] if values else None

    @property
    def final_checkpoint_written(self) -> bool:
        """Whether the state after the last step was persisted (a failed write leaves an older one)."""
        return self.checkpoint_uri is not None and self.checkpoint_step == self.final_step

    def summary(self) -> str:
        losses = self.metrics.column("loss").to_pylist()
        steps = self.final_step - self.start_step
        resumed = f", resumed from step {self.start_step}" if self.start_step else ""
        return "\n".join([
            f"run finished: {steps} steps in {self.seconds:.1f}s on {self.plan.world_size} worker(s) "
            f"({self.plan.strategy}, {self.plan.dtype}{resumed})",
            f"loss: first {losses[0]:.4f} -> last {losses[-1]:.4f}" if losses else "loss: no steps",
            *_eval_line(self.metrics),
            *_step_time_line(self.metrics, getattr(self.plan, "predicted_step_seconds", 0.0), self.start_step,
                             _plan_device(self.plan)),
            *(f"restart: {r.reason}; " + (f"restored step {r.restored_step} from {r.restored_from} on "
                                          f"{r.world_size} worker(s)" if r.restored_from
                                          else "failed again before its restore") for r in self.restarts),
            *(f"warning: {e}" for e in self.persist_errors),
            f"metrics:    {_shown(self.metrics_uri)}",
            f"checkpoint: {_checkpoint_line(self)}",
            f"plan:       {_shown(os.path.join(self.run_dir, 'plan.json'))}",
        ])


def _shown(uri: str) -> str:
    """A local path in full (a job's working directory is not where it was submitted from)."""
    return uri if "://" in uri else os.path.abspath(uri)


def _checkpoint_line(result: Result) -> str:
    via = {"storage": " (written by the workers)", "object_store": ""}.get(result.checkpoint_via, "")
    if result.checkpoint_uri is None:
        return "none written" + (" (see the warnings above)" if result.persist_errors else "")
    if not result.final_checkpoint_written:
        return (f"{_shown(result.checkpoint_uri)} is step {result.checkpoint_step}, NOT the final step "
                f"{result.final_step}: its checkpoint could not be written (see the warnings above)")
    return f"{_shown(result.checkpoint_uri)}{via}"


def as_config(config: Union[RunConfig, dict, str], overrides: Optional[list[str]] = None) -> RunConfig:
    if isinstance(config, RunConfig):
        return config_from_dict(config.to_dict(), overrides) if overrides else config
    if isinstance(config, dict):
        return config_from_dict(config, overrides)
    if isinstance(config, (str, os.PathLike)):
        return load_config(str(config), overrides)
    raise ConfigError(f"train() takes a RunConfig, a dict or a YAML path, got {type(config).__name__}")


def _plan_device(plan) -> str:
    """The device type the run's engine plan was made for ("cpu", "cuda"), or "" when unknown."""
    engine = getattr(plan, "engine", None) or {}
    return str((engine.get("hardware") or {}).get("device", "")).split(":")[0]


def _step_time_line(metrics, predicted: float, start_step: int = 0, device: str = "") -> list[str]:
    """The run's step time beside its plan's prediction: whether the automatic plan held on this
    machine (the rates it was searched with are a short profile's). This run's steps only (a
    resumed run's metrics hold the steps before it too, with another plan), and the first, which
    also builds and warms up, left out where there are others; a median, so that the first steps
    after a restart do not move it much."""
    if not metrics.num_rows or "step_seconds" not in metrics.column_names:
        return []
    steps, times = metrics.column("step").to_pylist(), metrics.column("step_seconds").to_pylist()
    seconds = [t for step, t in zip(steps, times) if step > start_step and t]
    if not seconds:
        return []
    steady = seconds[1:] if len(seconds) > 1 else seconds
    median = statistics.median(steady)
    line = (f"step time: median {median:.3f}s over {len(steady)} step(s)"
            + (" after the first" if len(seconds) > 1 else ""))
    if predicted and predicted > 0:
        line += f"; the plan predicted {predicted:.3f}s (measured {median / predicted:.2f}x)"
        if device == "cpu" and median > 1.3 * predicted:
            line += (" (on a CPU the model leaves out the engine's per-chunk Python work, much of a small "
                     "model's step: docs/planner.md, \"Limits, honestly\")")
    return [line]


def _eval_line(metrics) -> list[str]:
    """The held-out loss at the first and last evaluation, if the run evaluated."""
    if "eval_loss" not in metrics.column_names:
        return []
    rows = [(s, v) for s, v in zip(metrics.column("step").to_pylist(), metrics.column("eval_loss").to_pylist())
            if v is not None]
    if not rows:
        return []
    (s0, v0), (s1, v1) = rows[0], rows[-1]
    if len(rows) == 1:
        return [f"eval loss: step {s0} {v0:.4f}"]
    return [f"eval loss: step {s0} {v0:.4f} -> step {s1} {v1:.4f} ({len(rows)} evaluations)"]


def _show_step(bar: ProgressBar, m: dict) -> None:
    bar.update(m["step"], m["loss"], m["tokens_per_s"])
    if m.get("eval_loss") is not None:
        bar.note(f"step {m['step']}: eval loss {m['eval_loss']:.4f}")


def check_data(cfg: RunConfig) -> RunConfig:
    """Resolve and open the dataset on the driver; returns the config with an absolute data path."""
    uri = resolve_data_uri(cfg.data.path, cfg.data.cache_dir)
    if "://" not in uri:
        uri = os.path.abspath(uri)
    dataset = TokenDataset(uri)
    shape = resolve_model_shape(cfg.model)
    vocab_key = "model.hf.vocab_size" if cfg.model.hf is not None else "model.vocab_size"
    if dataset.vocab_size > shape["vocab_size"]:
        raise ConfigError(f"{vocab_key}={shape['vocab_size']} is smaller than the dataset's vocabulary "
                          f"({dataset.vocab_size}): use at least {dataset.vocab_size}")
    BatchSampler(dataset, shape["seq_len"], cfg.train.seed)  # raises when no full window fits
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, path=uri))
    if cfg.eval.path is not None:
        eval_uri = cfg.eval.path if "://" in cfg.eval.path else os.path.abspath(cfg.eval.path)
        held_out = TokenDataset(eval_uri, what="eval.path")
        if held_out.vocab_size > shape["vocab_size"]:
            raise ConfigError(f"{vocab_key}={shape['vocab_size']} is smaller than eval.path's vocabulary "
                              f"({held_out.vocab_size}): use at least {held_out.vocab_size}")
        if held_out.tokenizer != dataset.tokenizer:
            raise ConfigError(f"eval.path {eval_uri!r} was tokenised with "
                              f"{tokenizer_named(held_out.tokenizer, held_out.tokenizer_file)} and data.path with "
                              f"{tokenizer_named(dataset.tokenizer, dataset.tokenizer_file)}: the held-out loss would "
                              f"mean nothing. Prepare both with the same --tokenizer (and --eos-token)")
        n = BatchSampler(held_out, shape["seq_len"], cfg.train.seed).n_windows
        if n < cfg.eval.windows:
            warnings.warn(f"eval.path {eval_uri!r} holds {n} window(s) of {shape['seq_len'] + 1} tokens, fewer than "
                          f"eval.windows={cfg.eval.windows}: each evaluation repeats some (set eval.windows={n}, or "
                          f"give more held-out text)", stacklevel=3)
        if eval_uri == uri:
            warnings.warn(f"eval.path is data.path ({uri!r}): the 'held-out' loss is measured on training data",
                          stacklevel=3)
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, path=eval_uri))
    return cfg


def warn_if_data_under_one_batch(cfg: RunConfig, num_workers: int) -> None:
    """A dataset with fewer windows than one global batch trains, but every step repeats windows
    inside its own batch: say so, with the sizes, rather than let it pass for a real run."""
    seq_len = resolve_model_shape(cfg.model)["seq_len"]
    windows = windows_in(count_tokens(cfg.data.path), seq_len)
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * num_workers
    if windows < global_batch:
        warnings.warn(
            f"data.path {cfg.data.path!r} holds {windows} window(s) of {seq_len + 1} tokens, fewer than one global "
            f"batch of {global_batch} (train.micro_batch={cfg.train.micro_batch} x train.grad_accum="
            f"{cfg.train.grad_accum} x {num_workers} worker(s)): every step repeats windows within its batch. "
            f"Give more text, or a smaller micro-batch or seq_len", stacklevel=3)


def verifies(path: str) -> bool:
    """Whether a checkpoint's files all match their checksums (streamed, nothing kept)."""
    from elixir_ray.checkpoint.shards import verify_files

    try:
        fs, root = storage.resolve(path)
        return verify_files(fs, root, read_manifest(path)["files"]) is None
    except (CheckpointError, OSError):
        return False


def check_resume(cfg: RunConfig, uri: str) -> None:
    """Refuse a checkpoint of another model, or one with nothing left to train, before any worker starts.

    The restore takes the newest checkpoint that verifies and falls back past a damaged one, so this
    checks the newest one whose manifest reads (warning about the newer ones skipped) and refuses only
    when none reads. Only manifests are read here; the files' checksums are verified by the restore.
    """
    from elixir_ray.model.factory import expected_checkpoint_shapes

    candidates = list_checkpoints(uri) or [uri]
    newest, skipped = None, []
    newest_path = None
    for path in reversed(candidates):
        try:
            newest, newest_path = read_manifest(path), path
            break
        except CheckpointError as exc:
            skipped.append(exc)
    if newest is None:
        hint = checkpoint_path_hint(uri)
        raise ConfigError(f"--resume {uri!r}{hint}" if hint else f"--resume {uri!r}: {skipped[0]}") from None
    for exc in skipped:
        warnings.warn(f"--resume {uri!r}: skipping checkpoint: {exc}; checking the previous one", stacklevel=2)
    try:
        check_compatible(newest, expected_checkpoint_shapes(cfg))
    except CheckpointError as exc:
        raise ConfigError(f"--resume {uri!r}: {exc}") from None
    theirs = checkpoint_tokenizer_identity(newest)
    if theirs != (ours := data_tokenizer(cfg.data.path))["tokenizer"]:
        named = tokenizer_named(theirs, newest.get("tokenizer_file"))
        how = ("without --tokenizer" if theirs == "bytes" else
               f"with --tokenizer naming {newest.get('tokenizer_file') or 'that tokenizer.json'}")
        raise ConfigError(f"--resume {uri!r}: the checkpoint's model was trained on tokens of {named} and data.path "
                          f"holds tokens of {ours['tokenizer_file']}: its embeddings would be read as another "
                          f"vocabulary's. Prepare data.path with the checkpoint's tokenizer (elixir-ray prepare-data "
                          f"{how})")
    changed = model_fields_changed((newest.get("config") or {}).get("model"), cfg)
    if changed:
        warnings.warn(f"--resume {uri!r}: the checkpoint's model had {', '.join(changed)}: every tensor has the "
                      f"shape this run's model expects, so it loads, but its weights are then read as another "
                      f"model's; set the checkpoint's values to continue it", stacklevel=2)
    # "nothing left to train": the restore takes the newest that verifies, so the newest is refused
    # here when its files do verify (read through once, only in that case); a corrupt file can move
    # the restore back to any of them, so otherwise refuse only when even the oldest leaves no step
    if int(newest.get("step", 0)) >= cfg.train.steps and verifies(newest_path):
        raise ConfigError(nothing_left_to_train(uri, int(newest["step"]), cfg.train.steps))
    oldest = newest
    for path in candidates:
        try:
            oldest = read_manifest(path)
            break
        except CheckpointError:
            continue
    step = int(oldest.get("step", 0))
    if step >= cfg.train.steps:
        raise ConfigError(nothing_left_to_train(uri, step, cfg.train.steps))


def model_fields_changed(theirs: Optional[dict], cfg: RunConfig) -> list[str]:
    """The model fields a checkpoint's run set otherwise than this run, that leave every tensor's
    shape as it is (the attention heads of the GPT; any of a Hugging Face model's fields but its
    name): `their=value (this run: value)` each. The window length and checkpointing may change."""
    if not isinstance(theirs, dict):
        return []
    mine = cfg.model
    if isinstance(theirs.get("hf"), dict) and isinstance(mine.hf, dict):
        ours, others = mine.hf, theirs["hf"]
        keys = sorted((set(ours) | set(others)) - {"_name_or_path"})
        return [f"model.hf.{k}={others.get(k)!r} (this run: {ours.get(k)!r})" for k in keys
                if others.get(k) != ours.get(k)]
    if theirs.get("hf") is not None or mine.hf is not None:
        return []  # the shapes differ; check_compatible says so
    try:
        other_shape = resolve_model_shape(config_from_dict({"model": theirs}).model)
    except (ConfigError, TypeError, KeyError, ValueError):
        return []  # a config this version cannot read: the shapes were compared already
    shape = resolve_model_shape(mine)
    return [f"model.{k}={other_shape[k]} (this run: {shape[k]})" for k in sorted(shape)
            if k != "seq_len" and other_shape.get(k) != shape[k]]


def _writable_local_dir(uri: str, key: str) -> Optional[str]:
    return storage.writable_local_dir(uri, f"{key} {uri!r}", f"point {key} at a directory you can write (it is "
                                                             f"made if missing)")


# Where Ray unpacks a job's `--working-dir` upload: a `ray job submit` entrypoint runs in that copy.
RAY_WORKING_DIR_COPY = f"{os.sep}runtime_resources{os.sep}working_dir_files{os.sep}"


def check_output_dir(cfg: RunConfig) -> None:
    """The run directory gets the metrics and the plan (and the checkpoints, unless checkpoint.uri
    sends them elsewhere): a run that could not write it would train to the end and then fail. A
    relative path under `ray job submit` lands in Ray's copy of the working directory, which goes
    with the cluster: the job succeeds and its outputs are lost, so that is warned about."""
    _writable_local_dir(cfg.run_dir, "output_dir")
    in_copy = [f"{key} ({os.path.abspath(uri)})" for key, uri in (("output_dir", cfg.run_dir),
                                                                    ("checkpoint.uri", cfg.checkpoint_uri))
               if "://" not in uri and RAY_WORKING_DIR_COPY in os.path.abspath(uri) + os.sep]
    if in_copy:
        warnings.warn(f"{' and '.join(in_copy)}: inside Ray's copy of the job's working directory, which is deleted "
                      f"with the cluster, so the run's outputs would be lost: give an absolute path on lasting "
                      f"storage or a URI (--set output_dir=/data/runs, s3://...)", stacklevel=3)


def warn_of_earlier_checkpoints(cfg: RunConfig) -> None:
    """A new run (no --resume) whose checkpoint directory already holds an earlier run's checkpoints
    writes its own beside them, and a directory given to --resume, export or sample takes the
    highest step there, whichever run wrote it: a user who meant to start afresh under the same name
    would read the old run's weights back without a word, so say it."""
    try:
        earlier = list_checkpoints(cfg.checkpoint_uri)
    except (OSError, CheckpointError):  # an unreadable directory: the run's own writes say what is wrong
        return
    if not earlier:
        return
    newest = os.path.basename(earlier[-1].rstrip("/"))
    warnings.warn(f"{_shown(cfg.checkpoint_uri)} already holds {len(earlier)} checkpoint(s) of an earlier run "
                  f"(the newest: {newest}): this run starts afresh and writes its own beside them (one of the "
                  f"same step replaced), and --resume, export or sample given that directory take the highest step "
                  f"there, whichever run wrote it. "
                  f"To continue the earlier run, pass --resume {earlier[-1]}; to keep the two apart, give this run "
                  f"another name (--set name=...)", stacklevel=3)


def check_checkpoint_space(cfg: RunConfig) -> None:
    """A checkpoint that cannot be written where it goes would lose the run's weights at its end:
    refuse a local `checkpoint.uri` under a file or in a directory that cannot be written, or whose
    filesystem has less free space than one checkpoint of this model, and warn when it cannot hold
    the `checkpoint.keep` + 1 that are on disk at once while the newest is written (an object store
    URI is not checked)."""
    import shutil

    from elixir_ray.model.factory import build_model

    uri = cfg.checkpoint_uri
    path = _writable_local_dir(uri, "checkpoint.uri")
    if path is None:
        return
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return  # the checkpoint's own write will say what is wrong with the path
    params = sum(p.numel() for p in build_model(cfg, device="meta").parameters())
    need = STATE_BYTES_PER_PARAM * params
    if free < need:
        raise ConfigError(
            f"checkpoint.uri {uri!r}: one checkpoint of this model takes at least {format_bytes(need)} "
            f"({params / 1e6:,.1f}M parameters x {STATE_BYTES_PER_PARAM} bytes: weights and AdamW moments), "
            f"but {path} has {format_bytes(free)} free: point checkpoint.uri at larger storage (another disk, "
            f"s3://...)")
    room = int(free // need)
    if room < cfg.checkpoint.keep + 1 and cfg.checkpoint.every_steps > 0:
        fix = f"set checkpoint.keep={room - 1}" if room >= 2 else "set checkpoint.every_steps=0 (only the final one)"
        warnings.warn(
            f"checkpoint.uri {uri!r}: {path} has {format_bytes(free)} free, room for {room} checkpoint(s) of "
            f"{format_bytes(need)}, but with checkpoint.keep={cfg.checkpoint.keep} there are up to "
            f"{cfg.checkpoint.keep + 1} at once (the newest is written before the oldest is pruned): later "
            f"checkpoints will fail to write ({fix}, or free space)", stacklevel=3)


REACH_TIMEOUT_S = 10.0


def _check_reachable(address: str, hint: str) -> None:
    """A host:port that nothing answers at fails here in seconds: Ray itself retries for minutes."""
    import socket

    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # "auto", ray:// and the rest: Ray's own message says what is wrong
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT_S).close()
    except OSError as exc:
        raise ClusterError(f"cannot join the Ray cluster at RAY_ADDRESS={address!r}: nothing answers there "
                           f"({exc.strerror or type(exc).__name__}; {hint})") from None


class RayStartedByTrain:
    """The Ray connection `train()` started in this process, shared by every run in it: runs started
    from threads (a sweep's) join it, and only the last to end shuts it down. Without the count the
    first run to end shut Ray down under the others (their workers vanished mid-run), and two
    starting at once raced in ray.init. Process-wide by nature, as Ray's own connection is."""

    def __init__(self):
        self.lock = threading.Lock()
        self.runs = 0  # runs using the connection train() started; 0 when it started none
        self.keeper_done: Optional[threading.Event] = None  # ends the thread that started Ray

    def join(self, cfg: RunConfig) -> bool:
        """Connect (or join this process's connection); True if this run must `leave()` at its end."""
        with self.lock:
            if threading.current_thread() is threading.main_thread():
                started = _ensure_ray(cfg)
            else:
                started = self._start_in_a_keeper_thread(cfg)
            if started or self.runs:
                self.runs += 1
                return True
            return False

    def _start_in_a_keeper_thread(self, cfg: RunConfig) -> bool:
        """A local cluster's processes are killed when the thread that started them ends (Ray sets
        the parent-death signal, which follows the starting thread, not the process): started from
        a sweep's thread, it died with the first run to finish. So a thread of its own starts it and
        lives until the last run leaves."""
        ready, done, outcome = threading.Event(), threading.Event(), {}

        def keep() -> None:
            try:
                outcome["started"] = _ensure_ray(cfg)
            except BaseException as exc:  # raised in the run's thread below
                outcome["error"] = exc
            ready.set()
            if outcome.get("started"):
                done.wait()

        threading.Thread(target=keep, name="elixir-ray-keeper", daemon=True).start()
        ready.wait()
        if "error" in outcome:
            raise outcome["error"]
        if outcome["started"]:
            self.keeper_done = done
        return outcome["started"]

    def leave(self) -> None:
        import ray

        with self.lock:
            self.runs -= 1
            if self.runs == 0:
                ray.shutdown()
                if self.keeper_done is not None:
                    self.keeper_done.set()
                    self.keeper_done = None


RAY_STARTED_BY_TRAIN = RayStartedByTrain()


def _ensure_ray(cfg: RunConfig) -> bool:
    """Connect to RAY_ADDRESS when set; otherwise start an embedded local cluster. True if started here.

    `address="local"` always starts a new cluster: a bare `ray.init()` would join a cluster that
    `ray start` left on this machine instead (and refuse the `num_cpus` given here).
    """
    import ray

    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        address = os.environ["RAY_ADDRESS"]
        hint = "give the head's GCS address, host:6379, or unset RAY_ADDRESS for a local cluster"
        _check_reachable(address, hint)
        try:
            ray.init(namespace=cfg.cluster.namespace)
        except (ValueError, ConnectionError) as exc:  # a bad or unreachable address: one line, not a traceback
            text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise ClusterError(f"cannot join the Ray cluster at RAY_ADDRESS={address!r}: {text[:600]} "
                               f"({hint})") from None
    else:
        ray.init(address="local", num_cpus=_local_cpus(cfg), include_dashboard=False, namespace=cfg.cluster.namespace)
    return True


def _local_cpus(cfg: RunConfig) -> int:
    """The CPUs of the local cluster `train()` starts when RAY_ADDRESS is unset."""
    return cfg.cluster.local_num_cpus or max(2, os.cpu_count() or 2)


def check_local_cluster_shape(cfg: RunConfig) -> None:
    """Where `train()` will start a local cluster, the workers the config asks for are checked
    against what it will have before it starts (a dozen seconds), as a joined cluster's are
    once joined."""
    import ray
    import torch

    from elixir_ray.cluster.placement import resolve_worker_shape

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return
    cpus, gpus = _local_cpus(cfg), torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        resolve_worker_shape(cfg, {"CPU": cpus, "GPU": gpus})
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the local cluster a run starts where RAY_ADDRESS is unset: {cpus} CPUs, "
                          f"cluster.local_num_cpus sets how many; {gpus} GPU(s))") from None


def train(config: Union[RunConfig, dict, str], overrides: Optional[list[str]] = None,
          progress: bool = True, resume: Optional[str] = None) -> Result:
    """Run training on Ray; `resume` names a checkpoint (or a directory of them) to continue from."""
    cfg = check_data(as_config(config, overrides))
    check_model_step(cfg)
    if resume is not None:
        check_resume(cfg, resume)
    check_output_dir(cfg)
    check_checkpoint_space(cfg)
    check_local_cluster_shape(cfg)
    claim = claim_outputs(cfg)
    if resume is None:
        warn_of_earlier_checkpoints(cfg)
    try:
        return _train_claimed(cfg, progress, resume)
    finally:
        claim.release()


def _train_claimed(cfg: RunConfig, progress: bool, resume: Optional[str]) -> Result:
    import ray

    from elixir_ray.cluster.controller import RestoreSource, TrainController
    from elixir_ray.cluster.placement import resolve_worker_shape

    started_here = RAY_STARTED_BY_TRAIN.join(cfg)
    try:
        shape = resolve_worker_shape(cfg, ray.cluster_resources())
        warn_if_data_under_one_batch(cfg, shape.num_workers)
        bar = ProgressBar(cfg.train.steps, every=cfg.train.log_every) if progress else None
        controller = None
        saver = MetricsSaver(os.path.join(cfg.run_dir, "metrics.parquet"),
                             lambda: controller.outcome.metrics if controller else [])

        every = cfg.checkpoint.every_steps

        def on_metrics(m: dict) -> None:
            if bar:
                _show_step(bar, m)
            # at a checkpoint's step at once: a run resumed from it (after its driver was killed) then
            # finds every step before the checkpoint in the metrics on disk
            at_checkpoint = bool(every) and m["step"] % every == 0
            saver.save(every_s=0.0 if at_checkpoint else METRICS_SAVE_EVERY_S)

        start = time.monotonic()
        on_note = bar.note if bar else (lambda text: None)
        controller = TrainController(cfg, shape, on_metrics=on_metrics, on_note=on_note,
                                     resume=RestoreSource(resume) if resume else None)
        if resume is not None:  # the steps before the checkpoint, as the run that wrote it logged them
            controller.outcome.metrics = earlier_metrics(cfg)
        try:
            outcome = controller.run()
        except BaseException as exc:  # SIGTERM too (`ray job stop`): Ray's driver turns it into SystemExit
            if bar:
                bar.close()  # the lines below start on a line of their own, not after the bar's
            saver.save()  # a run stopped or failed midway keeps the metrics of what it trained
            if isinstance(exc, ClusterError):
                raise ClusterError(f"{exc}{_where_to_resume(controller, saver.uri)}") from exc
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):  # Ctrl-C, `ray job stop`
                where = _where_to_resume(controller, saver.uri)
                if where:
                    print(f"run stopped ({type(exc).__name__}){where}", file=sys.stderr, flush=True)
            raise
        if bar:
            bar.close()
        seconds = time.monotonic() - start
        return _write_outputs(cfg, outcome, seconds)
    finally:
        # the controller and the metrics callbacks refer to each other: without this the cycle (and
        # what the controller holds in the object store) lives on until the next garbage collection
        controller = None  # noqa: F841
        if started_here:
            RAY_STARTED_BY_TRAIN.leave()


METRICS_SAVE_EVERY_S = 10.0  # how often a run's metrics so far are written while it trains


class MetricsSaver:
    """Writes the run's metrics so far (atomically, the whole table), at most every so often while
    it trains and once more when it stops: a run stopped (`ray job stop`) or failed midway keeps
    the metrics of the steps it trained, which the end of a run alone used to write."""

    def __init__(self, uri: str, rows):
        self.uri, self.rows = uri, rows
        self.saved_at = time.monotonic()
        # A save converts only the rows added since the last one (converting every row again cost
        # O(rows so far) per save, O(steps^2) over a long run with frequent checkpoints). The state,
        # replaced whole by each save: the list converted from (a restore replaces it), how many of
        # its rows, the last of them (the same object while the list only grows), the Arrow parts.
        self._state: tuple = (None, 0, None, [])

    def _table(self, source: list) -> pa.Table:
        rows = list(source)  # the rows as of now (the list's owner may append while this converts)
        held, converted, last, parts = self._state
        same = (source is held and len(rows) >= converted
                and (converted == 0 or rows[converted - 1] is last))
        # another list (a restore keeps the rows up to its step), or this one cut back: start over
        converted, parts = (converted, list(parts)) if same else (0, [])
        if len(rows) > converted:
            parts.append(metrics_table(rows[converted:]))
            if len(parts) > 32:  # a handful of record batches, not one per save
                parts = [pa.concat_tables(parts).combine_chunks()]
        # committed in one store: an interrupt (Ctrl-C, SIGTERM) before it leaves the old state whole,
        # and the save the interrupt makes converts the same rows again, once
        self._state = (source, len(rows), rows[-1] if rows else None, parts)
        return pa.concat_tables(parts)

    def save(self, every_s: float = 0.0) -> None:
        if time.monotonic() - self.saved_at < every_s:
            return
        self.saved_at = time.monotonic()
        rows = self.rows()
        if not rows:
            return
        try:
            write_metrics(self._table(rows), self.uri)  # the atomic write makes the run directory
        except Exception as exc:  # never what stops a run: the end of the run writes them again
            log.warning("could not write the metrics so far to %s: %s", self.uri, exc)


def earlier_metrics(cfg: RunConfig) -> list[dict]:
    """The metrics the run directory already holds: the controller keeps those up to the restored
    step when the checkpoint resumed is this run's (its manifest names this run), so a resumed run's
    metrics start at step 1."""
    try:
        return read_metrics(os.path.join(cfg.run_dir, "metrics.parquet"))
    except (OSError, ValueError) as exc:
        log.warning("the run's earlier metrics could not be read (%s): they start at the resumed step", exc)
        return []


def _where_to_resume(controller, metrics_uri: str) -> str:
    """What a stopped or failed run kept: its newest checkpoint to resume from (its own, else the one
    it was resumed from), and its metrics. Read from the persister, not the outcome, which is filled
    in after the teardown that a second Ctrl-C can cut short."""
    if controller is None:
        return ""
    metrics = f"\nmetrics so far: {_shown(metrics_uri)}" if controller.outcome.metrics else ""
    persister = controller.persister
    if persister is not None and persister.committed:
        step, uri = persister.committed[-1]
        return f"\nthe newest checkpoint is step {step}: continue with --resume {uri}" + metrics
    if controller.resume is not None:  # none of its own yet: the one it started from is still there
        return f"\nno checkpoint written since the start: continue with --resume {controller.resume.uri}" + metrics
    return "\nno checkpoint was written yet: there is nothing to resume from" + metrics if metrics else ""


def _write_outputs(cfg: RunConfig, outcome, seconds: float) -> Result:
    run_dir = cfg.run_dir
    fs, run_path = storage.resolve(run_dir)
    fs.create_dir(run_path, recursive=True)
    table = metrics_table(outcome.metrics)
    metrics_uri = os.path.join(run_dir, "metrics.parquet")
    write_metrics(table, metrics_uri)
    storage.write_bytes_atomic(fs, f"{run_path}/plan.json", outcome.plan.to_json().encode())
    return Result(metrics=table, checkpoint_uri=outcome.checkpoint_uri, plan=outcome.plan, run_dir=run_dir,
                  metrics_uri=metrics_uri, seconds=seconds, restarts=outcome.restarts,
                  persist_errors=outcome.persist_errors, snapshot_stalls=outcome.snapshot_stalls,
                  checkpoint_via=outcome.checkpoint_via, final_step=outcome.final_step,
                  checkpoint_step=outcome.checkpoint_step, start_step=outcome.start_step, config=cfg)
