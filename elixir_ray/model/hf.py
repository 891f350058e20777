"""A Hugging Face causal language model as a run's model (`model.hf` in a config).

The built-in GPT is one architecture; people who train with this kind of system bring Llama,
Mistral, Qwen or GPT-2 shapes. The engine already trains any `nn.Module` (Hugging Face models
included), so a run only needs the model built from its transformers config fields, with random
initialisation and no download: on the meta device for the planner and the engine (which
materialises it chunk by chunk with the model's own `_init_weights`), and trained on the same token
windows and the same loss as the built-in GPT. The checkpoint then holds the model's own keys, so
`elixir-ray export` writes weights that load into `AutoModelForCausalLM.from_config(...)`.

transformers is imported only when a config names `model.hf`.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import json
import os
import re
from typing import Optional

import torch
import torch.nn as nn

from elixir_ray.errors import ConfigError
from elixir_ray.model.loss import logits_cross_entropy

# keys every config class takes through its keyword arguments (older config.json files carry the
# first ones; attn_implementation picks eager, sdpa or flash attention)
_COMMON_KEYS = frozenset({"rope_theta", "rope_scaling", "torch_dtype", "dtype", "transformers_version",
                          "architectures", "_name_or_path", "attn_implementation", "is_decoder",
                          "add_cross_attention", "output_attentions", "output_hidden_states"})
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")  # YAML 1.1 reads 1e-5 as a string


def _transformers():
    try:
        import transformers
    except ImportError:
        raise ConfigError("model.hf needs the transformers package on the driver and on every worker: "
                          "pip install 'elixir_ray[hf]' (or transformers), and list it in the job's "
                          "runtime_env pip packages") from None
    return transformers


def read_hf_file(path: str) -> dict:
    """The fields of a config.json (or of the config.json in a folder), as `model.hf` takes them."""
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise ConfigError(f"model.hf: {path!r} is no config.json file (nor a folder holding one); give a "
                          f"model's config.json, or its fields as a mapping (model_type: llama, hidden_size: ...)")
    try:
        with open(file) as f:
            fields = json.load(f)
    except ValueError as exc:
        raise ConfigError(f"model.hf: {file} is not valid JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"model.hf: {file} holds {type(fields).__name__}, not a mapping of config fields")
    fields["_name_or_path"] = os.path.abspath(file)  # as transformers notes where a config came from
    return fields


def numbers_read(fields):
    """The fields with the numbers YAML 1.1 leaves as strings (`1e-5`) made floats, as transformers
    wants them, in nested mappings and lists too (`rope_parameters: {rope_theta: 1e6}`)."""
    if isinstance(fields, dict):
        return {k: numbers_read(v) for k, v in fields.items()}
    if isinstance(fields, list):
        return [numbers_read(v) for v in fields]
    return float(fields) if isinstance(fields, str) and _FLOAT.fullmatch(fields) else fields


def hf_config(fields: dict):
    """The transformers config `model.hf` describes, or a ConfigError that names what to change.

    transformers keeps any keyword a config class does not know as a plain attribute, so a typo
    (`hiden_size`) would silently train the class's default size: every key must be one the class
    takes, unless the fields came from a config.json (`_name_or_path` set by `read_hf_file`), whose
    keys transformers wrote."""
    transformers = _transformers()
    fields = dict(fields)
    model_type = fields.pop("model_type", None)
    if not model_type:
        raise ConfigError("model.hf needs model_type, the architecture (for example llama, mistral, qwen2, gpt2)")
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        close = difflib.get_close_matches(str(model_type), MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, n=3)
        raise ConfigError(f"model.hf.model_type {model_type!r} is no causal language model this transformers "
                          f"({transformers.__version__}) builds"
                          + (f" (did you mean {', '.join(close)}?)" if close else
                             " (for example llama, mistral, qwen2, gpt2)"))
    cls = transformers.CONFIG_MAPPING[model_type]
    fields = numbers_read(fields)
    if "_name_or_path" not in fields:
        known = set(inspect.signature(cls.__init__).parameters) | set(getattr(cls, "attribute_map", {}))
        known |= set(transformers.PretrainedConfig().to_dict()) | _COMMON_KEYS
        try:
            known |= set(cls().to_dict())
        except Exception:  # noqa: BLE001 - a class whose defaults do not build: its signature says enough
            pass
        for key in fields:
            if key not in known:
                close = difflib.get_close_matches(key, sorted(known - {"self", "kwargs"}), n=2)
                raise ConfigError(f"model.hf.{key} is not a field of {cls.__name__}"
                                  + (f" (did you mean {' or '.join(close)}?)" if close else ""))
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as exc:  # noqa: BLE001 - transformers' own validation errors are of several kinds
        why = " ".join(str(exc).split())
        raise ConfigError(f"model.hf: {cls.__name__} refused these fields: {why}") from None


def max_positions(config) -> Optional[int]:
    """The longest sequence the model's position embeddings cover (None: no such limit)."""
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def check_hf(fields: dict, seq_len: int, checkpointing: bool) -> None:
    """What a run needs of the model, checked where the config is read (before any worker starts)."""
    config = hf_config(fields)
    limit = max_positions(config)
    if limit is not None and seq_len > limit:
        raise ConfigError(f"model.seq_len={seq_len} is longer than the {limit} positions model.hf's model covers: "
                          f"set model.seq_len to at most {limit}")
    try:
        model = build_hf(fields, checkpointing=False, device="meta")
    except Exception as exc:  # noqa: BLE001 - transformers checks some fields only when it builds the model
        why = " ".join(str(exc).split())
        raise ConfigError(f"model.hf: transformers could not build the model from these fields: "
                          f"{type(exc).__name__}: {why}") from None
    if checkpointing and not getattr(model, "supports_gradient_checkpointing", False):
        raise ConfigError(f"model.activation_checkpointing: {type(model).__name__} has no gradient checkpointing "
                          f"of its own; set it to false")


