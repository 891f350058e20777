"""The planner: searched plans fit their budget, never get slower with more budget, round-trip as
JSON, beat the hand-made recipes in prediction, train exactly like plain torch, and explain themselves."""

import copy
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.checkpoint import checkpoint

import elixir_ray
from elixir_ray.chunk_plan.layout import pack
from elixir_ray.chunk_plan.plan import PLAN_VERSION
from elixir_ray.config import config_from_dict
from elixir_ray.model.factory import build_model
from elixir_ray.planner.api import default_host_budget
from elixir_ray.planner.for_config import plan_config
from elixir_ray.planner.model_profile import checkpointing_variants, profile_model
from elixir_ray.planner.search import SearchSettings, plan_search
from elixir_ray.units import parse_bytes

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import train_side_by_side  # noqa: E402

# rates of the kind an H100 box measures; fixed so that the properties are about the search alone
GPU = elixir_ray.HardwareProfile(device="cuda:0", h2d_gbps=25.0, d2h_gbps=22.0, cpu_adam_params_per_s=1.5e9,
                                 device_adam_params_per_s=60e9, matmul_tflops=400.0, cpu_threads=16)
CPU = elixir_ray.HardwareProfile(device="cpu", h2d_gbps=10.0, d2h_gbps=10.0, cpu_adam_params_per_s=5e8,
                                 device_adam_params_per_s=5e8, matmul_tflops=0.1, cpu_threads=2)
VOCAB = 64


class Stack(nn.Module):
    """Blocks of varied widths, tied embeddings, and a per-block checkpointing switch."""

    def __init__(self, widths: list[int], d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(d), nn.Linear(d, w), nn.GELU(), nn.Linear(w, d))
                                    for w in widths)
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        self._ckpt = [False] * len(widths)

    def checkpointing(self):
        return list(self._ckpt)

    def set_checkpointing(self, mask):
        self._ckpt = list(mask)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        for block, ck in zip(self.blocks, self._ckpt):
            h = h + (checkpoint(block, h, use_reentrant=False) if ck and torch.is_grad_enabled() else block(h))
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _sample(rows: int = 4, seq: int = 17) -> tuple:
    return (torch.zeros(rows, seq, dtype=torch.long),)


def _min_budget(model, sample, **kw) -> int:
    with pytest.raises(elixir_ray.PlanError) as err:
        elixir_ray.plan(model, sample, device_memory=1024, **kw)
    return parse_bytes(re.search(r"smallest plan needs ([\d.]+ \w+)", str(err.value)).group(1).replace(" ", ""))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(widths=st.lists(st.sampled_from([16, 48, 128, 256]), min_size=1, max_size=6),
       rows=st.sampled_from([1, 4, 16]), world=st.sampled_from([1, 2, 4]), factor=st.floats(1.05, 20.0),
       more=st.floats(1.0, 8.0), in_backward=st.booleans())
@pytest.mark.extended
def test_plan_properties(widths, rows, world, factor, more, in_backward):
    """The search's properties over random models. Each model is traced once, at every checkpointing
    setting, and searched at three budgets: what `elixir_ray.plan` does per budget (it traces again
    each time, two thirds of this test's time when it called plan). `in_backward`: updates start in
    the last backward (device gradients released once applied)."""
    with torch.device("meta"):
        model = Stack(widths)
    profiles = [profile_model(model, _sample(rows), None, v, torch.bfloat16) for v in checkpointing_variants(model)]
    host = default_host_budget(world)

    def search(budget: int) -> elixir_ray.Plan:
        return plan_search(profiles, SearchSettings(GPU, budget, world, "bfloat16", 2, host_budget=host,
                                                    updates_in_backward=in_backward))

    with pytest.raises(elixir_ray.PlanError) as err:
        search(1024)
    minimum = parse_bytes(re.search(r"smallest plan needs ([\d.]+ \w+)", str(err.value)).group(1).replace(" ", ""))
    budget = int(minimum * factor)
    plan = search(budget)
    # every parameter is in exactly one chunk
    names = [n for n, _ in model.named_parameters()]
    assert sorted(plan.param_order) == sorted(names)
    numel = dict(model.named_parameters())
    slots, sizes = pack([numel[n].numel() for n in plan.param_order], plan.chunk_size, world)
    assert len(slots) == len(names) and len(sizes) == plan.n_chunks == len(plan.sharded)
    assert sum(plan.chunk_numels) == sum(p.numel() for p in model.parameters())
    assert all(s % world == 0 for s in sizes)
    # the prediction fits and adds up
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_peak_bytes == sum(plan.memory.values())
    # the parts overlap: the step is at least the compute and at most every part one after another
    assert plan.time["compute"] * (1 - 1e-9) <= plan.predicted_step_seconds <= sum(plan.time.values()) * (1 + 1e-9)
    # JSON round trip
    assert elixir_ray.Plan.from_json(plan.to_json()) == plan
    # more budget never predicts a slower step
    richer = search(int(budget * more))
    assert richer.predicted_step_seconds <= plan.predicted_step_seconds * (1 + 1e-12)


