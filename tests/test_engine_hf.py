"""Hugging Face models (random init from a config, no download) through the engine, against plain torch."""

import copy
import os
import sys

import pytest
import torch

from elixir_ray import wrap
from elixir_ray.engine import manual_plan

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import CausalLMLoss, count_updates_started_before_step, train_pairs  # noqa: E402

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
        # experts through torch's grouped matmul, whose meta kernel takes only bfloat16
        "mixtral": transformers.MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=2, num_key_value_heads=1, num_local_experts=4,
                                              num_experts_per_tok=2, **small),
    }


@pytest.mark.parametrize("name", ["gpt2", "opt", "llama", "mixtral"])
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
    # the model itself, called by keyword as HF loops call it; the trace takes the loss from its ModelOutput
    sample = {"input_ids": data[0], "labels": data[0]}
    plan = manual_plan(eng, sample, chunk_size=4096, n_blocks=3)
    model, opt = wrap(eng, torch.optim.AdamW(eng.parameters(), lr=1e-3), sample_inputs=sample, plan=plan,
                      device="cpu")
    losses = []
    for batch in data:
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert model.engine_stats()["evictions"] > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    state = model.state_dict()
    assert list(state) == list(ref.state_dict())  # the model's own keys: save_pretrained(state_dict=) takes them
    for key, value in ref.state_dict().items():
        assert torch.allclose(state[key], value.float(), atol=1e-5), key


def test_hf_model_traced_without_labels_names_what_the_trace_needs():
    model = transformers.AutoModelForCausalLM.from_config(_configs()["gpt2"])
    ids = torch.randint(0, 64, (2, 8))
    with pytest.raises(TypeError, match=r"GPT2LMHeadModel's forward returned a ModelOutput with no loss, .* pass "
                                        r"loss_fn=.*a Hugging Face model returns one when labels are among"):
        wrap(model, torch.optim.AdamW(model.parameters()), sample_inputs={"input_ids": ids}, device_memory="64MiB",
             device="cpu")


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
    """`activation_checkpointing_enable()`, reentrant (a nested backward per layer) or not, with the
    CPU updates started during backward (`accumulation_steps=1`): still one backward per step."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(_configs()["llama"], attn_implementation="eager")
    switch = ("activation_checkpointing_enable" if hasattr(base, "activation_checkpointing_enable")
              else "gradient_checkpointing_enable")  # renamed in transformers 5
    getattr(base, switch)({"use_reentrant": reentrant})  # the kwargs, by position: their name changed too
    base.train()
    data = [(torch.randint(0, 64, (4, 16)), torch.ones(4, 16, dtype=torch.long)) for _ in range(4)]
    ref = CausalLMLoss(copy.deepcopy(base))
    ref_losses = train_pairs(ref, torch.optim.AdamW(ref.parameters(), lr=1e-3), data)
    eng = CausalLMLoss(copy.deepcopy(base))
    plan = manual_plan(eng, data[0], chunk_size=4096, n_blocks=3)
    model, opt = wrap(eng, torch.optim.AdamW(eng.parameters(), lr=1e-3), sample_inputs=data[0], plan=plan,
                      device="cpu", accumulation_steps=1)
    assert opt.updates_in_backward
    started = count_updates_started_before_step(model, opt)
    losses = train_pairs(model, opt, data)
    assert len(started) == len(data) and min(started) > 0  # every step's updates began in its backward
    assert model.engine_stats()["evictions"] > 0
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_save_pretrained_takes_the_wrapped_models_state_dict(tmp_path, dtype):
    """The README's way to save a wrapped HF model: its own save_pretrained, given the engine's
    weights. In bf16 the module's parameters are bf16 compute copies, which HF read the dtype
    from: the saved config said bfloat16 and the fp32 weights loaded back in bf16."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_configs()["gpt2"])
    ids = torch.randint(0, 64, (2, 16))
    batch = transformers.BatchEncoding({"input_ids": ids, "labels": ids})  # a tokenizer's output: a Mapping
    model, opt = wrap(hf, torch.optim.AdamW(hf.parameters(), lr=1e-2), sample_inputs=batch, device_memory="64MiB",
                      device="cpu", dtype=dtype)
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    hf.save_pretrained(tmp_path / "a", state_dict=model.state_dict())  # it drops tied keys from the dict it is given
    hf.config.dtype = None
    model.save_pretrained(tmp_path / "b")  # the same, given the engine's weights by the wrapper
    assert hf.config.dtype is None  # the in-memory config is left as it was
    state = model.state_dict()
    for where in ("a", "b") if dtype == torch.float32 else ("b",):
        back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / where)
        assert back.dtype == torch.float32
        for key, value in back.state_dict().items():
            assert torch.equal(value, state[key]), (where, key)