def hf_vocab_size(fields: dict) -> int:
    return int(hf_config(fields).vocab_size)


def build_hf(fields: dict, checkpointing: bool, device=None) -> nn.Module:
    """The model, in fp32 (the engine keeps fp32 masters and casts its compute copies), in training
    mode, with the model's own gradient checkpointing (non-reentrant) when asked."""
    transformers = _transformers()
    config = hf_config(fields)
    where = torch.device(device) if device is not None else contextlib.nullcontext()
    with where:
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = model.to(torch.float32)  # a config.json that says bfloat16 still gets fp32 masters
    model.train()
    if checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # the name from transformers 5
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def hf_init_fn(model: nn.Module):
    """The per-module initialisation the engine materialises a meta-built model with: the model's own."""
    return model._init_weights


def hf_loss(model: nn.Module, tokens: torch.Tensor, targets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The mean next-token cross-entropy of `tokens` (seq_len+1 per row), as the built-in GPT computes
    it: the model sees the first seq_len tokens and is scored on the next one at each position.
    With `targets`, `tokens` are the inputs and positions whose target is -100 are not scored."""
    if targets is None:
        tokens, targets = tokens[:, :-1], tokens[:, 1:]
    return logits_cross_entropy(model(input_ids=tokens, use_cache=False).logits, targets)


def hf_sample_inputs(tokens: torch.Tensor) -> dict:
    """The keyword inputs the engine and the planner trace: those `hf_loss` calls the model with."""
    return {"input_ids": tokens[:, :-1], "use_cache": False}


def hf_trace_loss(output) -> torch.Tensor:
    """The traced step's loss from the model's output: the same kernels `hf_loss` runs on the logits
    (the trace runs on the meta device, where the targets' values do not matter)."""
    logits = output.logits
    targets = torch.zeros(logits.shape[:-1].numel(), dtype=torch.long, device=logits.device)
    return logits_cross_entropy(logits, targets)
