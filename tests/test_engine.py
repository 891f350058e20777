"""The chunk engine against plain torch AdamW, on CPU in fp32, with real gloo groups for several ranks."""

import copy
import dataclasses
import json
import os
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from elixir_ray import Plan, PlanError, wrap
from elixir_ray.engine import engine_state, load_engine_state, manual_plan
from elixir_ray.engine.trace import ValueReadError, trace_step

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import (LearnedRouter, Routed, Toy, batches, engine_run, param_groups,  # noqa: E402
                           reference_run, spawn_ranks, store_url, train_side_by_side)

STEPS, ACCUM, MAX_NORM = 20, 2, 0.5


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _engine(model, rows, chunk_size=1024, n_blocks=3, world=1, **plan_kwargs):
    sample = (batches(1, rows)[0],)
    plan = manual_plan(model, sample, chunk_size=chunk_size, n_blocks=n_blocks, world_size=world, **plan_kwargs)
    opt = torch.optim.AdamW(param_groups(model), lr=1e-2)
    return wrap(model, opt, sample_inputs=sample, plan=plan, max_grad_norm=MAX_NORM, device="cpu")


@pytest.mark.parametrize("ckpt", ["", "non-reentrant", "reentrant", "selective"])
def test_matches_torch_adamw_with_evictions(ckpt):
    torch.manual_seed(0)
    base = Toy(ckpt=ckpt)
    data = batches(STEPS * ACCUM, 8)
    ref_losses, ref_state = reference_run(base, data, STEPS, ACCUM, MAX_NORM)
    model, opt = _engine(copy.deepcopy(base), 8)
    losses = engine_run(model, opt, data, STEPS, ACCUM)
    stats = model.engine_stats()
    assert stats["chunks"] > stats["n_blocks"] and stats["evictions"] >= STEPS  # evictions every step
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5
    # the unused branch was never updated, exactly as torch leaves a parameter without .grad
    assert torch.equal(model.state_dict()["unused.weight"], base.state_dict()["unused.weight"])


def test_deep_optimizer_states_interleave_is_exact():
    torch.manual_seed(0)
    base = Toy()
    data = batches(6 * ACCUM, 8)
    plain, popt = _engine(copy.deepcopy(base), 8)
    dos, dopt = _engine(copy.deepcopy(base), 8, dos_gap=2)
    for m, opt in ((plain, popt), (dos, dopt)):
        m.store.timer.enabled = True  # counts the updates run on the compute device
        # torch's fused Adam for host chunks too, as for the DOS ones: the C kernel agrees with it to the
        # bit except in the few elements torch's own scalar tails round in double (test_host_kernel.py)
        opt.host_kernel = None
    assert engine_run(plain, popt, data, 6, ACCUM) == engine_run(dos, dopt, data, 6, ACCUM)
    assert _max_diff(plain.state_dict(), dos.state_dict()) == 0.0
    assert plain.store.timer.calls["device_adam"] == 0  # every chunk is on the host: all its updates on the CPU
    assert dos.store.timer.calls["device_adam"] > 0  # every other host chunk's update ran on the compute device


def test_device_placed_chunks_match_too():
    torch.manual_seed(0)
    base = Toy()
    data = batches(6 * ACCUM, 8)
    ref_losses, ref_state = reference_run(base, data, 6, ACCUM, MAX_NORM)
    model, opt = _engine(copy.deepcopy(base), 8, placements="device")
    losses = engine_run(model, opt, data, 6, ACCUM)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5


def test_gpt_blocks_checkpointed_whole_or_selectively_train_like_torch_without_checkpointing():
    from elixir_ray.model.gpt import build_gpt

    shape = dict(d_model=32, n_layers=4, n_heads=2, vocab_size=60, seq_len=16)
    torch.manual_seed(0)
    base = build_gpt(shape)
    model = copy.deepcopy(base)
    model.set_checkpointing(["selective", "full", "none", "selective"])
    g = torch.Generator().manual_seed(2)
    data = [torch.randint(0, 60, (4, 17), generator=g) for _ in range(6)]
    sample = (data[0],)
    plan = manual_plan(model, sample, chunk_size=2048, n_blocks=3)
    wrapped, opt = wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-2), sample_inputs=sample, plan=plan,
                        device="cpu")
    from elixir_ray.model.gpt import _hooks_may_change

    # the engine's forward pre-hooks only fetch: its selective blocks take their autograd Functions,
    # not torch's checkpointed pieces (the same results, more host time)
    assert not any(_hooks_may_change((b.ln1, b.attn.qkv, b.ln2, b.mlp.up, b.mlp.down)) for b in model.blocks)
    ref_opt = torch.optim.AdamW(base.parameters(), lr=1e-2)
    assert max(train_side_by_side(wrapped, opt, base, ref_opt, data)) <= 1e-5
    assert wrapped.engine_stats()["evictions"] >= len(data)
    # attention is invariant to a shift of every key, so the key bias's gradient is rounding noise,
    # which Adam scales up to steps of the learning rate: any other order of sums moves it (the
    # engine's plain GPT too); every other value matches
    d = shape["d_model"]

    def without_key_bias(state):
        return {k: torch.cat([v[:d], v[2 * d:]]) if k.endswith("attn.qkv.bias") else v for k, v in state.items()}

    assert _max_diff(without_key_bias(wrapped.state_dict()), without_key_bias(base.state_dict())) <= 1e-5


@pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
def test_a_step_wider_than_the_trace_goes_over_the_pool_with_a_warning(ckpt):
    """The sample routes to one expert, the training batches to all four: their recomputed region
    needs more chunks at once than the pool the trace sized. Pinned chunks are never evicted (their
    recomputed views are still to be read): the pool goes over, warns once, and counts by how much."""
    torch.manual_seed(0)
    base = Routed(ckpt=ckpt)
    sample = batches(1, 8, seed=5)[0]
    sample[0, :4] = torch.tensor([2, 1, 1, 1])  # expert 0 only
    data = batches(4, 8, seed=6)
    for batch in data:
        batch[0, :4] = batch[0, :4] // 2 * 2  # even: every expert
    ref_losses, ref_state = reference_run(base, data, 4, 1, None)
    m = copy.deepcopy(base)
    plan = manual_plan(m, (sample,), chunk_size=512, n_blocks=1)  # the pool: the trace's minimum
    model, opt = wrap(m, torch.optim.AdamW(param_groups(m), lr=1e-2), sample_inputs=(sample,), plan=plan,
                      device="cpu")
    with pytest.warns(UserWarning, match="this step needs at least") as caught:
        losses = engine_run(model, opt, data, 4, 1)
    assert sum("this step needs at least" in str(w.message) for w in caught) == 1
    assert model.engine_stats()["blocks_over_plan"] >= 1
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5


def test_meta_module_materialises_chunk_by_chunk_like_eager_init():
    from elixir_ray.model.gpt import build_gpt, init_gpt_weights

    shape = dict(d_model=32, n_layers=2, n_heads=2, vocab_size=60, seq_len=16)
    init = lambda m: init_gpt_weights(m, shape["n_layers"])  # noqa: E731
    eager = build_gpt(shape)
    torch.manual_seed(5)
    eager.apply(init)
    meta = build_gpt(shape, device="meta")
    meta.blocks[0].mlp.up.weight.tag = "kept"  # moving off meta swaps the tensor under the same object
    sample = (torch.randint(0, 60, (2, 17)),)
    torch.manual_seed(5)
    model, _ = wrap(meta, torch.optim.AdamW(meta.parameters()), sample_inputs=sample, device="cpu",
                    device_memory="64MiB", init_fn=init)
    assert _max_diff(model.state_dict(), eager.state_dict()) == 0.0
    assert meta.blocks[0].mlp.up.weight.tag == "kept"
    assert torch.allclose(model(sample[0]), eager(sample[0]), atol=1e-6)


def test_engine_state_round_trip():
    torch.manual_seed(0)
    base = Toy()
    data = batches(8, 8)
    a, aopt = _engine(copy.deepcopy(base), 8)
    engine_run(a, aopt, data, 2, 2)
    state = engine_state(a, aopt)
    assert "optim/l1.weight/exp_avg" in state and "optim/unused.weight/exp_avg" not in state
    b, bopt = _engine(copy.deepcopy(base), 8)
    load_engine_state(b, bopt, state)
    assert engine_run(a, aopt, data[4:], 2, 2) == engine_run(b, bopt, data[4:], 2, 2)


def test_a_checkpoint_written_from_the_live_state_restores_the_same_training(tmp_path):
    """The way checkpoint.via=storage saves: the rank's shard is a mapping that makes each array when
    the writer reads it (views of the live host state), streamed to files; loading those files into a
    fresh engine continues exactly as the original does. A 0-d buffer keeps its shape."""
    from elixir_ray.checkpoint import load_checkpoint
    from elixir_ray.checkpoint.shards import write_rank_shard
    from elixir_ray.checkpoint.store import begin_checkpoint, commit_checkpoint
    from elixir_ray.engine import EngineShard, engine_shard, layout_of

    torch.manual_seed(0)
    base = Toy()
    base.register_buffer("calls", torch.tensor(3.0))
    data = batches(8, 8)
    a, aopt = _engine(copy.deepcopy(base), 8)
    engine_run(a, aopt, data, 2, 2)
    a.module.calls.fill_(7.0)
    lazy, eager = EngineShard(a), engine_shard(a, aopt)
    assert set(lazy) == set(eager)
    for name in eager:
        np.testing.assert_array_equal(lazy[name], eager[name])
        assert lazy.spec_of(name) == (eager[name].shape, eager[name].dtype)
        assert lazy.nbytes_of(name) == eager[name].nbytes
    work = begin_checkpoint(str(tmp_path), 2)
    path = commit_checkpoint(str(tmp_path), 2, work, write_rank_shard(work, 0, lazy, part_bytes=4096),
                             layout_of(a), 1, {"samples_consumed": 16})
    _, state = load_checkpoint(path)
    assert state["model/calls"].shape == ()
    b, bopt = _engine(copy.deepcopy(base), 8)
    load_engine_state(b, bopt, state)
    assert b.module.calls.shape == () and float(b.module.calls) == 7.0
    assert engine_run(a, aopt, data[4:], 2, 2) == engine_run(b, bopt, data[4:], 2, 2)


