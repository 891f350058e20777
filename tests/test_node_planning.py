"""Plans for ranks on several nodes, from the ranks' own profiles (no cluster: `make_run_plan` is pure).

Each rank's profile is kept: the plan is costed with the slowest rank for each rate and names the
node that bounds its step; the collectives are charged at the rates the ranks measured within a
node, across all ranks and between nodes, and `explain()` shows them with the nodes measured.
"""

import dataclasses

import pytest

from elixir_ray.chunk_plan.plan import Plan
from elixir_ray.cluster.worker_profile import WorkerProfile
from elixir_ray.config import config_from_dict
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.network import GroupRates, Network
from elixir_ray.run_plan import make_run_plan, node_names

RATES = HardwareProfile(device="cpu", h2d_gbps=8.0, d2h_gbps=8.0, cpu_adam_params_per_s=2e9,
                        device_adam_params_per_s=2e9, matmul_tflops=0.5, cpu_threads=2)


def _rates(gather: float, reduce: float, latency: float = 5e-5) -> dict:
    return {"all_gather_gbps": gather, "reduce_scatter_gbps": reduce, "latency_s": latency}


def _profile(rank: int, node: str, hw: HardwareProfile = RATES, network: dict | None = None) -> WorkerProfile:
    return WorkerProfile(rank=rank, hostname="box", device="cpu", device_name="cpu", device_memory_total=2**34,
                         device_memory_free=2**33, cpu_threads=hw.cpu_threads, host_memory_free=2**33,
                         hardware=dataclasses.asdict(hw), node_id=node, network=network or {})


def _cfg(**engine):
    return config_from_dict({"model": {"size": "tiny"}, "train": {"micro_batch": 2},
                             "engine": {"time_kernels": False, "search_checkpointing": False, **engine}})


def test_nodes_are_told_apart_by_ray_node_id_and_named_by_host():
    ids = ["aaaaaaaaaa11", "aaaaaaaaaa11", "bbbbbbbbbb22", "bbbbbbbbbb22"]
    node_of_rank, names = node_names([_profile(r, n) for r, n in enumerate(ids)])
    assert node_of_rank == [0, 0, 1, 1]
    assert names == ["box/aaaaaaaa", "box/bbbbbbbb"]  # simulated nodes share the machine's host name
    other = dataclasses.replace(_profile(2, ids[2]), hostname="other")
    assert node_names([_profile(0, ids[0]), other])[1] == ["box", "other"]


def test_the_ranks_rates_combine_per_kind_of_group_at_the_slowest_with_its_nodes():
    measured = [{"world": _rates(2.0, 1.5), "node": _rates(20.0, 18.0, 1e-5), "peers": _rates(1.0, 0.9)},
                {"world": _rates(2.1, 1.6), "node": _rates(20.0, 18.0, 1e-5), "peers": _rates(1.1, 1.0)},
                {"world": _rates(2.0, 1.4), "node": _rates(9.0, 8.0, 2e-5), "peers": _rates(1.0, 0.9, 9e-5)},
                {"world": _rates(2.0, 1.5), "node": _rates(9.5, 8.0), "peers": _rates(1.1, 1.0)}]
    net = Network.from_ranks([0, 0, 1, 1], ["a", "b"], measured)
    assert (net.node.all_gather_gbps, net.node.reduce_scatter_gbps, net.node.nodes) == (9.0, 8.0, ("b",))
    assert net.node.latency_s == 5e-5  # the largest any rank of the kind measured
    assert net.world.reduce_scatter_gbps == 1.4 and net.world.nodes == ("a", "b")
    assert net.peers.nodes == ("a", "b") and net.peers.latency_s == 9e-5
    assert Network.from_dict(net.to_dict()) == net
    with pytest.raises(ValueError, match="node_of_rank must give each of the 4 rank"):
        Network.from_ranks([0, 1], ["a", "b"], measured)


def test_a_plan_for_mixed_nodes_is_costed_at_the_slowest_and_names_the_node_that_bounds_it():
    slow = dataclasses.replace(RATES, cpu_adam_params_per_s=2e8, matmul_tflops=0.05)  # node b: ten times slower
    network = {"world": _rates(5.0, 5.0), "node": _rates(20.0, 20.0), "peers": _rates(5.0, 5.0)}
    profiles = [_profile(0, "node-a", network=network), _profile(1, "node-a", network=network),
                _profile(2, "node-b", slow, network), _profile(3, "node-b", slow, network)]
    plan = make_run_plan(_cfg(device_memory="64MiB"), profiles)
    engine = Plan.from_dict(plan.engine)
    assert engine.node_of_rank == [0, 0, 1, 1]
    assert Plan.from_json(engine.to_json()) == engine  # the rates' nodes as JSON keeps them
    assert engine.hardware["cpu_adam_params_per_s"] == 2e8 and engine.hardware["matmul_tflops"] == 0.05  # node b's
    text = engine.explain()
    assert "the step is bound by compute" in text, text
    assert "at node box/node-b's rate, the slowest of the ranks'" in text
    # the collectives' rates, with the nodes they were measured on
    assert "collectives within a node: all-gather 20 GB/s" in text and "(measured on box/node-a)" in text
    assert "collectives between nodes: all-gather 5 GB/s" in text and "(measured on box/node-a-box/node-b)" in text
    # on one node there is no node to name
    one = make_run_plan(_cfg(device_memory="64MiB"), [_profile(0, "n"), _profile(1, "n", slow)])
    assert "the step is bound by" not in Plan.from_dict(one.engine).explain()
    alike = make_run_plan(_cfg(device_memory="64MiB"), [_profile(r, "a" if r < 2 else "b") for r in range(4)])
    assert "the step is bound by compute" in Plan.from_dict(alike.engine).explain()
    assert "at a rate every node measured alike" in Plan.from_dict(alike.engine).explain()


def test_collectives_are_charged_at_the_measured_rates_and_latency():
    """A slower network between the ranks predicts a slower step, and rates not measured are charged
    as before (`collective_gbps`, else the host-to-device rate, no latency)."""
    profiles = [_profile(r, "a" if r < 2 else "b") for r in range(4)]
    unmeasured = Plan.from_dict(make_run_plan(_cfg(device_memory="64MiB", replicate="none"), profiles).engine)
    assert unmeasured.network["world"] is None and "collectives" not in unmeasured.explain()
    slow = [dataclasses.replace(p, network={"world": _rates(0.01, 0.01, 1e-3)}) for p in profiles]
    costed = Plan.from_dict(make_run_plan(_cfg(device_memory="64MiB", replicate="none"), slow).engine)
    assert costed.time["all-gather"] > 10 * unmeasured.time["all-gather"]
    assert costed.time["gradient reduce"] > 10 * unmeasured.time["gradient reduce"]
    assert costed.predicted_step_seconds > unmeasured.predicted_step_seconds
    assert "collectives across all ranks: all-gather 0.01 GB/s" in costed.explain()
    with pytest.raises(ValueError, match="all_gather_gbps must be a positive number"):
        GroupRates(0.0, 1.0)
