"""What the meta trace says a step saves and runs, against a real CPU run of the same model."""

import dataclasses
import os
import sys

import pytest
import torch

import elixir_ray
from elixir_ray.engine.trace import trace_step
from elixir_ray.model.gpt import build_gpt
from elixir_ray.planner.hardware import HardwareProfile, device_name
from elixir_ray.planner.op_timing import time_ops

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import CausalLMLoss  # noqa: E402

CPU = HardwareProfile(device="cpu", h2d_gbps=10.0, d2h_gbps=10.0, cpu_adam_params_per_s=5e8,
                      device_adam_params_per_s=5e8, matmul_tflops=0.1, cpu_threads=2, device_name=device_name("cpu"))


def _gpt(seq: int = 128, checkpointing: bool | str = False, device=None):
    torch.manual_seed(0)
    return build_gpt(dict(d_model=64, n_layers=2, n_heads=4, vocab_size=300, seq_len=seq), checkpointing,
                     device=device)


def _real_saved_bytes(model, *inputs) -> int:
    """Bytes of the distinct storages autograd saves in a real forward, parameters left out."""
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage()._cdata not in params:
            saved[t.untyped_storage()._cdata] = (t.untyped_storage().nbytes(), t.untyped_storage())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(*inputs)
    return sum(n for n, _ in saved.values())


@pytest.mark.parametrize("checkpointing", [False, True])
def test_traced_activations_are_what_a_real_step_saves(checkpointing):
    # attention on meta would take the math path (a T x T matrix in fp32) and a tensor saved by
    # several ops would count several times; the real CPU run uses the fused kernel and shares it
    model = _gpt(checkpointing=checkpointing)
    batch = torch.randint(0, 300, (2, 129))
    traced = trace_step(model, (batch,)).saved_activation_bytes
    real = _real_saved_bytes(model, batch)
    assert abs(traced - real) <= 0.01 * real, (traced, real)


def test_traced_activations_grow_linearly_with_the_sequence():
    short = trace_step(_gpt(256, device="meta"), (torch.zeros(2, 257, dtype=torch.long),))
    long = trace_step(_gpt(512, device="meta"), (torch.zeros(2, 513, dtype=torch.long),))
    assert long.saved_activation_bytes < 2.2 * short.saved_activation_bytes  # no T^2 attention matrix


def test_trace_records_each_distinct_kernel_with_its_counts():
    sample = (torch.zeros(2, 129, dtype=torch.long),)
    plain = trace_step(_gpt(device="meta"), sample)
    recomputed = trace_step(_gpt(checkpointing=True, device="meta"), sample)
    assert sum(op.flops * op.count for op in plain.ops) == plain.flops
    assert sum(op.flops * op.forward_count for op in plain.ops) == plain.forward_flops

    def linear_calls(trace, phase_count):
        return sum(phase_count(op) for op in trace.ops if op.op.startswith("aten::addmm"))

    forward = linear_calls(plain, lambda op: op.forward_count)
    assert forward == linear_calls(plain, lambda op: op.count) == 2 * 4  # qkv, proj, up, down per block
    # checkpointed blocks run their linears again in backward, up to the last one whose output
    # backward needs (torch stops a recomputation early): qkv, proj and up, not down
    assert linear_calls(recomputed, lambda op: op.count) == forward + 2 * 3
    assert linear_calls(recomputed, lambda op: op.forward_count) == forward


def test_kernels_are_timed_on_the_device_and_reused_across_traces():
    sample = (torch.zeros(2, 129, dtype=torch.long),)
    trace = trace_step(_gpt(device="meta"), sample)
    cache = {}
    timed = time_ops(trace.ops, CPU, cache=cache)
    assert timed.estimated == [] and timed.timed == len(trace.ops)
    assert 0 < timed.forward_seconds < timed.step_seconds
    known = dict(cache)
    again = time_ops(trace_step(_gpt(checkpointing=True, device="meta"), sample).ops, CPU, cache=cache)
    assert all(cache[k] == v for k, v in known.items())  # shared kernels were not timed again
    assert again.step_seconds > timed.step_seconds  # the recomputed forward costs time


