"""The documents in the user's input files, read a piece at a time so a corpus need not fit in memory.

- `.jsonl` (or `.ndjson`): one document per line, the text in the field `text_field`.
- `.parquet`: one document per row, the text in the column `text_field`.
- anything else: a text file, one document. A large one is read in pieces of about `piece_bytes`,
  each cut before a space (see `_cut`), so that its tokens are those of the whole file.

Each yield is (documents, input bytes consumed since the last yield, whether the last document goes
on in the next yield), so the caller can show progress and knows where a document ends.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from elixir_ray.errors import ConfigError

PIECE_BYTES = 4 * 2**20
JSON_LINES = (".jsonl", ".ndjson")
WHITESPACE = frozenset(b" \t\r\n\x0b\x0c")


def _kind(path: str) -> str:
    lower = path.lower()
    if lower.endswith(JSON_LINES):
        return "jsonl"
    if lower.endswith(".parquet"):
        return "parquet"
    return "text"


def check_input(path: str, text_field: str) -> None:
    """Refuse, before anything is tokenised, an input whose text cannot be found: a Parquet file
    without the column (its schema is read, not its rows)."""
    if _kind(path) == "parquet":
        import pyarrow.parquet as pq

        try:
            names = pq.read_schema(path).names
        except Exception as exc:  # noqa: BLE001 - pyarrow's own errors, of several types
            raise ConfigError(f"{path!r} is not a Parquet file: {exc}") from None
        if text_field not in names:
            raise ConfigError(f"{path!r} has no column {text_field!r} (its columns: {', '.join(names)}): "
                              f"name the text column with --text-field")


def _text_utf8(data: bytes, path: str, offset: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path!r} is not UTF-8 text (byte {offset + exc.start:,}): this tokenizer takes text; "
                          f"convert the file, or use --tokenizer bytes") from None


def _cut(data: bytes, final: bool, piece_bytes: int) -> int:
    """Where this piece ends: before its last space that follows a character that is not a space.
    Pre-tokenizers (GPT-2's and Llama 3's byte-level patterns, whitespace splitting) never join that
    character to the space, so every pre-token, and so every token, is the one the whole text gives.
    Tokenizers that prepend a word marker to every text they are given (sentencepiece conversions
    such as Llama 2's) see each piece as a new text: at most a token or two differ per piece. A long
    way without such a space (4 pieces), the cut is at the last character boundary, so a multi-byte
    character is never split."""
    if final:
        return len(data)
    end = len(data) - 1  # a space at the very end: what follows it is not known yet
    while (space := data.rfind(b" ", 0, end)) > 0:
        if data[space - 1] < 0x80 and data[space - 1] not in WHITESPACE:
            return space
        end = space
    if len(data) < 4 * piece_bytes:
        return 0  # keep reading: a word start may come
    i = len(data) - 1
    while i > len(data) - 4 and data[i] & 0xC0 == 0x80:  # continuation bytes: back to the character's start
        i -= 1
    return i if data[i] >= 0xC0 else len(data)


def _text_pieces(path: str, as_bytes: bool, piece_bytes: int):
    offset, pending = 0, b""
    with open(path, "rb") as f:
        while True:
            block = f.read(piece_bytes)
            final = not block
            data = pending + block
            cut = _cut(data, final, piece_bytes)
            piece, pending = data[:cut], data[cut:]
            if piece or final:
                yield ([piece if as_bytes else _text_utf8(piece, path, offset)], len(piece), not final)
                offset += len(piece)
            if final:
                return


def _jsonl_documents(path: str, text_field: str, batch_bytes: int):
    docs, size = [], 0
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            size += len(line)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise ConfigError(f"{path}:{number} is not a JSON line ({exc})") from None
            text = record.get(text_field) if isinstance(record, dict) else None
            if not isinstance(text, str):
                found = (f"its fields: {', '.join(record)}" if isinstance(record, dict)
                         else f"it is a {type(record).__name__}, not an object")
                raise ConfigError(f"{path}:{number} has no text field {text_field!r} ({found}): "
                                  f"name the field with --text-field")
            if text:
                docs.append(text)
            if size >= batch_bytes:
                yield docs, size, False
                docs, size = [], 0
    yield docs, size, False


def _parquet_documents(path: str, text_field: str, batch_rows: int = 1024):
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    total, groups = os.path.getsize(path), parquet.metadata.num_row_groups
    reported = 0
    for i in range(groups):
        upto = total * (i + 1) // groups  # progress by row group: the file's bytes, shared out
        for batch in parquet.iter_batches(batch_size=batch_rows, row_groups=[i], columns=[text_field]):
            yield [t for t in batch.column(0).to_pylist() if t], upto - reported, False
            reported = upto
    yield [], total - reported, False


def documents(path: str, text_field: str = "text", as_bytes: bool = False,
              piece_bytes: int = PIECE_BYTES) -> Iterator[tuple[list, int, bool]]:
    """The documents of one input file, in batches (see the module's docstring). `as_bytes`: a text
    file's pieces as bytes (for the byte-level tokenizer, which takes any encoding) instead of str."""
    kind = _kind(path)
    if kind == "jsonl":
        return _jsonl_documents(path, text_field, piece_bytes)
    if kind == "parquet":
        return _parquet_documents(path, text_field)
    return _text_pieces(path, as_bytes, piece_bytes)
