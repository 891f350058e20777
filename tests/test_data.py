import numpy as np
import pytest
import torch

from elixir_ray.cli import main
from elixir_ray.data.dataset import BatchSampler, TokenDataset, prepare_dataset
from elixir_ray.data.tokenizer import ByteTokenizer
from elixir_ray.errors import ConfigError


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "def f(x):\n    return x * 2  # naïve ✓\n"
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and ids.max() < 256
    assert tok.decode(ids) == text
    docs = tok.encode_documents(["ab", "c"])
    assert list(docs) == [97, 98, tok.eos_id, 99, tok.eos_id]


def test_prepare_data_round_trip(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("hello world\n")
    b.write_text("second file\n")
    out = tmp_path / "ds" / "tokens.arrow"
    assert main(["prepare-data", str(a), str(b), "--out", str(out)]) == 0
    ds = TokenDataset(str(out))
    expected = ByteTokenizer().encode_documents([a.read_bytes(), b.read_bytes()])
    np.testing.assert_array_equal(ds.tokens, expected)
    assert not list(tmp_path.glob("ds/*.tmp-*")), "temporary file left behind"
    # the same dataset read through a pyarrow filesystem URI
    ds2 = TokenDataset(f"file://{out}")
    np.testing.assert_array_equal(ds2.tokens, expected)


def test_dataset_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        TokenDataset(str(tmp_path / "nope.arrow"))
    junk = tmp_path / "junk.arrow"
    junk.write_bytes(b"not arrow at all")
    with pytest.raises(ConfigError, match="not a token dataset"):
        TokenDataset(str(junk))
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ConfigError, match="empty"):
        prepare_dataset([str(empty)], str(tmp_path / "e.arrow"))
    short = tmp_path / "short.txt"
    short.write_text("abc")
    prepare_dataset([str(short)], str(tmp_path / "s.arrow"))
    with pytest.raises(ConfigError, match="fewer than one window"):
        BatchSampler(TokenDataset(str(tmp_path / "s.arrow")), seq_len=64, seed=0)