def test_loading_a_value_of_the_wrong_size_is_refused_and_tied_weights_take_the_last_key():
    """load_state_dict and load_engine_state read each rank's part by range: a value of another size
    must still be refused (not half-loaded), and a tied parameter given under two keys takes the
    last, as torch's load_state_dict does."""
    torch.manual_seed(0)
    model, opt = _engine(Toy(), 8)
    state = model.state_dict()
    wrong = dict(state, **{"l1.weight": torch.zeros(16, 32)})
    with pytest.raises(RuntimeError, match=r"size mismatch in load_state_dict \(1 key\(s\)\): l1.weight: \[16, 32\] "
                                           r"for \[64, 32\]"):
        model.load_state_dict(wrong)
    engine_run(model, opt, batches(2, 8), 1, 2)
    saved = engine_state(model, opt)
    smaller = dict(saved, **{"optim/l1.weight/exp_avg": np.zeros(8, dtype=np.float32)})
    with pytest.raises(RuntimeError, match=r"size mismatch for optim/l1.weight/exp_avg"):
        load_engine_state(model, opt, smaller)
    reference = Toy()  # its head.weight is its emb.weight
    both = {k: v.clone() for k, v in state.items()}
    both["emb.weight"], both["head.weight"] = torch.full_like(both["emb.weight"], 1.0), torch.full_like(both["emb.weight"], 2.0)
    reference.load_state_dict(both)
    assert float(reference.emb.weight.detach()[0, 0]) == 2.0
    model.load_state_dict(both)
    assert torch.equal(model.state_dict()["emb.weight"], reference.state_dict()["emb.weight"])


def test_budget_too_small_names_the_minimum_and_leaves_module_untouched():
    torch.manual_seed(0)
    model = Toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(PlanError, match=r"too small: the smallest plan needs"):
        wrap(model, opt, sample_inputs=(batches(1, 8)[0],), device_memory="4KiB", device="cpu")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.l1.weight.numel() > 0 and model.l1.weight.untyped_storage().nbytes() > 0


def test_unsupported_optimizer_is_refused():
    model = Toy()
    with pytest.raises(TypeError, match="supports torch.optim.AdamW and torch.optim.Adam"):
        wrap(model, torch.optim.SGD(model.parameters(), lr=0.1), sample_inputs=(batches(1, 8)[0],))
    with pytest.raises(TypeError, match="amsgrad"):
        wrap(model, torch.optim.AdamW(model.parameters(), amsgrad=True), sample_inputs=(batches(1, 8)[0],))
    assert model.l1.weight.untyped_storage().nbytes() > 0


def _rank_main(rank: int, world: int, store: str, out: str, ckpt: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    base = Toy(ckpt=ckpt)
    data = batches(STEPS * ACCUM, 8)
    model, opt = _engine(base, 8 // world, world=world)
    losses = engine_run(model, opt, data, STEPS, ACCUM, rank=rank, world=world)
    state = model.state_dict()  # collective: every rank gathers
    optim = opt.state_dict()  # so is this
    if rank == 0:
        torch.save({"losses": losses, "state": state, "optim": optim, "stats": model.engine_stats()}, out)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.parametrize("world,ckpt", [(2, "selective"), pytest.param(4, "", marks=pytest.mark.extended)])  # selective: all-gathers inside its regions
def test_sharded_ranks_match_one_process(world, ckpt, tmp_path):
    torch.manual_seed(0)
    base = Toy(ckpt=ckpt)
    ref_losses, ref_state, ref_optim = reference_run(base, batches(STEPS * ACCUM, 8), STEPS, ACCUM, MAX_NORM,
                                                     with_optimizer=True)
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_rank_main, (world, store_url(tmp_path), out, ckpt), world)
    result = torch.load(out)
    assert result["stats"]["evictions"] >= STEPS
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) <= 1e-5
    assert _max_diff(result["state"], ref_state) <= 1e-5
    # the optimizer's state dict gathers the sharded moments into torch's own layout
    assert result["optim"]["state"].keys() == ref_optim["state"].keys()
    assert [g["params"] for g in result["optim"]["param_groups"]] == [g["params"] for g in ref_optim["param_groups"]]
    for i, entry in ref_optim["state"].items():
        assert _max_diff(result["optim"]["state"][i], entry) <= 1e-5


