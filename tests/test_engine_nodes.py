"""4 gloo ranks on 2 simulated nodes (one spawn for the module): their collectives' rates, and
chunks sharded within each node and replicated across nodes.

The ranks time their collectives within each node, across all ranks and between nodes. Each way
of holding a chunk (replicated, sharded across all ranks, sharded within each node), a plan
mixing the three, and the plan searched for a slow network between the nodes train as one
process does on the global batch (fp32, to 1e-5), with gradient clipping, and the ranks'
checkpoint shards join into the same whole tensors.
"""

import functools
import os
import sys

import pytest
import torch
import torch.distributed as dist

import elixir_ray
from elixir_ray import wrap
from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.cluster.collective_rates import measure_collectives
from elixir_ray.engine import assemble, engine_shard, layout_of, manual_plan
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.network import GroupRates, Network

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import Toy, batches, engine_run, param_groups, reference_run, spawn_ranks, store_url  # noqa: E402

WORLD, STEPS, ACCUM, MAX_NORM = 4, 2, 2, 0.05
# rank -> node: two nodes of two ranks; the mixed plan's ranks alternate between them ("searched": the plan's)
RUNS = {"replicated": [0, 0, 1, 1], "sharded": [0, 0, 1, 1], "node_sharded": [0, 0, 1, 1], "mixed": [0, 1, 0, 1],
        "searched": [0, 0, 1, 1]}
RATES = HardwareProfile(device="cpu", h2d_gbps=5.0, d2h_gbps=5.0, cpu_adam_params_per_s=1e9,
                        device_adam_params_per_s=1e9, matmul_tflops=0.1, cpu_threads=1)


def _network(between_nodes_gbps: float) -> Network:
    """Two nodes of two ranks: 20 GB/s within a node, `between_nodes_gbps` across them (and across all
    ranks, whose ring crosses between the nodes), 50 us a call everywhere."""
    far = GroupRates(between_nodes_gbps, between_nodes_gbps, 5e-5, ("a", "b"))
    return Network(node_of_rank=(0, 0, 1, 1), node_names=("a", "b"), node=GroupRates(20.0, 20.0, 5e-5, ("a",)),
                   world=far, peers=far)


