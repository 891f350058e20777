"""Paths and URIs through pyarrow.fs, with writes that never leave a half-written file behind."""

from __future__ import annotations

import os
import uuid

import pyarrow.fs as pafs


def resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """A local path (relative or absolute) or any URI pyarrow.fs understands (file://, s3://, gs://, hdfs://)."""
    if "://" in uri:
        return pafs.FileSystem.from_uri(uri)
    return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))


def exists(fs: pafs.FileSystem, path: str) -> bool:
    return fs.get_file_info(path).type != pafs.FileType.NotFound


def write_bytes_atomic(fs: pafs.FileSystem, path: str, payload: bytes) -> None:
    """Write under a temporary name in the same directory, then rename over the target."""
    parent = os.path.dirname(path)
    if parent:
        fs.create_dir(parent, recursive=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        with fs.open_output_stream(tmp) as out:
            out.write(payload)
        fs.move(tmp, path)
    except BaseException:
        if exists(fs, tmp):
            fs.delete_file(tmp)
        raise


def temp_sibling(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"