def _routed_batches() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Batches whose halves route differently (rank 0: experts 0 and 1; rank 1: experts 2 and 3), and
    a sample that takes every expert."""
    data = batches(4, 8, seed=6)
    for b in data:
        b[0, :4] = torch.tensor([2, 2, 1, 1])
        b[4, :4] = torch.tensor([1, 1, 2, 2])
    sample = batches(1, 4, seed=5)[0]
    sample[0, :4] = torch.tensor([2, 2, 2, 2])
    return data, sample


def _routed_rank_main(rank: int, world: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    data, sample = _routed_batches()
    results = {}
    for ckpt in ("", "non-reentrant"):
        torch.manual_seed(0)
        base = Routed(ckpt=ckpt)
        plan = manual_plan(base, (sample,), chunk_size=512, n_blocks=3, world_size=world, sharded=False,
                           placements=["host", "device"] * 9)
        model, opt = wrap(base, torch.optim.AdamW(param_groups(base), lr=1e-2), sample_inputs=(sample,), plan=plan,
                          device="cpu", accumulation_steps=1)
        results[ckpt] = (engine_run(model, opt, data, 4, 1, rank=rank, world=world), model.state_dict())
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.extended
def test_ranks_routing_to_different_experts_train_like_torch_on_the_whole_batch(tmp_path):
    """Each rank uses experts the other does not: reductions still pair up (one fixed order, each
    chunk waiting only for what this rank used), and an expert used on one rank only is updated on
    both with half its gradient, as plain training on the whole batch would."""
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_routed_rank_main, (2, store_url(tmp_path), out), 2)
    results = torch.load(out)
    data, _ = _routed_batches()
    for ckpt, (losses, state) in results.items():
        torch.manual_seed(0)
        ref = Routed(ckpt=ckpt)
        opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
        ref_losses = []
        for b in data:  # each rank's loss is the mean over its half; the ranks' gradients are averaged
            loss = (ref(b[:4]) + ref(b[4:])) / 2
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_losses.append(loss.item())
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, ckpt
        assert _max_diff(state, ref.state_dict()) <= 1e-5, ckpt


@pytest.mark.extended
def test_a_learned_router_is_traced_with_its_weights_and_trains_like_torch():
    """Which experts run depends on the router's weights, which the meta trace does not have: the
    step is traced again with the real weights carried beside the meta ones. The engine then trains
    like torch, with evictions and clipping, though later steps route differently from the traced one."""
    torch.manual_seed(0)
    base = LearnedRouter()
    data = batches(10, 8, seed=3)
    assert trace_step(base, (data[0],)).weights_read
    assert not trace_step(Toy(), (data[0],)).weights_read
    ref_losses, ref_state = reference_run(base, data, 10, 1, MAX_NORM)
    model = copy.deepcopy(base)
    plan = manual_plan(model, (data[0],), chunk_size=600, n_blocks=2)
    plan = dataclasses.replace(plan, placements=["host", "device"] * (plan.n_chunks // 2)
                               + ["host"] * (plan.n_chunks % 2))
    model, opt = wrap(model, torch.optim.AdamW(param_groups(model), lr=1e-2), sample_inputs=(data[0],), plan=plan,
                      device="cpu", max_grad_norm=MAX_NORM)
    losses = engine_run(model, opt, data, 10, 1)
    assert model.engine_stats()["evictions"] >= 10
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref_state) <= 1e-5


def test_a_learned_router_after_a_dropout_is_traced_and_the_random_state_is_left_alone():
    """The router reads a dropout's output, so the dropout runs on real values too, from a fork of
    the generator: the training's random stream is the same as without the trace."""
    torch.manual_seed(0)
    model = LearnedRouter(dropout=0.1)
    state = torch.get_rng_state()
    assert trace_step(model, (batches(1, 8)[0],)).weights_read
    assert torch.equal(state, torch.get_rng_state())


def test_a_learned_router_built_on_meta_is_refused_with_what_to_change():
    with torch.device("meta"):
        model = LearnedRouter()
    with pytest.raises(ValueReadError, match="weights are on the meta device.*build it with real weights"):
        trace_step(model, (batches(1, 8)[0],))


def test_a_value_read_through_an_index_list_is_traced_on_a_meta_module():
    """`ids[:, [-1, 0]]` on meta made its index on the meta device, values lost: Hugging Face's check
    for padding in input_ids (`pad_token_id in ids[:, [-1, 0]]`) failed the trace of a meta model."""
    class PadCheck(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 4)
            self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

        def forward(self, ids):
            layer = self.a if 3 in ids[:, [-1, 0]] else self.b
            return layer(self.emb(ids)).square().mean()

    with torch.device("meta"):
        model = PadCheck()
    names = [n for n, _ in model.named_parameters()]
    for first, last, used in ((3, 5, "a"), (5, 5, "b")):
        ids = torch.full((2, 6), 7)
        ids[0, 0], ids[1, -1] = first, last
        trace = trace_step(model, (ids,))
        assert {names[i].split(".")[0] for i, got in enumerate(trace.got_grad) if got} == {"emb", used}
        assert not trace.weights_read


