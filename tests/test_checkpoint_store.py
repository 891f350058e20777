import json
import os
import time
from datetime import datetime, timezone

import numpy as np
import pyarrow.fs as pafs
import pytest
from pyarrow._fs import _MockFileSystem

from elixir_ray.checkpoint import (CheckpointError, check_compatible, delete_checkpoint, list_checkpoints,
                                   load_checkpoint, read_manifest, save_checkpoint)
from elixir_ray.checkpoint import safetensors_io
from elixir_ray.checkpoint.store import _list, _load_checkpoint, write_checkpoint


def _tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"model/w": rng.standard_normal((3, 4)).astype(np.float32),
            "model/b": rng.standard_normal(4).astype(np.float32),
            "rng/state": rng.integers(0, 255, 16).astype(np.uint8)}


def test_safetensors_round_trip():
    t = _tensors()
    out, meta = safetensors_io.decode(safetensors_io.encode(t, {"k": "v"}))
    assert meta == {"k": "v"}
    for k in t:
        np.testing.assert_array_equal(out[k], t[k])


def test_safetensors_readable_by_reference_library():
    st = pytest.importorskip("safetensors.numpy")
    t = _tensors()
    loaded = st.load(safetensors_io.encode(t))
    for k in t:
        np.testing.assert_array_equal(loaded[k], t[k])


def test_safetensors_rejects_truncation():
    payload = safetensors_io.encode(_tensors())
    with pytest.raises(ValueError, match="offsets outside the file"):
        safetensors_io.decode(payload[:-5])
    with pytest.raises(ValueError, match="truncated safetensors file: no header length"):
        safetensors_io.decode(payload[:4])


def test_save_load_keep_and_checksum(tmp_path):
    uri = str(tmp_path / "ck")
    for step in (1, 2, 3):
        save_checkpoint(uri, step, _tensors(step), {"samples_consumed": step * 8}, keep=2, part_bytes=40)
    found = list_checkpoints(uri)
    assert [p.rsplit("-", 1)[1] for p in found] == ["00000002", "00000003"]
    manifest, tensors = load_checkpoint(found[-1])
    assert manifest["step"] == 3 and manifest["samples_consumed"] == 24
    assert len(manifest["files"]) > 1  # split into parts
    for k, v in _tensors(3).items():
        np.testing.assert_array_equal(tensors[k], v)
    # flip one byte in a part: the checksum catches it
    shard = tmp_path / "ck" / "step-00000003" / manifest["tensors"]["model/w"]["file"]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(found[-1])


def test_uncommitted_checkpoints_are_invisible(tmp_path):
    uri = tmp_path / "ck"
    (uri / ".tmp-step-00000009-abcd").mkdir(parents=True)
    (uri / "step-00000010").mkdir()  # no manifest: a crash mid-write on a non-atomic store
    assert list_checkpoints(str(uri)) == []


def test_a_checkpoint_with_extra_model_tensors_is_refused():
    """A bigger model's checkpoint (more layers) has every tensor the model needs and then some."""
    manifest = {"tensors": {"model/w": {"shape": [3, 4]}, "model/b": {"shape": [4]},
                            "model/blocks.2.w": {"shape": [4]}, "model/blocks.3.w": {"shape": [4]},
                            "optim/w/exp_avg": {"shape": [3, 4]}, "rng/state": {"shape": [16]}}}
    with pytest.raises(CheckpointError, match=r"it has tensor 'model/blocks.2.w', which this model does not have"):
        check_compatible(manifest, {"model/w": (3, 4), "model/b": (4,)})
    # only the model's own namespace is compared: optimizer moments and RNG state are not model tensors
    check_compatible(manifest, {"model/w": (3, 4), "model/b": (4,), "model/blocks.2.w": (4,),
                                "model/blocks.3.w": (4,)})


def test_a_manifest_without_its_fields_is_unreadable(tmp_path):
    uri = str(tmp_path / "ck")
    path = save_checkpoint(uri, 1, _tensors(), {})
    (tmp_path / "ck" / "step-00000001" / "manifest.json").write_text(
        json.dumps({"format": "elixir_ray.checkpoint/1", "step": 1}))
    with pytest.raises(CheckpointError, match="without its step, files or tensors"):
        read_manifest(path)