def test_plan_is_the_search_over_the_traced_settings():
    """What test_plan_properties searches is what `elixir_ray.plan` returns for the same model and budget."""
    with torch.device("meta"):
        model = Stack([48, 256])
    profiles = [profile_model(model, _sample(4), None, v, torch.bfloat16) for v in checkpointing_variants(model)]
    budget = 3 * _min_budget(model, _sample(4), hardware=GPU, world_size=2)
    host = 2**30
    assert (plan_search(profiles, SearchSettings(GPU, budget, 2, "bfloat16", 2, host_budget=host))
            == elixir_ray.plan(model, _sample(4), device_memory=budget, hardware=GPU, world_size=2, host_memory=host))


def test_a_smaller_memory_margin_fits_more_of_the_budget_and_is_recorded():
    with torch.device("meta"):
        model = Stack([48, 256, 256])
    minimum = _min_budget(model, _sample(4), hardware=GPU, memory_margin=0.2)
    budget = int(minimum * 0.95)
    with pytest.raises(elixir_ray.PlanError):
        elixir_ray.plan(model, _sample(4), device_memory=budget, hardware=GPU, memory_margin=0.2)
    plan = elixir_ray.plan(model, _sample(4), device_memory=budget, hardware=GPU, memory_margin=0.1)
    assert plan.memory_margin == 0.1 and plan.predicted_peak_bytes <= budget * 0.9
    assert any("kept back" in n and "10%" in n for n in plan.notes)
    assert elixir_ray.Plan.from_json(plan.to_json()).memory_margin == 0.1
    roomy = 3 * minimum  # a smaller margin leaves more of the same budget: never a slower step
    assert (elixir_ray.plan(model, _sample(4), device_memory=roomy, hardware=GPU, memory_margin=0.05)
            .predicted_step_seconds <= elixir_ray.plan(model, _sample(4), device_memory=roomy, hardware=GPU,
                                                       memory_margin=0.2).predicted_step_seconds * (1 + 1e-12))


def test_the_default_margin_follows_the_device_and_its_allocator(monkeypatch):
    """A CUDA device trains on the allocator's expandable segments unless PYTORCH_CUDA_ALLOC_CONF
    turns them off, and its plans keep 10% of the budget back; without them, or on the CPU, 20%."""
    with torch.device("meta"):
        model = Stack([48, 256, 256])
    roomy = 3 * _min_budget(model, _sample(4), hardware=GPU, memory_margin=0.2)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert elixir_ray.plan(model, _sample(4), device_memory=roomy, hardware=GPU).memory_margin == 0.1
    assert elixir_ray.plan(model, _sample(4), device_memory=roomy, hardware=CPU).memory_margin == 0.2
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:False")
    assert elixir_ray.plan(model, _sample(4), device_memory=roomy, hardware=GPU).memory_margin == 0.2


@pytest.mark.parametrize("margin", [-0.1, 1.0, "0.1", False])
def test_a_memory_margin_outside_zero_to_one_is_refused_before_planning(margin):
    with torch.device("meta"):
        model = Stack([48])
    with pytest.raises(ValueError, match=r"memory_margin must be a fraction of the budget in \[0, 1\)"):
        elixir_ray.plan(model, _sample(4), device_memory="1GiB", hardware=GPU, memory_margin=margin)


def test_too_small_budget_names_the_minimum_and_what_dominates():
    with torch.device("meta"):
        model = Stack([256, 256])
    sample = _sample(64, 65)  # large activations: they dominate
    with pytest.raises(elixir_ray.PlanError, match=r"too small: the smallest plan needs .*\nof which activations at "
                                                   r"micro-batch 64 need .*\neven micro-batch 1 needs about"):
        elixir_ray.plan(model, sample, device_memory="64KiB", hardware=GPU)
    # a budget some smaller micro-batch fits: the hint estimates one (activations taken as proportional)
    with pytest.raises(elixir_ray.PlanError, match=r"use micro-batch (\d+) or less, an estimate") as refused:
        elixir_ray.plan(model, sample, device_memory="2MiB", hardware=GPU)
    assert 1 < int(re.search(r"use micro-batch (\d+) or less", str(refused.value)).group(1)) < 64
    minimum = _min_budget(model, sample, hardware=GPU)
    plan = elixir_ray.plan(model, sample, device_memory=int(minimum * 1.03), hardware=GPU)
    # recomputation is the only way in at the minimum (here recomputing block 0 alone: block 1's
    # recompute would run while a gradient buffer more is open, at the same activation peak)
    assert plan.activation_checkpointing[0] is True
    off = _min_budget(model, sample, hardware=GPU, search_checkpointing=False)
    assert off > minimum


