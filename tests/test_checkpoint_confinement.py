"""A checkpoint from someone else (a shared bucket, a downloaded run) is input: its manifest can name
files outside its directory, headers can claim shapes that overflow or are negative, numbers can
be absurd. Each is refused in one line naming what is wrong, a directory falls back to its previous
valid checkpoint saying why, and nothing outside the checkpoint is ever opened: the planted files
are watched through the kernel (inotify), which sees pyarrow's opens as well as Python's."""

import ctypes
import hashlib
import json
import os
import struct

import numpy as np
import pytest

from elixir_ray.checkpoint import (CheckpointError, list_checkpoints, load_checkpoint, load_newest_valid,
                                   read_manifest, save_checkpoint)
from elixir_ray.checkpoint import safetensors_io
from elixir_ray.checkpoint.export import export_safetensors
from elixir_ray.checkpoint.store import require_newest_valid

IN_OPEN = 0x20


class OpenWatch:
    """Whether any process opens `path` from now on (Linux inotify, through libc)."""

    def __init__(self, path: str):
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path), IN_OPEN) < 0:
            pytest.skip("inotify is not available here")

    def opened(self) -> bool:
        try:
            return bool(os.read(self.fd, 4096))
        except BlockingIOError:
            return False
        finally:
            os.close(self.fd)


def test_the_watch_sees_an_open_through_pyarrow(tmp_path):
    """The check below is worth something only if it sees what pyarrow opens (not Python's `open`)."""
    import pyarrow.fs as pafs

    path = tmp_path / "f"
    path.write_bytes(b"x")
    watch = OpenWatch(str(path))
    with pafs.LocalFileSystem().open_input_stream(str(path)) as f:
        f.read()
    assert watch.opened()


def _weights(value: float) -> dict:
    return {"model/w": np.full((3, 4), value, dtype=np.float32), "model/b": np.full(4, value, dtype=np.float32)}


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def _run(tmp_path):
    """A directory of two checkpoints (steps 1 and 2, weights 1.0 and 2.0) and a planted file outside
    it with valid contents (weights 0.0), as a forger would make one."""
    ck = tmp_path / "run" / "checkpoints"
    save_checkpoint(str(ck), 1, _weights(1.0), {})
    newest = save_checkpoint(str(ck), 2, _weights(2.0), {})
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = outside / "evil.safetensors"
    evil.write_bytes(safetensors_io.encode(_weights(0.0)))
    return str(ck), newest, str(evil)


def _forge(checkpoint: str, name: str, target: str) -> None:
    """Point every tensor of `checkpoint`'s manifest at file `name`, with `target`'s checksum and size
    recomputed (the manifest is all a forger has to change)."""
    path = os.path.join(checkpoint, "manifest.json")
    manifest = json.load(open(path))
    manifest["files"] = {name: {"sha256": _sha256(target), "bytes": os.path.getsize(target)}}
    for entry in manifest["tensors"].values():
        entry["file"] = name
    json.dump(manifest, open(path, "w"))


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_a_manifest_naming_a_file_outside_its_directory_is_refused_and_never_opened(tmp_path, how):
    ck, newest, evil = _run(tmp_path)
    if how == "symlink":
        name = "part-00000.safetensors"
        os.remove(os.path.join(newest, name))
        os.symlink(evil, os.path.join(newest, name))
        said = rf"checkpoint '{newest}': {name} is a link to {evil}, outside its checkpoint directory"
    else:
        name = os.path.relpath(evil, newest) if how == "relative" else evil
        said = rf"checkpoint '{newest}': its manifest names file '{name}', which is not a plain name inside its dir"
    _forge(newest, name, evil)
    watch = OpenWatch(evil)
    with pytest.raises(CheckpointError, match=said) as caught:
        load_checkpoint(newest)
    assert "\n" not in str(caught.value)
    with pytest.warns(UserWarning, match=r"skipping checkpoint: .*step-00000002.*; trying the previous one"):
        path, n = export_safetensors(ck, str(tmp_path / "weights.safetensors"))
    assert path.endswith("step-00000001") and n == 2
    exported, _ = safetensors_io.decode(open(tmp_path / "weights.safetensors", "rb").read())
    assert all((v == 1.0).all() for v in exported.values())  # the previous step's, not the planted zeros
    assert not watch.opened(), "a file outside the checkpoint was opened"


def test_another_steps_file_named_through_dot_dot_is_refused(tmp_path):
    """`../step-00000001/part-00000.safetensors` would export step 1's weights under step 2's name."""
    ck, newest, _ = _run(tmp_path)
    other = os.path.join(ck, "step-00000001", "part-00000.safetensors")
    _forge(newest, "../step-00000001/part-00000.safetensors", other)
    with pytest.raises(CheckpointError, match=r"names file '../step-00000001/part-00000.safetensors', which is "
                                              r"not a plain name"):
        read_manifest(newest)


