"""Paths and URIs through pyarrow.fs, with writes that never leave a half-written file behind."""

from __future__ import annotations

import contextlib
import json
import os
import uuid
from typing import Optional

import pyarrow.fs as pafs


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A local path (relative or absolute) or any URI pyarrow.fs understands (file://, s3://, gs://, hdfs://)."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def local_path(uri: str) -> Optional[str]:
    """The absolute local path a path or file:// URI names; None for any other URI (s3://, gs://...),
    without contacting it."""
    if "://" in uri and not uri.startswith("file://"):
        return None
    return os.path.abspath(os.path.expanduser(uri[len("file://"):] if uri.startswith("file://") else uri))


def nearest_existing(path: str) -> str:
    """`path`, or the nearest directory above it that exists: where a local output's files will land
    (a file found there instead of a directory means they cannot)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def writable_local_dir(uri: str, what: str, fix: str) -> Optional[str]:
    """The nearest directory of local `uri` that exists (where files made under it will land),
    refused with a ConfigError (`what`: the setting and its value; `fix`: what to do) when it is a
    file or cannot be written (a read-only mount too); None for an object store URI."""
    from elixir_ray.errors import ConfigError

    path = local_path(uri)
    if path is None:
        return None
    path = nearest_existing(path)
    if not os.path.isdir(path):
        raise ConfigError(f"{what}: {path} is a file, not a directory: {fix}")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{what}: {path} cannot be written by this user (or is on a read-only filesystem): {fix}")
    return path


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def read_json(uri: str):
    """The JSON value stored at `uri`; None where there is none or it does not read (a small record
    of the project's own, such as a trial's summary)."""
    try:
        fs, path = resolve(uri)
        if not exists(fs, path):
            return None
        with fs.open_input_stream(path) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def sync_to_disk(fs: pafs.FileSystem, path: str) -> None:
    """On a local filesystem, wait until the file's (or directory's) bytes are on the disk: a rename
    that commits a file, or the pruning of an older copy, must not come before its data after a power
    loss. Elsewhere an upload is durable once it completes. A filesystem that cannot sync a directory
    (some network mounts refuse) is left as it is."""
    if fs.type_name != "local":
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(fs: pafs.FileSystem, path: str, payload: bytes) -> None:
    """Write under a temporary name in the same directory, then rename over the target."""
    with atomic_output(fs, path) as out:
        out.write(payload)


@contextlib.contextmanager
def atomic_output(fs: pafs.FileSystem, path: str):
    """An output stream to a temporary name in the same directory, renamed over `path` when the
    block completes; on any error the temporary is removed and `path` is untouched."""
    parent = os.path.dirname(path)
    if parent:
        fs.create_dir(parent, recursive=True)
    tmp = temp_sibling(path)
    try:
        with fs.open_output_stream(tmp) as out:
            yield out
        sync_to_disk(fs, tmp)
        fs.move(tmp, path)
        sync_to_disk(fs, parent or ".")
    except BaseException:
        if exists(fs, tmp):
            fs.delete_file(tmp)
        raise


def temp_sibling(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"
