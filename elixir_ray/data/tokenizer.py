"""Byte-level tokenizer: every byte is a token, plus one end-of-document token. Needs no vocabulary file."""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    name = "bytes"
    eos_id = 256
    vocab_size = 257

    def encode(self, data: str | bytes) -> np.ndarray:
        if isinstance(data, str):
            data = data.encode("utf-8")
        return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)

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
