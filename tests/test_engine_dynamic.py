"""Steps that do not look like the traced sample: larger inputs, paths the trace did not take, views
of parameters kept across other modules' calls."""

import copy
import os
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from elixir_ray import wrap
from elixir_ray.engine import manual_plan

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import train_side_by_side  # noqa: E402

V, D = 50, 32


def _mlp():
    return nn.Sequential(nn.Linear(D, 2 * D), nn.ReLU(), nn.Linear(2 * D, D))


class HeldView(nn.Module):
    """Views of one weight taken first, used after a data-dependent number of other modules ran."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.gate = nn.Linear(D, 2 * D)
        self.mid = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        wa, wb = self.gate.weight.chunk(2)
        for m in self.mid[: 1 + int(x[0, 0]) % 3]:
            h = h + torch.tanh(m(h))
        h = h * torch.sigmoid(F.linear(h, wa)) + F.linear(h, torch.cat([wb[:, :1], wb[:, 1:]], 1))
        return F.cross_entropy(self.head(h).reshape(-1, V), x[:, 1:].reshape(-1))


class EarlyExit(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.layers = nn.ModuleList(_mlp() for _ in range(6))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        for layer in self.layers[: 6 if int(x[0, 0]) % 2 == 0 else 2]:
            h = h + checkpoint(layer, h, use_reentrant=False)
        return F.cross_entropy(self.head(h).reshape(-1, V), x[:, 1:].reshape(-1))


def _data(firsts, rows=4, length=9):
    g = torch.Generator().manual_seed(0)
    out = []
    for f in firsts:
        b = torch.randint(0, V, (rows, length), generator=g)
        b[0, 0] = f
        out.append(b)
    return out


def _side_by_side(base, sample, data, **plan_kw):
    ref, eng = copy.deepcopy(base), copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    model, opt = wrap(eng, torch.optim.AdamW(eng.parameters(), lr=1e-2), sample_inputs=sample, device="cpu",
                      plan=manual_plan(eng, sample, **plan_kw))
    assert max(train_side_by_side(model, opt, ref, ropt, data)) <= 1e-5
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-5), key
    return model


def test_a_view_of_a_parameter_kept_across_other_modules_is_fetched_again():
    torch.manual_seed(0)
    data = _data([0, 0, 1, 2])  # traced with one module between the views' making and use; then 2 and 3
    model = _side_by_side(HeldView(), (data[0],), data, chunk_size=1100, n_blocks=2)
    assert model.engine_stats()["evictions"] > 0


class ReadsAfterItsChildren(nn.Module):
    """Parameters read outside their own modules: its own weight after its children ran (their
    fetches evict its chunk), another layer's weight in a functional call, and two weights in a
    list (torch.cat)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.scale = nn.Parameter(torch.ones(D))
        self.mid = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        for m in self.mid:
            h = h + torch.tanh(m(h))
        h = h * self.scale + F.linear(h, self.mid[0].weight)
        w = torch.cat([self.mid[1].weight, self.mid[2].weight], 0)
        h = h + F.linear(h, w)[..., :D]
        return F.cross_entropy(self.head(h).reshape(-1, V), x[:, 1:].reshape(-1))


class MixedReads(nn.Module):
    """One op reading an evicted parameter beside a resident one, and beside a plain view of one
    made just before: the guard's fetch of the first must not evict the others. With
    `view_across`, also a view taken before guard fetches of other layers' weights and used after
    them: the trace must count those fetches as it counts modules' pre-hooks."""

    def __init__(self, view_across: bool = False):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.mid = nn.ModuleList(nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, V)
        self.view_across = view_across

    def forward(self, x):
        h = self.emb(x[:, :-1])
        for m in self.mid:
            h = h + torch.tanh(m(h))
        if self.view_across:
            wt = self.mid[2].weight.t()
            h = h + F.linear(h, self.mid[0].weight) + F.linear(h, self.emb.weight[:D])
            return F.cross_entropy(self.head(h + h @ wt).reshape(-1, V), x[:, 1:].reshape(-1))
        w = torch.cat([self.mid[1].weight, self.mid[0].weight], 0)
        h = h + F.linear(h, w)[..., :D]
        w = torch.cat([self.mid[2].weight.t(), self.mid[0].weight], 0)
        h = h + F.linear(h, w)[..., :D]
        return F.cross_entropy(self.head(h).reshape(-1, V), x[:, 1:].reshape(-1))


