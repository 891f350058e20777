"""Durable checkpoints through pyarrow.fs, independent of the world size.

Layout under the checkpoint URI:

    step-00000100/manifest.json          format, step, tensors (file, shape, dtype), per-file sha256, extra state
    step-00000100/part-00000.safetensors full tensors, split into files of at most ~1 GiB

Tensors are whole (not per-rank shards), so a checkpoint restores onto any number of workers.
The manifest is written last and is the commit marker: readers only pick up `step-*` directories
that hold one, so a crash or a full disk mid-write never yields a checkpoint that looks complete.
On a local filesystem a checkpoint is written into a hidden `.tmp-step-*` directory and renamed
into place. Object stores (s3://, gs://) cannot rename a directory (Arrow's S3 and GCS `move`
handle single objects only), so there the parts go straight into `step-*/` and the manifest,
one object written in a single atomic upload, commits them.

A second kind of checkpoint (format 2, see `shards.py`) holds each rank's shard in files the
workers wrote themselves, with the layout to join them; it is committed the same way (`begin_checkpoint`,
then `commit_checkpoint` writes the manifest), and `load_checkpoint` serves it as whole tensors too,
each read from the files only when it is used.
"""

from __future__ import annotations

import json
import os
import time
import uuid
import warnings
from typing import Mapping, Optional

import numpy as np
import pyarrow.fs as pafs

from elixir_ray import storage
from elixir_ray.checkpoint import safetensors_io
from elixir_ray.checkpoint.manifest import MANIFEST, MAX_MANIFEST_BYTES, check_manifest, confined_path
from elixir_ray.checkpoint.shards import (PART_BYTES, SHARDS_FORMAT, check_listed, open_shards, open_tensors,
                                          split_parts, tensor_entries, verify_files)

