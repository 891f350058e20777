"""The checks before a run starts: everything that can be checked without workers (the config, the
dataset, a `--resume` checkpoint, the output and checkpoint directories, the local cluster's size)
is checked here first, so bad input fails in a second with one line instead of after actors have
started. Each reads the run as resolved once (`resolved.ResolvedRun`), or only its config."""

from __future__ import annotations

import os
import warnings
from typing import Optional

from elixir_ray import storage
from elixir_ray.checkpoint import CheckpointError, check_compatible, list_checkpoints, read_manifest
from elixir_ray.checkpoint.store import STATE_BYTES_PER_PARAM, checkpoint_path_hint
from elixir_ray.config import RunConfig, config_from_dict, resolve_model_shape
from elixir_ray.data.dataset import (BatchSampler, TokenDataset, checkpoint_tokenizer_identity, count_tokens,
                                     data_tokenizer, tokenizer_named, windows_in)
from elixir_ray.errors import ConfigError, nothing_left_to_train
from elixir_ray.model import factory
from elixir_ray.run.embedded_ray import local_cpus
from elixir_ray.run.outputs import shown
from elixir_ray.run.resolved import ResolvedRun
from elixir_ray.units import format_bytes


def check_data(run: ResolvedRun) -> None:
    """Open the dataset (and the held-out one) on the driver: it must exist, fit the model's
    vocabulary and hold a full window."""
    cfg, shape, uri = run.config, run.model_shape, run.data_uri
    dataset = TokenDataset(uri)
    vocab_key = "model.hf.vocab_size" if cfg.model.hf is not None else "model.vocab_size"
    if dataset.vocab_size > shape["vocab_size"]:
        raise ConfigError(f"{vocab_key}={shape['vocab_size']} is smaller than the dataset's vocabulary "
                          f"({dataset.vocab_size}): use at least {dataset.vocab_size}")
    check_token_ids(dataset, shape["vocab_size"], vocab_key)
    BatchSampler(dataset, shape["seq_len"], cfg.train.seed)  # raises when no full window fits
    if run.eval_uri is not None:
        eval_uri = run.eval_uri
        held_out = TokenDataset(eval_uri, what="eval.path")
        if held_out.vocab_size > shape["vocab_size"]:
            raise ConfigError(f"{vocab_key}={shape['vocab_size']} is smaller than eval.path's vocabulary "
                              f"({held_out.vocab_size}): use at least {held_out.vocab_size}")
        check_token_ids(held_out, shape["vocab_size"], vocab_key)
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


def check_token_ids(dataset: TokenDataset, vocab_size: int, vocab_key: str) -> None:
    """Token ids from the data itself, not its metadata (which a hand-made or edited file may get
    wrong): an id at or above the model's vocabulary fails inside the workers' embedding, after a
    restart spent on it. A large file is scanned in slices (`TokenDataset.largest_id`)."""
    largest, whole = dataset.largest_id()
    if largest >= vocab_size:
        scan = "" if whole else " (in a sampled scan)"
        raise ConfigError(f"{dataset.what} {dataset.uri!r} holds token id {largest:,}{scan}, at or above "
                          f"{vocab_key}={vocab_size:,}, though its metadata says vocab_size {dataset.vocab_size:,}: "
                          f"give the model a vocabulary above every id, or prepare the data again "
                          f"(elixir-ray prepare-data)")


def check_model_step(run: ResolvedRun) -> None:
    """One training step of a `model.hf` model, traced on the meta device before any worker starts
    (`model.factory.check_model_step`), on the run's one meta-device build."""
    if run.config.model.hf is not None:
        factory.check_model_step(run.config, meta_model=run.meta_model.module)


def warn_if_data_under_one_batch(run: ResolvedRun, num_workers: int) -> None:
    """A dataset with fewer windows than one global batch trains, but every step repeats windows
    inside its own batch: say so, with the sizes, rather than let it pass for a real run."""
    cfg, seq_len = run.config, run.model_shape["seq_len"]
    windows = windows_in(count_tokens(run.data_uri), seq_len)
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


