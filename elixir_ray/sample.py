"""Text from a trained checkpoint (`elixir-ray sample`): the quickest look at what a run learned.

The model is rebuilt from the config its checkpoint keeps and loaded with its fp32 weights, so the
whole model must fit where it is sampled (the host, or one GPU). The prompt follows an
end-of-document token, as every document did in training; the text ends after `max_tokens` new
tokens or at the model's own end-of-document token. No key-value cache: each new token runs the
window again, which is plenty for a look at a model this system trained.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from elixir_ray.checkpoint.store import CheckpointError, checkpoint_path_hint, load_newest_valid
from elixir_ray.config import RunConfig, config_from_dict, resolve_model_shape
from elixir_ray.data.tokenizer import ByteTokenizer, load_tokenizer
from elixir_ray.errors import ConfigError
from elixir_ray.model.factory import build_model


@dataclass
class Sampled:
    checkpoint: str  # the checkpoint sampled
    step: int
    prompt: str
    text: str  # what the model wrote after the prompt
    tokens: int  # how many tokens it wrote
    ended: bool  # it wrote the end-of-document token


def load_checkpoint_model(ckpt_uri: str, device: torch.device) -> tuple[str, dict, RunConfig, torch.nn.Module]:
    """The newest valid checkpoint at `ckpt_uri` as (path, manifest, its run's config, the model in
    eval mode on `device`)."""
    errors: list = []
    found = load_newest_valid(ckpt_uri, errors)
    if found is None:
        hint = checkpoint_path_hint(ckpt_uri)
        raise CheckpointError(f"no valid checkpoint at {ckpt_uri!r}{hint or (f': {errors[-1]}' if errors else '')}")
    path, manifest, tensors = found
    if not isinstance(manifest.get("config"), dict):
        raise CheckpointError(f"checkpoint {path!r} does not say which model it holds (no run config in its manifest)")
    cfg = config_from_dict(manifest["config"])
    model = build_model(cfg, device="meta").to_empty(device=device)
    if cfg.model.hf is not None:
        model.tie_weights()  # to_empty makes a new tensor per module: tie them again
    else:
        model.head.weight = model.wte.weight
    state = {k[len("model/"):]: torch.from_numpy(v.copy()) for k, v in tensors.items() if k.startswith("model/")}
    model.load_state_dict(state)
    return path, manifest, cfg, model.eval()


def checkpoint_tokenizer(manifest: dict, tokenizer: Optional[str], eos_token: Optional[str]):
    """The tokenizer the checkpoint's data was made with: the byte-level one, or the file named,
    checked against what the checkpoint says it read."""
    theirs = manifest.get("tokenizer", "bytes")
    if tokenizer is None:
        if theirs != "bytes":
            raise ConfigError(f"the checkpoint was trained on tokens of {theirs}: name that tokenizer with --tokenizer "
                              f"(the tokenizer.json its data was prepared with)")
        return ByteTokenizer()
    tok = load_tokenizer(tokenizer, eos_token)
    if tok.identity != theirs:
        raise ConfigError(f"--tokenizer {tokenizer!r} gives {tok.identity}, but the checkpoint was trained on tokens of "
                          f"{theirs}: name the tokenizer (and --eos-token) its data was prepared with")
    return tok


def _encode(tok, text: str) -> list[int]:
    return [int(t) for t in tok.encode_batch([text])[0]] if text else []


@torch.no_grad()
def sample(ckpt_uri: str, prompt: str = "", max_tokens: int = 200, temperature: float = 0.8, top_k: Optional[int] = 50,
           seed: int = 0, tokenizer: Optional[str] = None, eos_token: Optional[str] = None,
           device: Optional[str] = None) -> Sampled:
    """Continue `prompt` from the newest valid checkpoint at `ckpt_uri`. `temperature` 0 takes the
    likeliest token each time; `top_k` keeps only the k likeliest (None: all)."""
    if max_tokens < 1:
        raise ConfigError(f"--tokens {max_tokens}: sample at least 1 token")
    if temperature < 0:
        raise ConfigError(f"--temperature {temperature}: use 0 (the likeliest token each time) or more")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k}: keep at least 1 token")
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    path, manifest, cfg, model = load_checkpoint_model(ckpt_uri, where)
    tok = checkpoint_tokenizer(manifest, tokenizer, eos_token)
    window = resolve_model_shape(cfg.model)["seq_len"]
    context = [tok.eos_id] + _encode(tok, prompt)
    generator = torch.Generator(device=where).manual_seed(seed)
    written: list[int] = []
    ended = False
    for _ in range(max_tokens):
        ids = torch.tensor([context[-window:]], device=where)
        logits = (model.logits(ids) if cfg.model.hf is None else model(input_ids=ids, use_cache=False).logits)
        logits = logits[0, -1].float()
        logits[tok.vocab_size:] = float("-inf")  # rows past the tokenizer's ids (a padded vocabulary) mean nothing
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if nxt == tok.eos_id:
            ended = True
            break
        written.append(nxt)
        context.append(nxt)
    return Sampled(checkpoint=path, step=int(manifest["step"]), prompt=prompt, text=tok.decode(written),
                   tokens=len(written), ended=ended)