def _learned_router_rank_main(rank: int, world: int, store: str, out: str) -> None:
    import datetime

    torch.set_num_threads(1)  # sharded chunks here would mispair gathers and hang: a timeout turns that into an error
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    base = LearnedRouter(n_experts=8)
    data = batches(6, 2, seed=3)  # one row of 8 tokens per rank: each rank's tokens miss some experts
    model, opt = wrap(base, torch.optim.AdamW(param_groups(base), lr=1e-2), sample_inputs=(data[0][:1],),
                      device_memory="64MiB", device="cpu", accumulation_steps=1)
    losses = engine_run(model, opt, data, 6, 1, rank=rank, world=world)
    state = model.state_dict()
    if rank == 0:
        torch.save({"losses": losses, "state": state, "sharded": model.plan.sharded, "notes": model.plan.notes}, out)
    dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.extended
def test_ranks_with_a_learned_router_get_every_chunk_replicated_and_train_like_torch(tmp_path):
    """The ranks' halves of a batch route to different experts (in 5 of the 6 steps): the planner, seeing that the trace
    read values computed from the weights, replicates every chunk, and training matches torch on the
    whole batch."""
    out = str(tmp_path / "rank0.pt")
    spawn_ranks(_learned_router_rank_main, (2, store_url(tmp_path), out), 2)
    result = torch.load(out)
    assert not any(result["sharded"])
    assert any("read values computed from the weights" in n for n in result["notes"])
    torch.manual_seed(0)
    ref = LearnedRouter(n_experts=8)
    opt = torch.optim.AdamW(param_groups(ref), lr=1e-2)
    ref_losses = []
    for b in batches(6, 2, seed=3):
        loss = (ref(b[:1]) + ref(b[1:])) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) <= 1e-5
    assert _max_diff(result["state"], ref.state_dict()) <= 1e-5


def _searching_rank_main(rank: int, world: int, store: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    torch.manual_seed(0)
    sample = (batches(1, 8)[0],)
    results = {}
    for budget in ("4KiB", "64MiB"):
        model = Toy()
        try:
            wrapped, _ = wrap(model, torch.optim.AdamW(model.parameters()), sample_inputs=sample,
                              device_memory=budget, device="cpu")
            results[budget] = wrapped.plan.to_json()
        except PlanError as exc:
            results[budget] = f"PlanError: {exc}"
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


class SumsAcrossRanks(nn.Module):
    """A module whose forward runs a functional collective: planning must not replay it on one rank."""

    def __init__(self):
        super().__init__()
        self.l = nn.Linear(8, 8)

    def forward(self, x):
        import torch.distributed._functional_collectives as funcol

        return funcol.all_reduce(self.l(x), "sum", dist.group.WORLD).square().mean()


def _collective_rank_main(rank: int, world: int, store: str, out_dir: str) -> None:
    import datetime

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)
    model = SumsAcrossRanks()
    wrapped, opt = wrap(model, torch.optim.AdamW(model.parameters()), sample_inputs=(torch.randn(4, 8),),
                        device_memory="64MiB", device="cpu")
    wrapped(torch.randn(4, 8)).backward()
    opt.step()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"notes": wrapped.plan.notes}, f)
    dist.destroy_process_group()


@pytest.mark.extended
def test_planning_a_module_with_collectives_does_not_replay_them(tmp_path):
    spawn_ranks(_collective_rank_main, (2, store_url(tmp_path), str(tmp_path)), 2)
    for r in (0, 1):
        notes = json.loads((tmp_path / f"rank{r}.json").read_text())["notes"]
        assert any("distinct kernels timed on" in n for n in notes)


@pytest.mark.extended
def test_ranks_without_a_plan_all_run_rank_zeros_search(tmp_path):
    """Measured rates and kernel times differ per rank; one search, broadcast, keeps the chunks alike,
    and rank 0's PlanError reaches every rank instead of leaving the others waiting."""
    spawn_ranks(_searching_rank_main, (2, store_url(tmp_path), str(tmp_path)), 2)
    first, second = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert first["4KiB"].startswith("PlanError: ") and "too small" in first["4KiB"]
    assert second["4KiB"].startswith("PlanError: rank 0 could not plan: PlanError: ")
    assert Plan.from_json(first["64MiB"]) == Plan.from_json(second["64MiB"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_compute_tracks_the_fp32_loss_curve(dtype):
    """bf16 compute copies (fp16 with dynamic loss scaling) from fp32 masters stay within 1e-2 relative."""
    torch.manual_seed(0)
    base = Toy()
    data = batches(STEPS * ACCUM, 8)
    ref_losses, _ = reference_run(base, data, STEPS, ACCUM, MAX_NORM)
    m = copy.deepcopy(base)
    sample = (data[0],)
    plan = manual_plan(m, sample, chunk_size=1024, n_blocks=3)
    model, opt = wrap(m, torch.optim.AdamW(param_groups(m), lr=1e-2), sample_inputs=sample, plan=plan,
                      max_grad_norm=MAX_NORM, device="cpu", dtype=dtype)
    computed_in = set()
    m.l1.register_forward_hook(lambda mod, args, out: computed_in.add(out.dtype))
    losses = engine_run(model, opt, data, STEPS, ACCUM)
    assert computed_in == {dtype}  # the compute really ran in the low precision (fp32 would match exactly)
    assert (opt.loss_scale is not None) == (dtype == torch.float16)
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)) <= 1e-2
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())


