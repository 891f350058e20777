"""What the engine overlaps, checked for exactness on CPU with real threads and real gloo groups.

- Host chunks' CPU AdamW runs on a background thread: `step()` returns before it finishes and the
  next forward waits chunk by chunk. With `accumulation_steps`, it starts during the last backward.
- The pool prefetches the next traced accesses (synchronously on a CPU, on a side stream on CUDA).
- Low-precision compute uploads a host copy already cast to the compute dtype.
Each must give exactly what plain torch AdamW gives; the misuses that would break that are refused.
"""

import copy
import dataclasses
import os
import sys
import threading
from concurrent.futures import Future

import pytest
import torch
import torch.distributed as dist

from elixir_ray import wrap
from elixir_ray.engine import engine_state, load_engine_state, manual_plan
from elixir_ray.engine.host_updates import HostUpdates
from elixir_ray.engine.timing import StepTimer

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import (Toy, batches, count_updates_started_before_step, engine_run, param_groups,  # noqa: E402
                           reference_run, spawn_ranks, store_url)

STEPS = 12


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _engine(model, rows, world=1, max_grad_norm=None, accumulation_steps=None, prefetch=1, dtype=None,
            cycle=("host",), **plan_kwargs):
    """`cycle`: chunk placements, repeated over the chunks."""
    sample = (batches(1, rows)[0],)
    plan = manual_plan(model, sample, chunk_size=1024, n_blocks=3, world_size=world, **plan_kwargs)
    plan = dataclasses.replace(plan, placements=[cycle[i % len(cycle)] for i in range(plan.n_chunks)])
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    return wrap(model, opt, sample_inputs=sample, plan=plan, max_grad_norm=max_grad_norm, device="cpu",
                accumulation_steps=accumulation_steps, prefetch=prefetch, dtype=dtype)


def record_device_gradients_at_step(model, opt) -> list[list[tuple]]:
    """Record, at every `opt.step()`, (updated, gradient alive, released) for each device chunk:
    with updates in backward, a device chunk's gradient is released once its update has run there."""
    seen: list[list[tuple]] = []
    step = opt.step

    def recording_step(*args, **kwargs):
        seen.append([(c.updated, c.grad is not None, c.grad_released)
                     for c in model.store.chunks if c.placement == "device"])
        return step(*args, **kwargs)

    opt.step = recording_step
    return seen


def assert_device_gradients_released(seen: list[list[tuple]], steps: int) -> None:
    """Every step, some device chunk was updated in the backward, and each one that was holds no
    gradient (those with none to update hold none either)."""
    assert len(seen) == steps
    for chunks in seen:
        assert any(updated for updated, _, _ in chunks)
        assert all(not alive and released == updated for updated, alive, released in chunks), chunks


@pytest.mark.parametrize("accum", [1, 2])
@pytest.mark.parametrize("ckpt", ["", "non-reentrant", "reentrant"])  # reentrant: a nested backward per region
def test_updates_started_during_the_last_backward_match_torch(accum, ckpt):
    """Also: each device chunk's gradient is released once its update has run in the backward (the
    planner counts none of them beyond the buffers still collecting), and the training is torch's."""
    torch.manual_seed(0)
    base = Toy(ckpt=ckpt)
    data = batches(STEPS * accum, 8)
    ref_losses, ref_state = reference_run(base, data, STEPS, accum, None)
    model, opt = _engine(copy.deepcopy(base), 8, accumulation_steps=accum, cycle=("host", "device"))
    assert opt.updates_in_backward
    started = count_updates_started_before_step(model, opt)
    device_grads = record_device_gradients_at_step(model, opt)
    losses = engine_run(model, opt, data, STEPS, accum)
    assert len(started) == STEPS and min(started) > 0  # every step's updates began in its last backward
    assert_device_gradients_released(device_grads, STEPS)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5
    assert torch.equal(model.state_dict()["unused.weight"], base.state_dict()["unused.weight"])


