"""The driver side of a run, as an explicit state machine.

    PLACING -> RENDEZVOUS -> PROFILING -> PLANNING -> TRAINING -> CHECKPOINTING -> FINISHED
                                  (any state) -> ERRORED

Each state is one method; `run()` walks them in order and records every transition, so a failure
says which phase broke and the restart policy of the fault-tolerance issue can hook in here.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from ray.util.placement_group import remove_placement_group

from elixir_ray.cluster.placement import WorkerShape, bundle_rank_order, create_placement_group
from elixir_ray.cluster.worker import TrainWorker
from elixir_ray.config import RunConfig
from elixir_ray.errors import ClusterError
from elixir_ray.plan import Plan, make_plan
from elixir_ray.profile import WorkerProfile

log = logging.getLogger("elixir_ray")


class RunState(enum.Enum):
    PLACING = "placing"
    RENDEZVOUS = "rendezvous"
    PROFILING = "profiling"
    PLANNING = "planning"
    TRAINING = "training"
    CHECKPOINTING = "checkpointing"
    FINISHED = "finished"
    ERRORED = "errored"


@dataclass
class Rendezvous:
    master_addr: str
    master_port: int
    backend: str


@dataclass
class ControllerOutcome:
    metrics: list[dict] = field(default_factory=list)
    plan: Optional[Plan] = None
    profiles: list[WorkerProfile] = field(default_factory=list)
    shards: dict = field(default_factory=dict)  # rank -> ObjectRef of that rank's state shard
    final_step: int = 0
    samples_consumed: int = 0
    transitions: list[tuple[str, float]] = field(default_factory=list)


class TrainController:
    def __init__(self, cfg: RunConfig, shape: WorkerShape,
                 on_metrics: Callable[[dict], None] = lambda m: None, poll_interval_s: float = 0.25):
        self.cfg, self.shape = cfg, shape
        self.on_metrics = on_metrics
        self.poll_interval_s = poll_interval_s
        self.state: Optional[RunState] = None
        self.workers: list = []
        self.pg = None
        self.outcome = ControllerOutcome()

    def _enter(self, state: RunState) -> None:
        self.state = state
        self.outcome.transitions.append((state.value, time.time()))
        log.info("run %s: %s", self.cfg.name, state.value)

    def run(self) -> ControllerOutcome:
        try:
            self._enter(RunState.PLACING)
            self._place()
            self._enter(RunState.RENDEZVOUS)
            self._rendezvous()
            self._enter(RunState.PROFILING)
            profiles = self._profile()
            self._enter(RunState.PLANNING)
            plan_ref = self._plan(profiles)
            self._enter(RunState.TRAINING)
            self._train(plan_ref)
            self._enter(RunState.CHECKPOINTING)
            self._collect_state()
            self._enter(RunState.FINISHED)
            return self.outcome
        except BaseException:
            self._enter(RunState.ERRORED)
            raise
        finally:
            self._teardown()

    # -- states -------------------------------------------------------------------------------

    def _place(self) -> None:
        self.pg = create_placement_group(self.shape, self.cfg.cluster.placement_timeout_s)
        order = bundle_rank_order(self.pg, ray.get_runtime_context().get_node_id())
        config = self.cfg.to_dict()
        for rank, bundle in enumerate(order):
            self.workers.append(TrainWorker.options(
                name=f"worker-{rank}", namespace=self.cfg.cluster.namespace,
                num_cpus=self.shape.cpus_per_worker, num_gpus=1 if self.shape.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
            ).remote(config, rank, self.shape.num_workers))

    def _rendezvous(self) -> Rendezvous:
        infos = self._get([w.node_info.remote() for w in self.workers], "reading worker node info")
        # Every rank on a node sees all of that node's GPUs; local rank = order within the node.
        by_node: dict[str, list[int]] = {}
        for rank, info in enumerate(infos):
            by_node.setdefault(info["node_id"], []).append(rank)
        calls = []
        for node, ranks in by_node.items():
            gpus = sorted({g for r in ranks for g in infos[r]["gpu_ids"]}, key=lambda g: int(g) if g.isdigit() else g)
            for local_rank, rank in enumerate(ranks):
                calls.append(self.workers[rank].set_devices.remote(gpus, local_rank))
        self._get(calls, "setting devices")
        single_node = len(by_node) == 1
        master_addr = "127.0.0.1" if single_node else infos[0]["node_ip"]
        last_error = None
        for _attempt in range(3):  # a free port can be taken between probe and bind: retry
            port = self._get([self.workers[0].free_port.remote(master_addr)], "probing a port")[0]
            rdv = Rendezvous(master_addr, port, self.shape.backend)
            try:
                self._get([w.init_process_group.remote(rdv.master_addr, rdv.master_port, rdv.backend,
                                                       self.cfg.cluster.init_timeout_s) for w in self.workers],
                          "initialising the process group", timeout=self.cfg.cluster.init_timeout_s + 30)
                return rdv
            except ClusterError as exc:
                last_error = exc
                log.warning("process group on %s:%d failed, retrying with another port: %s", master_addr, port, exc)
        raise ClusterError(f"could not form the process group after 3 ports: {last_error}")

    def _profile(self) -> list[WorkerProfile]:
        profiles = self._get([w.profile.remote() for w in self.workers], "profiling the workers")
        self.outcome.profiles = profiles
        return profiles

    def _plan(self, profiles: list[WorkerProfile]):
        plan = make_plan(self.cfg, profiles)
        self.outcome.plan = plan
        plan_ref = ray.put(plan)  # one copy in the object store, read by every worker
        self._get([w.setup.remote(plan_ref) for w in self.workers], "setting up the workers")
        return plan_ref

    def _train(self, plan_ref) -> None:
        del plan_ref
        runs = [w.run.remote(self.cfg.train.steps) for w in self.workers]
        pending = list(runs)
        while pending:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_interval_s)
            self._drain_metrics()
            for ref in runs:  # surface a failed rank at once rather than after the others hang
                if ref not in pending:
                    self._get([ref], "training")
        self.outcome.final_step = self._get(runs, "training")[0]
        self._drain_metrics()

    def _drain_metrics(self) -> None:
        for m in self._get([self.workers[0].poll.remote()], "polling metrics")[0]:
            self.outcome.metrics.append(m)
            self.on_metrics(m)

    def _collect_state(self) -> None:
        """Data parallel ranks hold identical state, so rank 0's shard is the whole of it."""
        ref = self.workers[0].state_shard.remote()
        shard = self._get([ref], "collecting the final state")[0]
        self.outcome.shards = {0: shard["tensors"]}
        self.outcome.samples_consumed = shard["samples_consumed"]

    # -- helpers ------------------------------------------------------------------------------

    def _get(self, refs: list, what: str, timeout: Optional[float] = None) -> list:
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise ClusterError(f"timed out after {timeout:g}s while {what}") from None
        except ray.exceptions.RayActorError as exc:
            raise ClusterError(f"a worker died while {what}: {exc}") from exc
        except ray.exceptions.RayTaskError as exc:
            raise ClusterError(f"a worker failed while {what}: {exc}") from exc

    def _teardown(self) -> None:
        for w in self.workers:
            try:
                ray.get(w.shutdown.remote(), timeout=10)
            except Exception:  # a dead or hung worker is killed below anyway
                pass
            ray.kill(w)
        self.workers = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None