FORMAT = "elixir_ray.checkpoint/1"  # whole tensors
FORMATS = (FORMAT, SHARDS_FORMAT)
STATE_BYTES_PER_PARAM = 12  # a checkpoint's fp32 weights and two AdamW moments, per parameter
TMP_PREFIX = ".tmp-step-"
# A `.tmp-step-*` directory untouched for this long is a crashed save's leftover: a save in progress
# writes one part file (at most ~1 GiB) after another, so its newest file is never nearly that old.
STALE_TMP_SECONDS = 3600
# A temporary directory holding a manifest is a commit's last moment (the manifest is written, then
# the directory renamed): one that old was interrupted between the two, not in progress.
FINISH_AFTER_S = 60


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt, or does not fit the model."""


def _step_dir(step: int) -> str:
    return f"step-{step:08d}"


def save_checkpoint(uri: str, step: int, tensors: Mapping[str, np.ndarray], extra: dict,
                    keep: Optional[int] = None, part_bytes: int = PART_BYTES) -> str:
    """Write the tensors and the manifest; returns the committed checkpoint's path. `keep` then
    leaves the newest `keep` checkpoints under `uri` by step, whichever run wrote them (a run's own
    pruning, `checkpoint.keep`, goes through CheckpointPersister and removes only its own)."""
    fs, root = storage.resolve(uri)
    fs.create_dir(root, recursive=True)
    remove_stale_temporaries(fs, root)  # first: on a full disk, a crashed save's leftovers free the space
    written = write_checkpoint(fs, root, step, tensors, extra, part_bytes)
    if keep:
        for old in _list(fs, root)[:-keep]:
            if old != written:  # an older step saved after newer ones is still what the caller asked for
                _remove_checkpoint(fs, old)
    return _as_uri(uri, root, f"{root}/{_step_dir(step)}")


def write_checkpoint(fs: pafs.FileSystem, root: str, step: int, tensors: Mapping[str, np.ndarray], extra: dict,
                     part_bytes: int = PART_BYTES) -> str:
    """Write and commit one checkpoint under `root` on `fs`; returns its path on `fs`.

    A local filesystem renames a finished temporary directory into place. Elsewhere the directory
    cannot be renamed, so the parts are written in place after the old manifest (if this step was
    saved before) is deleted, and the manifest last: until it exists the directory is not a checkpoint.
    """
    final = f"{root}/{_step_dir(step)}"
    work = _work_dir(fs, root, step)
    try:
        files, entries = {}, {}
        spec = safetensors_io.spec_of_mapping(tensors)
        for i, names in enumerate(split_parts(tensors, part_bytes)):
            name = f"part-{i:05d}.safetensors"
            for key in names:
                shape, dtype = spec(key)
                entries[key] = {"file": name, "shape": list(shape), "dtype": str(np.dtype(dtype))}
            # each tensor is joined (if `tensors` joins) just before its bytes are written
            with fs.open_output_stream(f"{work}/{name}") as out:
                sha256, nbytes = safetensors_io.write(out, names, tensors.__getitem__, spec)
            storage.sync_to_disk(fs, f"{work}/{name}")
            files[name] = {"sha256": sha256, "bytes": nbytes}
        _write_manifest(fs, work, final, {"format": FORMAT, "step": step, "files": files, "tensors": entries,
                                          **extra})
    except BaseException:
        _discard(fs, work)
        raise
    return final


def begin_checkpoint(uri: str, step: int) -> str:
    """The directory (a path or URI the workers can open) into which the ranks write a step's shard
    files; nothing there is a checkpoint until `commit_checkpoint`, and `abort_checkpoint` removes it."""
    fs, root = storage.resolve(uri)
    fs.create_dir(root, recursive=True)
    remove_stale_temporaries(fs, root)
    return _as_uri(uri, root, _work_dir(fs, root, step))


def _work_dir(fs: pafs.FileSystem, root: str, step: int) -> str:
    """Where a step's files are written before the commit: a hidden temporary directory renamed into
    place on a local filesystem; elsewhere (no directory rename) the step's own directory, with the
    old manifest (a step written again) deleted first."""
    if fs.type_name == "local":
        work = f"{root}/{TMP_PREFIX}{step:08d}-{uuid.uuid4().hex[:8]}"
    else:
        work = f"{root}/{_step_dir(step)}"
        _remove_checkpoint(fs, work)
    fs.create_dir(work, recursive=True)
    return work


def _discard(fs: pafs.FileSystem, work: str) -> None:
    """Remove an uncommitted directory, best effort: a leftover without a manifest is never read as
    a checkpoint, and stale temporaries are removed by later saves."""
    try:
        _remove_checkpoint(fs, work)
    except OSError:
        pass


def commit_checkpoint(uri: str, step: int, work_uri: str, files: dict[str, dict], layout: dict, world: int,
                      extra: dict) -> str:
    """Commit the shard files the ranks wrote into `work_uri` (`begin_checkpoint`): check that every
    file is there at the size its rank wrote (ranks on another node writing to a local path of their
    own would not be), list the whole tensors they hold, write the manifest last, and on a local
    filesystem rename the directory into place. Returns the committed checkpoint's path or URI; on
    any error nothing is committed and the directory is removed."""
    fs, root = storage.resolve(uri)
    _, work = storage.resolve(work_uri)
    final = f"{root}/{_step_dir(step)}"
    try:
        for name, info in sorted(files.items()):
            found = fs.get_file_info(f"{work}/{name}")
            if found.type == pafs.FileType.NotFound or found.size != info["bytes"]:
                raise CheckpointError(
                    f"rank {info['rank']}'s file {name} is not where the driver reads {uri!r}"
                    + ("" if found.type == pafs.FileType.NotFound else f" at the size written ({found.size} of "
                                                                        f"{info['bytes']} bytes)")
                    + ": every worker must write to storage the driver reads too (a shared filesystem, or an "
                      "object store URI such as s3://...)")
        manifest = {"format": SHARDS_FORMAT, "step": step, "files": files,
                    "shards": {"world": world, "layout": layout}, **extra}
        try:
            manifest["tensors"] = tensor_entries(open_shards(work_uri, manifest))
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"the shard files of step {step} do not make a checkpoint: {exc}") from None
        _write_manifest(fs, work, final, manifest)
    except BaseException:
        abort_checkpoint(work_uri)
        raise
    return _as_uri(uri, root, final)


def _write_manifest(fs: pafs.FileSystem, work: str, final: str, manifest: dict) -> None:
    """The commit: the manifest, written last; on a local filesystem the directory is then renamed
    into place (elsewhere `work` is `final` already)."""
    with fs.open_output_stream(f"{work}/manifest.json") as out:
        out.write(json.dumps(manifest, indent=1, sort_keys=True).encode())
    if fs.type_name == "local":
        # on the disk before the rename commits them (and before older checkpoints are pruned)
        storage.sync_to_disk(fs, f"{work}/manifest.json")
        storage.sync_to_disk(fs, work)
        # a step saved again: the old copy is moved aside first and removed only once the new one is
        # in place, so that a crash in between leaves a complete copy (restored by the next save's
        # clean-up), never none
        aside = None
        if storage.exists(fs, final):
            aside = f"{os.path.dirname(final)}/{TMP_PREFIX}{os.path.basename(final)[len('step-'):]}-replaced"
            _remove_checkpoint(fs, aside)
            fs.move(final, aside)
            # a rename keeps the old copy's age: made young, a reader's clean-up
            # (`_finish_interrupted_commits`) takes it for the commit in progress it is, and leaves it
            os.utime(aside)
        fs.move(work, final)
        storage.sync_to_disk(fs, os.path.dirname(final))
        if aside is not None:
            _discard(fs, aside)


def abort_checkpoint(work_uri: str) -> None:
    """Remove a directory `begin_checkpoint` made that will not be committed (best effort)."""
    try:
        fs, work = storage.resolve(work_uri)
    except OSError:
        return
    _discard(fs, work)


def delete_checkpoint(path: str) -> None:
    """Delete one committed checkpoint (a path or URI as `save_checkpoint` returns), manifest first."""
    fs, root = storage.resolve(path)
    _remove_checkpoint(fs, root)


def _remove_checkpoint(fs: pafs.FileSystem, path: str) -> None:
    """Delete one checkpoint directory, manifest first, so that no reader sees it half-deleted as committed
    (deleting a directory is file by file, on an object store object by object in no set order)."""
    if storage.exists(fs, f"{path}/manifest.json"):
        fs.delete_file(f"{path}/manifest.json")
    if storage.exists(fs, path):
        fs.delete_dir(path)


def remove_stale_temporaries(fs: pafs.FileSystem, root: str, max_age_s: float = STALE_TMP_SECONDS) -> list[str]:
    """Delete the `.tmp-step-*` directories under `root` that crashed saves left behind; returns them.

    Only one whose newest entry (the directory or any file in it) was modified more than `max_age_s`
    ago: another process may be saving into the same root right now, and its directory is fresh.
    Where the filesystem reports no modification times the directory is left alone. Failures are
    ignored: a leftover is never read as a checkpoint, it only takes space.
    """
    cutoff_ns = time.time_ns() - int(max_age_s * 1e9)
    removed = []
    try:
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    except OSError:
        return removed
    if _finish_interrupted_commits(fs, root, infos):
        infos = fs.get_file_info(pafs.FileSelector(root, allow_not_found=True))
    for info in infos:
        if info.type != pafs.FileType.Directory or not os.path.basename(info.path).startswith(TMP_PREFIX):
            continue
        try:
            inside = fs.get_file_info(pafs.FileSelector(info.path, recursive=True))
            mtimes = [i.mtime_ns for i in (info, *inside) if i.mtime_ns is not None]
            if mtimes and max(mtimes) < cutoff_ns:
                fs.delete_dir(info.path)
                removed.append(info.path)
        except OSError:
            continue  # e.g. another save removed it first
    return removed


def list_checkpoints(uri: str) -> list[str]:
    """Committed checkpoints under uri, oldest first, as paths or URIs that the readers here accept."""
    fs, root = storage.resolve(uri)
    return [_as_uri(uri, root, path) for path in _list(fs, root)]


def checkpoint_path_hint(uri: str) -> str:
    """For a local path that holds no checkpoint: what it is instead (a run directory, a file), and
    where its checkpoints are; empty when there is nothing to add."""
    if "://" in uri:
        return ""
    if os.path.isfile(uri):
        parent = os.path.dirname(os.path.abspath(uri))
        return (f" (a checkpoint's manifest: give its directory, {parent})" if os.path.basename(uri) == "manifest.json"
                else " (a file: give a checkpoint directory, or a directory of them)")
    if os.path.isdir(os.path.join(uri, "checkpoints")):
        return f" (a run directory? its checkpoints are in {uri.rstrip('/')}/checkpoints)"
    if not os.path.exists(uri):
        return ": no such file or directory"
    return ""


def _finish_interrupted_commits(fs: pafs.FileSystem, root: str, infos: list) -> bool:
    """A local commit interrupted between its renames (a step saved again: the old copy moved aside,
    the new one not yet in place) leaves complete copies, manifests written, under temporary names
    and no checkpoint of that step: the new copy (else the old) is put in place. Returns whether any
    was. Only copies at least FINISH_AFTER_S old: a younger one may be a commit in progress."""
    if fs.type_name != "local":
        return False  # elsewhere a step's files are written in place
    limit_ns = time.time_ns() - int(FINISH_AFTER_S * 1e9)
    complete = sorted((i for i in infos if i.type == pafs.FileType.Directory
                       and os.path.basename(i.path).startswith(TMP_PREFIX)
                       and i.mtime_ns is not None and i.mtime_ns < limit_ns
                       and storage.exists(fs, f"{i.path}/manifest.json")),
                      key=lambda i: os.path.basename(i.path).endswith("-replaced"))
    finished = False
    for info in complete:
        digits = os.path.basename(info.path)[len(TMP_PREFIX):][:8]
        if not digits.isdigit():
            continue
        final = f"{root}/{_step_dir(int(digits))}"
        if storage.exists(fs, final):
            continue
        try:
            _read_manifest(fs, info.path, info.path)  # a manifest cut short by the kill: not a complete copy
        except CheckpointError:
            continue
        try:
            fs.move(info.path, final)
            finished = True
        except OSError:  # a read-only filesystem, or another process finished it first
            continue
    return finished


def _list(fs: pafs.FileSystem, root: str) -> list[str]:
    """Committed checkpoints under root, as paths on fs (an interrupted local commit finished first)."""
    return _step_dirs(fs, root)[0]


def _step_dirs(fs: pafs.FileSystem, root: str) -> tuple[list[str], list[str]]:
    """The `step-*` directories under root, as paths on fs, each sorted: those with a manifest (the
    committed checkpoints) and those without (a save cut short, or one in progress on an object store)."""
    if fs.get_file_info(root).type != pafs.FileType.Directory:  # missing, or a file (one checkpoint's manifest?)
        return [], []
    found, unfinished = [], []
    infos = fs.get_file_info(pafs.FileSelector(root))
    if _finish_interrupted_commits(fs, root, infos):
        infos = fs.get_file_info(pafs.FileSelector(root))
    for info in infos:
        name = os.path.basename(info.path)
        if info.type == pafs.FileType.Directory and name.startswith("step-"):
            (found if storage.exists(fs, f"{info.path}/{MANIFEST}") else unfinished).append(info.path)
    return sorted(found), sorted(unfinished)


def _as_uri(uri: str, root: str, path: str) -> str:
    """`path` (under `root`, as the filesystem names it) in the form of `uri`: a URI keeps its scheme,
    since an object store's path (`bucket/key`) would otherwise be read back as a local path."""
    if "://" not in uri:
        return path
    base, sep, query = uri.partition("?")  # s3://bucket/key?region=...: the options stay at the end
    return base.rstrip("/") + path[len(root.rstrip("/")):] + sep + query


