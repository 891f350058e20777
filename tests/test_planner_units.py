import dataclasses
import json
import re
from functools import cache, partial

import numpy as np
import pytest
import torch

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from elixir_ray.planner.cache_sim import count_loads
from elixir_ray.planner.hardware import HardwareProfile, profile_hardware


def test_cache_sim_basic():
    seq = [(0,), (1,), (2,), (0,), (1,), (2,)]
    assert count_loads(seq, 3) == 3
    # two blocks: Belady keeps the chunk used soonest; 0,1 load, 2 evicts 1 (used after 0), ...
    assert count_loads(seq, 2) == 4
    assert count_loads([(0, 1), (1, 2), (0, 2)], 2) == 4


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
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
    assert hw.cpu_adam_beside_copies == 0.0  # no device copies to run beside it on a CPU


@pytest.mark.parametrize("field,value,message", [
    ("h2d_gbps", "fast", "h2d_gbps must be a positive number, got 'fast'"),
    ("matmul_tflops", 0, "matmul_tflops must be a positive number, got 0"),
    ("cpu_adam_params_per_s", -1, "cpu_adam_params_per_s must be a positive number"),
    ("d2h_gbps", True, "d2h_gbps must be a positive number"),
    ("collective_gbps", float("nan"), "collective_gbps must be a non-negative number"),
    ("cpu_adam_beside_copies", -0.5, "cpu_adam_beside_copies must be a non-negative number"),
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
    # measured beside pinned copies both ways (the engine's loads and gradient copies), the job
    # kept 0.7 of its rate: both rates are costed at that share; 0 (not measured) keeps them whole
    contended = HardwareProfile(**rates, cpu_adam_low_grad_params_per_s=2e9, cpu_adam_beside_copies=0.7)
    assert np.allclose(adam_host(contended, 4), 2**20 / 2.8e9) and np.allclose(adam_host(contended, 2), 2**20 / 1.4e9)
    assert "x0.70 beside copies" in contended.rates() and "beside copies" not in measured.rates()
    both = HardwareProfile.slowest([contended, measured, HardwareProfile(**rates, cpu_adam_beside_copies=0.9)])
    assert both.cpu_adam_beside_copies == 0.7  # the lowest measured share; an unmeasured one does not count
    assert HardwareProfile.slowest([measured, older]).cpu_adam_beside_copies == 0.0
    assert HardwareProfile.from_json(contended.to_json()) == contended


def test_copies_are_costed_at_what_each_way_kept_beside_the_cpu_job_where_measured():
    """The profile's copies both ways beside the CPU AdamW job: a step's loads, gradient copies
    and DOS copies run so in training, so each way is costed at no more than that rate."""
    import numpy as np

    from elixir_ray.planner.cost import chunk_costs

    rates = dict(device="cuda:0", h2d_gbps=50.0, d2h_gbps=40.0, cpu_adam_params_per_s=4e9,
                 device_adam_params_per_s=8e10, matmul_tflops=500.0, cpu_threads=16)
    alone, beside = HardwareProfile(**rates), HardwareProfile(**rates, copies_beside_cpu_adam_gbps=25.0)
    assert alone.link_rates() == (50.0, 40.0) and beside.link_rates() == (25.0, 25.0)
    assert HardwareProfile(**rates, copies_beside_cpu_adam_gbps=45.0).link_rates() == (45.0, 40.0)
    sizes = np.array([2**20])
    a = chunk_costs(sizes, sizes, np.ones(1, dtype=bool), 1, 2, alone, upload=True, grad_bytes=2)
    b = chunk_costs(sizes, sizes, np.ones(1, dtype=bool), 1, 2, beside, upload=True, grad_bytes=2)
    assert np.allclose(b.load_host, a.load_host * 2) and np.allclose(b.dos_in, a.dos_in * 2)
    assert np.allclose(b.reduce_host, a.reduce_host * 40 / 25) and np.allclose(b.dos_out, a.dos_out * 40 / 25)
    assert "beside it 25.0 GB/s each" in beside.rates() and "beside it" not in alone.rates()
    assert HardwareProfile.slowest([alone, beside, HardwareProfile(**rates, copies_beside_cpu_adam_gbps=30.0)]
                                   ).copies_beside_cpu_adam_gbps == 25.0  # the lowest measured; 0 does not count
    assert HardwareProfile.from_json(beside.to_json()) == beside
    with pytest.raises(ValueError, match="copies_beside_cpu_adam_gbps must be a non-negative number"):
        HardwareProfile(**rates, copies_beside_cpu_adam_gbps=-1.0)


def test_the_engines_own_kernels_are_costed_by_the_device_memory_they_move():
    """At the device AdamW's rate times its 28 bytes per element: a device chunk's fill casts its
    fp32 master (4 + 2 bytes in bf16) and its gradients are copied into an fp32 buffer (2 + 4); a
    host chunk whose gradients go down in bf16 collects them in bf16 with one rank (2 + 2), and
    with several widens them (2 + 4) and casts its shard back (4 + 2); with fp32 gradients, the
    widening copy alone (4 + 4 in fp32)."""
    import numpy as np

    from elixir_ray.planner.cost import chunk_costs

    hw = HardwareProfile(device="cuda:0", h2d_gbps=50.0, d2h_gbps=50.0, cpu_adam_params_per_s=4e9,
                         device_adam_params_per_s=1e9, matmul_tflops=500.0, cpu_threads=16)
    sizes = np.array([2**20, 2**21])
    low = chunk_costs(sizes, sizes, np.ones(2, dtype=bool), 1, 2, hw, grad_bytes=2)
    assert np.allclose(low.fill_device, sizes * 6 / 28e9) and np.allclose(low.stage, sizes * 6 / 28e9)
    assert np.allclose(low.stage_host, sizes * 4 / 28e9)
    two = chunk_costs(sizes, sizes // 2, np.zeros(2, dtype=bool), 2, 2, hw, grad_bytes=2)
    assert np.allclose(two.stage_host, (sizes * 6 + sizes // 2 * 6) / 28e9)
    wide = chunk_costs(sizes, sizes, np.ones(2, dtype=bool), 1, 4, hw, grad_bytes=4)
    assert np.allclose(wide.fill_device, sizes * 8 / 28e9) and np.allclose(wide.stage_host, sizes * 8 / 28e9)
    assert np.allclose(wide.stage, wide.stage_host)


def test_overlap_model_hides_cpu_adam_behind_backward_only_when_updates_start_there():
    from elixir_ray.planner.cost import StepParts, overlapped_step

    parts = dict(compute=0.6, forward=0.15, on_stream=0.0, h2d=0.2, d2h=0.3, cpu_adam=0.5, cpu_wait=0.01)
    in_backward = overlapped_step(StepParts(**parts, updates_in_backward=True))
    at_step = overlapped_step(StepParts(**parts, updates_in_backward=False))
    assert in_backward == pytest.approx(0.6 + 0.01)  # 0.45 s of backward and 0.15 s of forward hide it
    assert at_step == pytest.approx(0.6 + (0.5 - 0.15))  # only the next forward hides it
    # bound by the link: 0.9 s of loads, a third of them the forward's (0.15 s of it waited for
    # beyond the forward's compute), the rest beside the 0.45 s of recompute and backward
    assert overlapped_step(StepParts(**{**parts, "h2d": 0.9}, updates_in_backward=True, forward_loads=0.3)) \
        == pytest.approx(0.15 + 0.15 + 0.6)
    assert overlapped_step(StepParts(**{**parts, "cpu_adam": 0.0}, updates_in_backward=False)) == pytest.approx(0.6)
    # with 3 micro-steps only the last one's backward (0.2 - 0.15 = 0.05 s) hides updates started in it
    three = dict(parts, compute=0.6, forward=0.15)
    assert overlapped_step(StepParts(**three, updates_in_backward=True, micro_steps=3)) \
        == pytest.approx(0.6 + (0.5 - 0.05 - 0.15))


def test_overlap_model_hides_deep_optimizer_states_copies_behind_the_next_forward_and_idle_backward_link():
    """DOS updates started at step() run on their own streams: the next forward hides up to its
    length of their copies (both directions at once), and what it does not hide runs beside the CPU
    AdamW's remainder, not after it. Started in the last backward, they first take the link's time
    that backward's own copies leave idle."""
    from elixir_ray.planner.cost import StepParts, overlapped_step

    parts = dict(compute=0.6, forward=0.15, on_stream=0.0, h2d=0.2, d2h=0.1, cpu_adam=0.0, cpu_wait=0.0)
    at_step = dict(parts, updates_in_backward=False)
    assert overlapped_step(StepParts(**at_step, dos_in=0.1, dos_out=0.12)) == pytest.approx(0.6)  # the forward hides it
    assert overlapped_step(StepParts(**at_step, dos_in=0.3, dos_out=0.2)) == pytest.approx(0.6 + (0.3 - 0.15))
    # the link: 0.45 s of backward's loads and 0.3 s of DOS copies in one direction exceed the
    # compute; the step is the link's 0.75 s, the DOS copies counted once (in the forward's wait)
    assert overlapped_step(StepParts(**{**at_step, "h2d": 0.45}, dos_in=0.3, dos_out=0.0)) == pytest.approx(0.75)
    # the next forward's own loads go up the link beside the DOS copies in: together they exceed it
    assert overlapped_step(StepParts(**at_step, dos_in=0.1, dos_out=0.12, forward_loads=0.1)) \
        == pytest.approx(0.6 + 0.05)
    # without DOS, loads shorter than the forward are hidden by it; longer ones are waited for
    assert overlapped_step(StepParts(**at_step, forward_loads=0.1)) == pytest.approx(0.6)
    assert overlapped_step(StepParts(**{**at_step, "h2d": 0.3}, forward_loads=0.2)) == pytest.approx(0.6 + 0.05)

    in_backward = dict(parts, updates_in_backward=True)
    # backward (0.45 s) leaves the link idle for 0.25 s going up and 0.35 s coming down: 0.05 s of
    # the copies in are left for the forward, which hides them
    assert overlapped_step(StepParts(**in_backward, dos_in=0.3, dos_out=0.2)) == pytest.approx(0.6)
    assert overlapped_step(StepParts(**in_backward, dos_in=0.55, dos_out=0.2)) == pytest.approx(0.6 + (0.3 - 0.15))
    # a backward bound by its own loads leaves no idle link: as from step()
    assert overlapped_step(StepParts(**{**in_backward, "h2d": 0.45}, dos_in=0.3, dos_out=0.0)) == pytest.approx(0.75)
    # beside 0.2 s of CPU work left after the forward: the later of the two, not their sum
    cpu = dict(in_backward, cpu_adam=0.45 + 0.35, cpu_wait=0.01)  # 0.45 s hidden by the last backward
    assert overlapped_step(StepParts(**cpu, dos_in=0.3, dos_out=0.3)) == pytest.approx(0.6 + 0.2)
    assert overlapped_step(StepParts(**cpu, dos_in=0.7, dos_out=0.3)) == pytest.approx(0.6 + 0.3)


def test_overlap_model_stops_the_forward_at_its_first_dos_chunk_until_the_queue_is_through():
    """Where DOS updates start in backward, the first DOS chunk the forward needs is the last in
    their queue (gradients are final in the reverse order): only the forward's compute before that
    chunk hides the queue, and its loads so far share the link with it; the later loads then
    overlap the later compute."""
    from elixir_ray.planner.cost import StepParts, overlapped_step

    # started in backward, whose own loads (0.45 s) leave the link going up no idle time: the DOS
    # copies in (0.3 s) are left whole for the forward; those out (0.2 s) go in backward's idle time
    in_backward = dict(compute=0.6, forward=0.15, on_stream=0.0, h2d=0.55, d2h=0.1, cpu_adam=0.0, cpu_wait=0.0,
                       updates_in_backward=True, dos_in=0.3, dos_out=0.2, forward_loads=0.1)
    whole = overlapped_step(StepParts(**in_backward))  # the whole forward hides the queue: 0.1 + 0.3 - 0.15 exposed
    assert whole == pytest.approx(0.6 + 0.25)
    # the defaults are the whole forward and all its loads: the same step
    assert overlapped_step(StepParts(**in_backward, dos_first_at=0.15, loads_to_dos=0.1)) == pytest.approx(whole)
    # a DOS chunk a third of the way in, after 0.04 s of loads: 0.04 + 0.3 - 0.05 exposed there,
    # then 0.06 s of loads beside 0.1 s of compute
    assert overlapped_step(StepParts(**in_backward, dos_first_at=0.05, loads_to_dos=0.04)) == pytest.approx(0.6 + 0.29)
    # ... or beside 0.02 s of compute when the DOS chunk comes late: 0.04 s of loads wait after it
    assert overlapped_step(StepParts(**in_backward, dos_first_at=0.13, loads_to_dos=0.04)) \
        == pytest.approx(0.6 + 0.21 + 0.04)
    # a backward with idle link time for the copies in: nothing left to wait for but the loads
    idle = dict(in_backward, h2d=0.2)
    assert overlapped_step(StepParts(**idle, dos_first_at=0.0, loads_to_dos=0.01)) == pytest.approx(0.6 + 0.01)
    # started at step(), the DOS chunks are queued in the forward's order: its first is first, no stop
    at_step = dict(in_backward, updates_in_backward=False)
    assert overlapped_step(StepParts(**at_step, dos_first_at=0.05, loads_to_dos=0.04)) == pytest.approx(
        overlapped_step(StepParts(**at_step)))


def test_overlap_model_releases_the_dos_queue_as_its_gradients_are_final():
    """Where DOS updates start in backward, each DOS chunk's copies take backward's idle link only
    after its gradient is final: the copies left for the forward are the most by which any part
    of the queue, from one chunk's gradient on, outlasts the idle link after it."""
    from elixir_ray.planner.cost import StepParts, overlapped_step
    from elixir_ray.planner.search import Layout, _dos_queue

    # backward 0.45 s with 0.1 s of its own loads and gradient copies: 0.35 s idle each way
    idle = dict(compute=0.6, forward=0.15, on_stream=0.0, h2d=0.2, d2h=0.1, cpu_adam=0.0, cpu_wait=0.0,
                updates_in_backward=True, forward_loads=0.1)
    lay = Layout(profile=None, chunk_size=1, sizes=np.ones(3), numels=np.ones(3), shards=np.ones(3),
                 replicated=np.ones(3, dtype=bool), events=[], min_blocks=1, param_order=[],
                 backward_final=np.array([0.9, 0.5, 0.1]))  # chunk 2's gradient first, chunk 0's last
    dos_in = np.array([0.05, 0.2, 0.1])

    def step(dos, **kw):
        dos = np.array(dos)
        queue_in, queue_out, after = _dos_queue(lay, dos, dos_in, np.zeros(3))
        return overlapped_step(StepParts(**{**idle, **kw}, dos_in=float(dos_in[dos].sum()), dos_out=0.0,
                                         dos_queue_in=queue_in, dos_queue_out=queue_out, dos_after=after))

    # all three: from chunk 2 on 0.35 - 0.35*0.9 left; from chunk 1 on 0.25 - 0.35*0.5 = 0.075, the
    # most; from chunk 0 0.05 - 0.035: 0.075 left, beside the forward's 0.1 s of loads
    assert step([True, True, True]) == pytest.approx(0.45 + 0.15 + (0.1 + 0.075 - 0.15))
    # without chunk 2 (the first in the queue) the same is left: never slower with less work
    assert step([True, True, False]) == pytest.approx(step([True, True, True]))
    assert step([False, False, True]) == pytest.approx(0.6)  # early in backward: hidden
    assert step([False, False, False]) == pytest.approx(0.6)
    # the same rows at once (the search's form)
    rows = np.array([[True, True, True], [False, False, True]])
    queue_in, queue_out, after = _dos_queue(lay, rows, dos_in, np.zeros(3))
    both = overlapped_step(StepParts(**{**idle, "h2d": np.array([0.2, 0.2])}, dos_in=rows @ dos_in, dos_out=np.zeros(2),
                                     dos_queue_in=queue_in, dos_queue_out=queue_out, dos_after=after))
    assert both == pytest.approx([step([True, True, True]), 0.6])
    # with no queue given, the whole queue may start as backward does (the earlier model)
    assert overlapped_step(StepParts(**idle, dos_in=0.35, dos_out=0.0)) == pytest.approx(0.6)
    # at step(), nothing is in backward: the queue's release times do not matter
    at_step = dict(idle, updates_in_backward=False)
    queue_in, queue_out, after = _dos_queue(lay, np.array([True, True, True]), dos_in, np.zeros(3))
    assert overlapped_step(StepParts(**at_step, dos_in=0.35, dos_out=0.0, dos_queue_in=queue_in,
                                     dos_queue_out=queue_out, dos_after=after)) \
        == pytest.approx(overlapped_step(StepParts(**at_step, dos_in=0.35, dos_out=0.0)))


def test_a_chunks_gradient_is_final_when_its_last_gradient_arrives_not_at_its_last_read():
    """A GPT's embedding is read in backward by no op (its gradient is a scatter into the rows),
    and, tied to the head, its last weight read is the head's, at backward's start: its gradient
    is final last all the same, which the planner's CPU and DOS timings must know."""
    from elixir_ray.model.gpt import build_gpt
    from elixir_ray.planner.model_profile import profile_model
    from elixir_ray.planner.search import make_layout

    model = build_gpt(dict(d_model=64, n_layers=4, n_heads=4, vocab_size=256, seq_len=32), False, device="meta")
    assert model.head.weight is model.wte.weight
    sample = torch.randint(0, 256, (2, 33))
    profile = profile_model(model, (sample,), None, None, torch.float32)
    lay = make_layout(profile, 20_000, 1)  # wte (16,384 elements) in chunk 0, then about a block a chunk
    final = lay.backward_final
    assert final[0] == pytest.approx(1.0) and final[0] == final.max()
    assert all(final[1:] < 1.0) and list(final[1:]) == sorted(final[1:], reverse=True)  # later blocks first


def _three_chunk_layout():
    from elixir_ray.planner.search import Layout

    n = 3
    return Layout(profile=None, chunk_size=1, sizes=np.ones(n), numels=np.ones(n), shards=np.ones(n),
                  replicated=np.ones(n, dtype=bool), events=[], min_blocks=1, param_order=[],
                  forward_before=np.array([0.0, 0.5, 0.8]), backward_final=np.array([1.0, 0.6, 0.3]))


def test_a_cpu_update_is_waited_for_as_long_as_it_outlasts_its_chunks_time():
    """A chunk's CPU update has from its final gradient to the forward's need for it: a tied
    embedding (final last, needed first) has none, a middle chunk part of backward and forward."""
    from elixir_ray.planner.search import UpdateQueue, _cpu_wait

    lay, none = _three_chunk_layout(), np.zeros(3)
    adam = np.array([0.05, 0.05, 0.3])
    plain = np.array([[True, False, False], [False, True, False], [False, False, True], [False] * 3])
    # forward 0.1 s, last backward 0.3 s: chunk 0 has nothing, chunk 1 0.05 + 0.12 s, chunk 2 0.08 + 0.21 s
    assert _cpu_wait(UpdateQueue(lay, plain, adam, 0.1, True, none), 0.3) == pytest.approx([0.05, 0.0, 0.01, 0.0])
    # updates at step(): only the forward's compute before each chunk
    assert _cpu_wait(UpdateQueue(lay, plain, adam, 0.1, False, none), 0.3) == pytest.approx([0.05, 0.0, 0.22, 0.0])
    # its load after its update, and its gradient's copy down before it (within backward), are waited for too
    assert _cpu_wait(UpdateQueue(lay, plain, adam, 0.1, True, np.full(3, 0.01), np.full(3, 0.02)), 0.3) \
        == pytest.approx([0.06, 0.0, 0.04, 0.0])


def test_cpu_updates_queue_on_one_thread_lowest_chunk_first_among_those_ready():
    """The updates run one at a time: one ready while another runs waits for it, so the forward
    waits for the queue, not for the slowest update alone; among those ready the thread takes
    the chunk the forward needs first (`HostUpdates`), not the one ready first."""
    from elixir_ray.planner.search import UpdateQueue, _cpu_wait

    lay, none = _three_chunk_layout(), np.zeros(3)
    adam = np.array([0.05, 0.05, 0.3])
    every = np.ones((1, 3), dtype=bool)
    # chunk 2 runs from 0.09 to 0.39 s of the 0.3 s backward; chunks 1 (ready at 0.18) and 0 (at
    # 0.3) wait for it; then chunk 0 (0.39 to 0.44), then 1 (to 0.49): 0.14 s into the forward each,
    # where the forward needs chunk 0 at once and chunk 1 after 0.05 s. Alone, none waits over 0.05 s.
    assert _cpu_wait(UpdateQueue(lay, every, adam, 0.1, True, none), 0.3) == pytest.approx([0.14])
    assert max(_cpu_wait(UpdateQueue(lay, np.eye(3, dtype=bool), adam, 0.1, True, none), 0.3)) == pytest.approx(0.05)
    # a thread that took them as they came (1 before 0) would make the forward wait 0.19 s
    # per row, a backward of its own (the longest of the backward's streams, `overlapped_step`)
    rows = np.array([[True, True, True], [True, False, False]])
    assert _cpu_wait(UpdateQueue(lay, rows, adam, 0.1, True, none), np.array([0.3, 0.5])) == pytest.approx([0.14, 0.05])


def test_the_forwards_loads_follow_one_another_one_chunk_ahead_of_its_compute():
    """The pool loads a chunk from the first access of the chunk before it, on one copy stream, after
    its update: loads slower than the compute between them add up where host chunks follow one
    another, though the forward as a whole would have time for all of them."""
    from elixir_ray.planner.search import _forward_chain

    lay = _three_chunk_layout()  # the forward of 0.1 s needs its chunks at 0, 0.05 and 0.08 s
    done = np.full((1, 3), -1.0)  # every update ended before the forward
    every = np.ones((1, 3), dtype=bool)
    # each load 0.04 s: starts 0.04, 0.09 and 0.13 s, so the forward ends at 0.15 s (its 0.12 s of
    # loads against its 0.1 s of compute would say 0.02 s)
    assert _forward_chain(lay, every, done, np.full(3, 0.04), 0.1) == pytest.approx([0.05])
    # chunk 2 alone: its load waits for chunk 1's compute to start (0.05 s) and ends at 0.09 s
    last = np.array([[False, False, True]])
    assert _forward_chain(lay, last, done, np.full(3, 0.04), 0.1) == pytest.approx([0.01])
    # chunk 1's update ends 0.07 s into the forward: its load follows (0.01 s), and the rest waits
    updated = np.array([[-1.0, 0.07, -1.0]])
    assert _forward_chain(lay, np.array([[False, True, False]]), updated, np.full(3, 0.01), 0.1) \
        == pytest.approx([0.03])
    # rows apart: one without host chunks does not wait, and one whose loads are all in time waits
    # exactly 0 (no rounding left over to read as a wait)
    rows = np.array([[True, True, True], [False, False, False], [True, False, False]])
    assert _forward_chain(lay, rows, np.full((3, 3), -1.0), np.full(3, 0.04), 0.1).tolist() \
        == pytest.approx([0.05, 0.0, 0.04]) and _forward_chain(lay, rows[1:], done, np.zeros(3), 0.1).tolist() == [0.0, 0.0]
    # a chunk the forward does not use is not waited for, however late its update
    unused = dataclasses.replace(lay, forward_before=np.array([0.0, 0.5, 1.0]))
    assert _forward_chain(unused, last, np.array([[-1.0, -1.0, 5.0]]), np.full(3, 0.04), 0.1) == pytest.approx([0.0])
    # two chunks ahead (Plan.prefetch_depth 2): chunk 1's load is issued at the forward's start and
    # chunk 2's at chunk 0's compute, so only the link bounds them: 0.12 s of loads, the last
    # needed at 0.08 s; further ahead changes nothing here
    assert _forward_chain(lay, every, done, np.full(3, 0.04), 0.1, depth=2) == pytest.approx([0.04])
    assert _forward_chain(lay, every, done, np.full(3, 0.04), 0.1, depth=5) == pytest.approx([0.04])


def test_a_host_chunk_the_device_updates_is_still_loaded_in_turn():
    """A row whose host chunks the Deep Optimizer States update (no CPU update at all) still waits
    for their loads in the forward, through the queue's function as the search passes it."""
    from elixir_ray.planner.cost import StepParts, overlapped_step
    from elixir_ray.planner.search import UpdateQueue, _cpu_wait

    lay, none = _three_chunk_layout(), np.zeros((1, 3), dtype=bool)
    last = np.array([[False, False, True]])  # loaded after chunk 1's compute starts (0.05 s): 0.01 s late
    assert _cpu_wait(UpdateQueue(lay, none, np.zeros(3), 0.1, True, np.full(3, 0.04), loaded=last), 0.3) \
        == pytest.approx([0.01])
    parts = dict(compute=0.6, forward=0.1, on_stream=0.0, h2d=0.0, d2h=0.0, cpu_adam=0.0)
    queue = partial(_cpu_wait, UpdateQueue(lay, none[0], np.zeros(3), 0.1, in_backward=True, load=np.full(3, 0.04),
                                           loaded=last[0]))
    assert overlapped_step(StepParts(**parts, cpu_wait=queue, updates_in_backward=True)) == pytest.approx(0.61)
    assert overlapped_step(StepParts(**parts, cpu_wait=0.01, updates_in_backward=True)) \
        == pytest.approx(0.6)  # a number: CPU's


def test_the_critical_path_adds_up_to_the_step_and_is_named_in_a_plans_notes():
    from elixir_ray.planner.cost import StepParts, overlapped_step
    from elixir_ray.planner.search import critical_path_note

    path = {}
    parts = dict(compute=0.6, forward=0.15, on_stream=0.0, h2d=0.2, d2h=0.5, cpu_adam=0.7, cpu_wait=0.03)
    step = overlapped_step(StepParts(**parts, updates_in_backward=True, forward_loads=0.1), path=path)
    assert step == pytest.approx(path["forward"] + max(path["cpu_wait"], path["link_wait"]) + path["rest"])
    assert path["rest"] == pytest.approx(0.5) and path["rest_d2h"] == pytest.approx(0.5)
    assert path["cpu_wait"] == pytest.approx(0.05)  # 0.2 s of updates left after backward, 0.15 s of forward
    note = critical_path_note(path)
    assert note == ("critical path: the forward's compute 150.0 ms, a wait of 50.0 ms for host chunks' CPU updates "
                    "and loads, then recompute and backward 500.0 ms (bound by copies device->host)")
    quiet = dict(path, cpu_wait=0.0, link_wait=0.0)
    assert ", no wait, then" in critical_path_note(quiet, grad_accum=2)
    assert "recompute, backward and the other micro-steps" in critical_path_note(quiet, grad_accum=2)


def test_overlap_model_gives_the_cpu_queue_the_backward_it_has():
    """A cpu_wait function is played out over the last backward as long as its longest stream
    (here the copies down, 0.7 s against 0.45 s of compute), or from step() on."""
    from elixir_ray.planner.cost import StepParts, overlapped_step

    seen = []

    def wait(backward):
        seen.append(backward)
        return 0.02

    parts = dict(compute=0.6, forward=0.15, on_stream=0.0, h2d=0.2, d2h=0.7, cpu_adam=0.1, cpu_wait=wait)
    assert overlapped_step(StepParts(**parts, updates_in_backward=True)) == pytest.approx(0.15 + 0.02 + 0.7)
    assert seen == [pytest.approx(0.7)]
    # the function says the forward's wait for its loads too (0 where a row loads nothing), so it
    # counts with no CPU work; a number is the CPU updates' wait alone
    assert overlapped_step(StepParts(**{**parts, "cpu_adam": 0.0}, updates_in_backward=True)) \
        == pytest.approx(0.15 + 0.02 + 0.7)
    assert overlapped_step(StepParts(**{**parts, "cpu_adam": 0.0, "cpu_wait": 0.02}, updates_in_backward=True)) \
        == pytest.approx(0.15 + 0.7)


def test_forward_shares_are_the_accesses_before_each_chunks_first_forward_one():
    from elixir_ray.planner.search import forward_shares

    events = [(0,), (1,), (1, 2), (0,), (2,), (1,)]
    phases = ["forward"] * 4 + ["backward"] * 2
    assert forward_shares(events, phases, 4).tolist() == [0.0, 0.25, 0.5, 1.0]  # chunk 3: not in forward


def test_overlap_model_is_bound_by_each_phase_and_by_the_link_overall():
    """The forward and the rest of the step each last as long as their longest stream; so the
    step is never shorter than the compute, than either direction's copies, or than the parts of
    one phase, and never longer than every part one after another."""
    from elixir_ray.planner.cost import StepParts, overlapped_step

    rng = np.random.default_rng(0)
    for _ in range(2000):
        compute, h2d, d2h, cpu, dos_in, dos_out, on_stream = rng.uniform(0.0, 1.0, 7)
        forward = compute * rng.uniform(0.1, 0.5)
        forward_loads = h2d * rng.uniform(0.0, 1.0)
        micro = int(rng.integers(1, 4))
        kw = dict(compute=compute, forward=forward, on_stream=on_stream, h2d=h2d, d2h=d2h, cpu_adam=cpu,
                  cpu_wait=cpu * 0.1, micro_steps=micro, dos_in=dos_in, dos_out=dos_out,
                  forward_loads=forward_loads)
        first = dict(dos_first_at=forward * rng.uniform(0.0, 1.0), loads_to_dos=forward_loads * rng.uniform(0.0, 1.0))
        for in_backward in (False, True):
            step = float(overlapped_step(StepParts(**kw, updates_in_backward=in_backward)))
            assert step >= max(compute + on_stream, h2d + dos_in, d2h + dos_out, forward_loads + dos_in) - 1e-12
            assert step <= compute + on_stream + h2d + d2h + cpu + dos_in + dos_out + 1e-12
            # the wait at the first DOS chunk only adds to that, within the same bound
            stopped = float(overlapped_step(StepParts(**kw, **first, updates_in_backward=in_backward)))
            assert step - 1e-12 <= stopped <= compute + on_stream + h2d + d2h + cpu + dos_in + dos_out + 1e-12
        assert overlapped_step(StepParts(**kw, updates_in_backward=True)) \
            <= overlapped_step(StepParts(**kw, updates_in_backward=False))


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
    from elixir_ray.chunk_plan.plan import Plan

    plan = Plan(chunk_size=8, n_blocks=2, param_order=["w"], placements=["host"] * 4, sharded=[False] * 4,
                dos_gap=gap, chunk_numels=[8] * 4)
    assert f"Deep Optimizer States updates {said} host chunk on the device" in plan.explain()
    assert "Deep Optimizer States" not in Plan(chunk_size=8, n_blocks=2, param_order=["w"], placements=["host"] * 4,
                                               sharded=[False] * 4, chunk_numels=[8] * 4).explain()


def test_gradient_buffer_moments_follow_each_chunk_from_first_gradient_to_hand_off():
    """Chunk 0 holds parameters 0 and 2, chunk 1 parameter 1; backward gives 2, 1, 0. Moments 2k
    are after k gradients, 2k+1 as gradient k arrives (its chunk's buffer open, not handed on)."""
    from elixir_ray.chunk_plan.layout import gradient_buffer_moments, open_gradient_chunks

    moments, handed_at = gradient_buffer_moments([2, 1, 0], [0, 1, 0])
    assert moments == [(0, 0), (1, 0), (1, 0), (2, 0), (1, 1), (1, 1), (0, 2)]
    assert handed_at == {1: 4, 0: 6}
    assert open_gradient_chunks([2, 1, 0], [0, 1, 0]) == 2
    # a parameter that never gets a gradient keeps its chunk open to the end (one rank)
    moments, handed_at = gradient_buffer_moments([1], [0, 1, 0])
    assert moments[-1] == (0, 1) and handed_at == {1: 2}
    # several ranks reduce in a fixed order, highest chunk first: one with no traced gradient is
    # reduced from zeros when its turn comes (a device chunk keeps them as its gradient)
    moments, handed_at = gradient_buffer_moments([0], [0, 1, 2], ordered=True)
    assert moments == [(0, 0), (1, 0), (0, 3)] and handed_at == {2: 2, 1: 2, 0: 2}
    moments, handed_at = gradient_buffer_moments([2, 0], [0, 1, 2], ordered=True)
    assert moments == [(0, 0), (1, 0), (0, 2), (1, 2), (0, 3)] and handed_at == {2: 2, 1: 2, 0: 4}


@cache  # traced once per setting: the planner's functions leave a profile and its layout as they are
def _gpt_layout(checkpointing, chunk_size=4096):
    from elixir_ray.model.gpt import build_gpt
    from elixir_ray.planner.model_profile import profile_model
    from elixir_ray.planner.search import make_layout

    shape = dict(d_model=64, n_layers=4, n_heads=4, vocab_size=211, seq_len=32)
    with torch.device("meta"):
        model = build_gpt(shape, checkpointing)
    profile = profile_model(model, (torch.randint(0, 211, (4, 33)),), None, None, torch.bfloat16)
    return profile, make_layout(profile, chunk_size, 1)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_memory_samples_cover_the_whole_activation_peak(checkpointing):
    """The trace's samples (each access and each gradient's arrival) see every activation byte: their
    largest is the step's activation peak, and each gradient has its sample."""
    profile, lay = _gpt_layout(checkpointing)
    trace = profile.trace
    assert max(high for high, _ in trace.memory_samples) == trace.activation_peak_bytes
    arrivals = [end for _, end in trace.memory_samples if end % 2 == 1]
    assert arrivals == [2 * k + 1 for k in range(len(trace.grad_order))]
    assert trace.memory_samples[-1][1] == 2 * len(trace.grad_order)
    assert lay.event_activations is not None and len(lay.event_activations) == len(trace.memory_samples)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.booleans(), st.booleans(), st.booleans())
def test_prefix_peaks_are_the_peaks_of_each_prefix_alone(seed, freed, dos, released):
    """The search sums the peaks of every prefix of a ranking at once (running sums); each must be the
    peak `evaluate` gives that placement alone, part by part. The timeline peak never exceeds the
    sum of the separate peaks it replaced (with the DOS buffers, held at every moment), and never
    falls below the activation peak. `released`: device gradients released once applied in backward."""
    import numpy as np

    from elixir_ray.planner.cost import STATE_BYTES
    from elixir_ray.planner.search import MAX_REDUCTIONS_IN_FLIGHT, MemorySettings, _dos_buffer_bytes, _memory_rows

    profile, lay = _gpt_layout(True, chunk_size=2048)
    rng = np.random.default_rng(seed)
    n_chunks = len(lay.sizes)
    ranking = rng.permutation(n_chunks)
    rank_of = np.empty(n_chunks, dtype=np.int64)
    rank_of[ranking] = np.arange(n_chunks)
    prefixes = rank_of[None, :] < np.arange(n_chunks + 1)[:, None]
    args = (lay, 3, 2 if dos else 0, 2, 1, False, 2, freed, released)
    together = _memory_rows(lay, 3, prefixes, MemorySettings(*args[2:]), ranking=ranking)
    size = int(lay.sizes.max())
    for k in range(n_chunks + 1):
        alone = _memory_rows(lay, 3, prefixes[k:k + 1], MemorySettings(*args[2:]))
        assert {p: float(v[k]) for p, v in together.items()} == pytest.approx({p: float(v[0]) for p, v in alone.items()})
        peak = sum(float(v[k]) for v in together.values())
        device_state = STATE_BYTES * float(lay.shards[prefixes[k]].sum())
        in_flight = MAX_REDUCTIONS_IN_FLIGHT if k < n_chunks else 0
        summed = (3 * size * 2 + device_state + profile.trace.activation_peak_bytes
                  + (lay.open_grads + in_flight) * size * 4 + in_flight * size * 2 + 4 * size + STATE_BYTES * size
                  + _dos_buffer_bytes(lay, args[2], k < n_chunks))
        assert profile.trace.activation_peak_bytes <= peak <= summed


@pytest.mark.parametrize("in_backward", [False, True], ids=["updates-at-step", "updates-in-backward"])
@pytest.mark.parametrize("budget_mib", [24, 64])
def test_the_charted_memory_reaches_the_predicted_peak_and_never_passes_it(budget_mib, in_backward):
    """The plan chart draws, moment by moment, what the planner counts: its highest point is the
    predicted peak (the pool is full by then), never above it; also where device gradients are
    released in backward (the chart takes where updates start from the plan)."""
    import numpy as np

    from elixir_ray.planner.chart import memory_timeline
    from elixir_ray.planner.search import SearchSettings, plan_search

    profile, _ = _gpt_layout(True)
    hw = HardwareProfile(device="cuda", h2d_gbps=20, d2h_gbps=20, cpu_adam_params_per_s=1e9,
                         device_adam_params_per_s=5e10, matmul_tflops=100, cpu_threads=8)
    plan = plan_search([profile], SearchSettings(hw, budget_mib * 2**20, 1, "bfloat16", 2,
                                                 updates_in_backward=in_backward))
    assert plan.updates_in_backward == in_backward
    t = memory_timeline(plan, profile, 2)
    total = t["state"] + t["pool"] + t["buffers"] + t["activations"]
    assert np.isclose(total.max(), plan.predicted_peak_bytes, rtol=1e-9)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**31 - 1), st.booleans(), st.booleans(), st.sampled_from([1, 2]))
def test_device_gradients_released_in_backward_never_raise_the_peak(seed, freed, dos, world):
    """With updates started in backward and one micro-step, a device chunk's gradient goes as soon as
    it is handed on (its update runs then): the peak of any placement is no larger than with the
    updates at step(), and strictly smaller wherever device gradients were counted: in the state
    (16 bytes per element, without `freed` or with no host chunk), or at the worst moment (those
    handed on by then, or all of them at the step). With `freed`, a worst moment before any device
    chunk is handed on (a GPT's activations peak as backward starts) keeps its peak. Nothing is
    left of them at any moment."""
    import numpy as np

    from elixir_ray.planner.cost import STATE_BYTES
    from elixir_ray.planner.search import MemorySettings, _memory_rows, make_layout

    profile, _ = _gpt_layout(True, chunk_size=2048)
    lay = make_layout(profile, 2048, world)
    rng = np.random.default_rng(seed)
    device = rng.random((8, len(lay.sizes))) < rng.random((8, 1))
    device[0], device[1] = False, True
    args = (lay, 3, device, 2 if dos else 0, 2, world, False, 2, freed)
    kept = _memory_rows(*args[:3], MemorySettings(*args[3:], released=False))
    released = _memory_rows(*args[:3], MemorySettings(*args[3:], released=True))
    peak_kept, peak_released = sum(kept.values()), sum(released.values())
    has_device = device.any(axis=1)
    assert np.all(peak_released <= peak_kept)
    assert np.all(peak_released[~has_device] == peak_kept[~has_device])
    assert np.all(released["gradients of device chunks"] == 0)
    assert np.allclose(released["optimizer state on device"], (STATE_BYTES - 4) * (device @ lay.shards))
    in_state = kept["optimizer state on device"] > released["optimizer state on device"]
    assert np.all(in_state == (has_device & (not freed or ~(~device).any(axis=1))))
    counted = in_state | (kept["gradients of device chunks"] > 0)  # in the state, at the worst moment or the step
    assert np.all(peak_released[counted] < peak_kept[counted])
    assert counted[1]  # every chunk on the device: gradients in the state


def test_a_plan_whose_updates_start_in_backward_re_costs_to_its_prediction_either_way():
    """plan_memory and plan_step_seconds take where the updates start from the plan (the micro-steps
    too), so a plan searched either way re-costs to its own peak and step; asked for the updates at
    step(), a plan with device chunks searched for updates in backward needs more (its device
    gradients alive), and the search, given the release, fits at least as fast a step in the budget."""
    from elixir_ray.planner.search import SearchSettings, plan_memory, plan_search, plan_step_seconds

    profile, _ = _gpt_layout(True)
    hw = HardwareProfile(device="cuda", h2d_gbps=20, d2h_gbps=20, cpu_adam_params_per_s=1e9,
                         device_adam_params_per_s=5e10, matmul_tflops=100, cpu_threads=8)
    for budget_mib in (12, 24, 64):
        plans = {}
        for in_backward in (False, True):
            plan = plan_search([profile], SearchSettings(hw, budget_mib * 2**20, 1, "bfloat16", 2,
                                                         updates_in_backward=in_backward))
            assert sum(plan_memory(plan, profile, 2).values()) == plan.predicted_peak_bytes
            assert plan_step_seconds(plan, profile, hw, 2) == pytest.approx(plan.predicted_step_seconds, rel=1e-9)
            plans[in_backward] = plan
        released = plans[True]
        if "device" in released.placements:
            at_step = sum(plan_memory(released, profile, 2, updates_in_backward=False).values())
            assert at_step > released.predicted_peak_bytes
            assert any("released" in note for note in released.notes)
        assert released.predicted_step_seconds <= plans[False].predicted_step_seconds * (1 + 1e-12)


def _three_chunk_plan(**fields):
    from elixir_ray.chunk_plan.plan import Plan

    return Plan(chunk_size=8, n_blocks=1, param_order=["a", "b", "c"], placements=["host", "device", "host"],
                sharded=[False] * 3, chunk_numels=[8, 8, 8], **fields)


def test_a_plans_resident_chunks_round_trip_and_only_host_chunks_may_be_resident():
    from elixir_ray.chunk_plan.errors import PlanError
    from elixir_ray.chunk_plan.plan import Plan

    plan = _three_chunk_plan(resident=[True, False, True])
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.resident == [True, False, True]
    assert [again.is_resident(i) for i in range(3)] == [True, False, True]
    assert "resident: 2 host chunk(s) keep their compute copy on the device" in plan.explain()
    assert "chunk(s) 0, 2 (16 parameters)" in plan.explain()
    # a plan of this version written without the field keeps no chunk resident
    older = json.loads(plan.to_json())
    del older["resident"]
    assert Plan.from_dict(older).resident == [] and not Plan.from_dict(older).is_resident(0)
    assert "resident:" not in _three_chunk_plan().explain()
    with pytest.raises(PlanError, match=r"^chunk 1 is resident but its state is on the device: only a host "
                                        r"chunk's compute copy can stay on the device$"):
        _three_chunk_plan(resident=[False, True, False])
    with pytest.raises(PlanError, match="the plan's resident lists 2 chunks, its placements 3"):
        _three_chunk_plan(resident=[True, False])
    with pytest.raises(PlanError, match="chunk 0 is resident"):
        Plan.from_dict({**json.loads(plan.to_json()), "placements": ["device", "device", "host"]})


def test_index_ranges_name_runs_of_chunks():
    from elixir_ray.chunk_plan.plan import index_ranges

    assert index_ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert index_ranges([3]) == "3" and index_ranges([]) == ""


def test_the_cache_sim_gives_resident_chunks_no_block_and_no_load():
    from elixir_ray.planner.cache_sim import loads_per_chunk

    seq = [(0,), (1,), (2,), (0,), (1,), (2,)]
    assert count_loads(seq, 2) == 4
    # chunk 0 stays on the device outside the pool: 1 and 2 share two blocks, each loaded once
    assert loads_per_chunk(seq, 2, resident=[0]) == {1: 1, 2: 1}
    assert loads_per_chunk([(0, 1), (1, 2)], 1, resident=[1]) == {0: 1, 2: 1}  # an op's resident chunk takes no block


# an H100-like box whose host link is slow beside a fast CPU AdamW: the link bounds the step
SLOW_LINK = HardwareProfile(device="cuda:0", h2d_gbps=1.0, d2h_gbps=22.0, cpu_adam_params_per_s=50e9,
                            device_adam_params_per_s=60e9, matmul_tflops=400.0, cpu_threads=16)


def test_a_resident_chunk_holds_its_compute_copy_and_crosses_the_link_once_a_step():
    """Memory: exactly the chunk's size in the compute dtype more, every other part the same, and
    the host state unchanged. Loads: the pool's loads of the other chunks (the resident one takes
    no block) every micro-step, and the resident chunk's one load per step."""
    from elixir_ray.planner.cache_sim import loads_per_chunk
    from elixir_ray.planner.search import Choice, evaluate, loads_at

    _, lay = _gpt_layout(True, chunk_size=2048)
    n, blocks, accum = len(lay.sizes), lay.min_blocks, 2
    loads = loads_at(lay, blocks)
    c = int(np.flatnonzero(loads >= 2)[len(np.flatnonzero(loads >= 2)) // 2])  # a chunk the pool loads twice or more
    plain = Choice(lay, blocks, np.zeros(n, dtype=bool), 0, upload=True)
    kept = dataclasses.replace(plain, resident=np.arange(n) == c)
    memory, time, host, _ = evaluate(plain, SLOW_LINK, 1, 2, accum)
    memory_kept, time_kept, host_kept, _ = evaluate(kept, SLOW_LINK, 1, 2, accum)
    assert memory_kept["resident compute copies"] == lay.sizes[c] * 2 and memory["resident compute copies"] == 0
    assert {k: v for k, v in memory_kept.items() if k != "resident compute copies"} == \
        {k: v for k, v in memory.items() if k != "resident compute copies"}
    assert host_kept == host
    # sharded across two ranks, a resident copy is still the whole chunk: it is gathered at its load
    from elixir_ray.planner.search import MemorySettings, _memory_rows, make_layout

    halves = make_layout(lay.profile, 2048, 2)
    one = (np.arange(len(halves.sizes)) == 0)[None, :]
    rows = _memory_rows(halves, blocks, np.zeros_like(one), MemorySettings(0, 2, 2, True), resident=one)
    assert rows["resident compute copies"][0] == halves.sizes[0] * 2 == 2 * halves.shards[0] * 2
    h2d = SLOW_LINK.link_rates()[0] * 1e9
    others = loads_per_chunk(lay.events, blocks, resident=[c])
    assert c not in others
    expected = (accum * sum(k * lay.shards[i] * 2 for i, k in others.items()) + lay.shards[c] * 2) / h2d
    assert time_kept["copies host->device"] == pytest.approx(expected, rel=1e-12)
    assert time["copies host->device"] == pytest.approx(accum * float((loads * lay.shards).sum()) * 2 / h2d, rel=1e-12)
    saved = (accum * loads[c] - 1.5) * lay.shards[c] * 2 / h2d  # its loads but one, less half a load's slack
    assert time_kept["copies host->device"] < time["copies host->device"] - saved


def test_the_search_keeps_host_chunks_resident_where_the_link_bounds_the_step_and_memory_is_left():
    """Two micro-steps a step over a slow link: a pooled host chunk crosses it every micro-step, a
    resident one once a step, for two bytes a parameter of device memory the budget has to spare."""
    from elixir_ray.planner.search import SearchSettings, plan_search, plan_step_seconds, resident_bytes

    profile, lay = _gpt_layout(True, chunk_size=2048)
    settings = SearchSettings(hw=SLOW_LINK, budget=2 * 2**20, dtype_name="bfloat16", elem_bytes=2, grad_accum=2,
                              memory_margin=0.1)
    plan = plan_search([profile], settings, chunk_sizes=[2048])
    kept = np.array(plan.resident, dtype=bool)
    assert kept.any() and all(plan.placements[i] == "host" for i in np.flatnonzero(kept))
    assert plan.memory["resident compute copies"] == resident_bytes(lay, 2)[kept].sum()
    assert plan.predicted_peak_bytes <= settings.limit
    # the same plan with its chunks pooled instead is predicted slower: the link is what they relieve
    pooled = plan_step_seconds(dataclasses.replace(plan, resident=[]), profile, SLOW_LINK, 2)
    assert pooled > 1.5 * plan.predicted_step_seconds
    assert plan_step_seconds(plan, profile, SLOW_LINK, 2) == pytest.approx(plan.predicted_step_seconds, rel=1e-12)
    assert any(note.startswith(f"resident compute copies: {int(kept.sum())} host chunk(s)") for note in plan.notes)
    assert f"resident: {int(kept.sum())} host chunk(s)" in plan.explain()
    # with a fast link and the state's memory to spare, nothing is kept resident for nothing
    roomy = plan_search([profile], dataclasses.replace(settings, budget=64 * 2**20), chunk_sizes=[2048])
    assert roomy.resident == [] and set(roomy.placements) == {"device"}