@pytest.mark.parametrize("accum", [1, 2])
def test_deep_optimizer_states_start_in_the_last_backward_a_tile_at_a_time_and_match_torch(monkeypatch, accum):
    """Where updates may start in backward, a Deep Optimizer States chunk's starts there too, once its
    gradient is final, and goes through the buffers a tile at a time: here tiles of 24 elements,
    which cut through the DOS chunks' parameters (32 and 64 elements) and across two of them in
    one. The result is still torch's."""
    from elixir_ray.engine import optimizer as optimizer_module

    monkeypatch.setattr(optimizer_module, "DOS_TILE", 24)
    torch.manual_seed(0)
    base = Toy()
    data = batches(STEPS * accum, 8)
    ref_losses, ref_state = reference_run(base, data, STEPS, accum, None)
    model, opt = _engine(copy.deepcopy(base), 8, accumulation_steps=accum, dos_gap=2)
    dos = sorted(opt.dos_chunks)
    tiles: dict[int, list] = {}
    tile_in = opt._dos_tile_in

    def record_tile(c, calls, factor, buf, lo, hi):
        assert buf.shape == (4, 24)
        tiles.setdefault(c.index, []).append((lo, hi))
        tile_in(c, calls, factor, buf, lo, hi)

    monkeypatch.setattr(opt, "_dos_tile_in", record_tile)
    started, step = [], opt.step

    def counting_step(*args, **kwargs):  # DOS chunks with a gradient, and those whose update began in the backward
        chunks = [model.store.chunks[i] for i in dos]
        started.append((sum(1 for c in chunks if c.grad is not None), sum(1 for c in chunks if c.updated)))
        return step(*args, **kwargs)

    opt.step = counting_step
    losses = engine_run(model, opt, data, STEPS, accum)
    assert len(started) == STEPS and all(n > 0 and began == n for n, began in started)
    assert opt._dos_lanes is None  # dropped at each step's end, made again by the next step's first
    assert len(tiles) == started[0][0]
    assert sorted(set(tiles[1])) == [(0, 24), (24, 48), (48, 72)]  # parameters of 32 at 0 and 32: the second tile has parts of both
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5


def test_updates_really_start_before_step():
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8, accumulation_steps=2)
    data = batches(2, 8)
    model(data[0]).backward()
    assert not any(c.updated for c in model.store.chunks)  # first of two backward passes: nothing final yet
    model(data[1]).backward()
    started = [c.index for c in model.store.chunks if c.updated]
    host_with_grad = [c.index for c in model.store.chunks if c.grad is not None]
    assert started and set(started) == set(host_with_grad)  # every chunk with a gradient, before step()
    opt.step()
    opt.zero_grad()


def test_a_released_gradient_read_through_grad_says_it_was_applied_in_backward():
    """`.grad` is None for every wrapped parameter (gradients live in the chunks), and reading it after
    a backward warns once. With the updates started in backward, the warning also says that this
    step's updates already ran and the device chunks' gradients were applied and released: a loop
    that clips or scales between backward and step reaches nothing."""
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8, accumulation_steps=1, cycle=("host", "device"))
    model(batches(1, 8)[0]).backward()
    released = [c for c in model.store.chunks if c.placement == "device" and c.grad_released]
    assert released and all(c.grad is None for c in released)
    param = released[0].slots[0].param
    with pytest.warns(UserWarning, match=r"\.grad is None.*applied and released then.*accumulation_steps=None"):
        assert param.grad is None
    opt.step()
    opt.zero_grad()
    assert not any(c.grad_released for c in model.store.chunks)


def test_without_accumulation_steps_device_gradients_stay_until_zero_grad():
    """Updates at step(): every device chunk's gradient is there from its backward to zero_grad(), as
    before, and a `.grad` read warns without any word of a release."""
    torch.manual_seed(0)
    base = Toy()
    data = batches(3, 8)
    ref_losses, ref_state = reference_run(base, data, 3, 1, None)
    model, opt = _engine(copy.deepcopy(base), 8, accumulation_steps=None, cycle=("host", "device"))
    assert not opt.updates_in_backward
    device_grads = record_device_gradients_at_step(model, opt)
    with pytest.warns(UserWarning) as seen:
        model(data[0]).backward()
        assert model.slots[0].param.grad is None
    read = [w for w in seen if ".grad of parameter" in str(w.message)]
    assert len(read) == 1 and "released" not in str(read[0].message)
    device = [c for c in model.store.chunks if c.placement == "device"]
    assert any(c.grad is not None for c in device) and not any(c.grad_released or c.updated for c in device)
    opt.step()
    assert any(c.grad is not None for c in device)  # until zero_grad
    opt.zero_grad()
    losses = engine_run(model, opt, data[1:], 2, 1)
    assert all(not updated and not released for chunks in device_grads for updated, _, released in chunks)
    assert any(alive for chunks in device_grads for _, alive, _ in chunks)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses[1:])) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5