def test_prepare_data_refuses_what_would_lose_a_file_or_mislead_before_writing(tmp_path):
    """Found by a user walkthrough: --out naming an input replaced the user's text with Arrow bytes, --out
    naming a directory ended in a rename traceback, and a directory input was said not to exist."""
    text = tmp_path / "a.txt"
    text.write_text("hello world\n")
    (tmp_path / "texts").mkdir()
    with pytest.raises(ConfigError, match="is one of the input files"):
        prepare_dataset([str(text)], str(text))
    assert text.read_text() == "hello world\n"
    with pytest.raises(ConfigError, match=r"is a directory: name the dataset file, for example .*data.arrow"):
        prepare_dataset([str(text)], str(tmp_path / "texts"))
    with pytest.raises(ConfigError, match=r"is a directory: give the text files in it \(for example .*\*.txt\)"):
        prepare_dataset([str(tmp_path / "texts")], str(tmp_path / "d.arrow"))
    with pytest.raises(ConfigError, match="does not exist \\(a pattern that matched no file reaches here as it is\\)"):
        prepare_dataset([str(tmp_path / "texts" / "*.txt")], str(tmp_path / "d.arrow"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "texts"]  # nothing written


def test_rank_slices_are_disjoint_and_deterministic(tiny_dataset):
    ds = TokenDataset(tiny_dataset)
    sampler = BatchSampler(ds, seq_len=32, seed=3)
    world, micro, accum = 3, 2, 2
    seen = []
    for rank in range(world):
        for m in range(accum):
            seen.append(sampler.rank_batch(100, rank, micro, accum, m))
    rows = {tuple(r.tolist()) for batch in seen for r in batch}
    assert len(rows) == world * micro * accum  # disjoint
    # together they are exactly the global samples [100, 112)
    expected = {tuple(r.tolist()) for r in sampler.samples(100, world * micro * accum)}
    assert rows == expected
    again = BatchSampler(TokenDataset(tiny_dataset), seq_len=32, seed=3).rank_batch(100, 1, micro, accum, 1)
    assert again.equal(seen[3])
    other_seed = BatchSampler(ds, seq_len=32, seed=4).rank_batch(100, 1, micro, accum, 1)
    assert not other_seed.equal(seen[3])


def test_epochs_wrap_around(tiny_dataset):
    sampler = BatchSampler(TokenDataset(tiny_dataset), seq_len=32, seed=0)
    n = sampler.n_windows
    batch = sampler.samples(n - 1, 3)  # crosses into the second epoch
    assert batch.shape == (3, 33)
    assert torch.equal(batch[0], sampler.samples(0, n)[-1])  # the first epoch's last window
    first, second = (sorted(map(tuple, sampler.samples(e * n, n).tolist())) for e in (0, 1))
    assert first == second  # the second epoch takes every window again, as the first did
    assert not torch.equal(sampler.samples(0, n), sampler.samples(n, n))  # in another order


def test_a_dataset_smaller_than_one_global_batch_is_warned_of_with_its_sizes(tmp_path):
    import warnings

    from elixir_ray.run.preflight import warn_if_data_under_one_batch
    from elixir_ray.run.resolved import as_config, resolve_run

    text = tmp_path / "a.txt"
    text.write_bytes(bytes(range(32, 127)) * 5)  # 475 bytes + an end-of-document token: 7 windows of 65
    prepare_dataset([str(text)], str(tmp_path / "d.arrow"))
    run = resolve_run(as_config({"model": {"size": "tiny", "seq_len": 64}, "data": {"path": str(tmp_path / "d.arrow")},
                                 "train": {"micro_batch": 4}}))
    with pytest.warns(UserWarning, match=r"holds 7 window\(s\) of 65 tokens, fewer than one global batch of 8 "
                                         r"\(train.micro_batch=4 x train.grad_accum=1 x 2 worker\(s\)\)"):
        warn_if_data_under_one_batch(run, num_workers=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_data_under_one_batch(run, num_workers=1)  # 7 windows hold a batch of 4


def _token_file(path, tokens, vocab_size: int = 257) -> str:
    """A token dataset whose metadata says `vocab_size`, whatever ids `tokens` hold (a hand-made or
    edited file)."""
    from elixir_ray.data.dataset import TokenFileWriter

    writer = TokenFileWriter(str(path), np.uint16)
    writer.append(np.asarray(tokens, dtype=np.uint16))
    writer.commit({"tokenizer": "bytes", "tokenizer_file": "bytes", "vocab_size": vocab_size, "documents": 1})
    return str(path)


def test_token_ids_at_or_above_the_models_vocabulary_are_refused_from_the_data_not_its_metadata(tmp_path):
    """The metadata says 257 and the model has 260; one id of 300 failed inside the workers' embedding,
    after a restart spent on it."""
    from elixir_ray.run.preflight import check_data
    from elixir_ray.run.resolved import as_config, resolve_run

    tokens = np.arange(4000) % 256
    tokens[1234] = 300
    bad = _token_file(tmp_path / "bad.arrow", tokens)
    good = _token_file(tmp_path / "good.arrow", np.arange(4000) % 256)
    cfg = {"model": {"size": "tiny", "seq_len": 16, "vocab_size": 260}, "data": {"path": bad}}
    with pytest.raises(ConfigError, match=rf"^data.path '{bad}' holds token id 300, at or above model.vocab_size=260, "
                                          rf"though its metadata says vocab_size 257: [^\n]*$"):
        check_data(resolve_run(as_config(cfg)))
    cfg["data"]["path"], cfg["eval"] = good, {"path": bad, "windows": 1}
    with pytest.raises(ConfigError, match=r"^eval.path .* holds token id 300, at or above model.vocab_size=260"):
        check_data(resolve_run(as_config(cfg)))
    cfg["eval"]["path"] = _token_file(tmp_path / "held-out.arrow", np.arange(2000) % 256)
    check_data(resolve_run(as_config(cfg)))


def test_a_large_token_file_is_scanned_in_evenly_spaced_slices(tmp_path, monkeypatch):
    from elixir_ray.data import dataset

    tokens = np.arange(200_000) % 250
    for planted in (0, 199_999, 123_456):  # the first slice, the last token, and between slices
        tokens[planted] = 260
    path = _token_file(tmp_path / "d.arrow", tokens)
    assert TokenDataset(path).largest_id() == (260, True)
    monkeypatch.setattr(dataset, "SCAN_WHOLE_TOKENS", 10_000)
    monkeypatch.setattr(dataset, "SCAN_SLICE_TOKENS", 1_000)
    monkeypatch.setattr(dataset, "SCAN_SLICES", 4)
    ds = TokenDataset(path)
    largest, whole = ds.largest_id()
    assert (largest, whole) == (260, False)
    ds.tokens = ds.tokens.copy()
    ds.tokens[[0, 199_999]] = 1  # only the id between the slices is left: a sampled scan need not see it
    assert ds.largest_id() == (249, False)