def read_manifest(path: str) -> dict:
    fs, root = storage.resolve(path)
    return _read_manifest(fs, root, path)


def _read_manifest(fs: pafs.FileSystem, root: str, shown: str) -> dict:
    """The manifest of the checkpoint at `root`, every field checked (`manifest.check_manifest`)
    before any file it names is opened; any fault is a CheckpointError in one line."""
    try:
        with fs.open_input_stream(confined_path(fs, root, MANIFEST)) as f:
            payload = f.read(MAX_MANIFEST_BYTES + 1)
        if len(payload) > MAX_MANIFEST_BYTES:
            raise ValueError(f"it is larger than {MAX_MANIFEST_BYTES} bytes, more than any manifest written")
        manifest = json.loads(payload)
    except (OSError, ValueError, RecursionError) as exc:  # JSON and UTF-8 errors are ValueErrors
        raise CheckpointError(f"checkpoint {shown!r} has no readable manifest: {_one_line(exc)}") from None
    if not isinstance(manifest, dict) or manifest.get("format") not in FORMATS:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {shown!r} has format {found!r}, expected one of {', '.join(FORMATS)}")
    if not (isinstance(manifest.get("files"), dict) and isinstance(manifest.get("tensors"), dict)
            and isinstance(manifest.get("step"), int)):
        raise CheckpointError(f"checkpoint {shown!r} has a manifest without its step, files or tensors")
    shards = manifest.get("shards")
    if manifest["format"] == SHARDS_FORMAT and not (
            isinstance(shards, dict) and isinstance(shards.get("world"), int) and shards["world"] >= 1
            and isinstance(shards.get("layout"), dict)):
        raise CheckpointError(f"checkpoint {shown!r} has a manifest without its shards' world size or layout")
    try:
        check_manifest(manifest, shards=manifest["format"] == SHARDS_FORMAT)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {shown!r}: {exc}") from None
    return manifest