class Vmapped(nn.Module):
    """A forward through torch.vmap, whose batched tensors have no storage to look at."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.lin = nn.Linear(D, D)
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = torch.vmap(lambda r: self.lin(r) + r * self.lin.weight.sum(0))(self.emb(x[:, :-1]))
        return F.cross_entropy(self.head(h).reshape(-1, V), x[:, 1:].reshape(-1))


def test_parameters_read_outside_their_modules_are_fetched_by_their_guards_without_a_per_op_mode():
    torch.manual_seed(0)
    data = _data([0, 1, 2])
    # one chunk per module and a pool of two blocks: every read after the children finds its chunk evicted
    model = _side_by_side(ReadsAfterItsChildren(), (data[0],), data, chunk_size=1100, n_blocks=2)
    assert model.hooks.per_op_reason == ""  # no view kept across fetches: the guards are enough
    assert model.engine_stats()["evictions"] > 0


def test_an_op_reading_an_evicted_parameter_beside_resident_ones_and_views_trains_as_torch():
    torch.manual_seed(0)
    data = _data([0, 1, 2])
    # a layer a chunk, the head's prefetched beside the layer used last: a fetch in the op evicts one
    model = _side_by_side(MixedReads(), (data[0],), data, chunk_size=1700, n_blocks=2)
    assert model.hooks.per_op_reason == "" and model.engine_stats()["evictions"] > 0


def test_a_view_kept_across_the_guards_fetches_takes_the_per_op_mode_and_trains_as_torch():
    torch.manual_seed(0)
    data = _data([0, 1, 2])
    model = _side_by_side(MixedReads(view_across=True), (data[0],), data, chunk_size=1100, n_blocks=2)
    assert "view of a parameter" in model.hooks.per_op_reason


def test_a_forward_through_vmap_is_traced_and_trains_as_torch():
    torch.manual_seed(0)
    data = _data([0, 1])
    model = _side_by_side(Vmapped(), (data[0],), data, chunk_size=1100, n_blocks=2)
    assert model.hooks.per_op_reason == ""


def test_a_resident_parameter_still_pickles():
    """The engine's fetch is kept where the guard finds it (GradReads) and dropped when a parameter
    is pickled or copied: a parameter (its data and attributes) pickles as it did before wrap."""
    import pickle

    torch.manual_seed(0)
    base = ReadsAfterItsChildren()
    x, = _data([0])
    model, _ = wrap(base, torch.optim.AdamW(base.parameters()), sample_inputs=(x,), device="cpu",
                    plan=manual_plan(base, (x,), chunk_size=1 << 20, n_blocks=1))
    model(x)  # one chunk, resident after the forward
    copy_ = pickle.loads(pickle.dumps(base.mid[0].weight))
    assert torch.equal(copy_, base.mid[0].weight) and copy_._engine_grad_reads.fetch is None


def test_only_a_forward_that_keeps_a_view_of_a_parameter_across_fetches_takes_the_per_op_mode():
    torch.manual_seed(0)
    data = _data([0])
    for base, per_op in ((HeldView(), True), (EarlyExit(), False), (ReadsAfterItsChildren(), False)):
        model, _ = wrap(base, torch.optim.AdamW(base.parameters()), sample_inputs=(data[0],), device="cpu",
                        plan=manual_plan(base, (data[0],), chunk_size=1100, n_blocks=2))
        reason = model.hooks.per_op_reason
        assert bool(reason) == per_op, (type(base).__name__, reason)
        if per_op:
            assert "view of a parameter" in reason and "linear" in reason


def test_an_untraced_path_is_counted_and_not_prefetched_from_a_stale_place():
    torch.manual_seed(0)
    short, long = _data([1, 2])
    base = EarlyExit()
    traced_long = _side_by_side(base, (long,), [long], chunk_size=2200, n_blocks=3)
    traced_short = _side_by_side(base, (short,), [long], chunk_size=2200, n_blocks=3)
    assert traced_long.engine_stats()["untraced_accesses"] == 0
    assert traced_short.engine_stats()["untraced_accesses"] > 0
    # off the trace the pool loads little more than on it (it was 42 loads against 24)
    assert traced_short.engine_stats()["fetches"] <= traced_long.engine_stats()["fetches"] + 4
    # a path the trace did not see may keep views it never saw kept: later forwards check every op
    assert traced_long.hooks.per_op_reason == ""
    with torch.no_grad():
        traced_short(long)
    assert "path the trace did not" in traced_short.hooks.per_op_reason


def test_a_training_step_larger_than_the_sample_warns_once_and_is_counted():
    torch.manual_seed(0)
    base = EarlyExit()
    small, = _data([2], rows=2, length=9)
    big, = _data([2], rows=4, length=17)
    model, opt = wrap(base, torch.optim.AdamW(base.parameters()), sample_inputs=(small,), device="cpu",
                      plan=manual_plan(base, (small,), chunk_size=2200, n_blocks=3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(small).backward()  # the sample's size, then smaller, then evaluation: nothing said
        model(small[:1]).backward()
        with torch.no_grad():
            model(big)
    assert model.engine_stats()["input_over_sample"] == 1.0
    with pytest.warns(UserWarning, match=r"step's input 0 has 68 elements, 3.8x as many as in sample_inputs.* may exceed device_memory"):
        model(big).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(big).backward()  # once
    opt.step()
    assert model.engine_stats()["input_over_sample"] == pytest.approx(68 / 18, abs=1e-3)


class WithTable(nn.Module):
    """Tokens beside a fixed-size input larger than them (a bias table)."""

    def __init__(self):
        super().__init__()
        self.inner = EarlyExit()

    def forward(self, x, table=None):
        return self.inner(x) + 0 * table.sum()


def test_a_larger_input_is_compared_with_the_same_input_of_the_sample():
    torch.manual_seed(0)
    base = WithTable()
    small, = _data([2], rows=2, length=9)
    big, = _data([2], rows=4, length=17)
    table = torch.zeros(1000)  # larger than either: comparing the largest inputs would see no growth
    model, _ = wrap(base, torch.optim.AdamW(base.parameters()), sample_inputs={"x": small, "table": table},
                    device="cpu", plan=manual_plan(base, {"x": small, "table": table}, chunk_size=2200, n_blocks=3))
    with pytest.warns(UserWarning, match=r"step's input 'x' has 68 elements, 3.8x"):
        model(x=big, table=table).backward()
    assert model.engine_stats()["input_over_sample"] == pytest.approx(68 / 18, abs=1e-3)


def _ranks_trace_their_own_samples(rank: int, world: int, store: str, out: str, same: bool) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    base = EarlyExit()
    short, long = _data([1, 2])
    sample = long if same or rank == 0 else short  # rank 1's sample exits early: fewer layers traced
    try:
        model, opt = wrap(base, torch.optim.AdamW(base.parameters(), lr=1e-2), sample_inputs=(sample,), device="cpu",
                          plan=manual_plan(base, (long,), chunk_size=2200, n_blocks=3, world_size=world))
        model(long).backward()
        opt.step()
        result = "trained"
    except ValueError as exc:
        result = str(exc)
    with open(f"{out}.{rank}", "w") as f:
        f.write(result)
    dist.destroy_process_group()


@pytest.mark.parametrize("same", [True, False])
def test_ranks_that_traced_other_paths_are_refused_on_every_rank_before_a_hang(tmp_path, same):
    from engine_models import spawn_ranks, store_url

    out = str(tmp_path / "result")
    spawn_ranks(_ranks_trace_their_own_samples, (2, store_url(str(tmp_path)), out, same), 2)
    results = [open(f"{out}.{rank}").read() for rank in range(2)]
    if same:
        assert results == ["trained", "trained"]
    else:
        for text in results:  # both ranks raise, so neither waits in a collective for the other
            assert text.startswith("rank(s) [1] traced another order of chunk accesses than rank 0"), text


class SkipsMiddle(nn.Module):
    """The middle layer runs only when the first token is even: on the other steps the part of the
    gradient buffer of its chunk (which it shares with the next layer) that it owns is not written."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.l1, self.l2, self.l3 = (nn.Linear(D, D) for _ in range(3))
        self.head = nn.Linear(D, V)

    def forward(self, x):
        h = torch.tanh(self.l1(self.emb(x[:, :-1])))
        if int(x[0, 0]) % 2 == 0:
            h = torch.tanh(self.l2(h))
        h = torch.tanh(self.l3(h))
        return F.cross_entropy(self.head(h).reshape(-1, V), x[:, 1:].reshape(-1))


