"""Token datasets: one Arrow IPC file with a `tokens` column (uint16, or uint32 for a vocabulary past
65,536 ids), memory-mapped for training, made by `prepare_dataset` from the user's files.

Training samples are windows of seq_len + 1 tokens at multiples of seq_len. Their order is a
seeded permutation per epoch, so the whole data order is a pure function of (seed, sample index):
the data position is one integer, `samples_consumed`, independent of the number of workers.
Each rank takes a disjoint slice of every global batch.
"""

from __future__ import annotations

import os
import sysconfig
import tempfile
from dataclasses import dataclass
from typing import Optional

import numpy as np
import pyarrow as pa
import torch

from elixir_ray import storage
from elixir_ray.data.sources import PIECE_BYTES, check_input, segments
from elixir_ray.data.tokenizer import load_tokenizer
from elixir_ray.errors import ConfigError

FORMAT = "elixir_ray.tokens/1"
# the token-id check before a run (`TokenDataset.largest_id`): a file of up to SCAN_WHOLE_TOKENS is
# read whole (64M tokens, 128 MiB of uint16, about 0.1 s), a larger one in evenly spaced slices
SCAN_WHOLE_TOKENS = 64 * 2**20
SCAN_SLICES = 64
SCAN_SLICE_TOKENS = 2**16


class TokenFileWriter:
    """Appends tokens to a scratch file, then writes them as one Arrow record batch (read back
    zero-copy, memory-mapped) under a temporary name and renames it: readers never see a partial
    dataset, and a corpus larger than memory is never held in it (the scratch file is mapped). The
    scratch file has no name (it is gone however the process ends); it lies beside a local output,
    else in the temporary directory (TMPDIR): it needs 2 or 4 bytes per token there."""

    def __init__(self, out_uri: str, dtype: np.dtype):
        self.out_uri, self.dtype, self.count = out_uri, np.dtype(dtype), 0
        local = storage.local_path(out_uri)
        # beside the output (the same disk, most likely); nothing is created before the dataset is complete
        where = storage.nearest_existing(os.path.dirname(local)) if local else None
        self._scratch = tempfile.TemporaryFile(prefix=".tokens-", dir=where)

    def append(self, tokens: np.ndarray) -> None:
        self._scratch.write(np.ascontiguousarray(tokens, dtype=self.dtype).tobytes())
        self.count += len(tokens)

    def commit(self, metadata: dict) -> None:
        self._scratch.flush()
        tokens = (np.memmap(self._scratch, dtype=self.dtype, mode="r", shape=(self.count,)) if self.count
                  else np.zeros(0, dtype=self.dtype))
        table = pa.table({"tokens": pa.array(tokens)})
        table = table.replace_schema_metadata({"format": FORMAT, "num_tokens": str(self.count),
                                               **{k: str(v) for k, v in metadata.items()}})
        try:
            with storage.atomic_output(*storage.resolve(self.out_uri)) as out:
                with pa.ipc.new_file(out, table.schema) as writer:
                    writer.write_table(table, max_chunksize=self.count or None)
        finally:
            del table, tokens
            self.discard()

    def discard(self) -> None:
        self._scratch.close()


def _check_prepare_args(text_files: list[str], out_uri: str, text_field: str, as_bytes: bool) -> None:
    if not text_files:
        raise ConfigError("prepare-data needs at least one input file")
    for path in text_files:
        if os.path.isdir(path):
            raise ConfigError(f"{path!r} is a directory: give the text files in it (for example "
                              f"{os.path.join(path, '*.txt')})")
        if not os.path.isfile(path):
            unexpanded = any(c in path for c in "*?[")
            raise ConfigError(f"text file {path!r} does not exist" +
                              (" (a pattern that matched no file reaches here as it is)" if unexpanded else ""))
        check_input(path, text_field, as_bytes)
    local = storage.local_path(out_uri)
    if local is None:
        try:
            storage.resolve(out_uri)  # an unknown scheme or missing credentials, before the work rather than after
        except Exception as exc:  # noqa: BLE001 - pyarrow's own errors, of several types
            raise ConfigError(f"--out {out_uri!r} cannot be written: {exc}") from None
        return
    if os.path.isdir(local):
        raise ConfigError(f"--out {out_uri!r} is a directory: name the dataset file, for example "
                          f"{os.path.join(out_uri, 'data.arrow')}")
    if any(os.path.exists(local) and os.path.samefile(local, path) for path in text_files):
        raise ConfigError(f"--out {out_uri!r} is one of the input files: it would be replaced by the dataset; "
                          f"name another file")
    storage.writable_local_dir(os.path.dirname(local), f"--out {out_uri!r}",
                               "name a dataset file in a directory you can write (one that is missing is made)")