def _one_line(exc: BaseException) -> str:
    """An error's text on one line (pyarrow's OSErrors carry a detail line)."""
    return " ".join(str(exc).split()) or type(exc).__name__


def load_checkpoint(path: str) -> tuple[dict, Mapping[str, np.ndarray]]:
    """Read and verify one checkpoint: every file's checksum must match its manifest entry. Whole
    tensors either way: a shards checkpoint's are joined from the files as each is read."""
    fs, root = storage.resolve(path)
    return _load_checkpoint(fs, root, path)


def _load_checkpoint(fs: pafs.FileSystem, root: str, shown: str) -> tuple[dict, Mapping[str, np.ndarray]]:
    """Either format: every file checked whole first (streamed through sha256, nothing kept), then
    each tensor read from its file when it is used."""
    manifest = _read_manifest(fs, root, shown)
    problem = verify_files(fs, root, manifest["files"])
    if problem is not None:
        raise CheckpointError(f"checkpoint {shown!r}: {problem}")
    where = shown if "://" in shown else root  # absolute: the workers that read it have their own cwd
    try:
        if manifest["format"] == SHARDS_FORMAT:
            joined = open_shards(where, manifest, fs, root)
            check_listed(joined, manifest)
            return manifest, joined
        return manifest, open_tensors(where, manifest, fs, root)
    except Exception as exc:  # noqa: BLE001 - whatever a forged or damaged file does, the reader falls back past it
        raise CheckpointError(f"checkpoint {shown!r}: its files are malformed: {_one_line(exc)}") from None