class ObjectStoreHandler(pafs.FileSystemHandler):
    """pyarrow's in-memory filesystem with an object store's `move`: Arrow's S3FileSystem::Move copies
    one object and deletes it ("We don't implement moving directories", arrow/filesystem/s3fs.cc), so
    moving a directory fails there; GCS is the same. Everything else is the real mock filesystem."""

    def __init__(self):
        self.fs = _MockFileSystem(datetime.now(timezone.utc))

    def get_type_name(self):
        return "object-store"

    def move(self, src, dest):
        if self.fs.get_file_info(src).type == pafs.FileType.Directory:
            raise OSError(f"moving directories is not supported: {src}")
        self.fs.move(src, dest)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self.fs.delete_dir_contents("", accept_root_dir=True)

    def delete_file(self, path):
        self.fs.delete_file(path)

    def copy_file(self, src, dest):
        self.fs.copy_file(src, dest)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return self.fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)

    def normalize_path(self, path):
        return self.fs.normalize_path(path)


def test_object_store_commits_by_writing_the_manifest_last():
    """No directory rename on an object store: the parts go into step-*/ and the manifest commits them."""
    fs = pafs.PyFileSystem(ObjectStoreHandler())
    root = "bucket/run/checkpoints"
    fs.create_dir(root, recursive=True)
    for step in (1, 2):
        path = write_checkpoint(fs, root, step, _tensors(step), {"samples_consumed": step * 8}, part_bytes=40)
        assert path == f"{root}/step-{step:08d}"
    # the same step written again replaces the earlier one (its parts, not only its manifest)
    write_checkpoint(fs, root, 2, {"model/w": np.ones((2, 2), np.float32)}, {"samples_consumed": 99})
    assert _list(fs, root) == [f"{root}/step-00000001", f"{root}/step-00000002"]
    manifest, tensors = _load_checkpoint(fs, f"{root}/step-00000002", "step 2")
    assert manifest["samples_consumed"] == 99 and list(tensors) == ["model/w"]
    assert sorted(i.base_name for i in fs.get_file_info(pafs.FileSelector(f"{root}/step-00000002"))) == \
        ["manifest.json", "part-00000.safetensors"]
    manifest, tensors = _load_checkpoint(fs, f"{root}/step-00000001", "step 1")
    for k, v in _tensors(1).items():
        np.testing.assert_array_equal(tensors[k], v)
    assert not [i for i in fs.get_file_info(pafs.FileSelector(root)) if i.base_name.startswith(".tmp")]


def test_a_failed_object_store_write_leaves_no_checkpoint():
    fs = pafs.PyFileSystem(ObjectStoreHandler())
    # the first part is written, the second cannot be encoded (safetensors has no complex dtype)
    bad = {"model/a": np.zeros(3, np.float32), "model/z": np.zeros(3, np.complex64)}
    with pytest.raises(TypeError, match="safetensors cannot store"):
        write_checkpoint(fs, "bucket/ck", 3, bad, {}, part_bytes=8)
    assert _list(fs, "bucket/ck") == []
    assert fs.get_file_info("bucket/ck/step-00000003").type == pafs.FileType.NotFound


def test_stale_temporary_directories_are_removed_on_save(tmp_path):
    """A crashed save's `.tmp-step-*` is removed once it is old; one being written right now is kept."""
    root = tmp_path / "ck"
    crashed = root / ".tmp-step-00000009-abcd1234"
    crashed.mkdir(parents=True)
    (crashed / "part-00000.safetensors").write_bytes(b"half")
    busy = root / ".tmp-step-00000010-abcd1234"  # an old directory whose part is being written now
    busy.mkdir()
    (busy / "part-00000.safetensors").write_bytes(b"being written")
    two_hours_ago = time.time() - 2 * 3600
    for p in (crashed / "part-00000.safetensors", crashed, busy):
        os.utime(p, (two_hours_ago, two_hours_ago))
    save_checkpoint(str(root), 11, _tensors(), {})
    assert not crashed.exists(), "a crashed save's leftover stays forever"
    assert busy.exists(), "a save in progress lost its directory"
    assert [p.name for p in root.iterdir() if p.name.startswith(".tmp")] == [busy.name]
    assert [os.path.basename(p) for p in list_checkpoints(str(root))] == ["step-00000011"]