def test_fp16_needs_the_module_to_return_the_loss():
    """The loss scale is applied to the module's output; anything else would train on unscaled gradients."""

    class ReturnsPair(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Toy()

        def forward(self, x):
            loss = self.inner(x)
            return loss, loss.detach()

    m = ReturnsPair()
    sample = (batches(1, 4)[0],)
    model, _ = wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=sample, device="cpu", dtype=torch.float16,
                    device_memory="64MiB", loss_fn=lambda out: out[0])
    with pytest.raises(TypeError, match="must return the scalar loss"):
        model(sample[0])


class _UsesWeightsInLists(nn.Module):
    """The parent reads its children's weights itself, inside lists (torch.cat), never calling them."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.a = nn.Linear(d, d, bias=False)
        self.b = nn.Linear(d, d, bias=False)
        self.head = nn.Linear(2 * d, 50)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        w = torch.cat([self.a.weight, self.b.weight], dim=0)  # (2d, d): both chunks needed at once
        logits = self.head(torch.relu(h @ w.t()))
        return nn.functional.cross_entropy(logits.reshape(-1, 50), x[:, 1:].reshape(-1))


def test_parameters_passed_inside_lists_are_fetched():
    torch.manual_seed(0)
    base = _UsesWeightsInLists()
    data = batches(6, 4)
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses = []
    for batch in data:
        loss = ref(batch)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    m = copy.deepcopy(base)
    plan = manual_plan(m, (data[0],), chunk_size=256, n_blocks=3)
    model, opt = wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sample_inputs=(data[0],), plan=plan,
                      device="cpu")
    assert plan.n_chunks >= 4  # a, b, emb and head in separate chunks, so a and b get evicted
    losses = []
    for batch in data:
        loss = model(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5
    assert _max_diff(model.state_dict(), ref.state_dict()) <= 1e-5


def test_host_state_lives_in_one_arena_of_exactly_its_size():
    """Host chunks' master, gradient buffer and moments (and upload copies) are disjoint slices of one
    allocation per dtype, so pinning it on a GPU locks exactly the state's bytes."""
    torch.manual_seed(0)
    m = Toy()
    sample = (batches(1, 8)[0],)
    plan = manual_plan(m, sample, chunk_size=1024, n_blocks=3, upload_copies=True)
    plan = dataclasses.replace(plan, placements=[("host", "device")[i % 2] for i in range(plan.n_chunks)])
    model, _ = wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=sample, plan=plan, device="cpu",
                    dtype=torch.bfloat16)
    store = model.store
    host = [c for c in store.chunks if c.placement == "host"]
    n = sum(c.shard_len for c in host)
    assert {dt: b.numel() for dt, b in store.arena.buffers.items()} == {torch.float32: 4 * n, torch.bfloat16: n}
    spans = []
    for c in host:
        for t in (c.master, c.grad_buffer, c.exp_avg, c.exp_avg_sq, c.upload):
            assert t.untyped_storage().data_ptr() == store.arena.buffers[t.dtype].untyped_storage().data_ptr()
            spans.append((t.dtype, t.storage_offset(), t.storage_offset() + t.numel()))
    for dtype in (torch.float32, torch.bfloat16):
        ranges = sorted((lo, hi) for dt, lo, hi in spans if dt == dtype)
        assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))  # disjoint
        assert sum(hi - lo for lo, hi in ranges) == store.arena.buffers[dtype].numel()  # and exactly filling it
    assert all(c.master.device.type == "cpu" and c.grad_buffer is None for c in store.chunks if c.placement == "device")


def test_a_prefetch_further_ahead_never_evicts_a_chunk_a_plain_pool_keeps():
    """The pool's rule for prefetches beyond the next access's chunks, over a real store and an
    access order made up to catch it: at the 6th access a prefetch of chunk 5 (needed at the 17th)
    could evict chunk 1 (needed at the 21st), but chunks 6, 7 and 8, loaded by then, are next needed
    only in the next step, so a plain pool evicts one of those instead; evicting chunk 1 cost a
    load more a step (10 against 9). Loading 5 ahead, the pool makes the loads it makes one ahead."""
    from elixir_ray.engine.pool import ChunkPool

    torch.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(9)])
    plan = manual_plan(m, (torch.randn(2, 8),), chunk_size=64, n_blocks=9)
    model, _ = wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=(torch.randn(2, 8),), plan=plan, device="cpu")
    store = model.store
    assert len(store.chunks) == 9
    events = [(c,) if isinstance(c, int) else c for c in
              [0, 1, 1, 2, 3, 4, (8, 7), 6, 7, 8, 7, 0, 6, 8, 7, 6, 5, 4, 3, 2, 1, 0]]
    loads = {}
    for depth in (1, 5):
        store.free_all()
        before = store.counts["fetches"]
        pool = ChunkPool(store, 8, events, keep_recent=1, prefetch_depth=depth)
        for _ in range(2):
            for ev in events:
                pool.access(ev)
            pool.reset()
        loads[depth] = store.counts["fetches"] - before
    assert loads[5] == loads[1] == 18, loads


