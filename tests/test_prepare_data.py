"""`prepare-data` with the user's own tokenizer and corpus formats: a Hugging Face tokenizer.json
(built here with the `tokenizers` library, nothing downloaded), .jsonl and .parquet inputs, ids past
65,535, and the errors a user meets first."""

import json
import math
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from conftest import tiny_config

from elixir_ray import train
from elixir_ray.checkpoint import read_manifest
from elixir_ray.cli import main
from elixir_ray.data.dataset import BatchSampler, TokenDataset, prepare_dataset, read_metadata
from elixir_ray.errors import ConfigError

tokenizers = pytest.importorskip("tokenizers")

DOCS = ["The cat sat on the mat.\nIt was warm.\n", "Tokenizers split text into pieces: ünïcödé too ✓\n",
        "def f(x):\n    return x * 2\n" * 20]


def _bpe(tmp_path, vocab_size=300, name="tokenizer.json"):
    """A small byte-level BPE tokenizer, trained here on the test documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 3, trainer)
    path = tmp_path / name
    tok.save(str(path))
    return tok, path


def _expected(tok, docs, eos="<|endoftext|>"):
    ids = []
    for d in docs:
        ids += tok.encode(d, add_special_tokens=False).ids + [tok.token_to_id(eos)]
    return np.array(ids)


def test_a_tokenizer_file_gives_its_ids_and_one_end_of_document_token_per_document(tmp_path, capsys):
    tok, path = _bpe(tmp_path)
    text = tmp_path / "a.txt"
    text.write_text(DOCS[0])
    lines = tmp_path / "b.jsonl"
    lines.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS[1:])) + "\n")
    table = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": DOCS[::-1], "n": [1, 2, 3]}), table, row_group_size=2)
    out = tmp_path / "ds.arrow"
    assert main(["prepare-data", str(text), str(lines), str(table), "--out", str(out), "--tokenizer", str(path),
                 "--text-field", "body", "--quiet"]) == 2  # the .jsonl has no `body` field
    assert "b.jsonl:1 has no text field 'body' (its fields: text, id): name the field with --text-field" in \
        capsys.readouterr().err and not out.exists()
    pq.write_table(pa.table({"text": DOCS[::-1], "n": [1, 2, 3]}), table, row_group_size=2)
    assert main(["prepare-data", str(text), str(lines), str(table), "--out", str(out), "--tokenizer",
                 str(path)]) == 0
    shown = capsys.readouterr()
    ds = TokenDataset(str(out))
    np.testing.assert_array_equal(ds.tokens, _expected(tok, [DOCS[0]] + DOCS[1:] + DOCS[::-1]))
    assert ds.tokens.dtype == np.uint16 and ds.vocab_size == tok.get_vocab_size() == 300
    assert read_metadata(str(out))["documents"] == "6"
    assert "6 documents" in shown.out and "token ids lie below 300" in shown.out
    assert "tokenising:" in shown.err  # the progress line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.jsonl", "c.parquet", "ds.arrow",
                                                          "tokenizer.json"]  # no scratch file left


def test_a_large_text_file_read_in_pieces_gives_the_tokens_of_the_whole_file(tmp_path):
    """Pieces are cut where a line starts with text, where this tokenizer splits anyway: the same tokens. A long run
    without one is cut at a character boundary: never inside a multi-byte character."""
    tok, path = _bpe(tmp_path)
    text = tmp_path / "big.txt"
    text.write_text("".join(DOCS) * 30)
    whole = prepare_dataset([str(text)], str(tmp_path / "whole.arrow"), tokenizer=str(path))
    pieces = prepare_dataset([str(text)], str(tmp_path / "pieces.arrow"), tokenizer=str(path), piece_bytes=64)
    assert whole == pieces
    np.testing.assert_array_equal(TokenDataset(str(tmp_path / "pieces.arrow")).tokens,
                                  _expected(tok, [text.read_text()]))
    with text.open("a") as f:
        f.write("x" * 300 + "é" * 301 + "✓" * 99)  # 901 bytes past the last line end, 2- and 3-byte characters
    prepare_dataset([str(text)], str(tmp_path / "pieces.arrow"), tokenizer=str(path), piece_bytes=64)
    ids = TokenDataset(str(tmp_path / "pieces.arrow")).tokens
    assert tok.decode(ids[:-1].tolist()) == text.read_text()
    prepare_dataset([str(text)], str(tmp_path / "bytes.arrow"), piece_bytes=64)  # the byte-level tokenizer: exact
    raw = np.frombuffer(text.read_bytes(), dtype=np.uint8)
    np.testing.assert_array_equal(TokenDataset(str(tmp_path / "bytes.arrow")).tokens, np.append(raw, 256))


def test_ids_past_65535_are_kept_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("w1 w65535 w65536 w69999 nope\n" * 40)
    prepare_dataset([str(tmp_path / "a.txt")], str(tmp_path / "d.arrow"), tokenizer=str(tmp_path))
    ds = TokenDataset(str(tmp_path / "d.arrow"))
    assert ds.tokens.dtype == np.uint32 and ds.vocab_size == 70_002
    assert list(ds.tokens[:6]) == [1, 65535, 65536, 69999, 70000, 1] and ds.tokens[-1] == 70_001  # eos: </s>
    windows = BatchSampler(ds, seq_len=16, seed=0).samples(0, 8)
    assert windows.dtype == torch.int64 and (windows == 65536).any() and int(windows.max()) == 70_000


def test_the_end_of_document_token_comes_from_the_flag_the_saved_config_or_a_known_name(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"a": 0, "b": 1, "[UNK]": 2, "<end>": 3, "</s>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("a b a\n")
    out = str(tmp_path / "d.arrow")

    def last_token(**kw):
        prepare_dataset([str(tmp_path / "a.txt")], out, tokenizer=str(tmp_path / "tokenizer.json"), **kw)
        return int(TokenDataset(out).tokens[-1])

    assert last_token() == 4  # </s>, a known name
    assert last_token(eos_token="<end>") == 3
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<end>", "lstrip": False}}))
    assert last_token() == 3  # as transformers saves it
    with pytest.raises(ConfigError, match=r"--eos-token '<nope>' is not a token of .*tokenizer.json"):
        last_token(eos_token="<nope>")
    (tmp_path / "tokenizer_config.json").unlink()
    del vocab["</s>"]
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="which token ends a document is not known .* name it with --eos-token"):
        last_token()


def test_a_saved_truncation_does_not_cut_documents_short(tmp_path):
    tok, path = _bpe(tmp_path)
    tok.enable_truncation(max_length=4)
    tok.save(str(path))
    (tmp_path / "a.txt").write_text("".join(DOCS))
    n = prepare_dataset([str(tmp_path / "a.txt")], str(tmp_path / "d.arrow"), tokenizer=str(path))
    assert n > 100


def test_bad_inputs_are_refused_before_anything_is_written(tmp_path):
    _, path = _bpe(tmp_path)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 au lait\n".encode("latin-1"))
    out = tmp_path / "d.arrow"
    with pytest.raises(ConfigError, match=r"latin1.txt' is not UTF-8 text \(byte 3\): .* or use --tokenizer bytes"):
        prepare_dataset([str(latin1)], str(out), tokenizer=str(path))
    prepare_dataset([str(latin1)], str(out))  # the byte-level tokenizer takes any bytes
    out.unlink()
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"content": ["x"]}), table)
    with pytest.raises(ConfigError, match=r"has no column 'text' \(its columns: content\): name the text column"):
        prepare_dataset([str(latin1), str(table)], str(out))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(ConfigError, match=r"broken.jsonl:2 is not a JSON line"):
        prepare_dataset([str(broken)], str(out))
    with pytest.raises(ConfigError, match=r"no tokenizer.json in .*\. Give a tokenizer.json file"):
        prepare_dataset([str(latin1)], str(out), tokenizer=str(_empty_dir(tmp_path)))
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        prepare_dataset([str(latin1)], str(out), tokenizer=str(broken))
    with pytest.raises(ConfigError, match="--eos-token is for a --tokenizer file"):
        prepare_dataset([str(latin1)], str(out), eos_token="</s>")
    assert not out.exists() and not list(tmp_path.glob(".tokens-*")) and not list(tmp_path.glob("*.tmp-*"))


def _empty_dir(tmp_path):
    d = tmp_path / "no-tokenizer"
    d.mkdir()
    return d


def test_a_held_out_set_from_another_tokenizer_is_refused(tmp_path):
    from elixir_ray.run.preflight import check_data
    from elixir_ray.run.resolved import as_config, resolve_run

    _, path = _bpe(tmp_path)
    (tmp_path / "a.txt").write_text("".join(DOCS) * 20)
    prepare_dataset([str(tmp_path / "a.txt")], str(tmp_path / "hf.arrow"), tokenizer=str(path))
    prepare_dataset([str(tmp_path / "a.txt")], str(tmp_path / "bytes.arrow"))
    cfg = {"model": {"size": "tiny", "seq_len": 16, "vocab_size": 300}, "data": {"path": str(tmp_path / "hf.arrow")},
           "eval": {"path": str(tmp_path / "bytes.arrow"), "windows": 1}}
    with pytest.raises(ConfigError, match=r"eval.path .* was tokenised with bytes and data.path with "
                                          r".*/tokenizer.json \(tokenizers:sha256:[0-9a-f]{16}\): .* Prepare both with the same --tokenizer"):
        check_data(resolve_run(as_config(cfg)))
    cfg["eval"]["path"] = str(tmp_path / "hf.arrow")
    cfg["model"]["vocab_size"] = 299
    with pytest.raises(ConfigError, match=r"model.vocab_size=299 is smaller than the dataset's vocabulary \(300\)"):
        check_data(resolve_run(as_config(cfg)))


@pytest.mark.extended
def test_a_run_trains_on_ids_past_65535_from_a_tokenizer_file(ray_cluster, tmp_path):
    """The workers read a uint32 dataset: the first loss is that of a uniform guess over its 70,002 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    rng = np.random.default_rng(0)
    (tmp_path / "a.jsonl").write_text("".join(
        json.dumps({"text": " ".join(f"w{i}" for i in rng.integers(60_000, 70_000, 50))}) + "\n" for _ in range(40)))
    assert main(["prepare-data", str(tmp_path / "a.jsonl"), "--out", str(tmp_path / "d.arrow"), "--tokenizer",
                 str(tmp_path / "tokenizer.json"), "--quiet"]) == 0
    cfg = tiny_config(str(tmp_path / "d.arrow"), tmp_path, model={"vocab_size": 70_002, "seq_len": 32},
                      train={"steps": 2, "micro_batch": 2})
    result = train(cfg, progress=False)
    first = result.metrics.column("loss").to_pylist()[0]
    assert abs(first - math.log(70_002)) < 0.5, first
    identity = TokenDataset(str(tmp_path / "d.arrow")).tokenizer
    manifest = read_manifest(result.checkpoint_uri)
    assert identity.startswith("tokenizers:sha256:") and manifest["tokenizer"] == identity
    assert manifest["tokenizer_file"] == f"{tmp_path.name}/tokenizer.json"
    # the trained model writes with the same tokenizer (ids past 65,535 decode to its words)
    assert main(["sample", os.path.dirname(result.checkpoint_uri), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--tokens", "3", "--temperature", "0", "--device", "cpu"]) == 0


def test_compressed_json_lines_and_text_are_read_and_progress_counts_the_files_bytes(tmp_path):
    import bz2
    import gzip

    from elixir_ray.progress import ByteProgress

    tok, path = _bpe(tmp_path)
    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines.encode()))
    (tmp_path / "b.json").write_text(lines)  # what datasets' to_json writes: JSON lines
    with pa.CompressedOutputStream(str(tmp_path / "c.txt.zst"), "zstd") as out:
        out.write(DOCS[2].encode())
    (tmp_path / "d.txt.bz2").write_bytes(bz2.compress(DOCS[0].encode()))
    files = [str(tmp_path / n) for n in ("a.jsonl.gz", "b.json", "c.txt.zst", "d.txt.bz2")]
    shown = []

    class Seen(ByteProgress):
        def add(self, nbytes):
            shown.append(nbytes)
            super().add(nbytes)

    prepare_dataset(files, str(tmp_path / "d.arrow"), tokenizer=str(path), progress=Seen("t"), batch_docs=1)
    np.testing.assert_array_equal(TokenDataset(str(tmp_path / "d.arrow")).tokens,
                                  _expected(tok, DOCS + DOCS + [DOCS[2], DOCS[0]]))
    assert sum(shown) == sum(os.path.getsize(f) for f in files)
    (tmp_path / "e.json").write_text(json.dumps([{"text": "an array, not lines"}], indent=1))
    with pytest.raises(ConfigError, match=r"e.json:1 is not a JSON line .* \(a .json file is read as JSON lines"):
        prepare_dataset([str(tmp_path / "e.json")], str(tmp_path / "e.arrow"))
    (tmp_path / "f.txt.gz").write_bytes(b"not gzip at all")
    with pytest.raises(ConfigError, match=r"f.txt.gz' could not be read as gzip"):
        prepare_dataset([str(tmp_path / "f.txt.gz")], str(tmp_path / "f.arrow"))


