"""Meta kernels answered from memory give the trace exactly what running them gives."""

import os
import sys

import pytest
import torch

from elixir_ray.engine.meta_kernels import MetaKernelCache
from elixir_ray.engine.sample import as_sample_inputs
from elixir_ray.engine.trace import _trace_step
from elixir_ray.model.gpt import GPTConfig, GPT

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import LearnedRouter, Routed, Toy, batches  # noqa: E402


def _both(module, inputs, dtype=None, with_weights=False):
    inputs = as_sample_inputs(inputs)
    return [_trace_step(module, inputs, None, dtype, with_weights=with_weights, cache_kernels=cache)
            for cache in (False, True)]


def test_a_repeated_call_gets_fresh_outputs_of_the_kernels_layout():
    a = torch.empty(4, 6, device="meta").t()  # not contiguous: the output follows its strides
    b = torch.empty(6, 4, device="meta", dtype=torch.bfloat16)
    with MetaKernelCache() as cache:
        first = a + b
        second = a + b
        inplace = a.add_(b)
        view = second.t()
        third = torch.add(a, torch.tensor(2.0))  # a CPU argument: another kernel's values could decide a shape
    assert (cache.misses, cache.hits) == (1, 1)
    for out in (first, second):
        assert (out.shape, out.stride(), out.dtype) == ((6, 4), (1, 6), torch.float32)
    assert second.untyped_storage()._cdata != first.untyped_storage()._cdata
    assert inplace is a and view._base is second  # in place and views run the kernel as ever
    assert third.device.type == "meta"


def test_a_kernel_that_returns_a_view_of_its_input_is_never_answered_from_memory():
    x = torch.empty(8, 4, device="meta")
    with MetaKernelCache() as cache:
        parts = [x.split(2) for _ in range(3)]
        outs = [torch.ops.aten.alias(x) for _ in range(2)]
    assert cache.hits == 0
    assert all(p.untyped_storage()._cdata == x.untyped_storage()._cdata for ps in parts for p in ps)
    assert all(o.untyped_storage()._cdata == x.untyped_storage()._cdata for o in outs)


def test_what_the_arguments_layouts_do_not_decide_is_never_answered_from_memory():
    ints = torch.empty(3, dtype=torch.int64, device="meta")
    longer = torch.empty(8, device="meta")[:4]
    previous = torch.get_default_dtype()
    try:
        with MetaKernelCache():
            halves = [ints / 2]
            torch.set_default_dtype(torch.float64)  # integer division and factories take the default dtype
            halves += [ints / 2, torch.empty(2, device="meta")]
            torch.set_default_dtype(previous)
            zeros = [torch._efficientzerotensor(3, device="meta") for _ in range(2)]
            same = [torch.ops.aten._has_same_storage_numel(x, torch.empty(4, device="meta"))
                    for x in (torch.empty(4, device="meta"), longer)]  # storage sizes are not in the key
    finally:
        torch.set_default_dtype(previous)
    assert [h.dtype for h in halves] == [torch.float32, torch.float64, torch.float64]
    assert [z._is_zerotensor() for z in zeros] == [True, True]
    assert same == [True, False]


@pytest.mark.parametrize("modes", [["none"] * 4, ["selective", "full", "none", "full"], ["full"] * 4])
def test_a_gpt_traces_the_same_with_and_without_the_cache(modes):
    model = GPT(GPTConfig(d_model=64, n_layers=4, n_heads=4, vocab_size=97, seq_len=32))
    model.set_checkpointing(modes)
    ids = torch.randint(0, 97, (2, 33))
    plain, cached = _both(model, (ids,), dtype=torch.bfloat16)
    assert cached == plain
    assert plain.activation_peak_bytes > 0 and plain.ops


@pytest.mark.parametrize("make", [Toy, Routed, lambda: Routed(ckpt="reentrant")])
def test_small_models_trace_the_same_with_and_without_the_cache(make):
    torch.manual_seed(0)
    plain, cached = _both(make(), (batches(1, 8)[0],))
    assert cached == plain


def test_a_step_traced_with_the_weights_values_is_the_same_with_the_cache():
    torch.manual_seed(0)
    plain, cached = _both(LearnedRouter(), (batches(1, 8)[0],), with_weights=True)
    assert cached == plain and cached.weights_read


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_models_trace_the_same_with_and_without_the_cache(name):
    transformers = pytest.importorskip("transformers")
    configs = {
        "gpt2": transformers.GPT2Config(n_embd=32, n_layer=3, n_head=2, n_positions=32, vocab_size=64),
        "llama": transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                          num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                                          max_position_embeddings=32),
    }
    model = transformers.AutoModelForCausalLM.from_config(configs[name], attn_implementation="sdpa")
    ids = torch.randint(0, 64, (2, 16))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # padding: the model reads the mask's values
    plain, cached = _both(model, {"input_ids": ids, "attention_mask": mask, "labels": ids}, dtype=torch.bfloat16)
    assert cached == plain