def test_kernels_too_big_to_replay_are_estimated_from_flops_and_bytes():
    trace = trace_step(_gpt(device="meta"), (torch.zeros(2, 129, dtype=torch.long),))
    estimated = time_ops(trace.ops, CPU, max_bytes=0)
    assert estimated.timed == 0 and len(estimated.estimated) == len(trace.ops)
    matmul_part = sum(op.flops * op.count for op in trace.ops) / (CPU.matmul_tflops * 1e12)
    assert estimated.step_seconds > matmul_part  # plus the memory-bound kernels at the copy rate


def test_kernels_whose_flops_would_take_long_to_replay_are_estimated_and_the_rest_timed():
    """A call that at the matmul rate would run for over LONG_CALL_S (attention at a long sequence on
    a CPU) is estimated from its FLOPs, not replayed several times over; calls without FLOPs (norms,
    casts) are still timed."""
    from elixir_ray.planner.op_timing import LONG_CALL_S

    trace = trace_step(_gpt(device="meta"), (torch.zeros(2, 129, dtype=torch.long),))
    biggest = max(op.flops for op in trace.ops)
    slow = dataclasses.replace(CPU, matmul_tflops=biggest / (2 * LONG_CALL_S) / 1e12)  # the biggest: 2 x LONG_CALL_S
    result = time_ops(trace.ops, slow)
    long_ops = [op for op in trace.ops if op.flops / (slow.matmul_tflops * 1e12) > LONG_CALL_S]
    assert long_ops and sorted(result.estimated) == sorted(op.op for op in long_ops)
    assert result.timed == len(trace.ops) - len(long_ops) > 0
    assert result.step_seconds >= sum(op.flops * op.count for op in long_ops) / (slow.matmul_tflops * 1e12)


def test_plan_made_beside_the_device_times_its_kernels():
    model = _gpt(device="meta")
    sample = (torch.zeros(2, 129, dtype=torch.long),)
    here = elixir_ray.plan(model, sample, device_memory="1GiB", hardware=CPU)
    assert any("distinct kernels timed on cpu" in n for n in here.notes)
    away = elixir_ray.plan(model, sample, device_memory="1GiB", hardware=CPU, time_compute=False)
    assert any("traced FLOPs" in n for n in away.notes)
    assert away.time["compute"] == pytest.approx(trace_step(model, sample).flops / 1e11)
    # rates measured on another machine (or unnamed) are not mixed with this one's kernel times
    for name in ("Some Other CPU", ""):
        other = dataclasses.replace(CPU, device_name=name)
        elsewhere = elixir_ray.plan(model, sample, device_memory="1GiB", hardware=other)
        assert any("traced FLOPs" in n for n in elsewhere.notes)


def _real_activation_peak(model, *inputs) -> int:
    """The CPU allocator's high-water mark over a real step, from the profiler's memory events,
    plus the inputs, which exist before it starts (as do the weights, which are not counted; their
    gradients are dropped on arrival, as the engine does)."""
    from torch.profiler import ProfilerActivity, profile

    handles = [p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None)) for p in model.parameters()]
    try:
        model(*inputs).backward()  # a warm-up step
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model(*inputs).backward()
    finally:
        for h in handles:
            h.remove()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = sum(x.numel() * x.element_size() for x in inputs)  # the batch: on the device all step
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("checkpointing", [False, True, "selective"])
def test_traced_activation_peak_is_a_real_steps_and_tops_the_saved_bytes(checkpointing):
    model = _gpt(checkpointing=checkpointing)
    batch = torch.randint(0, 300, (2, 129))
    trace = trace_step(model, (batch,))
    real = _real_activation_peak(model, batch)
    assert abs(trace.activation_peak_bytes - real) <= 0.02 * real, (trace.activation_peak_bytes, real)
    # backward's first gradients sit on the saved tensors: at least the loss's fp32 logits gradient
    logits = 2 * 128 * 300 * 4
    assert trace.activation_peak_bytes >= trace.saved_activation_bytes + logits
    assert len(trace.live_before) == len(trace.events) and max(trace.live_before) <= trace.activation_peak_bytes
    # the highs between accesses reach the peak, which the samples at accesses miss (the chart draws them)
    assert len(trace.live_high) == len(trace.events) and max(trace.live_high) == trace.activation_peak_bytes
    assert all(h >= b for h, b in zip(trace.live_high, trace.live_before))