def test_what_a_scraped_corpus_holds_is_handled_line_by_line(tmp_path):
    """A null text is skipped, a lone surrogate becomes '?' with one warning, the text of a special
    token stays text (it would end a document inside one), a non-string is refused with its line."""
    tok, path = _bpe(tmp_path)
    eos = tok.token_to_id("<|endoftext|>")
    rows = [{"text": "one <|endoftext|> doc"}, {"text": None}, {"text": "bad \ud800 here"}, {"text": "last"}]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.warns(UserWarning, match=r"a.jsonl: 1 line\(s\) hold lone surrogates .* first at line 3"):
        prepare_dataset([str(tmp_path / "a.jsonl")], str(tmp_path / "d.arrow"), tokenizer=str(path))
    ids = TokenDataset(str(tmp_path / "d.arrow")).tokens
    assert list(ids).count(eos) == 3 and read_metadata(str(tmp_path / "d.arrow"))["documents"] == "3"
    assert tok.decode(ids.tolist(), skip_special_tokens=False).startswith("one <|endoftext|> doc<|endoftext|>bad ? here")
    (tmp_path / "b.jsonl").write_text('{"text": "fine"}\n{"text": ["a", "list"]}\n')
    with pytest.raises(ConfigError, match=r"b.jsonl:2: field 'text' is a JSON list, not a string"):
        prepare_dataset([str(tmp_path / "b.jsonl")], str(tmp_path / "b.arrow"))


