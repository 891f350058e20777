import json
import re

import pytest
import torch

from hypothesis import given, settings
from hypothesis import strategies as st

from elixir_ray.planner.cache_sim import count_loads
from elixir_ray.planner.hardware import HardwareProfile, profile_hardware


def test_cache_sim_basic():
    seq = [(0,), (1,), (2,), (0,), (1,), (2,)]
    assert count_loads(seq, 3) == 3
    # two blocks: Belady keeps the chunk used soonest; 0,1 load, 2 evicts 1 (used after 0), ...
    assert count_loads(seq, 2) == 4
    assert count_loads([(0, 1), (1, 2), (0, 2)], 2) == 4


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=40))
def test_cache_sim_bounds_and_monotonic(seq):
    distinct = len({c for op in seq for c in op})
    widest = max(len(set(op)) for op in seq)
    previous = None
    for blocks in range(widest, distinct + 2):
        loads = count_loads(seq, blocks)
        assert loads >= distinct
        if blocks >= distinct:
            assert loads == distinct
        if previous is not None:
            assert loads <= previous  # more blocks never cost more loads
        previous = loads


def test_profile_hardware_measures_positive_rates():
    hw = profile_hardware("cpu", copy_bytes=8 * 2**20, adam_numel=2**20)
    assert hw.h2d_gbps > 0 and hw.d2h_gbps > 0 and hw.cpu_adam_params_per_s > 0 and hw.matmul_tflops > 0
    assert HardwareProfile.from_json(hw.to_json()) == hw
    slow = HardwareProfile.slowest([hw, HardwareProfile(**{**json.loads(hw.to_json()), "h2d_gbps": 0.5})])
    assert slow.h2d_gbps == min(0.5, hw.h2d_gbps)
    assert hw.cpu_adam_low_grad_params_per_s > 0  # the engine's update from bf16 gradients, timed apart


@pytest.mark.parametrize("field,value,message", [
    ("h2d_gbps", "fast", "h2d_gbps must be a positive number, got 'fast'"),
    ("matmul_tflops", 0, "matmul_tflops must be a positive number, got 0"),
    ("cpu_adam_params_per_s", -1, "cpu_adam_params_per_s must be a positive number"),
    ("d2h_gbps", True, "d2h_gbps must be a positive number"),
    ("collective_gbps", float("nan"), "collective_gbps must be a non-negative number"),
    ("device", "", "device must name a torch device"),
])
def test_a_hardware_profile_with_a_rate_that_is_not_a_positive_number_is_refused(field, value, message):
    """Profiles are JSON files people edit: a zero rate would divide by zero in the cost model, a
    negative one would predict a negative time."""
    rates = dict(device="cuda:0", h2d_gbps=50.0, d2h_gbps=50.0, cpu_adam_params_per_s=4e9,
                 device_adam_params_per_s=8e10, matmul_tflops=500.0, cpu_threads=16)
    with pytest.raises(ValueError, match=re.escape(message)):
        HardwareProfile(**{**rates, field: value})
    HardwareProfile(**{**rates, "collective_gbps": 0.0})  # 0: not measured, allowed


def test_host_chunks_with_bf16_gradients_are_costed_at_that_updates_rate():
    import numpy as np

    from elixir_ray.planner.cost import chunk_costs

    rates = dict(device="cuda:0", h2d_gbps=50.0, d2h_gbps=50.0, cpu_adam_params_per_s=4e9,
                 device_adam_params_per_s=8e10, matmul_tflops=500.0, cpu_threads=16)
    sizes = np.array([2**20, 2**20])

    def adam_host(hw, grad_bytes):
        return chunk_costs(sizes, sizes, np.ones(2, dtype=bool), 1, 2, hw, grad_bytes=grad_bytes).adam_host

    measured = HardwareProfile(**rates, cpu_adam_low_grad_params_per_s=2e9)
    assert np.allclose(adam_host(measured, 4), 2**20 / 4e9) and np.allclose(adam_host(measured, 2), 2**20 / 2e9)
    older = HardwareProfile(**rates)  # a profile without the bf16 rate: the fp32 one stands in
    assert np.allclose(adam_host(older, 2), 2**20 / 4e9)


