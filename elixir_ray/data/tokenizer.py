"""Tokenizers for `prepare-data`: the built-in byte-level one, or the user's own Hugging Face tokenizer.

Every document becomes its tokens followed by one end-of-document token; nothing else is added (no
beginning-of-sequence token, whatever the tokenizer's own post-processor would add), so the token
stream is the same whether a document is encoded whole or, for a large text file, in pieces. Text
that spells a special token ("<|endoftext|>" in a scraped page) is encoded as text.
A dataset records which tokenizer made it (`identity`), so that a held-out set made with another
one is refused instead of giving a meaningless loss.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

import numpy as np

from elixir_ray.errors import ConfigError

# Tried in this order when neither --eos-token nor a tokenizer_config.json names the end of a document.
EOS_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>", "[SEP]")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 while every id fits (most tokenizers up to 65,536 entries), else uint32 (Llama 3's 128k)."""
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


class ByteTokenizer:
    """Every byte is a token, plus one end-of-document token. Needs no vocabulary file, and takes
    any bytes (a text file in any encoding)."""

    name = identity = "bytes"
    eos_id = 256
    vocab_size = 257
    takes_bytes = True

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def encode(self, data: str | bytes) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

    def encode_batch(self, texts: list[str | bytes]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def encode_documents(self, documents) -> np.ndarray:
        """Concatenate documents, each followed by the end-of-document token."""
        parts = []
        for doc in documents:
            parts.append(self.encode(doc))
            parts.append(np.array([self.eos_id], dtype=np.uint16))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)

    def decode(self, tokens) -> str:
        data = bytes(int(t) for t in tokens if int(t) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face `tokenizer.json` (what `AutoTokenizer.save_pretrained` writes for a fast
    tokenizer), run by the `tokenizers` package. Truncation and padding saved in the file are turned
    off: a saved `max_length` would otherwise cut every document short without a word."""

    takes_bytes = False

    def __init__(self, path: str, eos_token: Optional[str] = None):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ConfigError("--tokenizer needs the `tokenizers` package: pip install 'elixir_ray[hf]' "
                              "(or --tokenizer bytes)") from None
        path = os.path.expanduser(path)  # `--tokenizer=~/model`: no shell expands a ~ after `=`
        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            where = f"no tokenizer.json in {path!r}" if os.path.isdir(path) else f"{path!r} does not exist"
            raise ConfigError(f"--tokenizer: {where}. Give a tokenizer.json file, or a directory holding one (for a "
                              f"model with only a sentencepiece tokenizer.model, `AutoTokenizer.from_pretrained(DIR)"
                              f".save_pretrained(DIR)` writes it)")
        try:
            self._tok = Tokenizer.from_file(file)
        except Exception as exc:  # noqa: BLE001 - the library's own parse errors, of several types
            raise ConfigError(f"--tokenizer {file!r} is not a Hugging Face tokenizer.json: {exc}") from None
        self._tok.no_truncation()
        self._tok.no_padding()
        # a corpus that holds the text "<|endoftext|>" gets that text's tokens, not the special id
        # (which would end a document inside one): special ids are only the ones added here
        try:
            self._tok.encode_special_tokens = True
        except AttributeError:
            raise ConfigError("--tokenizer needs tokenizers >= 0.19: pip install -U tokenizers") from None
        self.file = file
        self.name = f"{os.path.basename(os.path.dirname(os.path.abspath(file)))}/{os.path.basename(file)}"
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        if not ids:
            raise ConfigError(f"--tokenizer {file!r} has an empty vocabulary")
        self.vocab_size = max(ids) + 1  # every id lies below it (ids may have gaps)
        if eos_token is not None:
            where = f"--eos-token {eos_token!r}"
        elif (eos_token := self._configured_eos()) is not None:
            where = f"the eos_token {eos_token!r} of the tokenizer_config.json beside it"
        else:
            where, eos_token = "", next((t for t in EOS_CANDIDATES if self._tok.token_to_id(t) is not None), None)
        if eos_token is None:
            raise ConfigError(f"--tokenizer {file!r}: which token ends a document is not known (no tokenizer_config.json "
                              f"beside it names an eos_token, and none of {', '.join(EOS_CANDIDATES)} is in its "
                              f"vocabulary): name it with --eos-token")
        eos_id = self._tok.token_to_id(eos_token)
        if eos_id is None:
            raise ConfigError(f"{where} is not a token of {file!r}: name one of its special tokens with --eos-token")
        self.eos_token, self.eos_id = eos_token, eos_id
        # what the tokens mean: the file as it encodes, and the end-of-document id; a held-out set must have the same
        self.identity = "tokenizers:sha256:" + hashlib.sha256(_canonical(file) + b"\0eos=%d" % eos_id).hexdigest()[:16]

    def _configured_eos(self) -> Optional[str]:
        """The eos_token of a tokenizer_config.json beside the file, as transformers saves it."""
        config = os.path.join(os.path.dirname(self.file), "tokenizer_config.json")
        try:
            with open(config, encoding="utf-8") as f:
                eos = json.load(f).get("eos_token")
        except (OSError, ValueError, AttributeError):
            return None
        if isinstance(eos, dict):  # an AddedToken, saved with its fields
            eos = eos.get("content")
        return eos if isinstance(eos, str) and eos else None

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab_size)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Encoded on the library's own threads; no special tokens added."""
        encode = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)  # no offsets: less memory
        encodings = encode(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=self.dtype) for e in encodings]

    def decode(self, tokens) -> str:
        return self._tok.decode([int(t) for t in tokens], skip_special_tokens=False)


def _canonical(file: str) -> bytes:
    """The tokenizer file's content in one form whatever wrote it: its JSON with sorted keys, without
    the saved truncation and padding (turned off here), and BPE merges as "a b" strings (tokenizers
    0.20 and later save them as pairs). Taken from the file rather than the library's own
    re-serialisation, which changes between versions: the same file must keep its identity."""
    with open(file, encoding="utf-8") as f:
        data = json.load(f)
    data.pop("truncation", None)
    data.pop("padding", None)
    model = data.get("model")
    if isinstance(model, dict) and isinstance(model.get("merges"), list):
        model["merges"] = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    return json.dumps(data, sort_keys=True, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def load_tokenizer(spec: str = "bytes", eos_token: Optional[str] = None):
    """`bytes` (built in), or the path of a tokenizer.json (or of a directory holding one)."""
    if spec == "bytes":
        if eos_token is not None:
            raise ConfigError("--eos-token is for a --tokenizer file: the byte-level tokenizer has its own (id 256)")
        return ByteTokenizer()
    return HFTokenizer(spec, eos_token)