def _batches(text_files: list[str], text_field: str, as_bytes: bool, batch_docs: int, piece_bytes: int):
    """The inputs' texts gathered for one `encode_batch` call each (the tokenizer's threads share a
    batch out), at most `batch_docs` texts or about `piece_bytes` of text, so that long documents
    never pile up in memory: (texts, whether each ends its document, input bytes they came from)."""
    texts, ends, size, nbytes = [], [], 0, 0
    for path in text_files:
        for more, more_ends, more_bytes in segments(path, text_field, as_bytes, piece_bytes):
            texts += more
            ends += more_ends
            size += sum(map(len, more))
            nbytes += more_bytes
            if len(texts) >= batch_docs or size >= piece_bytes:
                yield texts, ends, nbytes
                texts, ends, size, nbytes = [], [], 0, 0
    yield texts, ends, nbytes


def prepare_dataset(text_files: list[str], out_uri: str, tokenizer: str = "bytes", eos_token: Optional[str] = None,
                    text_field: str = "text", progress=None, batch_docs: int = 512,
                    piece_bytes: int = PIECE_BYTES) -> int:
    """Tokenise the user's files into one dataset (see `sources` for what each kind of file holds):
    each document's tokens, then the end-of-document token. `tokenizer`: `bytes`, or the path of a
    Hugging Face tokenizer.json (or its directory). `progress`: a `ByteProgress` over the input's
    bytes, or None. Returns the number of tokens written."""
    tok = load_tokenizer(tokenizer, eos_token)
    _check_prepare_args(text_files, out_uri, text_field, tok.takes_bytes)
    writer = TokenFileWriter(out_uri, tok.dtype)
    eos = np.array([tok.eos_id], dtype=tok.dtype)
    documents = content = 0
    if progress is not None:
        progress.begin(sum(os.path.getsize(p) for p in text_files))
    try:
        for texts, ends, nbytes in _batches(text_files, text_field, tok.takes_bytes, batch_docs, piece_bytes):
            for ids, ends_document in zip(tok.encode_batch(texts) if texts else [], ends):
                writer.append(ids)
                content += len(ids)
                if ends_document:
                    writer.append(eos)
                    documents += 1
            if progress is not None:
                progress.add(nbytes)
        if content == 0:
            raise ConfigError(f"the input files {text_files} are empty (no text in them): nothing to tokenise")
        writer.commit({"tokenizer": tok.identity, "tokenizer_file": tok.name, "vocab_size": tok.vocab_size,
                       "eos_id": tok.eos_id, "documents": documents, "sources": len(text_files)})
    except BaseException:
        writer.discard()
        if progress is not None:
            progress.close()
        raise
    if progress is not None:
        progress.finish()
    return writer.count


def builtin_corpus_files(max_bytes: int = 8 * 2**20) -> list[str]:
    """This Python's own standard-library sources, in a fixed order, up to max_bytes."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "test", "tests", "__pycache__", "idlelib"))
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    chosen, total = [], 0
    for path in files:
        size = os.path.getsize(path)
        if total + size > max_bytes:
            continue
        chosen.append(path)
        total += size
    return chosen


def builtin_dataset_uri(cache_dir: str | None) -> str:
    """Build the builtin corpus once per cache directory and Python version, then reuse it. The
    default directory is this machine's cache ($XDG_CACHE_HOME, else ~/.cache): on a cluster each
    node builds its own copy where its workers run."""
    cache_dir = cache_dir or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                                           ".cache"), "elixir_ray")
    version = "{}.{}".format(*sysconfig.get_python_version().split(".")[:2])
    uri = os.path.join(cache_dir, f"builtin-stdlib-py{version}.arrow")
    if not os.path.exists(uri):
        prepare_dataset(builtin_corpus_files(), uri)
    return uri


def resolve_data_uri(path: str, cache_dir: str | None) -> str:
    return builtin_dataset_uri(cache_dir) if path == "builtin" else path


def windows_in(num_tokens: int, seq_len: int) -> int:
    """Training windows (seq_len + 1 tokens, each overlapping the next by one) in so many tokens."""
    return max(0, (num_tokens - 1) // seq_len)


def read_metadata(uri: str) -> dict[str, str]:
    """A dataset's metadata (token count, tokenizer, vocabulary), from the file's footer: its tokens
    are not read (a dataset in an object store is not fetched again for them)."""
    fs, path = storage.resolve(uri)
    with fs.open_input_file(path) as source:
        meta = pa.ipc.open_file(source).schema.metadata or {}
    return {k.decode(): v.decode() for k, v in meta.items()}


def data_tokenizer(uri: str) -> dict[str, str]:
    """What a checkpoint keeps of the tokenizer its run's data was made with: its identity, which a
    resume and `sample` compare, and its file's name, which their messages show. The built-in corpus
    is byte-level wherever it is built."""
    meta = read_metadata(uri) if uri != "builtin" else {}
    identity = meta.get("tokenizer", "bytes")
    return {"tokenizer": identity, "tokenizer_file": meta.get("tokenizer_file", identity)}


def checkpoint_tokenizer_identity(manifest: dict) -> str:
    """The tokenizer a checkpoint's model was trained on. Checkpoints have said since the version
    whose `prepare-data` took other tokenizers; every one before that was trained on bytes."""
    return manifest.get("tokenizer", "bytes")


def tokenizer_named(identity: str, file: Optional[str]) -> str:
    """A tokenizer as the messages show it: its file's name, and the identity that tells it apart."""
    return f"{file} ({identity})" if file and file != identity else identity