# How many times a reader lists a directory again after the checkpoint it was reading was removed
# (pruned by a run's `checkpoint.keep` as it saved a newer one): each time there is a newer one.
RELISTS = 10


def load_newest_valid(uri: str, errors: Optional[list] = None) -> Optional[tuple[str, dict, dict[str, np.ndarray]]]:
    """The newest checkpoint under `uri` that verifies (or `uri`, when it names one checkpoint).

    A newer one that does not verify, or a newer `step-*` directory without a manifest (a save cut
    short), is skipped with a warning that says why (and its error appended to `errors`, for a
    caller that must say why nothing was found). One removed while it was read, as a run's
    `checkpoint.keep` prunes it after saving a newer one, sends the reader back to the listing
    for the newest, saying so."""
    fs, root = storage.resolve(uri)
    committed, unfinished = _step_dirs(fs, root)
    if not committed and not unfinished and storage.exists(fs, root) and _is_checkpoint(uri):
        return load_first_valid([uri], errors)  # uri names one checkpoint rather than a directory of them
    newest = committed[-1] if committed else ""
    for path in reversed([p for p in unfinished if p > newest]):
        exc = CheckpointError(f"checkpoint {_as_uri(uri, root, path)!r} has no {MANIFEST} (a save cut short, or "
                              f"one still in progress)")
        if errors is not None:
            errors.append(exc)
        if committed:
            warnings.warn(f"skipping checkpoint: {exc}; trying the previous one", stacklevel=2)
    tried: set = set()
    for _ in range(RELISTS + 1):
        paths = [p for p in reversed(list_checkpoints(uri)) if p not in tried]
        for i, path in enumerate(paths):
            try:
                manifest, tensors = load_checkpoint(path)
                return path, manifest, tensors
            except CheckpointError as exc:
                tried.add(path)
                if not _is_checkpoint(path):
                    warnings.warn(f"checkpoint {path!r} was removed while it was read (pruned by a run's "
                                  f"checkpoint.keep after a newer save?): taking the newest again", stacklevel=2)
                    break
                if errors is not None:
                    errors.append(exc)
                if i + 1 < len(paths):
                    warnings.warn(f"skipping checkpoint: {exc}; trying the previous one", stacklevel=2)
        else:
            return None
    return None