class GroupedQueryAttention(torch.nn.Module):
    """Fewer key/value heads than query heads, as Llama-style models have; a rotary-like table as a buffer."""

    def __init__(self, d: int = 128, heads: int = 8, kv_heads: int = 2, max_len: int = 8192):
        super().__init__()
        self.heads, self.kv_heads, self.dh = heads, kv_heads, d // heads
        self.q = torch.nn.Linear(d, d)
        self.kv = torch.nn.Linear(d, 2 * kv_heads * self.dh)
        self.register_buffer("table", torch.ones(max_len, d))  # 4 MiB, of which a slice is used

    def forward(self, x):
        b, t, d = x.shape
        x = x * self.table[:t]  # saves a slice of the buffer: the buffer is no activation
        q = self.q(x).view(b, t, self.heads, self.dh).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.kv_heads, self.dh).permute(2, 0, 3, 1, 4).unbind(0)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return y.float().square().mean()


def test_grouped_query_attention_and_buffers_are_traced_as_a_real_step_holds_them():
    torch.manual_seed(0)
    model = GroupedQueryAttention()
    x = torch.randn(2, 256, 128)
    trace = trace_step(model, (x,))
    assert abs(trace.saved_activation_bytes - _real_saved_bytes(model, x)) <= 0.02 * _real_saved_bytes(model, x)
    real = _real_activation_peak(model, x)
    # the real backward also expands the key/value gradients to every query head for a moment
    # (inside the kernel, invisible to the trace): a few percent here, where attention is all
    assert abs(trace.activation_peak_bytes - real) <= 0.08 * real, (trace.activation_peak_bytes, real)
    assert trace.activation_peak_bytes < model.table.numel() * 4  # the 4 MiB table is not counted
    attention = [op for op in trace.ops if op.op == "aten::_scaled_dot_product_flash_attention"]
    assert len(attention) == 1 and attention[0].args[1].shape[1] == 2  # key/value heads not repeated
    assert not any("repeat_interleave" in op.op for op in trace.ops)
    assert time_ops(trace.ops, CPU).estimated == []


def test_grouped_query_attention_flops_are_counted_where_torchs_formula_wants_equal_heads(monkeypatch):
    """torch 2.11's attention FLOP formula refuses fewer key/value heads than query heads (2.13 takes
    them): the trace widens them first, and counts the FLOPs of the attention over every query head."""
    from torch.utils.flop_counter import flop_registry

    calls = []
    for op in (torch.ops.aten._scaled_dot_product_flash_attention,
               torch.ops.aten._scaled_dot_product_flash_attention_backward):
        formula = flop_registry[op]

        def equal_heads_only(*args, formula=formula, **kwargs):
            heads = {a.shape[1] for a in args if isinstance(a, torch.Tensor) and a.dim() == 4}
            assert len(heads) == 1, "sdpa_flop_count: query/key/value shapes are incompatible"
            calls.append(heads.pop())
            return formula(*args, **kwargs)
        monkeypatch.setitem(flop_registry, op, equal_heads_only)
    trace = trace_step(GroupedQueryAttention(), (torch.randn(2, 256, 128),))
    forward = next(op for op in trace.ops if op.op == "aten::_scaled_dot_product_flash_attention")
    b, h, s, d = forward.args[0].shape  # the query's
    assert forward.flops == 4 * b * h * s * s * d and calls and set(calls) == {h}