def test_checkpoint_uris_keep_their_scheme(tmp_path):
    """Listed checkpoints of a URI are URIs: an object store's path (bucket/key) is not a local path."""
    uri = f"file://{tmp_path}/ck"
    saved = save_checkpoint(uri, 1, _tensors(), {})
    found = list_checkpoints(uri)
    assert found == [saved] == [f"{uri}/step-00000001"]
    manifest, _ = load_checkpoint(found[0])
    assert manifest["step"] == 1
    delete_checkpoint(found[0])
    assert list_checkpoints(uri) == [] and not (tmp_path / "ck" / "step-00000001").exists()


def test_joined_state_joins_each_tensor_across_shards_only_when_read():
    """Two ranks' shards of one sharded chunk (size 8, 4 elements each) holding a [2, 3] weight that
    crosses the boundary and a 2-element bias: each tensor read is the right slice, a fresh writable
    array, and nbytes_of knows its size without joining it."""
    from elixir_ray.engine import JoinedState, assemble

    whole = np.arange(8, dtype=np.float32)
    layout = {"world": 2, "chunks": [{"size": 8, "sharded": True}], "buffers": ["running"],
              "slots": [{"name": "w", "keys": ["w", "tied.w"], "chunk": 0, "offset": 0, "numel": 6, "shape": [2, 3]},
                        {"name": "b", "keys": ["b"], "chunk": 0, "offset": 6, "numel": 2, "shape": [2]}]}
    shards = [{"chunk/0/master": whole[r * 4:(r + 1) * 4].copy(), "chunk/0/exp_avg": -whole[r * 4:(r + 1) * 4],
               "chunk/0/exp_avg_sq": whole[r * 4:(r + 1) * 4] ** 2, "slots/step": np.array([3, 0])}
              for r in range(2)]
    shards[0]["model/running"] = np.ones(2, dtype=np.float32)
    for shard in shards:
        shard["chunk/0/master"].setflags(write=False)  # as object-store memory is
    joined = JoinedState(shards, layout, extra={"rng/rank1/torch_cpu": np.zeros(3, dtype=np.uint8)})
    assert set(joined) == {"model/w", "model/tied.w", "model/b", "optim/w/exp_avg", "optim/w/exp_avg_sq",
                           "optim/w/step", "model/running", "rng/rank1/torch_cpu"}  # b never stepped
    np.testing.assert_array_equal(joined["model/w"], whole[:6].reshape(2, 3))
    np.testing.assert_array_equal(joined["model/b"], whole[6:])
    np.testing.assert_array_equal(joined["optim/w/exp_avg_sq"], (whole[:6] ** 2).reshape(2, 3))
    assert joined["optim/w/step"].tolist() == [3.0]
    assert joined.nbytes_of("model/w") == 24 and joined.nbytes_of("model/b") == 8
    value = joined["model/w"]
    value[0, 0] = 99  # a fresh array: the shard is untouched
    assert shards[0]["chunk/0/master"][0] == 0
    assert set(assemble(shards, layout)) == set(joined) - {"rng/rank1/torch_cpu"}


def test_a_joined_state_is_written_one_part_at_a_time(tmp_path):
    """The writer holds one part's tensors at a time (1 KiB parts of two 512-byte tensors here), not the
    whole state: a mapping whose reads make fresh arrays counts how many are alive at each read."""
    import gc
    import weakref
    from collections.abc import Mapping

    class Fresh(Mapping):
        def __init__(self, n):
            self.n, self.alive, self.peak = n, [], 0

        def __iter__(self):
            return (f"t{i}" for i in range(self.n))

        def __len__(self):
            return self.n

        def __getitem__(self, name):
            gc.collect()
            self.alive = [r for r in self.alive if r() is not None]
            value = np.full(128, int(name[1:]), dtype=np.float32)
            self.alive.append(weakref.ref(value))
            self.peak = max(self.peak, len(self.alive))
            return value

    tensors = Fresh(6)
    path = save_checkpoint(str(tmp_path), 1, tensors, {}, part_bytes=1024)
    assert tensors.peak <= 2, tensors.peak  # one part: two tensors
    _, back = load_checkpoint(path)
    assert sorted(back) == [f"t{i}" for i in range(6)] and all((back[f"t{i}"] == i).all() for i in range(6))
    assert len(read_manifest(path)["files"]) == 3