def require_newest_valid(uri: str) -> tuple[str, dict, dict[str, np.ndarray]]:
    """`load_newest_valid`, or a CheckpointError that says why there is none (a run directory given
    for its checkpoints, or the last checkpoint's fault)."""
    errors: list = []
    found = load_newest_valid(uri, errors)
    if found is None:
        hint = checkpoint_path_hint(uri)
        raise CheckpointError(f"no valid checkpoint at {uri!r}{hint or (f': {errors[-1]}' if errors else '')}")
    return found


def load_first_valid(paths, errors: Optional[list] = None) -> Optional[tuple[str, dict, dict[str, np.ndarray]]]:
    """The first of `paths` (newest first) that verifies; a corrupt one is skipped with a warning."""
    paths = list(paths)
    for i, path in enumerate(paths):
        try:
            manifest, tensors = load_checkpoint(path)
            return path, manifest, tensors
        except CheckpointError as exc:
            if errors is not None:
                errors.append(exc)
            if i + 1 < len(paths):
                warnings.warn(f"skipping checkpoint: {exc}; trying the previous one", stacklevel=3)
    return None


def _is_checkpoint(uri: str) -> bool:
    fs, root = storage.resolve(uri)
    return storage.exists(fs, f"{root}/{MANIFEST}")


def check_compatible(manifest: dict, expected: dict[str, tuple]) -> None:
    """Refuse a checkpoint of another model: name the first tensor whose shape differs, that is missing,
    or that the model does not have (a bigger model's extra layers would otherwise fail every worker's
    restore). Only the namespaces `expected` covers (`model/` for `expected_checkpoint_shapes`) are
    compared; optimizer moments and other state in the manifest are not the model's tensors."""
    found = manifest["tensors"]
    for name, shape in expected.items():
        if name not in found:
            raise CheckpointError(f"checkpoint does not fit this model: it has no tensor {name!r}")
        if tuple(found[name]["shape"]) != tuple(shape):
            raise CheckpointError(
                f"checkpoint does not fit this model: {name!r} has shape {tuple(found[name]['shape'])} "
                f"in the checkpoint but {tuple(shape)} in the model"
            )
    namespaces = {name.split("/", 1)[0] + "/" for name in expected}
    for name in sorted(found):
        if name.startswith(tuple(namespaces)) and name not in expected:
            raise CheckpointError(
                f"checkpoint does not fit this model: it has tensor {name!r}, which this model does not have "
                f"(a checkpoint of a bigger model?)"
            )