def test_a_backward_after_a_step_without_zero_grad_is_refused_once_gradients_were_released():
    """torch would add the next backward's gradients to the last step's; those of the device chunks
    were applied and released in the last backward, so that would silently train on less: refused,
    with the way out. With zero_grad() in between it goes on."""
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8, accumulation_steps=1, cycle=("host", "device"))
    data = batches(3, 8)
    model(data[0]).backward()
    opt.step()
    with pytest.raises(RuntimeError, match=r"without optimizer.zero_grad\(\).*released once applied.*"
                                           r"accumulation_steps=None"):
        model(data[1]).backward()
    opt.zero_grad()
    with pytest.warns(UserWarning, match="the last backward did not finish"):  # the refused one
        loss = model(data[2])
    loss.backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("kwargs,warned", [({"accumulation_steps": 1}, False), ({"accumulation_steps": None}, True),
                                           ({"accumulation_steps": 1, "max_grad_norm": 0.5}, True)])
def test_a_plan_that_counted_released_gradients_warns_where_the_wrap_keeps_them(kwargs, warned):
    """A plan made for updates in backward with one micro-step counts no device gradient beyond the
    buffers collecting them; wrapped so that updates start at step(), they stay until zero_grad():
    said once, at wrap."""
    import warnings

    torch.manual_seed(0)
    model = Toy()
    sample = (batches(1, 8)[0],)
    plan = manual_plan(model, sample, chunk_size=1024, n_blocks=3)
    plan = dataclasses.replace(plan, placements=[("host", "device")[i % 2] for i in range(plan.n_chunks)],
                               updates_in_backward=True, grad_accum=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sample_inputs=sample, plan=plan, device="cpu",
             **kwargs)
    planned = [w for w in seen if "released once applied in backward" in str(w.message)]
    assert len(planned) == int(warned)


def test_clipping_starts_updates_at_step_and_stays_exact():
    """The clip coefficient needs every gradient, so nothing may start in backward; still exact."""
    torch.manual_seed(0)
    base = Toy()
    data = batches(STEPS, 8)
    ref_losses, ref_state = reference_run(base, data, STEPS, 1, 0.5)
    model, opt = _engine(copy.deepcopy(base), 8, max_grad_norm=0.5, accumulation_steps=1)
    assert not opt.updates_in_backward
    losses = engine_run(model, opt, data, STEPS, 1)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5


def test_step_returns_before_the_cpu_update_and_readers_wait_for_it():
    """A slow background thread: step() must not wait for it, and state_dict() must."""
    torch.manual_seed(0)
    base = Toy()
    data = batches(1, 8)
    _, ref_state = reference_run(base, data, 1, 1, None)
    model, opt = _engine(copy.deepcopy(base), 8)
    gate = threading.Event()
    model.store.updates.submit(gate.wait)  # occupies the one background thread until released
    model(data[0]).backward()
    opt.step()  # queues the host updates behind the gate and returns
    queued = [c for c in model.store.chunks if c.update is not None]
    assert queued and not any(c.update.done() for c in queued)
    threading.Timer(0.2, gate.set).start()
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5  # waited for every update


def test_an_error_on_the_background_thread_surfaces_where_the_chunk_is_next_used():
    updates = HostUpdates(StepTimer(torch.device("cpu")))

    def fails():
        raise ValueError("boom")

    future = updates.submit(fails)
    with pytest.raises(ValueError, match="boom"):
        updates.wait(future)


def test_a_backward_more_than_declared_is_refused():
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8, accumulation_steps=1)
    data = batches(2, 8)
    model(data[0]).backward()
    with pytest.raises(RuntimeError, match=r"accumulation_steps=1"):
        model(data[1]).backward()


def test_a_learning_rate_changed_after_backward_is_refused():
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8, accumulation_steps=1)
    model(batches(1, 8)[0]).backward()
    opt.param_groups[0]["lr"] = 1e-3
    with pytest.raises(RuntimeError, match="set hyper-parameters before the forward pass"):
        opt.step()


def test_restoring_an_engine_state_after_a_backward_that_started_updates_is_refused():
    """As model.load_state_dict is: the step would take the chunks already started as updated and
    skip them, so the loaded state would never get this step's update (silently)."""
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8, accumulation_steps=1)
    data = batches(2, 8)
    model(data[0]).backward()
    opt.step()
    opt.zero_grad()
    saved = engine_state(model, opt)
    model(data[1]).backward()
    with pytest.raises(RuntimeError, match="between backward"):
        load_engine_state(model, opt, saved)
    opt.step()
    load_engine_state(model, opt, saved)  # after the step it restores


def test_bad_accumulation_steps_and_prefetch_are_refused_before_anything_changes():
    model = Toy()
    sample = (batches(1, 8)[0],)
    for kwargs, match in (({"accumulation_steps": 0}, "accumulation_steps"), ({"prefetch": -1}, "prefetch")):
        with pytest.raises(ValueError, match=match):
            wrap(model, torch.optim.AdamW(model.parameters()), sample_inputs=sample, device="cpu", **kwargs)
        assert model.l1.weight.untyped_storage().nbytes() > 0