def test_a_configs_memory_margin_is_the_plans_and_its_alternatives():
    cfg = config_from_dict({"model": {"size": "tiny"}, "train": {"micro_batch": 2},
                            "engine": {"memory_margin": 0.1}})
    planned = plan_config(cfg, GPU, device_memory="64MiB")
    assert planned.plan.memory_margin == 0.1 and planned.plan.predicted_peak_bytes <= 0.9 * 64 * 2**20
    assert {p.memory_margin for p in planned.alternatives.values() if p is not None} == {0.1}
    default = plan_config(config_from_dict({"model": {"size": "tiny"}, "train": {"micro_batch": 2}}), GPU,
                          device_memory="64MiB")
    assert default.plan.memory_margin == 0.1  # on CUDA, with the allocator's expandable segments (engine/allocator.py)


def test_a_configs_micro_batch_hint_is_one_a_plan_was_found_for():
    """For a config, the estimate is checked by planning at it (and a few below): the hint names a
    micro-batch that fits, with the keys to set."""
    cfg = config_from_dict({"model": {"size": "tiny", "activation_checkpointing": "full"},
                            "train": {"micro_batch": 4}, "engine": {"memory_margin": 0.2}})
    with pytest.raises(elixir_ray.PlanError, match=r"use micro-batch (\d) \(a plan at \d fits: "
                                                   r"--set train.micro_batch=\d, and raise train.grad_accum") as err:
        plan_config(cfg, GPU, device_memory="4MiB")
    smaller = int(re.search(r"use micro-batch (\d)", str(err.value)).group(1))
    small = config_from_dict({"model": {"size": "tiny", "activation_checkpointing": "full"},
                              "train": {"micro_batch": smaller}, "engine": {"memory_margin": 0.2}})
    assert plan_config(small, GPU, device_memory="4MiB").plan.predicted_peak_bytes <= 4 * 2**20
    # where even one row does not fit, no micro-batch is named
    with pytest.raises(elixir_ray.PlanError, match=r"even micro-batch 1 does not fit \(a plan at 1 was tried\)"):
        plan_config(cfg, GPU, device_memory="3250KiB")  # the estimate says 1 row fits; the plan at 1 does not


def test_a_hugging_face_models_plan_names_the_config_key_that_turns_on_its_checkpointing():
    """model.hf: the planner traces the model and its loss as the workers run them, and its advice to
    call the model's own checkpointing switch becomes the config key that does."""
    pytest.importorskip("transformers")
    llama = dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=257, max_position_embeddings=128)
    cfg = config_from_dict({"model": {"seq_len": 64, "hf": llama}, "train": {"micro_batch": 4}})
    with pytest.raises(elixir_ray.PlanError) as err:
        plan_config(cfg, CPU, device_memory="2MiB")
    assert "turn on the model's own activation checkpointing (--set model.activation_checkpointing=true), or " \
           "use micro-batch" in str(err.value)
    assert "LlamaForCausalLM" not in str(err.value)
    full = config_from_dict({"model": {"seq_len": 64, "hf": llama, "activation_checkpointing": True},
                             "train": {"micro_batch": 4}})
    plain = plan_config(config_from_dict({"model": {"seq_len": 64, "hf": llama}, "train": {"micro_batch": 4}}),
                        CPU, device_memory="8MiB").plan
    recomputed = plan_config(full, CPU, device_memory="8MiB").plan
    assert recomputed.memory["activations"] < 0.6 * plain.memory["activations"]
    assert plain.param_order[0] == "model.embed_tokens.weight"  # the model's own names, in first-use order


PROBE = re.compile(r"checking whether micro-batch (\d+) fits with (\d+) of \d+ blocks recomputed whole"
                   r"(?:, (\d+) selectively)?")


