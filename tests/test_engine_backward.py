"""What the engine counts as one backward, and which gradients it waits for, on CPU against torch.

A backward is closed by a callback queued from a hook on the wrapped forward's output (in the
outermost graph task, whatever nested backwards reentrant checkpointing runs), and opened by its
first parameter gradient. With several ranks, the gradients a chunk waits for are the ones the
graph from that output will give (plus the parameters a reentrant region used with gradients off).
"""

import contextlib
import copy
import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from elixir_ray import wrap
from elixir_ray.engine import manual_plan
from elixir_ray.engine.hooks import _parameters_reached

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import VOCAB, Toy, batches, param_groups, spawn_ranks, store_url, train_side_by_side  # noqa: E402


def _max_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


class SharedBlock(nn.Module):
    """One Linear applied twice, each time in its own reentrant checkpointed region (ALBERT-style):
    its gradient accumulates once per region's nested backward."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.block = nn.Linear(d, d)
        self.head = nn.Linear(d, VOCAB)

    def _step(self, h):
        return torch.tanh(self.block(h))

    def forward(self, x):
        h = self.emb(x[:, :-1])
        for _ in range(2):
            h = h + (checkpoint(self._step, h, use_reentrant=True) if torch.is_grad_enabled() else self._step(h))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def test_a_parameter_in_two_reentrant_regions_gets_both_gradients():
    torch.manual_seed(0)
    base = SharedBlock()
    data = batches(4, 4, seed=3)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    plan = manual_plan(base, (data[0],), chunk_size=2048, n_blocks=3)
    model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), sample_inputs=(data[0],), plan=plan,
                      device="cpu")
    assert max(train_side_by_side(model, opt, ref, ref_opt, data)) <= 1e-5
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-5


def test_a_second_gradient_after_its_update_started_is_refused_with_the_way_out():
    torch.manual_seed(0)
    base = SharedBlock()
    batch = batches(1, 4, seed=3)[0]
    plan = manual_plan(base, (batch,), chunk_size=2048, n_blocks=3)
    model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), sample_inputs=(batch,), plan=plan,
                      device="cpu", accumulation_steps=1)  # updates start as soon as a chunk is reduced
    with pytest.raises(RuntimeError, match=r"use_reentrant=False"):
        model(batch).backward()


def test_autograd_grad_through_the_output_is_not_a_backward():
    """A gradient with respect to the input (a penalty, a saliency map) before loss.backward():
    with accumulation_steps=1 a second backward would be refused, and this is not one."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    x = torch.randn(8, 16)
    ref = copy.deepcopy(base)
    plan = manual_plan(base, (x,), chunk_size=512, n_blocks=2, loss_fn=lambda out: out.pow(2).mean())
    model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), sample_inputs=(x,), plan=plan,
                      device="cpu", accumulation_steps=1, loss_fn=lambda out: out.pow(2).mean())
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)

    def step(net, optimizer):  # the input's gradient first, then the parameters'
        xi = x.clone().requires_grad_()
        loss = net(xi).pow(2).mean()
        (g,) = torch.autograd.grad(loss, xi, retain_graph=True)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return g

    for _ in range(3):
        assert torch.allclose(step(model, opt), step(ref, ref_opt), atol=1e-6)
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-5


def test_the_graph_walk_finds_every_parameter_of_a_deep_model():
    """The walk that tells a rank which gradients its backward gives: with torch 2.11 it once found
    only the first layer's, since a freed node's id was taken for a node already seen."""
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(16)])
    slot_by_param = {id(p): object() for p in model.parameters()}
    out = model(torch.randn(2, 8)).sum()
    found = _parameters_reached([out.grad_fn], slot_by_param)
    assert found == {id(slot) for slot in slot_by_param.values()}


def test_the_graph_walk_holds_the_nodes_it_has_seen():
    """Whatever the torch version: nodes whose Python objects are made afresh on each access (and
    freed after) are still all walked, since a freed object's id can come back for another node."""
    params = [object() for _ in range(16)]

    class Accumulate:
        def __init__(self, variable):
            self.variable, self.next_functions = variable, ()

    class Node:
        def __init__(self, i):
            self.i = i

        @property
        def next_functions(self):  # new objects each time, as torch hands out for nodes nothing holds
            rest = ((Node(self.i + 1), 0),) if self.i + 1 < len(params) else ()
            return ((Accumulate(params[self.i]), 0),) + rest

    slot_by_param = {id(p): object() for p in params}
    assert _parameters_reached([Node(0)], slot_by_param) == {id(s) for s in slot_by_param.values()}