@pytest.mark.parametrize("ckpt", ["", "reentrant"])
def test_prefetch_loads_ahead_without_changing_results_or_adding_loads(ckpt):
    torch.manual_seed(0)
    base = Toy(ckpt=ckpt)
    data = batches(6, 8)
    plain, popt = _engine(copy.deepcopy(base), 8, prefetch=0)
    ahead, aopt = _engine(copy.deepcopy(base), 8, prefetch=2)
    assert engine_run(plain, popt, data, 6, 1) == engine_run(ahead, aopt, data, 6, 1)
    assert _max_diff(plain.state_dict(), ahead.state_dict()) == 0.0
    p, a = plain.engine_stats(), ahead.engine_stats()
    assert p["prefetches"] == 0 and a["prefetches"] > 0
    assert a["fetches"] <= p["fetches"]  # a prefetch only evicts what is needed later than what it loads


class Stack(torch.nn.Module):
    """Twelve layers, three to a chunk: each chunk is several accesses long, as a GPT block's is."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.emb = torch.nn.Embedding(64, d)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(12))
        self.head = torch.nn.Linear(d, 64)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        for layer in self.layers:
            h = h + torch.tanh(layer(h))
        return torch.nn.functional.cross_entropy(self.head(h).reshape(-1, 64), x[:, 1:].reshape(-1))


def _stack_engine(base, prefetch):
    data = torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(1))
    plan = manual_plan(base, (data,), chunk_size=3 * (32 * 32 + 32), n_blocks=3)
    model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), sample_inputs=(data,), plan=plan,
                      device="cpu", prefetch=prefetch)
    return model, opt, data


def test_the_next_chunk_is_prefetched_at_the_first_access_of_the_chunk_before_it():
    """On CUDA a prefetch's copy waits for the compute queued before it, so one access ahead it
    overlapped one module's compute; issued at the first access of the chunk before, it overlaps
    that whole chunk's. Loads and results stay those of the pool without prefetch."""
    torch.manual_seed(0)
    base = Stack()
    runs = {}
    for depth in (0, 1):
        model, opt, data = _stack_engine(copy.deepcopy(base), depth)
        losses = []
        for _ in range(4):
            losses += engine_run(model, opt, [data], 1, 1)
            model.store.settle_all()  # no prefetch put off by an update still running (the next test)
        runs[depth] = (losses, model.state_dict(), model.engine_stats())
    assert runs[0][0] == runs[1][0] and _max_diff(runs[0][1], runs[1][1]) == 0.0
    none, ahead = runs[0][2], runs[1][2]
    assert ahead["fetches"] <= none["fetches"] and ahead["prefetches"] > 0
    assert ahead["prefetch_lead"] / ahead["prefetches"] >= 2.5  # three layers a chunk: about 3 accesses ahead


class _FinishedWhenWaitedFor(Future):
    """A CPU update that runs until someone waits for its result: however slowly the training
    thread goes, a prefetch that looks at it finds it running."""

    def result(self, timeout=None):
        if not self.done():
            self.set_result(None)
        return super().result(timeout)


def test_a_chunk_whose_cpu_update_is_still_running_is_not_prefetched_until_it_has_finished():
    """Prefetching it would make the training thread wait for the update before it has queued the
    compute the load is to overlap. The access that needs it waits instead, as without prefetch."""
    torch.manual_seed(0)
    model, opt, data = _stack_engine(Stack(), 1)
    per_step, delayed = [], _FinishedWhenWaitedFor()
    for step in range(3):
        before = model.engine_stats()["prefetches"]
        model(data).backward()
        opt.step()  # host chunks' updates start on the background thread
        model.store.settle_all()  # all finished: no prefetch waits for a real one by chance
        if step == 1:  # the next forward finds chunk 2's update running until an access waits for it
            model.store.chunks[2].update = delayed
        opt.zero_grad()
        per_step.append(model.engine_stats()["prefetches"] - before)
    assert delayed.done()  # the forward that needed chunk 2 waited for its update
    assert per_step[2] < per_step[1]  # and loaded it then, not ahead