def test_parquet_columns_that_hold_no_text_are_refused_and_long_rows_come_in_small_batches(tmp_path):
    from elixir_ray.data.dataset import _batches
    from elixir_ray.data.sources import segments

    _, path = _bpe(tmp_path)
    pq.write_table(pa.table({"text": [1, 2], "raw": [b"ab", b"cd"]}), tmp_path / "t.parquet")
    with pytest.raises(ConfigError, match=r"column 'text' holds int64, not text: name the text column"):
        prepare_dataset([str(tmp_path / "t.parquet")], str(tmp_path / "d.arrow"))
    with pytest.raises(ConfigError, match=r"column 'raw' holds binary, not text; --tokenizer bytes takes binary"):
        prepare_dataset([str(tmp_path / "t.parquet")], str(tmp_path / "d.arrow"), tokenizer=str(path),
                        text_field="raw")
    prepare_dataset([str(tmp_path / "t.parquet")], str(tmp_path / "d.arrow"), text_field="raw")
    assert list(TokenDataset(str(tmp_path / "d.arrow")).tokens) == [97, 98, 256, 99, 100, 256]
    pq.write_table(pa.table({"text": [f"{i:4d}" * 250 for i in range(40)]}), tmp_path / "long.parquet")  # 1 group
    batches = [texts for texts, _, _ in segments(str(tmp_path / "long.parquet"), piece_bytes=4000)]
    assert sum(map(len, batches)) == 40 and max(map(len, batches)) <= 4
    batches = list(_batches([str(tmp_path / "long.parquet")] * 2, "text", False, batch_docs=512, piece_bytes=4000))
    assert sum(len(texts) for texts, _, _ in batches) == 80
    assert max(sum(map(len, texts)) for texts, _, _ in batches) <= 8000  # gathered up to about piece_bytes
    # a struct column before the text: Parquet's leaf columns are numbered past the Arrow field index
    nested = pa.table({"meta": [{"a": i, "b": "x"} for i in range(40)], "text": [f"{i:4d}" * 250 for i in range(40)]})
    pq.write_table(nested, tmp_path / "nested.parquet", use_dictionary=False)
    batches = [texts for texts, _, _ in segments(str(tmp_path / "nested.parquet"), piece_bytes=4000)]
    assert sum(map(len, batches)) == 40 and max(map(len, batches)) <= 4