def test_a_manifest_that_is_a_link_out_of_its_directory_is_refused(tmp_path):
    ck, newest, _ = _run(tmp_path)
    planted = tmp_path / "outside" / "manifest.json"
    os.replace(os.path.join(newest, "manifest.json"), planted)
    os.symlink(planted, os.path.join(newest, "manifest.json"))
    watch = OpenWatch(str(planted))
    with pytest.raises(CheckpointError, match=r"has no readable manifest: manifest.json is a link to .*outside its"):
        load_checkpoint(newest)
    assert not watch.opened()


def _header_file(path, shape, offsets, dtype="F32", data=b""):
    head = json.dumps({"model/w": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)


@pytest.mark.parametrize("shape,offsets,said", [
    ([2**32, 2**32], [0, 0], r"has offsets outside the file: shape \[4294967296, 4294967296\] is 73786976294838206464 "
                             r"bytes, its offsets \[0, 0\) of 0"),
    ([-128, -128], [0, 0], r"has shape \[-128, -128\] in its header, not whole numbers >= 0"),
    ([2.5, 2], [0, 20], r"has shape \[2.5, 2\] in its header, not whole numbers >= 0"),
    ([2, 2], [-16, 0], r"has offsets \[-16, 0\] in its header, not whole numbers >= 0"),
])
def test_header_shapes_that_overflow_or_are_negative_are_refused_and_the_directory_falls_back(tmp_path, shape,
                                                                                             offsets, said):
    ck, newest, _ = _run(tmp_path)
    part = tmp_path / "run" / "checkpoints" / "step-00000002" / "part-00000.safetensors"
    _header_file(part, shape, offsets)
    manifest = json.load(open(os.path.join(newest, "manifest.json")))
    manifest["files"] = {part.name: {"sha256": _sha256(part), "bytes": part.stat().st_size}}
    manifest["tensors"] = {"model/w": {"file": part.name, "shape": [2, 2], "dtype": "float32"}}
    json.dump(manifest, open(os.path.join(newest, "manifest.json"), "w"))
    with pytest.raises(CheckpointError, match=rf"checkpoint '{newest}': its files are malformed: tensor 'model/w' "
                                              rf"{said}"):
        load_checkpoint(newest)
    with pytest.warns(UserWarning, match=r"skipping checkpoint: .*step-00000002'.*tensor 'model/w'"):
        path, manifest, tensors = load_newest_valid(ck)
    assert path.endswith("step-00000001") and (tensors["model/w"] == 1.0).all()


@pytest.mark.parametrize("edit,said", [
    (lambda m: m["tensors"]["model/w"].update(shape=[-3, 4]), r"shape of 'model/w' is \[-3, 4\], not a list of whole"),
    (lambda m: m["tensors"]["model/w"].update(shape=[3, 4.0]), r"shape of 'model/w' is \[3, 4.0\]"),
    (lambda m: m["tensors"]["model/w"].update(shape=[300, 400]),
     r"its files are malformed: tensor 'model/w' is float32\[3, 4\] in part-00000.safetensors, float32\[300, 400\] "
     r"in the manifest"),
    (lambda m: m["files"]["part-00000.safetensors"].update(bytes=-1), r"size of part-00000.safetensors is -1"),
    (lambda m: m["files"]["part-00000.safetensors"].update(bytes=True), r"size of part-00000.safetensors is True"),
    (lambda m: m["files"]["part-00000.safetensors"].update(sha256=None), r"checksum of part-00000.safetensors is None"),
    (lambda m: m.update(step=-5), r"its manifest's step is -5"),
    (lambda m: m["tensors"]["model/w"].update(file="part-00009.safetensors"),
     r"puts tensor 'model/w' in 'part-00009.safetensors', which it does not list"),
])
def test_every_field_of_a_whole_tensor_manifest_is_checked(tmp_path, edit, said):
    _, newest, _ = _run(tmp_path)
    path = os.path.join(newest, "manifest.json")
    manifest = json.load(open(path))
    edit(manifest)
    json.dump(manifest, open(path, "w"))
    with pytest.raises(CheckpointError, match=rf"checkpoint '{newest}': .*{said}") as caught:
        load_checkpoint(newest)
    assert "\n" not in str(caught.value)


def test_a_newest_directory_without_a_manifest_falls_back_saying_why(tmp_path):
    ck, newest, _ = _run(tmp_path)
    os.remove(os.path.join(newest, "manifest.json"))
    with pytest.warns(UserWarning, match=r"skipping checkpoint: checkpoint '.*step-00000002' has no manifest.json "
                                         r"\(a save cut short, or one still in progress\); trying the previous one"):
        path, _, tensors = load_newest_valid(ck)
    assert path.endswith("step-00000001") and (tensors["model/b"] == 1.0).all()
    os.remove(os.path.join(ck, "step-00000001", "manifest.json"))
    with pytest.raises(CheckpointError, match=r"no valid checkpoint at .*: checkpoint '.*step-00000001' has no "
                                              r"manifest.json"):
        require_newest_valid(ck)


def test_a_checkpoint_pruned_while_it_is_read_sends_the_reader_to_the_newest(tmp_path, monkeypatch):
    """The reader verifies step 2 while a run saves step 3 with checkpoint.keep=1, which removes
    steps 1 and 2: it lists again and takes step 3, saying so (not 'its files are malformed')."""
    from elixir_ray.checkpoint import store

    ck, _, _ = _run(tmp_path)
    real = store.verify_files
    saved = []

    def verify_while_a_run_saves(fs, root, files):
        if not saved:
            saved.append(save_checkpoint(ck, 3, _weights(3.0), {}, keep=1))
        return real(fs, root, files)

    monkeypatch.setattr(store, "verify_files", verify_while_a_run_saves)
    with pytest.warns(UserWarning, match=r"checkpoint '.*step-00000002' was removed while it was read \(pruned by a "
                                         r"run's checkpoint.keep after a newer save\?\): taking the newest again"):
        path, manifest, tensors = load_newest_valid(ck)
    assert path == saved[0] and manifest["step"] == 3 and (tensors["model/w"] == 3.0).all()
    assert list_checkpoints(ck) == saved


def _shards_checkpoint(tmp_path):
    """A worker-written checkpoint of two ranks (tests/test_checkpoint_store.py's shards)."""
    from test_checkpoint_store import _ranks_write, _two_rank_shards

    shards, layout = _two_rank_shards()
    path, _ = _ranks_write(str(tmp_path / "ck"), 1, shards, layout)
    return path


@pytest.mark.parametrize("edit,said", [
    (lambda m: m["shards"].update(world=10**9), r"world size is 1000000000, but it lists \d+ file\(s\) and every rank"),
    (lambda m: m["shards"]["layout"]["chunks"][0].update(size=0),
     r"chunk 0 is sharded over 2 ranks with 0 elements, not a positive multiple of 2"),
    (lambda m: m["shards"]["layout"]["chunks"][0].update(size=7), r"chunk 0 is sharded over 2 ranks with 7 elements"),
    (lambda m: m["shards"]["layout"]["chunks"][0].update(shard_ranks=[0, 2]),
     r"chunk 0 names the ranks \[0, 2\] as holding its shards, not distinct ranks below 2"),
    (lambda m: m["shards"]["layout"]["chunks"][1].update(shard_ranks=[0]), r"chunk 1 names the ranks \[0\]"),
    (lambda m: m["shards"]["layout"].pop("chunks"), r"its layout does not list its chunks, slots and buffers"),
    (lambda m: m["shards"]["layout"]["slots"][0].update(numel=600), r"slot 'w' ends at element 600, past its chunk's 8"),
    (lambda m: m["shards"]["layout"]["slots"][0].update(chunk=5), r"slot 'w' is in chunk 5, not one of its 2"),
    (lambda m: m["shards"]["layout"]["slots"][0].update(shape=[3, 3]), r"slot 'w' has shape \[3, 3\], not 6 elements"),
    (lambda m: [info.update(rank=0) for info in m["files"].values()], r"lists no file of rank 1 of 2"),
    (lambda m: m["shards"]["layout"].update(world=3), r"its layout's world size is 3, its manifest's 2"),
    (lambda m: m["shards"]["layout"]["chunks"][1].update(size=8),
     r"its files are malformed: rank 0's chunk/1/master has shape \[4\], its layout says \[8\]"),
    (lambda m: m["shards"]["layout"]["buffers"].append("missing"), r"rank 0's files hold no buffer 'missing'"),
    (lambda m: m["tensors"]["model/w"].update(shape=[3, 2]),
     r"tensor 'model/w' has shape \[2, 3\] in the files, \[3, 2\] in the manifest"),
])
def test_every_field_of_a_worker_written_manifest_is_checked_in_python_integers(tmp_path, edit, said):
    """`world: 10**9` would allocate until memory ran out, a chunk size of 0 divide by zero, a
    missing `chunks` raise KeyError: each is one line naming the field instead."""
    path = _shards_checkpoint(tmp_path)
    manifest_path = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_path))
    edit(manifest)
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}': .*{said}") as caught:
        load_checkpoint(path)
    assert "\n" not in str(caught.value)


