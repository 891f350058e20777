"""Hugging Face models (random init from a config, no download) through the engine, against plain torch."""

import copy
import os
import sys

import pytest
import torch

from elixir_ray.engine import manual_plan, wrap

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import CausalLMLoss, train_pairs  # noqa: E402

transformers = pytest.importorskip("transformers")


def _configs():
    small = dict(vocab_size=64, max_position_embeddings=32)
    return {
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=32, vocab_size=64,
                                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
        "opt": transformers.OPTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, ffn_dim=64,
                                      word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **small),
        "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=1, **small),
    }


@pytest.mark.parametrize("name", ["gpt2", "opt", "llama"])
def test_hf_model_matches_plain_training(name):
    torch.manual_seed(0)
    config = _configs()[name]
    base = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    base.train()
    data = [torch.randint(0, 64, (4, 16)) for _ in range(4)]

    ref = copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    ref_losses = []
    for batch in data:
        loss = ref(input_ids=batch, labels=batch).loss
        loss.backward()
        ropt.step()
        ropt.zero_grad()
        ref_losses.append(loss.item())

    eng = copy.deepcopy(base)

    class Call(torch.nn.Module):  # HF models take keyword inputs; the engine traces positional ones
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, batch):
            return self.m(input_ids=batch, labels=batch).loss

    wrapped_in = Call(eng)
    plan = manual_plan(wrapped_in, (data[0],), chunk_size=4096, n_blocks=3)
    model, opt = wrap(wrapped_in, torch.optim.AdamW(wrapped_in.parameters(), lr=1e-3), sample_inputs=(data[0],),
                      plan=plan, device="cpu")
    losses = []
    for batch in data:
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert model.engine_stats()["evictions"] > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.allclose(state[f"m.{key}"], value.float(), atol=1e-5), key


def test_hf_sdpa_attention_with_a_padding_mask_trains_like_torch():
    """sdpa attention reads the padding mask's values to choose its path: the trace must follow them."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_configs()["llama"], attn_implementation="sdpa")
    base.train()
    data = []
    for _ in range(4):
        ids, mask = torch.randint(0, 64, (4, 16)), torch.ones(4, 16, dtype=torch.long)
        mask[0, :4] = 0  # left padding on one row
        data.append((ids, mask))

    ref = CausalLMLoss(copy.deepcopy(base))
    ref_losses = train_pairs(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data)
    eng = CausalLMLoss(copy.deepcopy(base))
    plan = manual_plan(eng, data[0], chunk_size=4096, n_blocks=3)
    model, opt = wrap(eng, torch.optim.AdamW(eng.parameters(), lr=1e-3), sample_inputs=data[0], plan=plan,
                      device="cpu")
    losses = train_pairs(model, opt, data)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5


@pytest.mark.parametrize("reentrant", [True, False])
def test_hf_gradient_checkpointing_with_updates_started_in_backward(reentrant):
    """`gradient_checkpointing_enable()`, reentrant (a nested backward per layer) or not, with the
    CPU updates started during backward (`accumulation_steps=1`): still one backward per step."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_configs()["llama"], attn_implementation="eager")
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    base.train()
    data = [(torch.randint(0, 64, (4, 16)), torch.ones(4, 16, dtype=torch.long)) for _ in range(4)]
    ref = CausalLMLoss(copy.deepcopy(base))
    ref_losses = train_pairs(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data)
    eng = CausalLMLoss(copy.deepcopy(base))
    plan = manual_plan(eng, data[0], chunk_size=4096, n_blocks=3)
    model, opt = wrap(eng, torch.optim.AdamW(eng.parameters(), lr=1e-3), sample_inputs=data[0], plan=plan,
                      device="cpu", accumulation_steps=1)
    assert opt.updates_in_backward
    losses = train_pairs(model, opt, data)
    assert model.engine_stats()["evictions"] > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
