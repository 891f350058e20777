"""The documents in the user's input files, read a piece at a time so a corpus need not fit in memory.

- `.jsonl`, `.ndjson` or `.json`: JSON lines (what `datasets.Dataset.to_json` writes), one document
  per line, the text in the field `text_field`. A line whose field is null is skipped.
- `.parquet`: one document per row, the text in the column `text_field`. Null rows are skipped.
- anything else: a text file, one document. A large one is read in pieces of about `piece_bytes`,
  each cut before a space (see `_word_cut`), which for the tokenizers named there gives the tokens
  of the whole file.

A name ending in `.gz`, `.bz2`, `.zst` or `.lz4` is decompressed as it is read (`corpus.jsonl.zst`).

`segments` yields (texts, ends, nbytes): texts to encode together, whether each ends its document
(a text file's pieces but the last do not), and the input file's bytes consumed since the last
yield (compressed bytes where it is compressed), for progress.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Iterator, Optional

import pyarrow as pa

from elixir_ray.errors import ConfigError

PIECE_BYTES = 4 * 2**20
SPLIT = 16  # a text piece is encoded as about this many parts at once, on the tokenizer's threads
JSON_LINES = (".jsonl", ".ndjson", ".json")
CODECS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4"}


def _codec(path: str) -> Optional[str]:
    return next((codec for ext, codec in CODECS.items() if path.lower().endswith(ext)), None)


def _stem(path: str) -> str:
    """The lower-case name without a compression extension."""
    lower = path.lower()
    ext = next((ext for ext in CODECS if lower.endswith(ext)), "")
    return lower[:len(lower) - len(ext)]


def _kind(path: str) -> str:
    stem = _stem(path)
    if stem.endswith(JSON_LINES):
        return "jsonl"
    if stem.endswith(".parquet"):
        return "parquet" if stem == path.lower() else "parquet-compressed"
    return "text"


def _is_text_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", bool)(t)


def _is_binary_type(t: pa.DataType) -> bool:
    if pa.types.is_dictionary(t):
        t = t.value_type
    return pa.types.is_binary(t) or pa.types.is_large_binary(t)


def check_input(path: str, text_field: str, as_bytes: bool) -> None:
    """Refuse, before anything is tokenised, an input whose text cannot be read: a Parquet file
    without the column, or whose column holds no text (its schema is read, not its rows)."""
    kind = _kind(path)
    if kind == "parquet-compressed":
        raise ConfigError(f"{path!r}: a Parquet file compresses its own columns; give it uncompressed")
    codec = _codec(path)
    if codec and not pa.Codec.is_available(codec):
        raise ConfigError(f"{path!r}: this pyarrow cannot decompress {codec}; decompress the file first")
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            schema = pq.read_schema(path)
        except Exception as exc:  # noqa: BLE001 - pyarrow's own errors, of several types
            raise ConfigError(f"{path!r} is not a Parquet file: {exc}") from None
        if text_field not in schema.names:
            raise ConfigError(f"{path!r} has no column {text_field!r} (its columns: {', '.join(schema.names)}): "
                              f"name the text column with --text-field")
        t = schema.field(text_field).type
        if not (_is_text_type(t) or (as_bytes and _is_binary_type(t))):
            hint = "; --tokenizer bytes takes binary" if _is_binary_type(t) else ""
            raise ConfigError(f"{path!r}: column {text_field!r} holds {t}, not text{hint}: name the text column "
                              f"with --text-field")


def _blocks(path: str, block_bytes: int):
    """The file's bytes, decompressed where its name says so, a block at a time, each with the
    position reached in the file itself (for progress)."""
    raw = pa.OSFile(path, "rb")
    codec = _codec(path)
    stream = pa.CompressedInputStream(raw, codec) if codec else raw
    try:
        while True:
            try:
                block = stream.read(block_bytes)
            except OSError as exc:
                raise ConfigError(f"{path!r} could not be read as {codec or 'a file'}: {exc}") from None
            if not block:
                return
            yield block, raw.tell()
    finally:
        stream.close()
        raw.close()


def _word_cut(data: bytes, lo: int, hi: int) -> int:
    """The last index in [lo, hi) of a space that follows a character that is not a space, or -1.
    Pre-tokenizers (GPT-2's and Llama 3's byte-level patterns, whitespace splitting) start a
    pre-token at such a space and never join it to the character before, so text cut there gives
    the tokens the whole text gives. Tokenizers that add a word marker to the start of every text
    they are given (sentencepiece conversions such as Llama 2's) see each piece as a new text: a
    token or two differ per piece."""
    i = hi
    while (i := data.rfind(b" ", max(lo, 1), i)) >= 0:
        j = i - 1
        while j > max(i - 4, 0) and data[j] & 0xC0 == 0x80:  # back to the character's first byte
            j -= 1
        try:
            before = data[j:i].decode("utf-8")
        except UnicodeDecodeError:
            continue
        if not before.isspace():
            return i
    return -1


def _cut(data: bytes, piece_bytes: int) -> int:
    """Where a text piece ends: at the last word cut; with none for a long way (4 pieces: text
    without spaces), at the last character boundary, so a multi-byte character is never split; 0:
    read on."""
    cut = _word_cut(data, 1, len(data))
    if cut > 0:
        return cut
    if len(data) < 4 * piece_bytes:
        return 0
    i = len(data) - 1
    while i > len(data) - 4 and data[i] & 0xC0 == 0x80:
        i -= 1
    return i if data[i] >= 0xC0 else len(data)


def _split(data: bytes, size: int) -> list[bytes]:
    """A piece as parts of about `size` bytes, at word cuts (one part where there are none)."""
    parts, start = [], 0
    while len(data) - start > size:
        cut = _word_cut(data, start + 1, start + size)
        if cut < 0:
            break
        parts.append(data[start:cut])
        start = cut
    parts.append(data[start:])
    return parts


def _text_segments(path: str, as_bytes: bool, piece_bytes: int):
    pending, offset, reported = b"", 0, 0
    blocks = _blocks(path, piece_bytes)
    while True:
        block, position = next(blocks, (b"", os.path.getsize(path)))
        final = not block
        data = pending + block
        cut = len(data) if final else _cut(data, piece_bytes)
        piece, pending = data[:cut], data[cut:]
        if piece or final:
            parts = [piece] if as_bytes else _decoded(_split(piece, max(1, piece_bytes // SPLIT)), path, offset)
            yield parts, [False] * (len(parts) - 1) + [final], position - reported
            reported, offset = position, offset + len(piece)
        if final:
            return


def _decoded(parts: list[bytes], path: str, offset: int) -> list[str]:
    texts = []
    for part in parts:
        try:
            texts.append(part.decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise ConfigError(f"{path!r} is not UTF-8 text (byte {offset + exc.start:,}): this tokenizer takes "
                              f"text; convert the file, or use --tokenizer bytes") from None
        offset += len(part)
    return texts


class _JsonLines:
    """One JSON line's text, with the problems a scraped corpus has: a null (skipped), a lone
    surrogate (valid JSON, not encodable: written as '?', counted and warned of once per file)."""

    def __init__(self, path: str, text_field: str, as_bytes: bool):
        self.path, self.field, self.as_bytes = path, text_field, as_bytes
        self.surrogates, self.first_surrogate = 0, 0

    def text(self, line: bytes, number: int):
        try:
            record = json.loads(line)
        except ValueError as exc:
            hint = (" (a .json file is read as JSON lines, one object per line, as datasets' to_json writes "
                    "them)" if _stem(self.path).endswith(".json") else "")
            raise ConfigError(f"{self.path}:{number} is not a JSON line ({exc}){hint}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"{self.path}:{number} is a JSON {type(record).__name__}, not an object with a "
                              f"{self.field!r} field")
        if self.field not in record:
            raise ConfigError(f"{self.path}:{number} has no text field {self.field!r} (its fields: "
                              f"{', '.join(record)}): name the field with --text-field")
        text = record[self.field]
        if text is None:
            return None
        if not isinstance(text, str):
            raise ConfigError(f"{self.path}:{number}: field {self.field!r} is a JSON {type(text).__name__}, "
                              f"not a string: name the text field with --text-field")
        try:
            data = text.encode("utf-8")
        except UnicodeEncodeError:
            self.surrogates += 1
            self.first_surrogate = self.first_surrogate or number
            data = text.encode("utf-8", "replace")
            text = data.decode("utf-8")
        return data if self.as_bytes else text

    def warn(self) -> None:
        if self.surrogates:
            warnings.warn(f"{self.path}: {self.surrogates} line(s) hold lone surrogates (escapes such as \\ud800 "
                          f"that are no character; first at line {self.first_surrogate}): each was written as '?'",
                          stacklevel=2)


def _jsonl_segments(path: str, text_field: str, as_bytes: bool, batch_bytes: int):
    reader = _JsonLines(path, text_field, as_bytes)
    texts, size, rest, number, reported = [], 0, b"", 0, 0
    for block, position in _blocks(path, batch_bytes):
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        for line in lines:
            number += 1
            if line.strip() and (text := reader.text(line, number)):
                texts.append(text)
                size += len(text)
        if size >= batch_bytes:
            yield texts, [True] * len(texts), position - reported
            texts, size, reported = [], 0, position
    if rest.strip() and (text := reader.text(rest, number + 1)):
        texts.append(text)
    reader.warn()
    yield texts, [True] * len(texts), os.path.getsize(path) - reported


def _parquet_segments(path: str, text_field: str, batch_bytes: int):
    """Row groups are read in batches of about `batch_bytes` of text (from the column's size in the
    file's metadata), so long documents never pile up."""
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    meta = parquet.metadata
    # the text's own leaf column: Parquet numbers the leaves of nested columns too, so a struct column
    # before it shifts its index away from the Arrow schema's field index
    column = next((i for i in range(meta.num_columns) if meta.schema.column(i).path == text_field), None)
    total, reported = os.path.getsize(path), 0
    for i in range(meta.num_row_groups):
        group = meta.row_group(i)
        size = group.column(column).total_uncompressed_size if column is not None else group.total_byte_size
        per_row = size / max(1, group.num_rows)
        rows = int(max(1, min(4096, batch_bytes / max(per_row, 1))))
        upto = total * (i + 1) // meta.num_row_groups  # progress by row group: the file's bytes, shared out
        batches = parquet.iter_batches(batch_size=rows, row_groups=[i], columns=[text_field])
        while True:
            try:
                batch = next(batches, None)
            except (OSError, pa.ArrowInvalid) as exc:
                raise ConfigError(f"{path!r}: row group {i} of {meta.num_row_groups} could not be read: {exc}") from None
            if batch is None:
                break
            texts = [t for t in batch.column(0).to_pylist() if t]
            yield texts, [True] * len(texts), upto - reported
            reported = upto
    yield [], [], total - reported


def segments(path: str, text_field: str = "text", as_bytes: bool = False,
             piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[list, list, int]]:
    """The texts of one input file, in batches (see the module's docstring). `as_bytes`: texts as
    bytes (for the byte-level tokenizer, which takes any encoding) instead of str."""
    kind = _kind(path)
    if kind == "jsonl":
        return _jsonl_segments(path, text_field, as_bytes, piece_bytes)
    if kind == "parquet":
        return _parquet_segments(path, text_field, piece_bytes)
    return _text_segments(path, as_bytes, piece_bytes)