def _two_rank_shards():
    """Two ranks' shards of a sharded chunk (a [2, 3] weight across the boundary, a bias) and a
    replicated one, as `engine_shard` gives them, with their layout."""
    whole = np.arange(8, dtype=np.float32)
    layout = {"world": 2, "chunks": [{"size": 8, "sharded": True}, {"size": 4, "sharded": False}],
              "buffers": ["running"],
              "slots": [{"name": "w", "keys": ["w"], "chunk": 0, "offset": 0, "numel": 6, "shape": [2, 3]},
                        {"name": "b", "keys": ["b"], "chunk": 0, "offset": 6, "numel": 2, "shape": [2]},
                        {"name": "v", "keys": ["v", "tied.v"], "chunk": 1, "offset": 0, "numel": 4, "shape": [4]}]}
    shards = [{"chunk/0/master": whole[r * 4:(r + 1) * 4].copy(), "chunk/0/exp_avg": -whole[r * 4:(r + 1) * 4],
               "chunk/0/exp_avg_sq": whole[r * 4:(r + 1) * 4] ** 2, "chunk/1/master": np.full(4, 7.0, np.float32),
               "slots/step": np.array([3, 3, 0]), "rng/torch_cpu": np.full(5, r, dtype=np.uint8)}
              for r in range(2)]
    shards[0]["model/running"] = np.ones(2, dtype=np.float32)
    return shards, layout


def _ranks_write(uri: str, step: int, shards: list, layout: dict) -> tuple[str, dict]:
    """What the workers and the driver do for checkpoint.via=storage: each rank writes its shard into
    the step's directory, the driver commits; (the checkpoint's path, the files' entries)."""
    from elixir_ray.checkpoint.shards import write_rank_shard
    from elixir_ray.checkpoint.store import begin_checkpoint, commit_checkpoint

    work = begin_checkpoint(uri, step)
    files = {}
    for rank, shard in enumerate(shards):
        files.update(write_rank_shard(work, rank, shard))
    return commit_checkpoint(uri, step, work, files, layout, len(shards), {"samples_consumed": 2 * step}), files


def test_a_checkpoint_the_ranks_write_reads_back_as_whole_tensors(tmp_path):
    """checkpoint.via=storage: each rank writes its own files (tiny parts, so several each), the driver
    commits them; a reader gets the same whole tensors as joining the shards in memory, each read
    from the files only when used, and the same after pickling (as it reaches a restore's workers)."""
    import pickle

    from elixir_ray.checkpoint.shards import SHARDS_FORMAT, join_rank_shards, write_rank_shard
    from elixir_ray.checkpoint.store import begin_checkpoint, commit_checkpoint

    shards, layout = _two_rank_shards()
    uri = str(tmp_path / "ck")
    work = begin_checkpoint(uri, 4)
    assert os.path.basename(work).startswith(".tmp-step-") and list_checkpoints(uri) == []
    files = {}
    for rank, shard in enumerate(shards):
        files.update(write_rank_shard(work, rank, shard, part_bytes=16))
    assert len(files) > 4 and {info["rank"] for info in files.values()} == {0, 1}
    path = commit_checkpoint(uri, 4, work, files, layout, 2, {"samples_consumed": 8})
    assert list_checkpoints(uri) == [path] and not os.path.exists(work)
    manifest = read_manifest(path)
    assert manifest["format"] == SHARDS_FORMAT and manifest["samples_consumed"] == 8
    assert manifest["tensors"]["model/w"] == {"shape": [2, 3], "dtype": "float32"}
    expected = join_rank_shards(shards, layout)
    _, back = load_checkpoint(path)
    again = pickle.loads(pickle.dumps(back))
    assert set(back) == set(expected) == set(again) and "rng/rank1/torch_cpu" in back
    for name in expected:
        np.testing.assert_array_equal(back[name], expected[name])
        np.testing.assert_array_equal(again[name], expected[name])
    assert set(manifest["tensors"]) == set(expected)


def test_a_chunk_sharded_within_each_node_is_written_by_the_first_nodes_ranks_and_read_back(tmp_path):
    """Four ranks on two nodes: a chunk sharded within each node is whole on each node, and only the
    ranks of rank 0's node (its layout's `shard_ranks`, here 0 and 2) write their halves; a reader
    joins them, and the manifest's check reads the layout so."""
    whole = np.arange(8, dtype=np.float32)
    layout = {"world": 4, "chunks": [{"size": 8, "sharded": True, "shard_ranks": [0, 2]}], "buffers": [],
              "slots": [{"name": "w", "keys": ["w"], "chunk": 0, "offset": 0, "numel": 8, "shape": [2, 4]}]}
    shards = [{"slots/step": np.array([1])} for _ in range(4)]
    for i, rank in enumerate((0, 2)):
        shards[rank].update({"chunk/0/master": whole[i * 4:(i + 1) * 4].copy(),
                             "chunk/0/exp_avg": whole[i * 4:(i + 1) * 4] / 10, "chunk/0/exp_avg_sq": whole[:4] * 0})
    path, files = _ranks_write(str(tmp_path / "ck"), 1, shards, layout)
    _, back = load_checkpoint(path)
    np.testing.assert_array_equal(back["model/w"], whole.reshape(2, 4))
    np.testing.assert_array_equal(back["optim/w/exp_avg"], (whole / 10).reshape(2, 4))