class Probed(Toy):
    """Toy with a monitoring head: computed in forward from a detached input, never part of the loss."""

    def __init__(self):
        super().__init__()
        self.probe = nn.Linear(32, 4)
        self.last_probe = None

    def forward(self, x):
        h = self.ln(self.emb(x[:, :-1]))
        for a, b in ((self.l1, self.l2), (self.l3, self.l4)):
            h = self._mlp(h, a, b)
        self.last_probe = self.probe(h.detach())
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _halves(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch[rank * 4: (rank + 1) * 4]


def _case(name: str, model, opt, data: list, rank: int) -> list[float]:
    """One training loop shape per case; each rank takes its half of every batch of 8 rows."""
    losses = []
    if name == "two forwards, two backwards":
        for first, second in zip(data[::2], data[1::2]):
            a, b = model(_halves(first, rank)), model(_halves(second, rank))
            a.backward()
            b.backward()
            opt.step()
            opt.zero_grad()
            losses.append(a.item() + b.item())
    elif name == "backward twice through one graph":
        for batch in data:
            loss = model(_halves(batch, rank))
            loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    else:  # "evaluation forward first": a no_grad forward, then a step
        for batch in data:
            with torch.no_grad():
                model(_halves(batch, rank))
            loss = model(_halves(batch, rank))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    return losses


CASES = ("two forwards, two backwards", "backward twice through one graph", "evaluation forward first")


def _reference(name: str, data: list) -> dict:
    """Plain torch on one process: each rank's loss is the mean over its half, and the ranks'
    gradients are averaged, so the loss is the mean of the halves' losses."""
    torch.manual_seed(0)
    ref = Probed()
    opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)

    def both(batch):
        return (ref(_halves(batch, 0)) + ref(_halves(batch, 1))) / 2

    if name == "two forwards, two backwards":
        for first, second in zip(data[::2], data[1::2]):
            (both(first) + both(second)).backward()
            opt.step()
            opt.zero_grad()
    elif name == "backward twice through one graph":
        for batch in data:
            loss = both(batch)
            loss.backward(retain_graph=True)
            loss.backward()
            opt.step()
            opt.zero_grad()
    else:
        for batch in data:
            both(batch).backward()
            opt.step()
            opt.zero_grad()
    return ref.state_dict()


def _rank_main(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    data = batches(4, 8, seed=4)
    results = {}
    for name in CASES:
        torch.manual_seed(0)
        base = Probed()
        sample = (_halves(data[0], rank),)
        plan = manual_plan(base, sample, chunk_size=600, n_blocks=3, world_size=world, sharded=False)
        model, opt = wrap(base, torch.optim.AdamW(param_groups(base), lr=1e-2), sample_inputs=sample, plan=plan,
                          device="cpu")
        store, held = model.store, []
        add_grad = store.add_grad

        def counting_add_grad(slot, grad, add_grad=add_grad, store=store, held=held):
            chunk = add_grad(slot, grad)
            held.append(sum(c.staging is not None for c in store.chunks))
            return chunk

        store.add_grad = counting_add_grad
        _case(name, model, opt, data, rank)
        results[name] = (model.state_dict(), max(held))
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_only_for_the_gradients_their_graph_gives(tmp_path):
    """Two ranks, replicated chunks: two forwards before their backwards, a backward run twice
    through one graph, and a no_grad forward before each step all train like torch, and a probe head
    used in forward but never in the loss does not hold any chunk's gradient buffer open."""
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_rank_main, (2, store_url(tmp_path), out), 2)
    results = torch.load(out)
    data = batches(4, 8, seed=4)
    for name in CASES:
        state, held = results[name]
        assert _max_diff(state, _reference(name, data)) <= 1e-5, name
        assert held == 1, (name, held)  # every chunk reduced as soon as its gradients are in


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises while `armed` is set: an out-of-memory error, say."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if _FailOnce.armed:
            raise RuntimeError("simulated out-of-memory in backward")
        return grad


@pytest.mark.parametrize("where", ["head", "l2"])  # before any parameter gradient; after some
def test_a_backward_that_raised_is_dropped_and_training_goes_on(where):
    """A loop that catches the error, skips the batch (zero_grad) and goes on trains exactly as
    torch without that batch: the failed backward's partial gradients are dropped (with a warning)."""
    torch.manual_seed(0)
    base = Toy()
    getattr(base, where).register_forward_hook(lambda mod, args, out: _FailOnce.apply(out))
    model, opt, ref, ref_opt, data = _engine_beside_torch(base)
    for i, batch in enumerate(data):
        _FailOnce.armed = i == 1
        try:
            with pytest.warns(UserWarning, match="did not finish") if i == 2 else contextlib.nullcontext():
                model(batch).backward()
        except RuntimeError as exc:
            assert i == 1 and "simulated" in str(exc)
            opt.zero_grad()
            continue
        finally:
            _FailOnce.armed = False
        _step_both(model, opt, ref, ref_opt, batch, engine_backward_done=True)
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-5


def _engine_beside_torch(base: nn.Module):
    """The engine (evicting every step) and plain torch AdamW on copies of `base`, and 4 batches."""
    ref = copy.deepcopy(base)
    data = batches(4, 4, seed=3)
    plan = manual_plan(base, (data[0],), chunk_size=1200, n_blocks=3)
    model, opt = wrap(base, torch.optim.AdamW(param_groups(base), lr=1e-2), sample_inputs=(data[0],), plan=plan,
                      device="cpu")
    return model, opt, ref, torch.optim.AdamW(param_groups(ref), lr=1e-2), data