def test_micro_batch_probes_try_the_most_recomputation_first_and_stop_at_the_first_fit():
    """The hint's probes trace one checkpointing setting at a time, the most recomputation first: a
    micro-batch that fits costs one trace, and one is refused only after every setting. A refusal
    is the full search's: no setting has a plan there."""
    def cfg(micro_batch):
        return config_from_dict({"model": {"size": "tiny"}, "engine": {"search_checkpointing": True, "memory_margin": 0.2},
                                 "train": {"micro_batch": micro_batch}})

    budget = "6400KiB"  # micro-batch 16 does not fit; the estimate, 4, does not either; 3 does
    lines: list = []
    with pytest.raises(elixir_ray.PlanError, match=r"use micro-batch (\d) \(a plan at \d fits") as err:
        plan_config(cfg(16), GPU, device_memory=budget, progress=lines.append)
    named = int(re.search(r"use micro-batch (\d)", str(err.value)).group(1))
    probes = [PROBE.fullmatch(line) for line in lines if line.startswith("checking whether")]
    assert all(probes), lines
    by_batch: dict = {}
    for p in probes:
        by_batch.setdefault(int(p[1]), []).append((int(p[2]), int(p[3] or 0)))
    most = max(setting for tried in by_batch.values() for setting in tried)
    assert min(by_batch) == named and by_batch[named] == [most], by_batch
    refused = [m for m in by_batch if m != named]
    assert refused, f"every probe at {budget} fit at once: pick a budget where the estimate is refused"
    settings = len(checkpointing_variants(build_model(cfg(1), device="meta")))
    for m in refused:
        assert by_batch[m] == sorted(by_batch[m], reverse=True) and len(by_batch[m]) == settings, by_batch
        with pytest.raises(elixir_ray.PlanError):
            plan_config(cfg(m), GPU, device_memory=budget)