def check_resume(run: ResolvedRun, uri: str) -> None:
    """Refuse a checkpoint of another model, or one with nothing left to train, before any worker starts.

    The restore takes the newest checkpoint that verifies and falls back past a damaged one, so this
    checks the newest one whose manifest reads (warning about the newer ones skipped) and refuses only
    when none reads. Only manifests are read here; the files' checksums are verified by the restore.
    """
    cfg = run.config
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
        check_compatible(newest, run.meta_model.checkpoint_shapes)
    except CheckpointError as exc:
        raise ConfigError(f"--resume {uri!r}: {exc}") from None
    theirs = checkpoint_tokenizer_identity(newest)
    if theirs != (ours := data_tokenizer(run.data_uri))["tokenizer"]:
        named = tokenizer_named(theirs, newest.get("tokenizer_file"))
        how = ("without --tokenizer" if theirs == "bytes" else
               f"with --tokenizer naming {newest.get('tokenizer_file') or 'that tokenizer.json'}")
        raise ConfigError(f"--resume {uri!r}: the checkpoint's model was trained on tokens of {named} and data.path "
                          f"holds tokens of {ours['tokenizer_file']}: its embeddings would be read as another "
                          f"vocabulary's. Prepare data.path with the checkpoint's tokenizer (elixir-ray prepare-data "
                          f"{how})")
    changed = model_fields_changed((newest.get("config") or {}).get("model"), run)
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


def model_fields_changed(theirs: Optional[dict], run: ResolvedRun) -> list[str]:
    """The model fields a checkpoint's run set otherwise than this run, that leave every tensor's
    shape as it is (the attention heads of the GPT; any of a Hugging Face model's fields but its
    name): `their=value (this run: value)` each. The window length and checkpointing may change."""
    if not isinstance(theirs, dict):
        return []
    mine = run.config.model
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
    shape = run.model_shape
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
    warnings.warn(f"{shown(cfg.checkpoint_uri)} already holds {len(earlier)} checkpoint(s) of an earlier run "
                  f"(the newest: {newest}): this run starts afresh and writes its own beside them (one of the "
                  f"same step replaced), and --resume, export or sample given that directory take the highest step "
                  f"there, whichever run wrote it. "
                  f"To continue the earlier run, pass --resume {earlier[-1]}; to keep the two apart, give this run "
                  f"another name (--set name=...)", stacklevel=3)


def check_checkpoint_space(run: ResolvedRun) -> None:
    """A checkpoint that cannot be written where it goes would lose the run's weights at its end:
    refuse a local `checkpoint.uri` under a file or in a directory that cannot be written, or whose
    filesystem has less free space than one checkpoint of this model, and warn when it cannot hold
    the `checkpoint.keep` + 1 that are on disk at once while the newest is written (an object store
    URI is not checked)."""
    import shutil

    cfg = run.config
    uri = cfg.checkpoint_uri
    path = _writable_local_dir(uri, "checkpoint.uri")
    if path is None:
        return
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return  # the checkpoint's own write will say what is wrong with the path
    params = run.meta_model.parameters
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


def check_local_cluster_shape(cfg: RunConfig) -> None:
    """Where `train()` will start a local cluster, the workers the config asks for are checked
    against what it will have before it starts (a dozen seconds), as a joined cluster's are
    once joined."""
    import ray
    import torch

    from elixir_ray.cluster.placement import resolve_worker_shape

    if ray.is_initialized() or os.environ.get("RAY_ADDRESS"):
        return
    cpus, gpus = local_cpus(cfg), torch.cuda.device_count() if torch.cuda.is_available() else 0
    try:
        resolve_worker_shape(cfg, {"CPU": cpus, "GPU": gpus})
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the local cluster a run starts where RAY_ADDRESS is unset: {cpus} CPUs, "
                          f"cluster.local_num_cpus sets how many; {gpus} GPU(s))") from None