@pytest.mark.parametrize("placement", ["host", "device"])
def test_a_parameter_without_a_gradient_between_two_with_one_is_clipped_and_updated_as_torch_does(placement):
    """A first gradient is copied into the chunk's buffer (not added to zeros), and what no gradient
    wrote is zeroed before the norm and the update read the buffer: garbage there would change
    the clipped norm of every step that skips the middle layer."""
    torch.manual_seed(0)
    base = SkipsMiddle()
    data = _data([0, 1, 3, 2, 5], rows=4)
    ref, eng = copy.deepcopy(base), copy.deepcopy(base)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    plan = manual_plan(eng, (data[0],), chunk_size=3200, n_blocks=3, placements=placement)
    model, opt = wrap(eng, torch.optim.AdamW(eng.parameters(), lr=1e-2), sample_inputs=(data[0],), device="cpu",
                      plan=plan, max_grad_norm=0.05)
    assert [s.name for s in model.store.chunks[1].slots] == ["l2.weight", "l2.bias", "l3.weight", "l3.bias"]
    for batch in data:
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected = ref(batch)
        expected.backward()
        norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ropt.step()
        ropt.zero_grad()
        assert abs(loss.item() - expected.item()) <= 1e-5
        assert opt.last_grad_norm == pytest.approx(float(norm), rel=1e-5)
    state = model.state_dict()
    for key, value in ref.state_dict().items():
        assert torch.allclose(state[key], value, atol=1e-5), key