class GroupedExperts(torch.nn.Module):
    """Experts as Hugging Face's mixture-of-experts layers run them: tokens sorted by expert, one
    grouped matmul over every expert's weight (whose meta kernel takes only bfloat16)."""

    def __init__(self, experts=4, d=32, hidden=48):
        super().__init__()
        self.w_in = torch.nn.Parameter(torch.randn(experts, hidden, d) * 0.1)
        self.w_out = torch.nn.Parameter(torch.randn(experts, d, hidden) * 0.1)

    def forward(self, x, offs):
        h = torch._grouped_mm(x, self.w_in.transpose(-2, -1), offs=offs)
        return torch._grouped_mm(torch.relu(h), self.w_out.transpose(-2, -1), offs=offs).square().mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_traces_at_any_dtype_and_its_flops_are_counted(dtype):
    """torch has no FLOP formula for the grouped matmul, and its meta kernel refused float32: a
    Mixtral step could not be traced at fp32, and its experts' compute was predicted as free."""
    tokens, d, hidden = 40, 32, 48
    model = GroupedExperts(d=d, hidden=hidden)
    offs = torch.tensor([10, 20, 25, 40], dtype=torch.int32)
    trace = trace_step(model, (torch.randn(tokens, d), offs), dtype=dtype)
    grouped = [op for op in trace.ops if op.op == "aten::_grouped_mm"]
    # forward: two products; backward: both weights' gradients and the hidden activation's (not x's)
    assert sum(op.forward_count for op in grouped) == 2 and sum(op.count for op in grouped) == 5
    assert {op.flops for op in grouped} == {2 * tokens * d * hidden}  # each is one (40 x 32) @ (32 x 48)
    assert sum(op.flops * op.count for op in grouped) == 5 * 2 * tokens * d * hidden
    assert all(trace.got_grad)


def test_a_replayed_grouped_matmul_splits_its_tokens_evenly_over_the_groups():
    """The trace keeps the offsets' shape only: replayed with zeros, every group is empty and the
    kernel, timed on the device, does no work at all."""
    from elixir_ray.planner.op_timing import _even_groups, _materialise

    trace = trace_step(GroupedExperts(), (torch.randn(40, 32), torch.tensor([10, 20, 25, 40], dtype=torch.int32)))
    seen = set()
    for op in trace.ops:
        if op.op == "aten::_grouped_mm":
            args, kwargs = _even_groups(_materialise(op.args, torch.device("cpu")),
                                        _materialise(op.kwargs, torch.device("cpu")))
            offs = kwargs.get("offs", args[2] if len(args) > 2 else None)
            assert offs.tolist() == [10, 20, 30, 40], op  # 40 tokens over 4 experts, in either operand's place
            seen.add((args[0].dim(), args[1].dim()))
    assert seen == {(2, 3), (2, 2)}  # the products and the weights' gradients


