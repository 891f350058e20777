"""Named GPT shapes. The large ones match the benchmark shapes (vocab 50304, sequence 1024)."""

MODEL_SIZES: dict[str, dict] = {
    # about 0.8M parameters: for tests and the demo on a 2-core machine
    "tiny": dict(d_model=128, n_layers=4, n_heads=4, vocab_size=257, seq_len=128),
    "small": dict(d_model=256, n_layers=6, n_heads=8, vocab_size=257, seq_len=256),
    "gpt-124m": dict(d_model=768, n_layers=12, n_heads=12, vocab_size=50304, seq_len=1024),
    "gpt-350m": dict(d_model=1024, n_layers=24, n_heads=16, vocab_size=50304, seq_len=1024),
    "gpt-1.5b": dict(d_model=1600, n_layers=48, n_heads=25, vocab_size=50304, seq_len=1024),
    "gpt-4b": dict(d_model=3072, n_layers=36, n_heads=24, vocab_size=50304, seq_len=1024),
    "gpt-10b": dict(d_model=4096, n_layers=50, n_heads=32, vocab_size=50304, seq_len=1024),
}


def gpt_param_count(d_model: int, n_layers: int, vocab_size: int, seq_len: int, **_) -> int:
    """Exact parameter count of `GPT` for a shape (tied embeddings counted once)."""
    d = d_model
    per_block = (
        2 * 2 * d  # two LayerNorms
        + d * 3 * d + 3 * d  # qkv
        + d * d + d  # attention output
        + d * 4 * d + 4 * d  # mlp up
        + 4 * d * d + d  # mlp down
    )
    return vocab_size * d + seq_len * d + n_layers * per_block + 2 * d