def test_a_damaged_parquet_file_is_one_error_naming_it(tmp_path, capsys):
    pq.write_table(pa.table({"text": [f"doc {i} " * 50 for i in range(4000)]}), tmp_path / "p.parquet",
                   row_group_size=1000)
    raw = bytearray((tmp_path / "p.parquet").read_bytes())
    raw[len(raw) // 2:len(raw) // 2 + 4000] = bytes(range(256)) * 15 + bytes(160)
    (tmp_path / "bad.parquet").write_bytes(bytes(raw))
    assert main(["prepare-data", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "d.arrow"), "--quiet"]) == 2
    assert "bad.parquet': row group " in capsys.readouterr().err
    assert not (tmp_path / "d.arrow").exists()


def test_tokens_are_the_same_across_piece_cuts_in_any_script(tmp_path):
    tok, path = _bpe(tmp_path)
    text = tmp_path / "ru.txt"
    text.write_text("привет слово мир, ещё одно слово. " * 200 + "日本語のテキストには空白がない" * 50)
    whole = prepare_dataset([str(text)], str(tmp_path / "w.arrow"), tokenizer=str(path))
    assert whole == prepare_dataset([str(text)], str(tmp_path / "p.arrow"), tokenizer=str(path), piece_bytes=256)
    np.testing.assert_array_equal(TokenDataset(str(tmp_path / "w.arrow")).tokens,
                                  TokenDataset(str(tmp_path / "p.arrow")).tokens)