def test_a_worker_written_checkpoint_is_refused_when_damaged_or_incomplete(tmp_path):
    """A shard file that does not match its checksum is refused on load; a commit that cannot find a
    rank's file where the driver reads (a rank on another node writing to its own disk) commits
    nothing and names the fix."""
    from elixir_ray.checkpoint.shards import write_rank_shard
    from elixir_ray.checkpoint.store import begin_checkpoint, commit_checkpoint

    shards, layout = _two_rank_shards()
    uri = str(tmp_path / "ck")
    path, files = _ranks_write(uri, 2, shards, layout)
    victim = os.path.join(path, sorted(files)[-1])
    data = bytearray(open(victim, "rb").read())
    data[-1] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        load_checkpoint(path)

    work = begin_checkpoint(uri, 3)
    files = write_rank_shard(work, 0, shards[0])
    elsewhere = str(tmp_path / "other-node")
    os.makedirs(elsewhere)
    files.update(write_rank_shard(elsewhere, 1, shards[1]))  # rank 1 wrote to a disk of its own
    with pytest.raises(CheckpointError, match="not where the driver reads .*shared filesystem"):
        commit_checkpoint(uri, 3, work, files, layout, 2, {"samples_consumed": 6})
    assert [os.path.basename(p) for p in list_checkpoints(uri)] == ["step-00000002"] and not os.path.exists(work)


def test_zero_dimensional_tensors_keep_their_shape_in_both_writers(tmp_path):
    """A 0-d buffer (BatchNorm's num_batches_tracked) is written as shape [] and read back so."""
    import io

    tensors = {"scalar": np.array(3.5, dtype=np.float32), "count": np.array(7, dtype=np.int64),
               "flags": np.array([True, False]), "empty": np.zeros((0, 3), dtype=np.float32)}
    back, _ = safetensors_io.decode(safetensors_io.encode(tensors))
    assert {k: v.shape for k, v in back.items()} == {k: v.shape for k, v in tensors.items()}
    out = io.BytesIO()
    safetensors_io.write(out, list(tensors), tensors.__getitem__, safetensors_io.spec_of_mapping(tensors))
    assert out.getvalue() == safetensors_io.encode(tensors)
    path = save_checkpoint(str(tmp_path), 1, tensors, {})
    _, loaded = load_checkpoint(path)
    assert loaded["scalar"].shape == () and float(loaded["scalar"]) == 3.5 and int(loaded["count"]) == 7


def test_a_restoring_rank_reads_only_its_part_of_a_sharded_tensor(tmp_path, monkeypatch):
    """`read_range` of a worker-written checkpoint reads just the bytes asked for, from the rank files
    that hold them: a rank restoring its shard of a large model does not read the whole state."""
    from elixir_ray.checkpoint import shards

    shard_list, layout = _two_rank_shards()
    path, _ = _ranks_write(str(tmp_path / "ck"), 1, shard_list, layout)
    _, joined = load_checkpoint(path)
    reads = []
    real = shards._CheckpointFiles.read_into
    monkeypatch.setattr(shards._CheckpointFiles, "read_into",
                        lambda self, name, offset, out: reads.append((name[:10], out.nbytes)) or real(self, name, offset, out))
    # model/w is chunk 0's elements [0, 6): rank 0 holds [0, 4), rank 1 [4, 8)
    np.testing.assert_array_equal(joined.read_range("model/w", 4, 6), [4.0, 5.0])
    assert reads == [("rank-00001", 8)]
    reads.clear()
    np.testing.assert_array_equal(joined.read_range("optim/w/exp_avg", 3, 5), [-3.0, -4.0])
    assert reads == [("rank-00000", 4), ("rank-00001", 4)]
    reads.clear()
    np.testing.assert_array_equal(joined.read_range("model/v", 1, 3), [7.0, 7.0])  # replicated: rank 0's
    assert reads == [("rank-00000", 8)]
    np.testing.assert_array_equal(joined.read_range("model/b", -2, 5), [6.0, 7.0])  # clamped to the tensor