def test_low_precision_host_copy_is_the_master_cast():
    torch.manual_seed(0)
    plain, _ = _engine(Toy(), 8, dtype=torch.bfloat16)
    assert all(c.upload is None for c in plain.store.chunks)  # only when the plan asks for it
    model, opt = _engine(Toy(), 8, dtype=torch.bfloat16, dos_gap=2, upload_copies=True)
    model.store.timer.enabled = True
    engine_run(model, opt, batches(3, 8), 3, 1)
    assert model.store.timer.calls["device_adam"] > 0  # Deep Optimizer States updates ran
    model.store.settle_all()
    host = [c for c in model.store.chunks if c.placement == "host"]
    assert host and all(c.upload is not None and c.upload.dtype == torch.bfloat16 for c in host)
    for c in host:  # refreshed after CPU updates and after Deep Optimizer States updates alike
        assert torch.equal(c.upload, c.master.to(torch.bfloat16))


def _rank_main(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8 // world, world=world, accumulation_steps=2, prefetch=2, cycle=("host", "device"))
    device_grads = record_device_gradients_at_step(model, opt)
    losses = engine_run(model, opt, batches(STEPS * 2, 8), STEPS, 2, rank=rank, world=world)
    assert_device_gradients_released(device_grads, STEPS)  # after their reductions, on every rank
    state = model.state_dict()  # collective: every rank gathers
    if rank == 0:
        torch.save({"losses": losses, "state": state}, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_with_updates_in_backward_and_prefetch_match_one_process(tmp_path):
    torch.manual_seed(0)
    base = Toy()
    ref_losses, ref_state = reference_run(base, batches(STEPS * 2, 8), STEPS, 2, None)
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_rank_main, (2, store_url(tmp_path), out), 2)
    result = torch.load(out)
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) <= 1e-5
    assert _max_diff(result["state"], ref_state) <= 1e-5


def test_queued_updates_run_lowest_chunk_first():
    """Backward finishes chunks last to first; the next forward needs chunk 0 first, so it goes first."""
    updates = HostUpdates(StepTimer(torch.device("cpu")))
    gate, order = threading.Event(), []
    updates.submit(gate.wait)  # holds the thread while the others queue up, in backward's order
    futures = [updates.submit(lambda i=i: order.append(i), priority=i) for i in (5, 3, 4, 0, 1)]
    gate.set()
    for f in futures:
        updates.wait(f)
    assert order == [0, 1, 3, 4, 5]


class _Gate:
    """What a queued update waits for, as a CUDA event is (`query`, `synchronize`), opened by the test."""

    def __init__(self):
        self.opened = threading.Event()

    def query(self) -> bool:
        return self.opened.is_set()

    def synchronize(self) -> None:
        self.opened.wait()


def test_an_update_whose_gradient_has_not_landed_does_not_hold_up_ready_ones():
    """Lowest chunk first among the updates that can run: chunk 0's gradient lands last (a tied
    embedding), and the thread must not sit waiting for it while later chunks' updates could run."""
    updates = HostUpdates(StepTimer(torch.device("cpu")))
    hold, order = threading.Event(), []
    updates.submit(hold.wait)  # holds the thread while the others queue up
    landed = _Gate()
    first = updates.submit(lambda: order.append(0), ready=[landed], priority=0)
    others = [updates.submit(lambda i=i: order.append(i), priority=i) for i in (3, 2)]
    hold.set()
    try:
        for f in others:
            f.result(timeout=20)  # a thread sitting on chunk 0's gradient would never get here
    finally:
        landed_later = not first.done()
        landed.opened.set()
    assert order[:2] == [2, 3] and landed_later  # ran while chunk 0 still waited for its gradient
    updates.wait(first)
    assert order == [2, 3, 0]
    # and with nothing ready, the thread waits for the oldest one's copy, then runs the lowest ready
    hold2, late, early = threading.Event(), _Gate(), _Gate()
    updates.submit(hold2.wait)
    done = [updates.submit(lambda: order.append(10), ready=[early], priority=10),
            updates.submit(lambda: order.append(5), ready=[late], priority=5)]
    hold2.set()
    early.opened.set()
    done[0].result(timeout=20)
    assert order[-1] == 10 and not done[1].done()
    late.opened.set()
    updates.wait(done[1])
    assert order[-2:] == [10, 5]


def test_the_background_thread_stops_when_its_engine_is_collected():
    """No thread that ran torch code may outlive its engine: one alive at process exit can abort it."""
    import gc

    updates = HostUpdates(StepTimer(torch.device("cpu")))
    updates.wait(updates.submit(lambda: torch.ones(8).add_(1)))
    thread = updates._thread
    del updates
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_cpu_updates_leave_one_core_to_the_training_thread():
    seen = []
    threads = torch.get_num_threads()
    updates = HostUpdates(StepTimer(torch.device("cpu")))
    updates.wait(updates.submit(lambda: seen.append(torch.get_num_threads())))
    assert seen == [max(1, threads - 1)]
    assert torch.get_num_threads() == threads  # the training thread keeps its own count