class ReadsItsMask(torch.nn.Module):
    """Decides from the mask's values, as Hugging Face's attention does, and edits a mask in place."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(64, 32)
        self.out = torch.nn.Linear(32, 64)

    def forward(self, ids, mask):
        positions = mask.long().cumsum(-1).clamp_(min=1) - 1  # in place on values made from the input
        mask.masked_fill_(mask == 0, 0)  # in place on the input itself
        h = self.emb(ids) + self.emb(positions)
        if bool(mask.all()):  # a decision on the input's values
            h = h * 2
        kept = mask.nonzero().shape[0]  # a shape that depends on values
        return torch.nn.functional.cross_entropy(self.out(h).reshape(-1, 64), ids.reshape(-1)) * kept


def test_decisions_on_input_values_are_traced_with_the_real_values():
    model = ReadsItsMask()
    ids, mask = torch.randint(0, 64, (2, 8)), torch.ones(2, 8, dtype=torch.long)
    mask[0, :3] = 0
    before = mask.clone()
    trace = trace_step(model, (ids, mask))
    assert torch.equal(mask, before)  # the caller's tensors are not written
    assert trace.flops > 0 and all(trace.got_grad)

    def muls(t):
        return sum(op.count for op in t.ops if op.op == "aten::mul.Tensor")

    unpadded = trace_step(model, (ids, torch.ones(2, 8, dtype=torch.long)))
    assert muls(unpadded) > muls(trace) > 0  # `h * 2` traced only where the real mask has no padding


def test_decisions_on_weight_values_take_the_branch_the_real_weights_take():
    class ReadsAWeight(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(4, 4)
            self.other = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.l(x).sum() if bool(self.l.weight.sum() > 0) else self.other(x).sum()

    for sign in (1.0, -1.0):
        module = ReadsAWeight()
        with torch.no_grad():
            module.l.weight.fill_(sign)
        trace = trace_step(module, (torch.randn(2, 4),))
        assert trace.weights_read
        assert trace.got_grad == ([True, True, False, False] if sign > 0 else [False, False, True, True])
        assert torch.equal(module.l.weight, torch.full((4, 4), sign))  # the module is left as it was
    with torch.device("meta"):
        module = ReadsAWeight()
    with pytest.raises(RuntimeError, match="build it with real weights"):
        trace_step(module, (torch.randn(2, 4),))


def test_hugging_face_attention_with_a_padding_mask_is_traced_as_a_real_step_saves():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      max_position_embeddings=64)
    torch.manual_seed(0)
    llama = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")

    model = CausalLMLoss(llama)
    ids, mask = torch.randint(0, 128, (2, 48)), torch.ones(2, 48, dtype=torch.long)
    mask[0, :5] = 0  # padding: the mask is not all ones, so attention takes it
    traced = trace_step(model, (ids, mask)).saved_activation_bytes
    real = _real_saved_bytes(model, ids, mask)
    # the trace over-counts this tiny model by about 10% (not yet pinned down; the attention kernels
    # save the same tensors); over, not under, is the side that cannot run out of memory
    assert real <= traced <= 1.12 * real, (traced, real)


def test_values_written_from_weights_or_never_written_are_not_read_stale():
    reads = {}

    class WritesWeightsIntoInputValues(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, mask):
            def read(name, t):
                try:
                    reads[name] = t.sum().item()
                except RuntimeError:
                    reads[name] = "refused"

            p = mask.clone()
            p.add_(self.w)  # now holds weight values: its input-made shadow is stale
            read("written in place", p)
            read("uninitialised", torch.empty(3, device=mask.device))
            base = mask.clone()
            base[1:].mul_(self.w[1:])  # written through a view
            read("base of a written view", base)
            read("untouched", mask.clone())
            torch.rand(3, device=mask.device)  # a random kernel: not run for real
            return (self.w * mask).sum()

    torch.manual_seed(0)
    expected = torch.rand(1)
    torch.manual_seed(0)
    trace_step(WritesWeightsIntoInputValues(), (torch.ones(3),))
    assert reads == {"written in place": "refused", "uninitialised": "refused", "base of a written view": "refused",
                     "untouched": 3.0}
    assert torch.equal(torch.rand(1), expected)  # the caller's random state is where it was


def test_selective_checkpointing_keeps_the_flops_and_frees_activations():
    sample = (torch.zeros(2, 129, dtype=torch.long),)
    none, selective, full = (trace_step(_gpt(checkpointing=mode, device="meta"), sample)
                             for mode in ("none", "selective", "full"))
    assert selective.flops == none.flops < full.flops  # no matmul runs twice
    assert full.activation_peak_bytes < selective.activation_peak_bytes < 0.9 * none.activation_peak_bytes
