import numpy as np
import pytest

from elixir_ray.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, save_checkpoint
from elixir_ray.checkpoint import safetensors_io


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
    with pytest.raises(ValueError):
        safetensors_io.decode(payload[:-5])
    with pytest.raises(ValueError):
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