def count_tokens(uri: str) -> int:
    """The tokens in a dataset `prepare_dataset` wrote, from its metadata."""
    meta = read_metadata(uri)
    if "num_tokens" in meta:
        return int(meta["num_tokens"])
    return len(TokenDataset(uri))


def _tokens_of(column: pa.ChunkedArray) -> np.ndarray:
    """The token column as one numpy array: a view of the file's buffer when it is one chunk.
    Read from the buffer directly: pyarrow's `to_numpy` imports pandas, a second per worker."""
    dtype = np.uint16 if column.type == pa.uint16() else np.uint32
    parts = [np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * dtype().itemsize)
             for chunk in column.chunks]
    if len(parts) == 1:
        return parts[0]
    return np.concatenate(parts) if parts else np.empty(0, dtype=dtype)


class TokenDataset:
    """A read-only view of a token file; local files are memory-mapped, remote ones read once."""

    def __init__(self, uri: str, what: str = "data.path"):
        """`what`: the config key that named it, for the errors."""
        fs, path = storage.resolve(uri)
        if not storage.exists(fs, path):
            raise ConfigError(f"{what} {uri!r} does not exist (build one with `elixir-ray prepare-data`)")
        try:
            if "://" not in uri:
                source = pa.memory_map(path, "r")
            else:
                source = fs.open_input_file(path)
            table = pa.ipc.open_file(source).read_all()
        except (pa.ArrowInvalid, OSError) as exc:
            raise ConfigError(f"{what} {uri!r} is not a token dataset: {exc}") from None
        meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()}
        if meta.get("format") != FORMAT or "tokens" not in table.column_names:
            raise ConfigError(f"{what} {uri!r} is not an elixir_ray token dataset (no {FORMAT} metadata)")
        column = table.column("tokens")
        if column.type not in (pa.uint16(), pa.uint32()):
            raise ConfigError(f"{what} {uri!r} holds {column.type} tokens, not uint16 or uint32")
        if column.null_count:
            raise ConfigError(f"{what} {uri!r} has missing tokens (rebuild it with `elixir-ray prepare-data`)")
        self.tokens = _tokens_of(column)
        self.uri, self.what = uri, what
        self.vocab_size = int(meta.get("vocab_size", 257))
        self.tokenizer = meta.get("tokenizer", "bytes")  # which tokenizer made it: a held-out set must match
        self.tokenizer_file = meta.get("tokenizer_file", self.tokenizer)
        if len(self.tokens) == 0:
            raise ConfigError(f"{what} {uri!r} holds no tokens")

    def __len__(self) -> int:
        return len(self.tokens)

    def num_windows(self, seq_len: int) -> int:
        return windows_in(len(self.tokens), seq_len)

    def largest_id(self) -> tuple[int, bool]:
        """(the largest token id seen, whether every token was read): the whole file up to
        SCAN_WHOLE_TOKENS, else SCAN_SLICES evenly spaced slices of SCAN_SLICE_TOKENS and the last
        token (a few MiB of a mapped file). The metadata's vocab_size is what prepare-data wrote;
        this is what the file holds, which a hand-made or edited file need not match."""
        tokens = self.tokens
        if len(tokens) <= SCAN_WHOLE_TOKENS:
            return int(tokens.max()), True
        starts = np.linspace(0, len(tokens) - SCAN_SLICE_TOKENS, SCAN_SLICES).astype(np.int64)
        found = max(int(tokens[a: a + SCAN_SLICE_TOKENS].max()) for a in starts)
        return max(found, int(tokens[-1])), False


@dataclass
class BatchSampler:
    """Maps global sample indices to token windows, deterministically from the seed."""

    dataset: TokenDataset
    seq_len: int
    seed: int

    def __post_init__(self):
        self.n_windows = self.dataset.num_windows(self.seq_len)
        if self.n_windows == 0:
            raise ConfigError(
                f"{self.dataset.what} {self.dataset.uri!r} holds {len(self.dataset)} tokens, fewer than one "
                f"window of model.seq_len+1 = {self.seq_len + 1}"
            )
        self._perm_epoch = -1
        self._perm = None

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            self._perm = np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)
            self._perm_epoch = epoch
        return self._perm

    def samples(self, start: int, count: int) -> torch.Tensor:
        """Global samples [start, start+count) as an int64 tensor of shape (count, seq_len+1)."""
        rows = []
        for g in range(start, start + count):
            epoch, pos = divmod(g, self.n_windows)
            w = int(self._permutation(epoch)[pos])
            rows.append(self.dataset.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1])
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def rank_batch(self, samples_consumed: int, rank: int, micro_batch: int, grad_accum: int,
                   micro_step: int) -> torch.Tensor:
        """This rank's micro-batch `micro_step` of the global batch that starts at samples_consumed."""
        per_rank = micro_batch * grad_accum
        start = samples_consumed + rank * per_rank + micro_step * micro_batch
        return self.samples(start, micro_batch)