def test_a_file_shorter_or_longer_than_its_manifest_says_is_refused(tmp_path):
    """The manifest's byte count is checked beside the checksum: the lazy readers trust it."""
    shards, layout = _two_rank_shards()
    path, files = _ranks_write(str(tmp_path / "ck"), 1, shards, layout)
    manifest_path = os.path.join(path, "manifest.json")
    manifest = json.load(open(manifest_path))
    name = sorted(files)[0]
    manifest["files"][name]["bytes"] += 16
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(CheckpointError, match=f"{name} has .* bytes, its manifest says"):
        load_checkpoint(path)


def test_keep_never_removes_the_step_just_saved(tmp_path):
    """An older step saved after a newer one with keep=1 returned the path it had just deleted."""
    root = str(tmp_path / "ck")
    save_checkpoint(root, 300, _tensors(), {})
    path = save_checkpoint(root, 250, _tensors(1), {}, keep=1)
    assert os.path.exists(os.path.join(path, "manifest.json")), path
    np.testing.assert_array_equal(load_checkpoint(path)[1]["model/w"], _tensors(1)["model/w"])


def test_a_step_saved_again_replaces_it_and_a_replace_cut_short_loses_neither_copy(tmp_path):
    """A local save of a step that exists replaces the old copy without a moment with neither: were the
    old one deleted before the new one is renamed in, a kill between the two would leave no checkpoint
    of that step, and the complete new copy would be removed as a crashed save's leftover an hour later."""
    root = tmp_path / "ck"
    save_checkpoint(str(root), 200, _tensors(), {"which": "old"})
    save_checkpoint(str(root), 200, _tensors(1), {"which": "new"})
    assert read_manifest(str(root / "step-00000200"))["which"] == "new"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".tmp")]  # the old copy is gone
    # the state a kill between the renames leaves: the old copy aside, the new one under its temporary name
    save_checkpoint(str(tmp_path / "other"), 200, _tensors(2), {"which": "newer"})
    os.rename(root / "step-00000200", root / ".tmp-step-00000200-replaced")
    os.rename(tmp_path / "other" / "step-00000200", root / ".tmp-step-00000200-1234abcd")
    assert list_checkpoints(str(root)) == []  # a commit this young may still be under way: left alone
    minute_ago = time.time() - 90
    for p in (root / ".tmp-step-00000200-replaced", root / ".tmp-step-00000200-1234abcd"):
        os.utime(p, (minute_ago, minute_ago))
    assert [os.path.basename(p) for p in list_checkpoints(str(root))] == ["step-00000200"]
    assert read_manifest(str(root / "step-00000200"))["which"] == "newer"  # the new copy, not the replaced one
    np.testing.assert_array_equal(load_checkpoint(str(root / "step-00000200"))[1]["model/w"], _tensors(2)["model/w"])
    # a save killed while writing its manifest is no complete copy: never put in place
    save_checkpoint(str(tmp_path / "third"), 300, _tensors(), {})
    cut = root / ".tmp-step-00000300-5678abcd"
    os.rename(tmp_path / "third" / "step-00000300", cut)
    with open(cut / "manifest.json", "r+b") as f:
        f.truncate(40)
    os.utime(cut, (minute_ago, minute_ago))
    assert [os.path.basename(p) for p in list_checkpoints(str(root))] == ["step-00000200"]


def test_a_local_checkpoint_is_on_the_disk_before_its_rename_commits_it(tmp_path, monkeypatch):
    """No file was synced: after a power loss a committed step could hold empty parts, with its
    predecessor already pruned (keep=1)."""
    synced = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fsync(fd)
    monkeypatch.setattr(os, "fsync", recording_fsync)
    root = tmp_path / "ck"
    path = save_checkpoint(str(root), 5, _tensors(), {}, part_bytes=64)  # several parts
    parts = sorted(p for p in os.listdir(path) if p.startswith("part-"))
    assert len(parts) > 1
    names = [os.path.basename(p) for p in synced]
    assert all(name in names for name in parts + ["manifest.json"]), names
    # the files and the temporary directory before the rename, then the directory that holds the step
    assert names.index("manifest.json") > max(names.index(p) for p in parts)
    assert synced[-1] == str(root)