def test_a_host_limit_that_keeps_state_on_the_device_is_named_when_nothing_fits():
    """Optimizer state the host may not hold stays on the device: when that is why a budget is too
    small, the refusal says so, with what the smallest plan would need were the host roomier."""
    with torch.device("meta"):
        model = Stack([256] * 4)
    sample = _sample(4)
    roomy = _min_budget(model, sample, hardware=GPU, host_memory="1GiB")
    tight = _min_budget(model, sample, hardware=GPU, host_memory="1KiB")
    assert tight > roomy
    # the device budget would do with room on the host: the host is named first
    with pytest.raises(elixir_ray.PlanError, match=r"^host memory is too small for device_memory .*: only 1.0 KiB "
                                                   r"per rank may hold optimizer state") as err:
        elixir_ray.plan(model, sample, device_memory=(roomy + tight) // 2, hardware=GPU, host_memory="1KiB")
    assert "with room on the host for all of it" in str(err.value)
    # neither would do: the device is named first, and the host's part in it
    with pytest.raises(elixir_ray.PlanError, match=r"^device_memory .* is too small: .*\nhost memory sets part of "
                                                   r"that: only 1.0 KiB per rank"):
        elixir_ray.plan(model, sample, device_memory=roomy // 2, hardware=GPU, host_memory="1KiB")
    plan = elixir_ray.plan(model, sample, device_memory=(roomy + tight) // 2, hardware=GPU, host_memory="1GiB")
    assert any("of 1.0 GiB allowed" in note for note in plan.notes)
    assert any(note.startswith("device memory usable:") for note in plan.notes)


def test_several_ranks_replicate_chunks_where_gathers_cost_more_than_the_memory():
    """With a small pool each chunk is fetched (and its shards gathered) more than once a step;
    "auto" keeps chunks whole on every rank where that saves more gather time than the all-reduce
    adds, as far as the host holds their whole state: with host RAM for some whole chunks, some;
    with host RAM only for shards, none. "all" and "none" force it (ranks using different
    parameters need "all")."""
    import dataclasses

    with torch.device("meta"):
        model = Stack([256] * 4)
    sample = _sample(4)
    links = dataclasses.replace(GPU, collective_gbps=0.05)
    kw = dict(hardware=links, world_size=2, dtype=torch.float32)
    budget = int(1.1 * max(_min_budget(model, sample, replicate=r, **kw) for r in ("none", "all")))
    none = elixir_ray.plan(model, sample, device_memory=budget, replicate="none", **kw)
    whole = elixir_ray.plan(model, sample, device_memory=budget, replicate="all", **kw)
    assert all(none.sharded) and not any(whole.sharded)

    def host_state(plan):
        return parse_bytes(re.search(r"on the host: ([\d.]+ \w+) per rank", "\n".join(plan.notes)).group(1).replace(" ", ""))

    assert host_state(whole) > host_state(none)
    some = elixir_ray.plan(model, sample, device_memory=budget, host_memory=(host_state(none) + host_state(whole)) // 2, **kw)
    assert 0 < sum(not s for s in some.sharded) < some.n_chunks  # some chunks, chosen one by one
    assert some.predicted_step_seconds < none.predicted_step_seconds
    assert some.predicted_peak_bytes <= budget
    shards_only = elixir_ray.plan(model, sample, device_memory=budget, host_memory=int(1.05 * host_state(none)), **kw)
    assert all(shards_only.sharded)
    with pytest.raises(ValueError, match="replicate must be one of auto, all, none"):
        elixir_ray.plan(model, sample, device_memory="1GiB", replicate="some", **kw)


def test_searched_plan_is_predicted_no_slower_than_hand_made_recipes():
    cfg = config_from_dict({"model": {"size": "small"}, "train": {"micro_batch": 4}})
    checked = 0
    for budget in ("190MiB", "220MiB", "260MiB", "400MiB"):
        result = plan_config(cfg, GPU, device_memory=budget)
        assert result.plan.predicted_peak_bytes <= parse_bytes(budget)
        for name, alt in result.alternatives.items():
            if alt is None:  # the table says what the recipe exceeds
                assert re.fullmatch(r"(device needs [\d.]+ \wiB)?(, )?(host needs .* per rank of .*)?",
                                    result.misfits[name]) and result.misfits[name], (name, result.misfits)
            if alt is not None:
                checked += 1
                assert alt.predicted_peak_bytes <= parse_bytes(budget), name
                assert result.plan.predicted_step_seconds <= alt.predicted_step_seconds * (1 + 1e-9), name
    assert checked >= 8


def test_searched_plan_trains_exactly_like_torch():
    torch.manual_seed(0)
    model = Stack([48, 128, 16, 64, 128, 32])
    reference = copy.deepcopy(model)
    sample = _sample(4)
    minimum = _min_budget(model, sample, hardware=CPU)
    plan = elixir_ray.plan(model, sample, device_memory=int(minimum * 1.1), hardware=CPU)
    assert plan.n_blocks < plan.n_chunks  # the pool is smaller than the model: evictions happen
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    wrapped, wopt = elixir_ray.wrap(model, opt, sample_inputs=sample, plan=plan, device="cpu")
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference.set_checkpointing(plan.activation_checkpointing)
    g = torch.Generator().manual_seed(3)
    data = [torch.randint(0, VOCAB, (4, 17), generator=g) for _ in range(5)]
    assert max(train_side_by_side(wrapped, wopt, reference, ref_opt, data)) <= 1e-5
    state = wrapped.state_dict()
    assert max((state[k] - v).abs().max().item() for k, v in reference.state_dict().items()) <= 1e-5


def test_wrap_without_a_plan_searches_one():
    model = Stack([16, 16])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    wrapped, _ = elixir_ray.wrap(model, opt, sample_inputs=_sample(2), device_memory="8MiB", device="cpu")
    assert wrapped.plan.predicted_step_seconds > 0 and wrapped.plan.budget_bytes == 8 * 2**20
    assert "searched" in wrapped.plan.notes[0]


def test_explain_lists_chunks_memory_and_time():
    with torch.device("meta"):
        model = Stack([128] * 4)
    plan = elixir_ray.plan(model, _sample(8), device_memory="4MiB", hardware=GPU, world_size=2)
    text = plan.explain()
    for needle in ("chunks of", "pool:", "optimizer state:", "across ranks:", "predicted peak device memory",
                   "pool blocks", "predicted step time", "compute", "of 4.0 MiB budget",
                   "critical path: the forward's compute"):
        assert needle in text, needle


@pytest.mark.parametrize("ckpt", [False, "full"], ids=["no-recompute", "blocks-recomputed"])
def test_a_deeper_prefetch_costs_no_load_one_chunk_ahead_does_not(ckpt):
    """A GPT with tied embeddings in 19 chunks, a pool of 9 blocks, loading up to 7 chunks ahead:
    the engine makes the same loads a step as one chunk ahead. A prefetch further ahead than the
    next chunk does not evict the tied embedding (used again at the forward's end) while the
    chunks just used are needed later (in backward): without that rule the forward evicted it and
    loaded it again, two loads more a step. The plan takes as many as the blocks allow."""
    from elixir_ray.engine import manual_plan
    from elixir_ray.model.gpt import build_gpt
    from elixir_ray.planner.search import make_layout, prefetch_depth

    torch.manual_seed(0)
    base = build_gpt(dict(d_model=64, n_layers=12, n_heads=4, vocab_size=257, seq_len=32), ckpt)
    data = [torch.randint(0, 257, (4, 33)) for _ in range(2)]
    lay = make_layout(profile_model(copy.deepcopy(base), (data[0],)), 40000, 1)
    assert len(lay.sizes) == 19 and prefetch_depth(9, lay.min_blocks) == (6 if not ckpt else 5)
    fetches, losses = {}, {}
    for depth in (1, prefetch_depth(9, lay.min_blocks), 7):
        m = copy.deepcopy(base)
        plan = manual_plan(m, (data[0],), chunk_size=40000, n_blocks=9, prefetch_depth=depth)
        assert f"loading {depth} chunk(s) ahead" in plan.explain()
        model, opt = elixir_ray.wrap(m, torch.optim.AdamW(m.parameters(), lr=1e-3), sample_inputs=(data[0],),
                                     plan=plan, device="cpu")
        assert model.pool.prefetch_depth == depth  # the plan's: wrap was given no prefetch=
        losses[depth] = []
        for batch in data:
            loss = model(batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[depth].append(float(loss.detach()))
        stats = model.engine_stats()
        fetches[depth] = stats["fetches"]
        assert stats["blocks_over_plan"] == 0
        if depth > 1:
            assert stats["prefetch_lead"] / stats["prefetches"] > 2  # really further ahead
    assert len(set(fetches.values())) == 1, fetches
    assert len({tuple(v) for v in losses.values()}) == 1
    m = copy.deepcopy(base)
    model, _ = elixir_ray.wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=(data[0],), plan=plan,
                               device="cpu", prefetch=0)
    assert model.pool.prefetch_depth == 0  # wrap's prefetch= over the plan's
    m = copy.deepcopy(base)
    with pytest.raises(ValueError, match="the plan's prefetch_depth must be an int >= 0"):
        elixir_ray.wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=(data[0],), device="cpu",
                        plan=dataclasses.replace(plan, prefetch_depth=-1))
    with pytest.raises(ValueError, match=r"prefetch must be an int >= 0 \(chunks to load ahead\) or None"):
        elixir_ray.wrap(m, torch.optim.AdamW(m.parameters()), sample_inputs=(data[0],), device="cpu", plan=plan,
                        prefetch=True)  # a bool is 1 to Python, not "on"


def test_old_plan_versions_and_unknown_fields_are_refused():
    with torch.device("meta"):
        model = Stack([16])
    data = json.loads(elixir_ray.plan(model, _sample(), device_memory="8MiB", hardware=GPU).to_json())
    assert data["version"] == PLAN_VERSION == 6 and data["prefetch_depth"] >= 1
    for version in (1, 2, 3, 4, 5, 7):  # only this version's format is read: an older plan is made again
        with pytest.raises(ValueError, match=f"plan version {version} is not supported .*reads version 6.*make the "
                                             f"plan again"):
            elixir_ray.Plan.from_json(json.dumps({**data, "version": version}))
    with pytest.raises(ValueError, match="unknown fields"):
        elixir_ray.Plan.from_json(json.dumps({**data, "surprise": 1}))
    with pytest.raises(ValueError, match=r"not a plan \(no version or placements; found \['collective_gbps'"):
        elixir_ray.Plan.from_json(GPU.to_json())  # a hardware profile handed over by mistake
    # a module's set_checkpointing takes True and False per block too, for "full" and "none"
    masked = elixir_ray.Plan.from_json(json.dumps({**data, "activation_checkpointing": [True, False]}))
    assert masked.activation_checkpointing == [True, False]
    assert "1 of 2 blocks recomputed whole" in masked.explain()


def test_a_plan_is_frozen_and_a_variant_is_a_replacement():
    with torch.device("meta"):
        model = Stack([16])
    plan = elixir_ray.plan(model, _sample(), device_memory="8MiB", hardware=GPU)
    gap = plan.dos_gap
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.dos_gap = gap + 1
    other = dataclasses.replace(plan, dos_gap=gap + 1)
    assert other.dos_gap == gap + 1 and plan.dos_gap == gap and other.placements == plan.placements


def test_cli_plan_prints_explanation_and_writes_chart_and_json(tmp_path):
    hw = tmp_path / "hw.json"
    hw.write_text(GPU.to_json())
    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    proc = subprocess.run([sys.executable, "-m", "elixir_ray", "plan", "jobs/configs/tiny.yaml", "--hardware", str(hw),
                           "--device-memory", "8MiB", "--png", str(png), "--json", str(out),
                           "--set", "engine.search_checkpointing=true"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "predicted step time" in proc.stdout and "| searched |" in proc.stdout
    # what it is doing goes to stderr as it starts each stage, so stdout stays the plan alone
    stages = [line for line in proc.stderr.splitlines() if line.startswith("... ")]
    assert any("setting 1 of" in line for line in stages) and "searching" in stages[-1], proc.stderr
    assert not any(line.startswith("... ") for line in proc.stdout.splitlines())
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plan = elixir_ray.Plan.from_json(out.read_text())
    assert plan.budget_bytes == 8 * 2**20 and plan.predicted_peak_bytes <= plan.budget_bytes
    # the host RAM limit is printed with where it came from, and another machine's rates with this one's
    # RAM draws a warning
    assert "host RAM for optimizer state:" in proc.stdout and "give --host-memory" in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "elixir_ray", "plan", "jobs/configs/tiny.yaml", "--hardware", str(hw),
                          "--device-memory", "1KiB", "--png", str(png)], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "smallest plan needs" in bad.stderr


@pytest.mark.parametrize("flags,message", [
    (["--device-memory", "12XB"], "--device-memory: expected a size"),
    (["--host-memory", "lots"], "--host-memory: expected a size"),
    (["--world-size", "0"], "--world-size: expected a whole number of at least 1"),
    (["--hardware", "missing.json"], "--hardware missing.json: cannot read it (FileNotFoundError"),
    (["--hardware", "jobs/configs/tiny.yaml"], "not a hardware profile (JSONDecodeError"),
    # another machine's rates, and no budget: what that device has free cannot be read here
    (["--hardware", "jobs/hardware/h100_anchors.json"], "cannot query for free memory: give the budget"),
    # outputs that could not be written after planning are refused before it
    (["--png", "/nonexistent-dir/x.png"], "the directory /nonexistent-dir does not exist"),
    (["--png", "chart.jpg"], "name the file *.png"),
    (["--json", "jobs"], "--json jobs is a directory"),
    (["--device-memory=0"], "--device-memory 0: a budget must be above 0"),
    # an option of the command spelt with underscores, a config key given as an option
    (["--device_memory", "1GiB"], "unrecognized arguments: --device_memory 1GiB (did you mean --device-memory?)"),
    (["--micro-batch", "2"], "(config values are set with --set: --set train.micro_batch=2)"),
])
def test_cli_plan_refuses_bad_flags_in_one_line_before_planning(flags, message, capsys):
    from elixir_ray.cli import main

    try:
        code = main(["plan", "jobs/configs/tiny.yaml", *flags])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_searched_plan_is_what_its_choice_costs():
    """The plan the search returns (layout, placements, DOS gap, upload copies) re-costs to exactly its
    own prediction: nothing of the winning candidate is lost on the way out. The 4.2B GPT with the H100
    anchor rates, where upload copies win at some budgets and not at others."""
    import numpy as np

    from elixir_ray.bench.systems import SHAPES
    from elixir_ray.model.gpt import build_gpt
    from elixir_ray.planner.model_profile import profile_model
    from elixir_ray.planner.search import Choice, SearchSettings, evaluate, make_layout, plan_search

    hw = elixir_ray.HardwareProfile.from_json(open("jobs/hardware/h100_anchors.json").read())
    shape = SHAPES["gpt-4b"]
    model = build_gpt(shape.model_shape(), True, device="meta")
    profile = profile_model(model, (torch.zeros(shape.micro_batch, shape.seq_len + 1, dtype=torch.long),),
                            None, None, torch.bfloat16)
    uploads = set()
    for in_backward in (False, True):
        for budget in ("24GiB", "40GiB", "70GiB"):
            plan = plan_search([profile], SearchSettings(hw, parse_bytes(budget), 1, "bfloat16", 2,
                                                         host_budget=parse_bytes("112GiB"),
                                                         updates_in_backward=in_backward))
            uploads.add(plan.upload_copies)
            choice = Choice(make_layout(profile, plan.chunk_size, 1), plan.n_blocks,
                            np.array([p == "device" for p in plan.placements]), plan.dos_gap, plan.upload_copies,
                            plan.host_grads_low)
            memory, _, _, seconds = evaluate(choice, hw, 1, 2, 1, in_backward)
            assert seconds == pytest.approx(plan.predicted_step_seconds, rel=1e-9), (budget, in_backward)
            assert sum(memory.values()) == plan.predicted_peak_bytes
    assert True in uploads  # the case that matters was exercised


@pytest.mark.parametrize("model_name,ordered", [("toy", False), ("gpt", False), ("toy", True), ("gpt", True),
                                                ("gpt-full", False), ("gpt-full", True)])
def test_gradient_buffers_the_planner_budgets_are_the_ones_the_engine_holds(model_name, ordered):
    """The planner counts, from the traced gradient order, how many chunks collect gradients at once
    (each an fp32 buffer on the device); the engine's real backward holds exactly that many. In the
    toy model a chunk boundary splits a layer, so two are open at once. In our GPT the order is
    not layer by layer: a selective block's norm gives the next matmul's weight gradient, and a
    block recomputed whole gives all of its gradients at once, in the order of autograd's ready
    queue, so the chunks a block spans may be open together; the count follows the trace all the same.
    `ordered`: reductions in the fixed order several ranks use (run here on one rank), which wait
    only for the parameters used in forward: the toy's chunk with the unused branch closes at once."""
    import os

    from elixir_ray.engine import manual_plan
    from elixir_ray.chunk_plan.layout import open_gradient_chunks
    from elixir_ray.engine.trace import trace_step, unique_parameters
    from elixir_ray.model.gpt import build_gpt

    sys.path.insert(0, os.path.dirname(__file__))
    from engine_models import Toy, batches

    torch.manual_seed(0)
    if model_name == "toy":
        model, sample, expected = Toy(), (batches(1, 4)[0],), 1 if ordered else 2
    else:
        shape = dict(d_model=32, n_layers=4, n_heads=4, vocab_size=97, seq_len=16)
        mode = "full" if model_name == "gpt-full" else "selective"
        model, sample, expected = build_gpt(shape, mode), (torch.randint(0, 97, (2, 17)),), None
    names = [n for n, _ in unique_parameters(model)]
    trace = trace_step(model, sample)
    plan = manual_plan(model, sample, chunk_size=4096, n_blocks=3)  # chunks span layers
    wrapped, opt = elixir_ray.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3), sample_inputs=sample,
                                   plan=plan, device="cpu")
    wrapped.hooks.ordered = ordered
    chunk_of = {s.name: s.chunk for s in wrapped.slots}
    predicted = open_gradient_chunks(trace.grad_order, [chunk_of[n] for n in names], ordered=ordered)
    store, held = wrapped.store, []
    add_grad = store.add_grad

    def counting_add_grad(slot, grad):  # what the hooks call for every gradient
        chunk = add_grad(slot, grad)
        held.append(sum(c.staging is not None for c in store.chunks))
        return chunk

    store.add_grad = counting_add_grad
    for _ in range(2):
        wrapped(sample[0]).backward()
        opt.step()
        opt.zero_grad()
    n_chunks = len(store.chunks)
    assert n_chunks >= 3 and held, n_chunks
    assert max(held) == predicted == (predicted if expected is None else expected)


def test_host_gradients_take_the_compute_dtype_only_with_bf16_and_one_micro_step():
    """bf16 with one micro-step: host chunks' gradients cross and wait in bf16, 14 host bytes per
    parameter instead of 16, half the gradient bytes over PCIe. Not with several micro-steps (they
    would accumulate on the host), fp16 (loss-scaled) or fp32, nor when the caller cannot promise
    one micro-step."""
    import numpy as np

    from elixir_ray.model.gpt import build_gpt
    from elixir_ray.planner.model_profile import profile_model
    from elixir_ray.planner.search import Choice, SearchSettings, evaluate, make_layout, plan_search

    shape = dict(d_model=64, n_layers=4, n_heads=4, vocab_size=97, seq_len=32)
    model = build_gpt(shape, device="meta")
    profile = profile_model(model, (torch.zeros(4, 33, dtype=torch.long),), None, None, torch.bfloat16)
    params = sum(profile.numels)
    cases = {  # (grad_accum, dtype, promised) -> host gradients in bf16?
        (1, "bfloat16", True): True, (2, "bfloat16", True): False, (1, "float16", True): False,
        (1, "float32", True): False, (1, "bfloat16", False): False,
    }
    host_bytes, d2h = {}, {}
    for (accum, dtype, promised), expected in cases.items():
        elem = 4 if dtype == "float32" else 2
        plan = plan_search([profile], SearchSettings(GPU, 3 * 2**20, 1, dtype, elem, grad_accum=accum,
                                                     low_host_grads=promised), chunk_sizes=[8192])
        assert "host" in plan.placements
        assert plan.host_grads_low == expected, (accum, dtype, promised)
        all_host = Choice(make_layout(profile, plan.chunk_size, 1), plan.n_blocks,
                          np.zeros(plan.n_chunks, dtype=bool), 0, False, plan.host_grads_low)
        _, time, host_bytes[accum, dtype, promised], _ = evaluate(all_host, GPU, 1, elem, accum)
        d2h[accum, dtype, promised] = time["copies device->host"] / accum
    padded = host_bytes[1, "float32", True] / 16
    assert padded >= params
    assert host_bytes[1, "bfloat16", True] == 14 * padded
    assert host_bytes[2, "bfloat16", True] == host_bytes[1, "bfloat16", False] == 16 * padded
    assert d2h[1, "bfloat16", True] == pytest.approx(d2h[2, "bfloat16", True] / 2)