def test_a_manifest_naming_a_huge_model_is_refused_before_sample_builds_it(tmp_path, monkeypatch):
    """The manifest's run config names gpt-10b, its tensors are a tiny model's: `sample` compares the
    shapes first and never builds the 10B model."""
    from elixir_ray import generate as sample_module
    from elixir_ray.run.resolved import as_config
    from elixir_ray.model.factory import init_reference_model

    from conftest import tiny_config

    cfg = as_config({**tiny_config("unused.arrow", tmp_path), "model": {"n_layers": 2, "seq_len": 16}})
    tensors = {f"model/{k}": v.detach().numpy() for k, v in init_reference_model(cfg).state_dict().items()}
    config = {**cfg.to_dict(), "model": {"size": "gpt-10b"}}
    save_checkpoint(str(tmp_path / "ck"), 1, tensors, {"config": config, "tokenizer": "bytes"})
    built = []
    monkeypatch.setattr(sample_module, "empty_model", lambda *a, **k: built.append(a) or pytest.fail("built"))
    with pytest.raises(CheckpointError, match=r"checkpoint '.*step-00000001' does not hold the model its config "
                                              r"\(model.size gpt-10b\) builds: "):
        sample_module.sample(str(tmp_path / "ck"), max_tokens=1, device="cpu")
    assert not built