def _step_both(model, opt, ref, ref_opt, batch, engine_backward_done: bool = False) -> None:
    if not engine_backward_done:
        model(batch).backward()
    opt.step()
    opt.zero_grad()
    ref(batch).backward()
    ref_opt.step()
    ref_opt.zero_grad()


@pytest.mark.parametrize("fail_at", [1, 2])  # the first fill of the forward, or one after an eviction
def test_a_fetch_that_raised_leaves_its_chunk_to_be_fetched_again(monkeypatch, fail_at):
    """A fill of a compute copy that raised (a staging buffer out of memory) left its chunk marked
    resident and never filled: a loop that caught the error and went on computed with whatever the
    block held (a loss of 8e32). Now the chunk is fetched again and training goes on exactly as
    torch's without that batch."""
    torch.manual_seed(0)
    model, opt, ref, ref_opt, data = _engine_beside_torch(Toy())
    fill, fills = model.store._fill, []

    def fill_failing_once(c):
        fills.append(c.index)
        if len(fills) == fail_at:
            raise torch.OutOfMemoryError("simulated: no memory for the staging buffer")
        fill(c)

    for i, batch in enumerate(data):
        if i == 1:
            monkeypatch.setattr(model.store, "_fill", fill_failing_once)
            with pytest.raises(torch.OutOfMemoryError, match="simulated"):
                model(batch).backward()
            monkeypatch.setattr(model.store, "_fill", fill)
            assert not model.store.chunks[fills[-1]].resident
            opt.zero_grad()
            continue
        _step_both(model, opt, ref, ref_opt, batch)
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-5


class TwoHeads(nn.Module):
    """Returns (main loss, auxiliary loss) from two heads: each output's hook may fire first."""

    def __init__(self, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.head = nn.Linear(d, VOCAB)
        self.aux = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.tanh(self.emb(x[:, :-1]))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1)), self.aux(h).pow(2).mean()


def _two_heads_rank_main(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    base = TwoHeads()
    data = batches(4, 8, seed=4)
    plan = manual_plan(base, (_halves(data[0], rank),), chunk_size=1700, n_blocks=3, world_size=world, sharded=False,
                       loss_fn=lambda out: out[0] + out[1])
    model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), sample_inputs=(_halves(data[0], rank),),
                      plan=plan, device="cpu", accumulation_steps=2, loss_fn=lambda out: out[0] + out[1])
    reduces = []
    for first, second in zip(data[::2], data[1::2]):
        before = model.store.counts["reduces"]
        for batch in (first, second):
            main, aux = model(_halves(batch, rank))
            ((main + 0.1 * aux) / 2).backward()
        opt.step()
        opt.zero_grad()
        reduces.append(model.store.counts["reduces"] - before)
    state = model.state_dict()
    if rank == 0:
        torch.save((state, reduces, len(model.store.chunks)), out)
    dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_wait_for_every_output_of_a_forward():
    """With two outputs, the auxiliary head's gradient can arrive before the main output's hook
    fires: the forward reads the graph of both, so each chunk is reduced once per backward and the
    updates started during the second backward are right."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.pt")
        spawn_ranks(_two_heads_rank_main, (2, store_url(tmp), out), 2)
        state, reduces, n_chunks = torch.load(out)
    assert reduces == [2 * n_chunks] * 2
    torch.manual_seed(0)
    ref = TwoHeads()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = batches(4, 8, seed=4)
    for first, second in zip(data[::2], data[1::2]):
        for batch in (first, second):
            losses = [ref(_halves(batch, r)) for r in (0, 1)]
            sum((main + 0.1 * aux) / 2 for main, aux in losses).div(2).backward()
        opt.step()
        opt.zero_grad()
    assert _max_diff(state, ref.state_dict()) <= 1e-5


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_the_wrap_trace_has_the_accesses_a_real_backward_makes(mode):
    """The pool prefetches along the wrap-time trace, so the trace must hold the accesses the
    engine really makes. A GPT block recomputed whole differentiates its recomputation inside
    its backward, whose saved tensors the engine's hooks (on in forward only) never see: the
    trace must not count their unpacks as accesses either (with them it had twice the backward
    accesses, and prefetched the chunks it already held instead of the next block's)."""
    from elixir_ray.engine.trace import trace_step
    from elixir_ray.model.gpt import build_gpt

    torch.manual_seed(0)
    model = build_gpt(dict(d_model=32, n_layers=3, n_heads=2, vocab_size=60, seq_len=16), mode)
    sample = (torch.randint(0, 60, (2, 17)),)
    traced = trace_step(copy.deepcopy(model), sample)
    wrapped, _ = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sample_inputs=sample,
                      plan=manual_plan(model, sample, chunk_size=2048, n_blocks=3), device="cpu")
    calls, access = [], wrapped.pool.access
    wrapped.pool.access = lambda ids, pin=False: (calls.append(tuple(ids)), access(ids, pin))[1]
    loss = wrapped(sample[0])
    in_forward = len(calls)
    loss.backward()
    assert in_forward == traced.phases.count("forward")
    assert len(calls) - in_forward == len(traced.phases) - traced.phases.count("forward")