def test_residency_flags_follow_the_storage_through_forward_recompute_and_steps():
    """The store keeps `Chunk.resident` beside every resize (the hooks read it for every op): at each
    module's entry, in forward and in recomputation, it agrees with the storage, and at most n_blocks
    chunks hold a compute copy."""
    torch.manual_seed(0)
    model, opt = _engine(Toy(ckpt="non-reentrant"), 8)
    store, checks = model.store, []

    def agree(*_):
        flags = [c.resident for c in store.chunks]
        assert flags == [c.compute.untyped_storage().nbytes() > 0 for c in store.chunks]
        assert sum(flags) <= model.engine_stats()["n_blocks"]
        checks.append(sum(flags))

    for mod in model.module.modules():
        mod.register_forward_pre_hook(agree)
    for batch in batches(3, 8):
        model(batch).backward()
        agree()
        opt.step()
        agree()
        opt.zero_grad()
    assert model.engine_stats()["evictions"] > 0 and len(checks) > 20 and max(checks) > 0


class _Untied(nn.Module):
    """No parameter used twice: each gradient is computed once, in the compute dtype."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 48)
        self.mid = nn.Sequential(nn.LayerNorm(48), nn.Linear(48, 96), nn.GELU(), nn.Linear(96, 48))
        self.head = nn.Linear(48, 50)

    def forward(self, x):
        logits = self.head(self.mid(self.emb(x[:, :-1])))
        return nn.functional.cross_entropy(logits.float().reshape(-1, 50), x[:, 1:].reshape(-1))


@pytest.mark.parametrize("clip,dos_gap", [(None, 0), (0.05, 2)], ids=["plain", "clipped-dos"])
def test_host_gradients_in_the_compute_dtype_change_nothing_with_one_micro_step(monkeypatch, clip, dos_gap):
    """bf16 compute: each gradient is computed in bf16, so sending host chunks' gradients down in bf16
    (half the PCIe bytes and 2 host bytes per parameter less), collected in bf16 on the device, loses
    nothing when no parameter is used twice; the CPU AdamW widens them a tile at a time (tiles made
    tiny here, so that they split parameters) and updates exactly as from fp32 gradients. Clipping
    scales them only once widened (scaling in bf16 would round them again), also in Deep Optimizer
    States updates."""
    from elixir_ray.engine import optimizer

    monkeypatch.setattr(optimizer, "GRAD_TILE_PER_THREAD", 50)
    torch.manual_seed(0)
    base = _Untied()
    data = batches(6, 8)
    runs = {}
    for low in (False, True):
        m = copy.deepcopy(base)
        sample = (data[0],)
        plan = manual_plan(m, sample, chunk_size=2048, n_blocks=2, host_grads_low=low, dos_gap=dos_gap)
        model, opt = wrap(m, torch.optim.AdamW(param_groups(m), lr=1e-2), sample_inputs=sample, plan=plan,
                          device="cpu", dtype=torch.bfloat16, accumulation_steps=1, max_grad_norm=clip)
        host = [c for c in model.store.chunks if c.placement == "host"]
        assert {c.grad_buffer.dtype for c in host} == {torch.bfloat16 if low else torch.float32}
        # and collected in bf16 on the device: nothing widened, nothing cast before the copy down
        assert {c.staging_dtype for c in host} == {torch.bfloat16 if low else torch.float32}
        assert model.store.arena.buffers[torch.float32].numel() == (3 if low else 4) * sum(c.shard_len for c in host)
        model.store.timer.enabled = True
        runs[low] = (engine_run(model, opt, data, 6, 1), model.state_dict())
        if clip is not None:
            assert opt.last_grad_norm > clip  # the clip really scaled every step's gradients
        assert (model.store.timer.calls["device_adam"] > 0) == (dos_gap > 0)  # the interleaved updates ran
    assert runs[True][0] == runs[False][0]
    assert _max_diff(runs[True][1], runs[False][1]) <= 1e-7  # fused Adam's vector tails round a tile's ends


def test_accumulating_host_gradients_in_the_compute_dtype_warns_once():
    torch.manual_seed(0)
    m = _Untied()
    data = batches(4, 8)
    plan = manual_plan(m, (data[0],), chunk_size=2048, n_blocks=2, host_grads_low=True)
    model, opt = wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sample_inputs=(data[0],), plan=plan,
                      device="cpu", dtype=torch.bfloat16)
    model(data[0]).backward()
    with pytest.warns(UserWarning, match="accumulation_steps=N"):
        model(data[1]).backward()
    opt.step()
    opt.zero_grad()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per wrapped model, not every step
        model(data[2]).backward()
        model(data[3]).backward()
        opt.step()


@pytest.mark.parametrize("late_zero_grad", [False, True], ids=["zero-grad-before-forward", "zero-grad-after-forward"])
@pytest.mark.parametrize("accumulation_steps", [None, 1], ids=["updates-at-step", "updates-in-backward"])
def test_a_forward_that_starts_with_device_gradients_alive_is_warned_of_once(late_zero_grad, accumulation_steps):
    """With one backward per step planned (host_grads_low), the planner counts a device chunk's
    gradient as gone from zero_grad() to its next backward; a loop that zeroes them only after the
    next forward holds them through it, beyond the plan: that is said once, before the forward runs.
    The usual order says nothing. With the updates started in backward (accumulation_steps=1) each
    device chunk's gradient is released once applied there: none is alive at the next forward,
    whenever zero_grad() comes, so nothing is said either."""
    import warnings

    torch.manual_seed(0)
    m = _Untied()
    data = batches(4, 8)
    plan = manual_plan(m, (data[0],), chunk_size=2048, n_blocks=2, host_grads_low=True)
    plan = dataclasses.replace(plan, placements=["device" if i % 2 else "host" for i in range(plan.n_chunks)])
    model, opt = wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-2), sample_inputs=(data[0],), plan=plan,
                      device="cpu", dtype=torch.bfloat16, accumulation_steps=accumulation_steps)
    assert opt.updates_in_backward == (accumulation_steps == 1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for batch in data:
            if not late_zero_grad:
                opt.zero_grad()
            loss = model(batch)
            if late_zero_grad:
                opt.zero_grad()
            loss.backward()
            opt.step()
    alive = [w for w in seen if "gradients of the chunks whose state is on the device" in str(w.message)]
    warned = late_zero_grad and accumulation_steps is None
    assert len(alive) == (1 if warned else 0)
    if warned:
        assert "call optimizer.zero_grad() before the forward" in str(alive[0].message)


def test_pool_protects_the_chunks_used_just_before_an_access():
    """With keep_recent=1, the chunk used just before an access is kept while it loads what is
    missing, even when the access also touches a resident chunk (here: 1 is resident, 3 is not, so
    0, the least recently used, goes; 2 was used just before)."""
    from elixir_ray.engine.pool import ChunkPool

    torch.manual_seed(0)
    model, _ = _engine(Toy(), 8, chunk_size=512)
    store = model.store
    assert len(store.chunks) >= 4
    store.free_all()
    events = [(0,), (1,), (2,), (1, 3), (0,), (2,)]
    pool = ChunkPool(store, 3, events, keep_recent=1, prefetch_depth=0)
    for ev in events[:4]:
        pool.access(ev)
    assert {c.index for c in store.chunks if c.resident} == {1, 2, 3}


def test_host_gradients_in_the_compute_dtype_only_where_one_micro_step_is_promised():
    """A searched plan keeps host gradients in bf16 only when wrap was promised one backward per step;
    a plan that keeps them so is refused with fp16 compute or a promise of several."""
    torch.manual_seed(0)
    data = batches(1, 8)
    plans = {}
    for steps in (None, 1, 2):  # 300 KiB: too little for any state on the device, whatever the measured rates
        m = _Untied()
        model, _ = wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=(data[0],), device="cpu",
                        dtype=torch.bfloat16, device_memory="300KiB", accumulation_steps=steps)
        assert "host" in model.plan.placements
        plans[steps] = model.plan.host_grads_low
    assert plans == {None: False, 1: True, 2: False}
    m = _Untied()
    low = manual_plan(m, (data[0],), chunk_size=2048, n_blocks=2, host_grads_low=True)
    with pytest.raises(ValueError, match="dtype=torch.bfloat16"):
        wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=(data[0],), plan=low, device="cpu",
             dtype=torch.float16)
    with pytest.raises(ValueError, match="grad_accum=4"):
        wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=(data[0],), plan=low, device="cpu",
             dtype=torch.bfloat16, accumulation_steps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("through", ["torch", "c"])
def test_a_host_gradients_norm_is_summed_in_fp64(dtype, through):
    """Through torch a tile at a time, or through the C kernel (threads of its own, eight running
    sums each): either way each element squared in double, so the sum is the fp64 one to rounding."""
    from elixir_ray.engine.host_kernel import host_adam_kernel
    from elixir_ray.engine.optimizer import NORM_TILE, _host_sum_of_squares

    kernel = host_adam_kernel() if through == "c" else None
    if through == "c" and kernel is None:
        pytest.skip("no C compiler here")
    grad = (torch.randn(2 * NORM_TILE + 12345, generator=torch.Generator().manual_seed(0)) * 1e-3).to(dtype)
    assert _host_sum_of_squares(grad, kernel) == pytest.approx(float(grad.double().pow(2).sum()), rel=1e-12)
    assert _host_sum_of_squares(grad[:0], kernel) == 0.0
    assert _host_sum_of_squares(grad[:7], kernel) == pytest.approx(float(grad[:7].double().pow(2).sum()), rel=1e-12)