def test_a_tokenizer_is_known_by_what_it_encodes(tmp_path):
    from elixir_ray.data.tokenizer import load_tokenizer

    tok, path = _bpe(tmp_path)
    first = load_tokenizer(str(path)).identity
    # the same tokenizer as an older tokenizers library saved it (merges as "a b" strings, not pairs)
    saved = json.loads(path.read_text())
    saved["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in saved["model"]["merges"]]
    (tmp_path / "older.json").write_text(json.dumps(saved, indent=1))
    assert load_tokenizer(str(tmp_path / "older.json")).identity == first
    tok.enable_truncation(max_length=8)
    tok.save(str(tmp_path / "again.json"), pretty=False)  # saved otherwise, with a truncation it ignores
    assert load_tokenizer(str(tmp_path / "again.json")).identity == first
    assert load_tokenizer(str(path), eos_token="a").identity != first  # another end of document
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eot_id|>"}))
    with pytest.raises(ConfigError, match=r"the eos_token '<\|eot_id\|>' of the tokenizer_config.json beside it "
                                          r"is not a token of .*: name one of its special tokens with --eos-token"):
        load_tokenizer(str(path))


def test_the_output_is_checked_before_the_work(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.txt").write_text("hello world\n")
    with pytest.raises(ConfigError, match=f"--tokenizer: no tokenizer.json in '{tmp_path}'"):
        prepare_dataset([str(tmp_path / "a.txt")], "d.arrow", tokenizer="~")  # a ~ the shell left as it is
    with pytest.raises(ConfigError, match="is one of the input files"):
        prepare_dataset([str(tmp_path / "a.txt")], "~/a.txt")  # a ~ the shell left as it is
    with pytest.raises(ConfigError, match=r"--out 'nope://bucket/x.arrow' cannot be written"):
        prepare_dataset([str(tmp_path / "a.txt")], "nope://bucket/x.arrow")
    with pytest.raises(ConfigError, match=rf"--out 'a.txt/more/d.arrow': {tmp_path}/a.txt is a file, not a directory"):
        prepare_dataset([str(tmp_path / "a.txt")], "a.txt/more/d.arrow")
    with pytest.raises(ConfigError, match="are empty"):
        prepare_dataset([_write(tmp_path / "e.txt", "")], "~/new/dir/d.arrow")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "e.txt"]  # nothing made, no ~ directory
    prepare_dataset([str(tmp_path / "a.txt")], "~/new/dir/d.arrow")
    assert TokenDataset(str(tmp_path / "new" / "dir" / "d.arrow")).tokens.size == 13
    assert sorted(p.name for p in (tmp_path / "new" / "dir").iterdir()) == ["d.arrow"]


def _write(path, text):
    path.write_text(text)
    return str(path)