@functools.lru_cache(maxsize=None)
def _searched(between_nodes_gbps: float) -> Plan:
    torch.manual_seed(0)
    return elixir_ray.plan(Toy(), (batches(1, 8)[0][: 8 // WORLD],), device_memory="1GiB", world_size=WORLD,
                           hardware=RATES, dtype=torch.float32, host_memory="1GiB",
                           network=_network(between_nodes_gbps))


def _modes(run: str, n: int) -> list[str]:
    if run != "mixed":
        return [run] * n
    return [("node_sharded", "sharded", "replicated")[i % 3] for i in range(n)]


def _rank_main(rank: int, store: str, out: str, searched: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD)
    results = {"network": measure_collectives([0, 0, 1, 1], torch.device("cpu"), 2**14)}
    for run, node_of_rank in RUNS.items():
        torch.manual_seed(0)
        model = Toy()
        data = batches(STEPS * ACCUM, 8)
        sample = (data[0][: 8 // WORLD],)
        n = manual_plan(model, sample, chunk_size=512, n_blocks=1, world_size=WORLD).n_chunks
        modes = _modes(run, n)
        plan = Plan.from_json(searched) if run == "searched" else manual_plan(
            model, sample, chunk_size=512, n_blocks=3, world_size=WORLD,
            placements=["host" if i % 2 else "device" for i in range(n)],
            sharded=[m != "replicated" for m in modes], node_sharded=[m == "node_sharded" for m in modes],
            node_of_rank=node_of_rank)
        wrapped, opt = wrap(model, torch.optim.AdamW(param_groups(model), lr=1e-2), sample_inputs=sample, plan=plan,
                            max_grad_norm=MAX_NORM, device="cpu")
        losses = engine_run(wrapped, opt, data, STEPS, ACCUM, rank=rank, world=WORLD)
        state, optim = wrapped.state_dict(), opt.state_dict()  # collectives: every rank gathers
        shard = engine_shard(wrapped, opt)
        shards = [None] * WORLD
        dist.all_gather_object(shards, shard)
        results[run] = {"losses": losses, "state": state, "optim": optim, "modes": wrapped.plan.sharding,
                        "shard_keys": sorted(k for k in shard if k.startswith("chunk/")),
                        "joined": assemble(shards, layout_of(wrapped)), "layout": layout_of(wrapped)}
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((torch.as_tensor(a[k]).float() - torch.as_tensor(b[k]).float()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of the 4 ranks measured and trained."""
    tmp = tmp_path_factory.mktemp("nodes")
    out = str(tmp / "rank")
    searched = _searched(between_nodes_gbps=0.001).to_json()
    spawn_ranks(_rank_main, (store_url(str(tmp)), out, searched), WORLD)
    return [torch.load(f"{out}.{r}", weights_only=False) for r in range(WORLD)]


@pytest.mark.slow
def test_the_ranks_time_collectives_within_a_node_across_all_ranks_and_between_nodes(ranks):
    from elixir_ray.planner.network import Network

    for rank in ranks:
        assert set(rank["network"]) == {"node", "world", "peers"}
        for rates in rank["network"].values():
            assert rates["all_gather_gbps"] > 0 and rates["reduce_scatter_gbps"] > 0 and rates["latency_s"] > 0
    net = Network.from_ranks([0, 0, 1, 1], ["a", "b"], [r["network"] for r in ranks])
    assert net.node.nodes in (("a",), ("b",)) and net.world.nodes == ("a", "b") and net.peers.nodes == ("a", "b")


@pytest.mark.slow
def test_each_way_of_holding_chunks_on_two_nodes_trains_as_one_process(ranks):
    torch.manual_seed(0)
    base = Toy()
    ref_losses, ref_state, ref_optim = reference_run(base, batches(STEPS * ACCUM, 8), STEPS, ACCUM, MAX_NORM,
                                                     with_optimizer=True)
    for run, node_of_rank in RUNS.items():
        result = ranks[0][run]
        if run != "searched":
            assert set(result["modes"]) == ({"node_sharded", "sharded", "replicated"} if run == "mixed" else {run})
        assert max(abs(a - b) for a, b in zip(result["losses"], ref_losses)) <= 1e-5, run
        assert _max_diff(result["state"], ref_state) <= 1e-5, run
        for i, entry in ref_optim["state"].items():
            assert _max_diff(result["optim"]["state"][i], entry) <= 1e-5, run
        # a checkpoint's join of the ranks' shards: the same weights and moments
        joined = result["joined"]
        assert _max_diff({k: joined[f"model/{k}"] for k in ref_state}, ref_state) <= 1e-5, run
        # a node-sharded chunk's shards come from the ranks of rank 0's node only, one per local rank
        node_chunks = [i for i, m in enumerate(result["modes"]) if m == "node_sharded"]
        first_node = [r for r in range(WORLD) if node_of_rank[r] == node_of_rank[0]]
        for i in node_chunks:
            assert result["layout"]["chunks"][i]["shard_ranks"] == first_node
            holders = [r for r in range(WORLD) if f"chunk/{i}/master" in ranks[r][run]["shard_keys"]]
            assert holders == first_node, run
        for r in range(WORLD):  # every rank joins the same tensors
            assert _max_diff(ranks[r][run]["joined"], joined) == 0.0


@pytest.mark.slow
def test_a_slow_network_between_nodes_shards_chunks_within_each_node_and_says_why(ranks):
    """The acceptance of hierarchical sharding: at 1 MB/s between the nodes (20 GB/s within) the
    search shards chunks within each node, explain() says why, and the plan trained above (test
    before) is the one searched: it trains as one process does."""
    plan = _searched(between_nodes_gbps=0.001)
    assert "node_sharded" in plan.sharding and plan.node_of_rank == [0, 0, 1, 1]
    assert ranks[0]["searched"]["modes"] == plan.sharding
    text = plan.explain()
    assert "sharding: " in text and "N within each node" in text
    why = next(line for line in text.splitlines() if "note: sharded within each node:" in line)
    assert "gathered within the node (all-gather 20 GB/s)" in why and "(0.001 GB/s)" in why, why
    assert "sharded so instead, the step is predicted at" in why
    assert "collectives between nodes: all-gather 0.001 GB/s" in text and "measured on a-b" in text


def test_a_fast_network_between_nodes_shards_no_chunk_within_a_node():
    plan = _searched(between_nodes_gbps=20.0)
    assert "node_sharded" not in plan.sharding and not plan.node_sharded
    assert "sharding within each node (replicated across the 2 nodes) was searched too" in plan.explain()


def test_a_plan_whose_node_sharding_cannot_run_is_refused_before_the_module_changes():
    torch.manual_seed(0)
    sample = (batches(1, 8)[0],)
    model = Toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n = manual_plan(model, sample, chunk_size=512, n_blocks=1).n_chunks
    cases = [(dict(sharded=False, node_sharded=True), "does not shard them"),
             (dict(node_sharded=[True] * (n + 1)), f"node_sharded lists {n + 1} chunks"),
             (dict(node_of_rank=[0, 1]), r"node_of_rank must give each of the 1 rank\(s\) a node")]
    for kwargs, said in cases:
        plan = manual_plan(model, sample, chunk_size=512, n_blocks=3, **kwargs)
        with pytest.raises(ValueError, match=said):
            wrap(model, torch.optim.AdamW(model.parameters()), sample_inputs=sample, plan=plan, device="cpu")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
