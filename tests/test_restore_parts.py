"""A restore moves only what a rank reads: snapshot shards in parts, checkpoint reads counted, and
the fingerprints that tell a node's copy of a file from another file."""

from collections.abc import Mapping

import numpy as np
import pytest

from elixir_ray.cluster.shared_storage import fingerprint
from elixir_ray.cluster.shard_parts import (CountedReads, RankShardRefs, RestoreReads, copy_here, fetch_whole,
                                            read_snapshot, split_shard, with_keys)

# two ranks: chunk 0 (8 elements) sharded, 4 each; chunk 1 (4 elements) replicated, whole on rank 0
LAYOUT = {"world": 2, "buffers": [],
          "chunks": [{"size": 8, "sharded": True}, {"size": 4, "sharded": False}],
          "slots": [{"name": "a", "keys": ["a"], "chunk": 0, "offset": 0, "numel": 8, "shape": [8]},
                    {"name": "b", "keys": ["b"], "chunk": 1, "offset": 0, "numel": 4, "shape": [4]}]}


def rank_shard(rank: int) -> dict:
    tensors = {"chunk/0/master": np.arange(4, dtype=np.float32) + 4 * rank,
               "slots/step": np.zeros(2, dtype=np.int64), "rng/torch_cpu": np.full(3, rank, dtype=np.uint8)}
    if rank == 0:
        tensors["chunk/1/master"] = np.arange(100, 104, dtype=np.float32)
    return {"tensors": tensors, "layout": LAYOUT if rank == 0 else None}


def put_parts(ray, rank: int) -> RankShardRefs:
    header, rest, *chunks = split_shard({"step": 1}, rank_shard(rank), chunks=2)
    return RankShardRefs(rest=ray.put(rest), chunks=tuple(ray.put(c) for c in chunks),
                         chunk_dtypes=header["chunk_dtypes"])


def test_a_restoring_rank_fetches_only_the_parts_holding_what_it_reads(ray_cluster):
    shards = [put_parts(ray_cluster, rank) for rank in range(2)]
    reads = RestoreReads()
    state = read_snapshot(shards, reads)
    rests = 2 * (16 + 3)  # every rank's step counts and random state
    assert reads.bytes == rests  # nothing of the chunks yet
    assert state.spec_of("model/a") == ((8,), np.float32) and state.nbytes_of("model/b") == 16
    assert reads.bytes == rests  # a tensor's dtype is told by the header, not fetched
    np.testing.assert_array_equal(state.read_range("model/a", 4, 8), [4, 5, 6, 7])  # rank 1's half of chunk 0
    assert reads.bytes == rests + 16  # rank 1's part of chunk 0 alone
    np.testing.assert_array_equal(state["model/b"], np.arange(100, 104))  # replicated: rank 0's whole chunk 1
    assert reads.bytes == rests + 16 + 16
    np.testing.assert_array_equal(state["rng/rank1/torch_cpu"], [1, 1, 1])
    # joined whole (the persister's copy, a liveness check), the parts give the shard as it was handed over
    whole = fetch_whole(shards, timeout_s=30)
    assert sorted(whole[0]["tensors"]) == sorted(rank_shard(0)["tensors"]) and whole[0]["layout"] == LAYOUT


@pytest.mark.parametrize("batch_bytes", [1, 40, 1 << 30], ids=["one-at-a-time", "some-at-a-time", "all-at-once"])
def test_the_driver_copies_a_snapshot_in_batches_of_objects_and_keeps_what_it_knows(ray_cluster, batch_bytes):
    """The persister's copy of a snapshot's shards to the driver's node: the headers say each
    object's bytes, so that several are pulled with one get (a pull from another node waits for a
    round of Ray's object manager); the copies hold the same arrays in new objects, with what the
    headers said. A shard of sizes not said, and a shard that is one object, are copied too."""
    header, rest, *chunks = split_shard({"step": 1}, rank_shard(0), chunks=2)
    assert header["part_bytes"] == [16 + 3, 16, 16]  # rest: step counts and random state; each chunk's slices
    said, = with_keys([RankShardRefs(rest=ray_cluster.put(rest), chunks=tuple(ray_cluster.put(c) for c in chunks),
                                     chunk_dtypes={})], [header])
    assert said.part_bytes == (19, 16, 16) and said.chunk_dtypes == header["chunk_dtypes"]
    unsaid = put_parts(ray_cluster, 1)
    whole = ray_cluster.put(rank_shard(1))
    copied_said, copied_unsaid, copied_whole = copy_here([said, unsaid, whole], timeout_s=30, batch_bytes=batch_bytes)
    assert not ray_cluster.get(copied_whole)["tensors"].keys() ^ rank_shard(1)["tensors"].keys()
    for shard, copy in ((said, copied_said), (unsaid, copied_unsaid)):
        assert not set(copy.refs) & set(shard.refs)
        assert (copy.chunk_dtypes, copy.part_bytes) == (shard.chunk_dtypes, shard.part_bytes)
        for original, copied in zip(ray_cluster.get(shard.refs), ray_cluster.get(copy.refs)):
            tensors, copied = original.get("tensors", original), copied.get("tensors", copied)
            assert sorted(copied) == sorted(tensors)
            for key, value in tensors.items():
                np.testing.assert_array_equal(copied[key], value)


def test_a_checkpoints_reads_are_counted_and_a_plain_dict_counts_whole():
    tensors = {"model/a": np.zeros(10, dtype=np.float32), "optim/a/step": np.ones(1, dtype=np.float32)}
    reads = RestoreReads()
    CountedReads(tensors, reads).read_range("model/a", 0, 2)
    assert reads.bytes == 44  # the dict came whole with its object

    class Lazy(Mapping):  # a mapping read on demand (a checkpoint's), not a plain dict
        __getitem__, __iter__, __len__ = tensors.__getitem__, tensors.__iter__, tensors.__len__

    lazy = RestoreReads()
    counted = CountedReads(Lazy(), lazy)
    np.testing.assert_array_equal(counted.read_range("model/a", 2, 5), np.zeros(3))
    assert lazy.bytes == 12 and counted.spec_of("model/a") == ((10,), np.float32)


def test_a_fingerprint_tells_a_copy_from_another_file(tmp_path):
    data = np.random.default_rng(0).integers(0, 255, 5 * 2**20, dtype=np.uint8).tobytes()
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "copy").write_bytes(data)
    (tmp_path / "other").write_bytes(data[:-1] + b"x")  # the same size, one byte apart in the last block
    assert fingerprint(str(tmp_path / "a")) == fingerprint(str(tmp_path / "copy")) is not None
    assert fingerprint(str(tmp_path / "other")) != fingerprint(str(tmp_path / "a"))
    assert fingerprint(str(tmp_path / "missing")) is None


@pytest.mark.parametrize("size", [0, 10, 3 * 2**20 + 1])
def test_a_fingerprint_reads_small_and_empty_files(tmp_path, size):
    (tmp_path / "f").write_bytes(b"y" * size)
    assert fingerprint(str(tmp_path / "f")).startswith(f"{size}:")
