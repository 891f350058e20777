"""Text from a trained checkpoint (`elixir-ray sample`): the quickest look at what a run learned.

The model is rebuilt from the model section of the config its checkpoint keeps and its fp32 weights
are copied in one at a time, so the whole model must fit where it is sampled (the host, or one GPU). The prompt follows an
end-of-document token, as every document did in training; the text ends after `max_tokens` new
tokens or at the model's own end-of-document token. No key-value cache: each new token runs the
window again, which is plenty for a look at a model this system trained.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from elixir_ray.checkpoint.store import CheckpointError, require_newest_valid
from elixir_ray.config import RunConfig, config_from_dict, resolve_model_shape
from elixir_ray.data.dataset import checkpoint_tokenizer_identity, tokenizer_named
from elixir_ray.data.tokenizer import ByteTokenizer, load_tokenizer
from elixir_ray.errors import ConfigError
from elixir_ray.model.factory import empty_model, init_fn_for


@dataclass
class Sampled:
    checkpoint: str  # the checkpoint sampled
    step: int
    prompt: str
    text: str  # what the model wrote after the prompt
    tokens: int  # how many tokens it wrote
    ended: bool  # it wrote the end-of-document token


def _model_config(manifest: dict, path: str) -> RunConfig:
    """The model section of the run config the checkpoint keeps (the rest, such as the data, need not
    hold any more, and keys a later version dropped there do not matter)."""
    config = manifest.get("config")
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise CheckpointError(f"checkpoint {path!r} does not say which model it holds (no run config in its manifest)")
    try:
        return config_from_dict({"model": config["model"]})
    except ConfigError as exc:
        raise ConfigError(f"checkpoint {path!r}: its run config's model section: {exc}") from None


def _load_weights(model: torch.nn.Module, tensors, path: str) -> None:
    """Each weight copied from the checkpoint straight into the model's own tensor, one at a time (a
    tied weight once): the weights are never held twice, on the host or on the way to a GPU."""
    own = model.state_dict()
    theirs = {k[len("model/"):] for k in tensors if k.startswith("model/")}
    if theirs != set(own):
        missing, extra = sorted(set(own) - theirs), sorted(theirs - set(own))
        raise CheckpointError(f"checkpoint {path!r} does not hold the model its config builds (missing: "
                              f"{missing[:5]}, unexpected: {extra[:5]})")
    done = set()
    for name, tensor in own.items():
        if tensor.data_ptr() in done:
            continue
        value = np.asarray(tensors[f"model/{name}"])
        if tuple(value.shape) != tuple(tensor.shape):
            raise CheckpointError(f"checkpoint {path!r}: {name} has shape {tuple(value.shape)}, the model's is "
                                  f"{tuple(tensor.shape)}")
        tensor.copy_(torch.from_numpy(value if value.flags.writeable else value.copy()))
        done.add(tensor.data_ptr())


def _check_shapes(cfg: RunConfig, manifest: dict, path: str) -> None:
    """The model the config builds has the shapes the checkpoint lists (its files were checked against
    the list when it was opened), compared on the meta device, which takes no memory: a manifest
    whose config names a larger model than its tensors hold is refused before that model is built."""
    from elixir_ray.checkpoint import check_compatible
    from elixir_ray.model.factory import expected_checkpoint_shapes

    try:
        check_compatible(manifest, expected_checkpoint_shapes(cfg))
    except CheckpointError as exc:
        model = "model.hf" if cfg.model.hf is not None else f"model.size {cfg.model.size}"
        raise CheckpointError(f"checkpoint {path!r} does not hold the model its config ({model}) builds: "
                              f"{exc}") from None


def _build_model(cfg: RunConfig, manifest: dict, tensors, path: str, device: torch.device) -> torch.nn.Module:
    _check_shapes(cfg, manifest, path)
    model = empty_model(cfg, device)
    # buffers a state dict leaves out (a rotary embedding's frequencies) come from the model's own
    # initialisation; the weights it draws there are then overwritten
    init = init_fn_for(cfg, model)
    with torch.no_grad():
        for module in model.modules():
            if module._non_persistent_buffers_set:
                init(module)
        _load_weights(model, tensors, path)
    return model.eval()


def load_checkpoint_model(ckpt_uri: str, device: torch.device) -> tuple[str, dict, RunConfig, torch.nn.Module]:
    """The newest valid checkpoint at `ckpt_uri` as (path, manifest, its model's config, the model in
    eval mode on `device`)."""
    path, manifest, tensors = require_newest_valid(ckpt_uri)
    cfg = _model_config(manifest, path)
    return path, manifest, cfg, _build_model(cfg, manifest, tensors, path, device)


def checkpoint_tokenizer(manifest: dict, tokenizer: Optional[str], eos_token: Optional[str]):
    """The tokenizer the checkpoint's data was made with: the byte-level one, or the file named,
    checked against what the checkpoint says it was trained on."""
    theirs = checkpoint_tokenizer_identity(manifest)
    named = tokenizer_named(theirs, manifest.get("tokenizer_file"))
    if tokenizer is None:
        if eos_token is not None:
            raise ConfigError("--eos-token is for a --tokenizer file: name the one the run's data was made with")
        if theirs != "bytes":
            raise ConfigError(f"the checkpoint was trained on tokens of {named}: name that tokenizer with --tokenizer "
                              f"(the tokenizer.json its data was prepared with)")
        return ByteTokenizer()
    tok = load_tokenizer(tokenizer, eos_token)
    if tok.identity != theirs:
        raise ConfigError(f"--tokenizer {tokenizer!r} gives {tok.identity}, but the checkpoint was trained on tokens "
                          f"of {named}: name the tokenizer (and --eos-token) its data was prepared with")
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
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"--temperature {temperature}: use 0 (the likeliest token each time) or more")
    if top_k is not None and top_k < 1:
        raise ConfigError(f"--top-k {top_k}: keep at least 1 token")
    where = _device(device)
    path, manifest, tensors = require_newest_valid(ckpt_uri)
    tok = checkpoint_tokenizer(manifest, tokenizer, eos_token)  # a wrong one refused before the model is built
    cfg = _model_config(manifest, path)
    model = _build_model(cfg, manifest, tensors, path, where)
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
            if top_k is not None and top_k < logits.numel():
                kth = torch.topk(logits, top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            logits = (logits - logits.max()) / temperature  # the likeliest at 0: no overflow at a tiny temperature
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if nxt == tok.eos_id:
            ended = True
            break
        written.append(nxt)
        context.append(nxt)
    # decoded with the prompt, then the prompt's text taken off: a tokenizer that drops the first
    # token's leading space (sentencepiece-style) would otherwise run the first word into the prompt
    prompt_ids = context[1:len(context) - len(written)]
    shown, whole = tok.decode(prompt_ids), tok.decode(prompt_ids + written)
    text = whole[len(shown):] if whole.startswith(shown) else tok.decode(written)
    return Sampled(checkpoint=path, step=int(manifest["step"]), prompt=prompt, text=text, tokens=len(written),
                   ended=ended)


def _device(name: Optional[str]) -> torch.device:
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is not a device: cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: this torch has no CUDA device (use cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {name}: there are {torch.cuda.device_count()} CUDA device(s)")
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name}: sample runs on cpu or cuda")
    return device