def test_overlap_model_hides_cpu_adam_behind_backward_only_when_updates_start_there():
    from elixir_ray.planner.cost import overlapped_step

    parts = dict(compute=0.6, forward=0.15, on_stream=0.0, h2d=0.2, d2h=0.3, cpu_adam=0.5, cpu_first=0.01, dos=0.0)
    in_backward = overlapped_step(**parts, updates_in_backward=True)
    at_step = overlapped_step(**parts, updates_in_backward=False)
    assert in_backward == pytest.approx(0.6 + 0.01)  # 0.45 s of backward and 0.15 s of forward hide it
    assert at_step == pytest.approx(0.6 + (0.5 - 0.15))  # only the next forward hides it
    assert overlapped_step(**{**parts, "h2d": 0.9}, updates_in_backward=True) == pytest.approx(0.9 + 0.01)
    assert overlapped_step(**{**parts, "cpu_adam": 0.0}, updates_in_backward=False) == pytest.approx(0.6)
    # with 3 micro-steps only the last one's backward (0.2 - 0.15 = 0.05 s) hides updates started in it
    three = dict(parts, compute=0.6, forward=0.15)
    assert overlapped_step(**three, updates_in_backward=True, micro_steps=3) == pytest.approx(0.6 + (0.5 - 0.05 - 0.15))


def test_checkpointing_variants_step_through_fractions_of_evenly_spread_blocks():
    from elixir_ray.model.gpt import build_gpt
    from elixir_ray.planner.model_profile import checkpointing_variants

    def gpt(n_layers):
        return build_gpt(dict(d_model=32, n_layers=n_layers, n_heads=2, vocab_size=64, seq_len=8), device="meta")

    def counts(variants, mode):
        return [v.count(mode) for v in variants]

    variants = checkpointing_variants(gpt(48))
    # nothing recomputed; then 0, 1/8, 1/4 and so on in eighths and thirds to all of the blocks whole,
    # the others selectively
    assert counts(variants, "full") == [0, 0, 6, 12, 16, 18, 24, 30, 32, 36, 42, 48]
    assert counts(variants, "selective") == [0, 48, 42, 36, 32, 30, 24, 18, 16, 12, 6, 0]
    assert counts(variants, "none") == [48] + [0] * 11
    quarter = variants[3]
    assert [i for i, m in enumerate(quarter) if m == "full"] == list(range(0, 48, 4))  # evenly spaced, from block 0
    assert not any(v[-1] == "full" for v in variants[2:7])  # up to half: not the last block, recomputed at the peak
    assert counts(checkpointing_variants(gpt(2)), "full") == [0, 0, 1, 2]  # fractions that coincide count once
    own = gpt(6)
    own.set_checkpointing([True, True, False, False, False, False])
    assert checkpointing_variants(own)[-1] == ["full", "full", "none", "none", "none", "none"]


def test_a_module_with_only_an_on_off_switch_gets_whole_block_fractions():
    from elixir_ray.planner.model_profile import checkpointing_variants

    class Switch(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mask = [False] * 6

        def checkpointing(self):
            return list(self.mask)

        def set_checkpointing(self, mask):
            self.mask = list(mask)

    variants = checkpointing_variants(Switch())
    assert all(isinstance(m, bool) for v in variants for m in v)
    assert [sum(v) for v in variants] == [0, 1, 2, 3, 4, 5, 6]  # eighths of 6 blocks coincide in places


@pytest.mark.parametrize("gap, said", [(2, "every 2nd"), (3, "every 3rd"), (4, "every 4th"), (11, "every 11th"),
                                       (12, "every 12th"), (13, "every 13th"), (16, "every 16th")])
def test_a_plans_description_names_its_deep_optimizer_states_gap_as_an_ordinal(gap, said):
    from elixir_ray.engine.plan import Plan

    plan = Plan(chunk_size=8, n_blocks=2, param_order=["w"], placements=["host"] * 4, sharded=[False] * 4,
                dos_gap=gap, chunk_numels=[8] * 4)
    assert f"Deep Optimizer States updates {said} host chunk on the device" in plan.explain()
    assert "Deep Optimizer States" not in Plan(chunk_size=8, n_blocks=2, param_order=["w"], placements=["host"] * 4,
                                               sharded=[False] * 4, chunk_numels=[8] * 4).explain()