def test_hf_attributes_are_read_through_the_wrapped_model():
    """Code written for the model reads its config, device and dtype, and calls its helpers, on what
    wrap returned; its weights stay guarded and its submodules still refuse a direct call."""
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(_configs()["gpt2"])
    n_params = hf.num_parameters()
    ids = torch.randint(0, 64, (2, 16))
    sample = {"input_ids": ids, "labels": ids}
    model, opt = wrap(hf, torch.optim.AdamW(hf.parameters(), lr=1e-2), sample_inputs=sample,
                      plan=manual_plan(hf, sample, chunk_size=4096, n_blocks=3), device="cpu")
    model(**sample).loss.backward()
    opt.step()
    assert model.config is hf.config and model.config.vocab_size == 64
    assert model.device == torch.device("cpu") and model.dtype == torch.float32
    assert model.num_parameters() == n_params
    assert model.get_input_embeddings() is hf.transformer.wte
    with pytest.raises(RuntimeError, match="was read"):  # evicted after the step: no data to read
        model.transformer.wte.weight.sum()
    with pytest.raises(RuntimeError, match="a part of the GPT2LMHeadModel given to elixir_ray.wrap ran outside the wrapped model .Embedding 'transformer.wte'"):
        model.transformer(ids)  # a submodule's direct call would compute outside the engine's fetch and dtype
    with pytest.raises(AttributeError, match="GPT2LMHeadModel has an attribute 'no_such_thing'"):
        model.no_such_thing
    with pytest.raises(AttributeError):  # private names stay the wrapper's own
        model._no_such_private
    assert model(**sample).loss.item() > 0  # and it trains on
    model.eval()
    config = copy.deepcopy(hf.generation_config)
    config.max_new_tokens, config.do_sample = 3, False
    model.generation_config = config  # set on the module, whose generate reads it
    assert hf.generation_config is config and "generation_config" not in vars(model)
    assert model.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long)).shape == (2, 7)
    model.my_note = "the wrapper's own"  # a name the module does not have stays on the wrapper
    assert vars(model)["my_note"] == "the wrapper's own" and not hasattr(hf, "my_note")


def test_hf_generate_through_the_wrapped_model_matches_plain_generate():
    """generate calls the model itself many times (with a growing cache): the wrapped model runs it
    with the parameters fetched, and training goes on exactly afterwards. pad_token_id is set and no
    attention mask is given, so GPT-2's forward checks input_ids for padding by value (in the trace too)."""
    torch.manual_seed(0)
    config = copy.deepcopy(_configs()["gpt2"])
    config.pad_token_id = config.eos_token_id = 1
    base = transformers.AutoModelForCausalLM.from_config(config)
    ref = copy.deepcopy(base)
    ids = torch.randint(2, 64, (2, 16))
    sample = {"input_ids": ids, "labels": ids}
    model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-3), sample_inputs=sample,
                      plan=manual_plan(base, sample, chunk_size=4096, n_blocks=3), device="cpu")
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)

    def step():
        for m, o in ((model, opt), (ref, ref_opt)):
            m(input_ids=ids, labels=ids).loss.backward()
            o.step()
            o.zero_grad()

    step()
    for m in (model, ref):
        m.eval()
    out = model.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long), max_new_tokens=10,
                         do_sample=False)
    assert torch.equal(out, ref.generate(ids[:, :4], attention_mask=torch.ones(2, 4, dtype=torch.long),
                                         max_new_tokens=10, do_sample=False))
    assert out.shape == (2, 14)
    for m in (model, ref):
        m.train()
    step()
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-5), key
    with pytest.raises(RuntimeError, match="called directly"):
        base.generate(ids[:, :4], max_new_tokens=2)


def test_generate_on_a_module_without_one_says_so():
    module = torch.nn.Linear(4, 1)
    model, _ = wrap(module, torch.optim.AdamW(module.parameters()), sample_inputs=(torch.randn(2, 4),),
                    device_memory="64MiB", device="cpu", loss_fn=lambda out: out.sum())
    with pytest.raises(AttributeError, match="Linear has no generate method"):
        model.generate(torch.randn(2, 4))


def test_hf_plan_error_names_the_models_own_activation_checkpointing():
    """The planner cannot switch a Hugging Face model's checkpointing per block, but the model can
    recompute its layers itself: when activations do not fit, the refusal says how."""
    import elixir_ray

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=256)
    model = transformers.AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 128, (8, 256))
    switch = ("activation_checkpointing_enable" if hasattr(model, "activation_checkpointing_enable")
              else "gradient_checkpointing_enable")
    with pytest.raises(elixir_ray.PlanError, match=rf"activations at micro-batch 8 need .*\ncall "
                                                   rf"LlamaForCausalLM.{switch}\(\) before planning or wrap"):
        elixir_ray.plan(model, {"input_ids": ids, "labels": ids}, device_memory="24MiB")
    getattr(model, switch)()
    plan = elixir_ray.plan(model, {"input_ids": ids, "labels": ids}, device_memory="24MiB")
    assert plan.predicted_peak_bytes <= 24 * 2**20


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_a_meta_built_model_materialised_with_its_init_weights_starts_where_apply_starts(name):
    """init_fn=model._init_weights on a meta-built model: GPT-2's init of an attention or MLP block
    rescales its child c_proj's weight, and its head shares the embedding; Llama's rotary buffers
    are computed by the init. The engine must end with the weights model.apply(model._init_weights)
    gives, drawing the same random numbers, though it makes one module's weights at a time."""
    config = _configs()[name]
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    ref = copy.deepcopy(meta).to_empty(device="cpu")
    ref.tie_weights()
    torch.manual_seed(0)
    ref.apply(ref._init_weights)
    next_ref = torch.randn(3)  # what a seeded loop draws after the init
    ids = torch.randint(0, 64, (2, 16))
    sample = {"input_ids": ids, "labels": ids}
    torch.manual_seed(0)
    model, opt = wrap(meta, torch.optim.AdamW(meta.parameters(), lr=1e-3), sample_inputs=sample,
                      plan=manual_plan(meta, sample, chunk_size=2048, n_blocks=2), device="cpu",
                      init_fn=meta._init_weights)
    assert torch.equal(torch.randn(3), next_ref)
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.equal(state[key], value), key
    loss = model(**sample).loss
    assert loss.item() == pytest.approx(ref(**sample).loss.item(), abs=1e-5)
