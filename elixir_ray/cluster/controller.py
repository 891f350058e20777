"""The driver side of a run, as an explicit state machine.

    PLACING -> RENDEZVOUS -> PROFILING -> PLANNING -> RESTORING -> TRAINING -> FINISHED
       ^                                                               |
       +------------------------ RESTARTING <--------------------------+  (a rank died, raised or stalled)
                                                          (any state) -> ERRORED
                                                          (any state) -> STOPPED  (a stop was requested)

Each state is one method that does its work and returns the next state with the reason for it;
`run()` loops over them until FINISHED, and `_set_state` is the only place the state changes, so
every transition is recorded with its time and reason. A `WorkerGroupFailure` in any state goes
to the restart policy, which picks RESTARTING or ends the run. The ranks themselves are a
`WorkerGroup` (`worker_group.py`): placed, joined, called, watched and killed as one.

Training runs in segments that end at checkpoint steps: a snapshot of the state goes to the
object store (owned by the driver) and is persisted in the background, or, for a state too large
for the object store (`checkpoint.via`), every worker writes its shard straight to durable storage
while training waits. On a worker-group failure the group is killed, not drained, re-formed
(fewer workers if `fault.elastic` allows), restored from the newest snapshot (object store first,
durable storage when those objects are gone or were never made), and continues.

A stop (`request_stop`: `run.stop()`, a Ray Tune scheduler's decision) ends training after the
step the ranks agree on, persists a checkpoint of that step, and kills the group: STOPPED. In a
state before training it ends the run at the next state boundary.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

import ray

from elixir_ray import storage
from elixir_ray.checkpoint import CheckpointError, check_compatible, load_first_valid, load_newest_valid
from elixir_ray.checkpoint.shards import SHARDS_FORMAT
from elixir_ray.checkpoint.store import STATE_BYTES_PER_PARAM, abort_checkpoint, begin_checkpoint, commit_checkpoint
from elixir_ray.cluster.failure import Decision, FailureKind, RestartPolicy, WorkerGroupFailure, step_against_timeout
from elixir_ray.cluster.cpu_shares import give_ranks_their_threads
from elixir_ray.cluster.elastic import grows_back, minimum_workers, workers_after_loss
from elixir_ray.cluster.placement import PlacementTimeoutError, WorkerShape, cpu_thread_hint, workers_that_fit
from elixir_ray.cluster.plan_cache import CachedPlan, PlanCache, node_kind, plan_key
from elixir_ray.cluster.shard_parts import all_refs, call_snapshot, chunk_count, with_keys
from elixir_ray.cluster.shared_storage import check_workers_see_storage
from elixir_ray.cluster.snapshots import CheckpointPersister, Snapshot
from elixir_ray.cluster.worker_group import GivenPlacement, WorkerGroup
from elixir_ray.cluster.worker_profile import WorkerProfile
from elixir_ray.config import RunConfig
from elixir_ray.data.dataset import data_tokenizer
from elixir_ray.errors import ClusterError, nothing_left_to_train
from elixir_ray.run_plan import RunPlan, device_budget, make_run_plan, split_global_batch
from elixir_ray.trainer import schedule_steps

log = logging.getLogger("elixir_ray")

# The slowest a rank is granted for copying its training state out at a snapshot (12 bytes per
# parameter: fp32 weights and two AdamW moments), on top of fault.detect_timeout_s: a large model's
# copy-out is minutes of work, not a stall.
SNAPSHOT_BYTES_PER_S = 256 * 2**20
# checkpoint.via=auto snapshots through the object store while the state is at most this share of
# the driver node's object store: beyond it, the snapshot would spill to disk or fail to fit
OBJECT_STORE_SHARE = 0.5
WRITE_POLL_S = 1.0  # how often the driver asks the ranks how far their checkpoint write has got
WRITES_END_TIMEOUT_S = 10.0  # after a failed write, how long killed ranks' writes get to end before it is removed


class RunState(enum.Enum):
    PLACING = "placing"  # reserving the workers' bundles and starting one actor per rank
    RENDEZVOUS = "rendezvous"  # showing each rank its devices and forming the process group
    PROFILING = "profiling"  # every rank measures its hardware and links (again on other nodes after a restart)
    PLANNING = "planning"  # the driver searches the plan; every rank builds its engine from it
    RESTORING = "restoring"  # the ranks load the newest snapshot or checkpoint (or start from scratch)
    TRAINING = "training"  # segments of steps, each ending in a snapshot or checkpoint
    RESTARTING = "restarting"  # the group was killed after a failure: waiting for workers to place again
    FINISHED = "finished"  # trained train.steps, the last checkpoint persisted
    STOPPED = "stopped"  # stopped on request before train.steps, a checkpoint of the step reached persisted
    ERRORED = "errored"  # the run ended with an error


class NextState(NamedTuple):
    """What a state method returns: the state to enter and why."""

    state: RunState
    reason: str


class Transition(NamedTuple):
    """One recorded change of state: its value, when (time.time()), and why."""

    state: str
    at: float
    reason: str


@dataclass
class RestartRecord:
    """One recovery, for the run's result and the recovery-time benchmark."""

    reason: str
    failed_at: float  # when the driver noticed
    failed_step: int  # the driver's step when it failed: where the segment under way started
    world_size: int = 0
    restored_from: str = ""  # "object_store", "durable", or "scratch"
    restored_step: int = 0
    resumed_at: Optional[float] = None  # when the first step after the restore completed


@dataclass
class Placement:
    """One group of ranks as placed: from which step, each rank's node and CPU threads."""

    step: int
    node_ids: list[str]
    threads: list[int]


@dataclass
class RestoreRecord:
    """One restore: the step and where from, onto how many ranks, and the bytes each rank read of the
    state (object-store parts fetched, or checkpoint bytes read) beside the state's whole size."""

    step: int
    source: str  # "object_store", "durable"
    world_size: int
    read_bytes: list[int]
    state_bytes: int


@dataclass
class RestoreSource:
    """Where the first try starts from (`--resume`)."""

    uri: str


@dataclass
class ControllerOutcome:
    metrics: list[dict] = field(default_factory=list)
    plan: Optional[RunPlan] = None
    profiles: list[WorkerProfile] = field(default_factory=list)
    final_step: int = 0
    checkpoint_step: Optional[int] = None  # the step of checkpoint_uri
    checkpoint_uri: Optional[str] = None
    persist_errors: list[str] = field(default_factory=list)
    restarts: list[RestartRecord] = field(default_factory=list)
    snapshot_stalls: list[float] = field(default_factory=list)  # seconds training paused per snapshot
    checkpoint_via: str = ""  # "object_store" or "storage": how the checkpoints left the workers
    start_step: int = 0  # the step this run started from (a --resume checkpoint's; 0 for a new run)
    transitions: list[Transition] = field(default_factory=list)
    placements: list[Placement] = field(default_factory=list)  # every group placed, the first one's first
    restores: list[RestoreRecord] = field(default_factory=list)  # every restore (not a start from scratch)
    plans: list[RunPlan] = field(default_factory=list)  # every plan trained with, `plan` (the last) last
    stopped: bool = False  # ended by a stop request, before train.steps


class TrainController:
    """Runs one training run on the Ray cluster the driver is connected to.

    `worker_group_cls` is the class that places and watches the ranks (a subclass injects faults);
    `placement` gives it bundles of a placement group reserved elsewhere (a Ray Tune trial's)
    instead of reserving its own. `stop_requested`, once set (by this driver's other threads),
    stops the run as `request_stop` does; `on_checkpoint(step, uri)` hears of each checkpoint
    committed, from the thread that committed it."""

    def __init__(self, cfg: RunConfig, shape: WorkerShape, *, on_metrics: Callable[[dict], None] = lambda m: None,
                 on_note: Callable[[str], None] = lambda text: None, resume: Optional[RestoreSource] = None,
                 poll_interval_s: float = 0.2, worker_group_cls: type[WorkerGroup] = WorkerGroup,
                 placement: Optional[GivenPlacement] = None, stop_requested: Optional[threading.Event] = None,
                 on_checkpoint: Callable[[int, str], None] = lambda step, uri: None,
                 plan_cache: Optional[PlanCache] = None):
        self.cfg, self.shape = cfg, shape
        self.on_metrics = on_metrics
        self.on_checkpoint = on_checkpoint
        self.stop_requested = stop_requested if stop_requested is not None else threading.Event()
        self.plan_cache = plan_cache  # profiles and plans shared by the runs of a sweep, or None
        self._plan_key: Optional[str] = None  # the first try's key in plan_cache, once its group has formed
        self._holds_lease = False  # this run measures for plan_cache's key, and others wait for its entry
        self._cached: Optional[CachedPlan] = None  # profiles and plan read from plan_cache
        self._planned_from: Optional[list] = None  # the profiles outcome.plan was searched from
        self._stop_sent = False  # the ranks of the try under way were asked to stop
        self.on_note = on_note  # what the user should see besides steps (a checkpoint that takes a while)
        self.resume = resume
        self.poll_interval_s = poll_interval_s
        self.worker_group_cls, self.placement = worker_group_cls, placement
        self._beats = 0  # rank 0's count of work within steps, as of the last poll
        self.policy = RestartPolicy(cfg.fault.max_restarts)
        self.failures: list[WorkerGroupFailure] = []  # every failure that was restarted, oldest first
        self.global_batch = cfg.train.micro_batch * cfg.train.grad_accum * shape.num_workers
        self.full_workers = shape.num_workers  # the most the run has; an elastic run grows back to them
        self._growing = False  # the group was ended at a checkpoint to place the full group again
        self.tokenizer = data_tokenizer(cfg.data.path)  # kept in checkpoints: a resume on other tokens is refused
        self.checkpoint_uri = cfg.checkpoint_uri
        self.state: Optional[RunState] = None
        self.group: Optional[WorkerGroup] = None  # the ranks of the try under way
        self.step = 0  # the last step completed by the whole group
        self.snapshots: list[Snapshot] = []  # newest last; older ones are dropped to free the store
        self.outcome = ControllerOutcome()
        self.persister: Optional[CheckpointPersister] = None
        self._thread_hint: Optional[str] = None  # the CPU-thread warning of the profiling round, if any

    # -- the loop ------------------------------------------------------------------------------

    def request_stop(self) -> None:
        """End the run after the step the ranks agree on, with a checkpoint of it; safe from any thread."""
        self.stop_requested.set()

    def run(self) -> ControllerOutcome:
        self.persister = CheckpointPersister(self.checkpoint_uri, self.cfg.checkpoint.keep,
                                             on_commit=self.on_checkpoint)
        try:
            self._set_state(RunState.PLACING, "the run starts")
            while self.state not in (RunState.FINISHED, RunState.STOPPED):
                self._set_state(*self._step())
            self.outcome.stopped = self.state is RunState.STOPPED
            return self.outcome
        except BaseException as exc:
            self._set_state(RunState.ERRORED, f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
            raise
        finally:
            self._kill_group()
            self._release_lease()
            self.persister.close()
            self.snapshots = []  # the run is over: its states leave the object store now, not at the next gc
            self.outcome.checkpoint_uri = self.persister.newest
            self.outcome.checkpoint_step = self.persister.committed[-1][0] if self.persister.committed else None
            self.outcome.persist_errors = list(self.persister.errors)

    def _set_state(self, state: RunState, reason: str) -> None:
        """The only place the state changes: every transition is recorded and logged."""
        self.state = state
        self.outcome.transitions.append(Transition(state.value, time.time(), reason))
        log.info("run %s: %s (%s)", self.cfg.name, state.value, reason)

    def _step(self) -> NextState:
        """Run the current state. A worker-group failure in any of them goes to the restart policy,
        unless a stop was requested: then the run stops with the checkpoints it has."""
        handlers = {RunState.PLACING: self._place, RunState.RENDEZVOUS: self._rendezvous,
                    RunState.PROFILING: self._profile, RunState.PLANNING: self._plan,
                    RunState.RESTORING: self._restore, RunState.TRAINING: self._train,
                    RunState.RESTARTING: self._restart}
        if self.stop_requested.is_set() and self.state is not RunState.TRAINING:
            return NextState(RunState.STOPPED, f"stop requested while {self.state.value}; the newest checkpoint "
                                               f"is {self._newest_step_said()}")
        try:
            return handlers[self.state]()
        except WorkerGroupFailure as failure:
            if self.stop_requested.is_set():
                self._kill_group()
                return NextState(RunState.STOPPED, f"stop requested, and then {failure}; the newest checkpoint is "
                                                   f"{self._newest_step_said()}")
            return self._recover_or_raise(failure)

    def _newest_step_said(self) -> str:
        committed = self.persister.committed if self.persister else []
        return f"step {committed[-1][0]}" if committed else "none of this run's"

    def _recover_or_raise(self, failure: WorkerGroupFailure) -> NextState:
        """Kill the group and ask the policy: RESTARTING, or a `ClusterError` that ends the run."""
        log.warning("worker group failed: %s", failure)
        self._kill_group()
        reached = self.outcome.metrics[-1]["step"] if self.outcome.metrics else self.step  # the last step trained
        if failure.step is None:
            failure.step = reached
        decision = self.policy.decide(failure, self.failures)
        if decision is Decision.FAIL_REPEATED:
            raise ClusterError(f"{failure}; the same error was raised after step {failure.step} before the last "
                               f"restart too, so another restart would fail the same way: giving up after "
                               f"{len(self.outcome.restarts)} restart(s); fix its cause before resuming") from failure
        if decision is Decision.FAIL:
            raise ClusterError(f"{failure}; giving up after {len(self.outcome.restarts)} restart(s) "
                               f"(fault.max_restarts={self.cfg.fault.max_restarts})") from failure
        # kept for the policy's comparisons (phase, kind, error, step) only: its traceback and the
        # exceptions chained to it would keep the failed phase's frames alive for the rest of the run,
        # and with them object refs in their locals (a snapshot's shards, a restore's whole state)
        failure.__traceback__ = failure.__cause__ = failure.__context__ = None
        self.failures.append(failure)
        self.outcome.restarts.append(RestartRecord(reason=str(failure), failed_at=time.time(), failed_step=self.step))
        self.on_note(f"step {reached}: {failure}; restarting (restart {len(self.outcome.restarts)} of "
                     f"{self.cfg.fault.max_restarts}), waiting up to {self.cfg.fault.wait_for_resources_s:g}s for "
                     f"{self.full_workers} worker(s)")
        return NextState(RunState.RESTARTING, str(failure))

    # -- states --------------------------------------------------------------------------------

    def _place(self) -> NextState:
        self.group = self.worker_group_cls(self.cfg, self.shape, placement=self.placement)
        try:
            self.group.place(first_try=not self.outcome.restarts)
        except PlacementTimeoutError as exc:
            if not self.outcome.restarts:  # nothing failed: the cluster is busy (another run holds them)
                raise
            raise WorkerGroupFailure("placing workers", str(exc)) from exc
        return NextState(RunState.RENDEZVOUS, f"{self.group.world_size} worker(s) placed")

    def _rendezvous(self) -> NextState:
        self.group.rendezvous()
        threads = give_ranks_their_threads(self.group, self.shape)
        check_workers_see_storage(self.group, self.cfg)
        self.outcome.placements.append(Placement(self.step, list(self.group.node_ids), threads))
        if [p.node_id for p in self.outcome.profiles] == self.group.node_ids:
            # a restart onto the same nodes, rank for rank: their rates and links are the ones measured
            return NextState(RunState.PLANNING, "process group formed on the profiled nodes; their profiles are reused")
        if self.outcome.restarts:  # a restart onto other nodes measures them
            return NextState(RunState.PROFILING, "process group formed")
        self._cached = self._cached_plan()
        if self._cached is not None:
            self.outcome.profiles = list(self._cached.profiles)
            where = f"{self._cached.uri} (measured by the run {self._cached.source!r})"
            reused = ("profiles and plan" if self._plan_found_before() is not None
                      else "profiles (not the plan: another budget)")
            log.info("%s reused from %s: no profiling round", reused, where)
            self.on_note(f"{reused} reused from {where}: no profiling round")
            return NextState(RunState.PLANNING, f"process group formed; {reused} reused from {where}")
        return NextState(RunState.PROFILING, "process group formed")

    def _cached_plan(self) -> Optional[CachedPlan]:
        """The profiles and plan of an earlier run of this shape from `plan_cache`, waiting for a run
        that is measuring them now; None when this run is to measure (it then writes the entry)."""
        if self.plan_cache is None:
            return None
        nodes = {info["NodeID"]: info.get("Resources", {}) for info in ray.nodes() if info.get("Alive")}
        kinds = [node_kind(nodes.get(node, {})) for node, count in self.group.workers_per_node.items()
                 for _ in range(count)]
        key = self._plan_key = plan_key(self.cfg, self.shape.num_workers, self.global_batch, kinds)
        found = self.plan_cache.get(key)
        if found is not None:
            return found
        if self.plan_cache.take_lease(key, self.cfg.name):
            self._holds_lease = True
            return None
        self.on_note(f"another run of this shape is measuring its profiles; waiting for its plan in "
                     f"{self.plan_cache.entry_uri(key)}")
        found = self.plan_cache.wait_for(key)
        if found is None:
            self._holds_lease = self.plan_cache.take_lease(key, self.cfg.name)
        return found

    def _plan_found_before(self) -> Optional[RunPlan]:
        """A plan searched from what this search would take (the same profiles, world size, global
        batch and budget), which the search would only find again: a restart onto the ranks' own
        nodes keeps its plan, and a run takes the plan cache's plan when its budget is the one that
        plan was searched for (a resumed sweep keeps its trials' budget while it still fits)."""
        if self.outcome.restarts:
            plan = self.outcome.plan if self.outcome.profiles is self._planned_from else None
        else:
            plan = self._cached.plan if self._cached is not None else None
        if plan is None or plan.world_size != self.shape.num_workers:
            return None
        return plan if plan.device_memory_bytes == device_budget(self.cfg, self.outcome.profiles) else None

    def _release_lease(self) -> None:
        if self._holds_lease and self.plan_cache is not None and self._plan_key is not None:
            self.plan_cache.release(self._plan_key)
        self._holds_lease = False

    def _restart(self) -> NextState:
        """Wait for the workers' resources; with fault.elastic, go on with as many as fit."""
        before = self.shape.num_workers
        self.shape = self._wait_for_workers()
        self.outcome.restarts[-1].world_size = self.shape.num_workers
        if self.shape.num_workers != before:
            self._warn_dropout_streams(before)
        return NextState(RunState.PLACING, f"restart {len(self.outcome.restarts)} on {self.shape.num_workers} "
                                           f"worker(s)")

    def _profile(self) -> NextState:
        # the minute or so before the first step is said, so that it does not read as a hang
        self.on_note(f"profiling {self.group.world_size} worker(s): copy, AdamW and matmul rates, and the "
                     f"model's kernels on the device")
        micro, _ = split_global_batch(self.global_batch, self.shape.num_workers, self.cfg.train.micro_batch)
        self.outcome.profiles = self.group.get_watched(self.group.call("profile", micro), "profiling the workers")
        nodes = [info for info in ray.nodes() if info.get("Alive")]
        hint = cpu_thread_hint(self.shape, self.group.workers_per_node,
                               {info["NodeID"]: float(info.get("Resources", {}).get("CPU", 0)) for info in nodes},
                               {info["NodeID"]: float(info.get("Resources", {}).get("GPU", 0)) for info in nodes})
        if hint:
            log.warning(hint)
        self._thread_hint = hint
        return NextState(RunState.PLANNING, f"{len(self.outcome.profiles)} profile(s)")

    def _plan(self) -> NextState:
        plan = self._plan_found_before()
        if plan is not None:
            log.info("the plan for %d worker(s) searched before from the same profiles, budget and batch is kept",
                     plan.world_size)
        else:
            self.on_note(f"searching the plan for {self.group.world_size} worker(s)")
            searched = time.monotonic()
            try:
                plan = make_run_plan(self.cfg, self.outcome.profiles, global_batch=self.global_batch)
            except ValueError as exc:
                raise ClusterError(f"cannot plan for {self.shape.num_workers} worker(s): {exc}") from None
            log.info("plan for %d worker(s) searched in %.1fs", plan.world_size, time.monotonic() - searched)
            if self._thread_hint:  # plan.json keeps it: the plan was searched at the CPU AdamW rate of those few threads
                plan.notes.append(self._thread_hint)
            if self._holds_lease:
                self.plan_cache.put(self._plan_key, self.outcome.profiles, plan, self.cfg.name)
                self._release_lease()
        self._planned_from = self.outcome.profiles
        # a restart with fewer workers keeps the global batch: more micro-steps each, a longer step
        before = self.outcome.plan
        where = (f" for {plan.world_size} worker(s) after a restart (before it, {before.world_size})"
                 if before is not None and before.world_size != plan.world_size else "")
        error, warning = step_against_timeout(plan.predicted_step_seconds, self.cfg.fault.detect_timeout_s, where)
        if error:
            raise ClusterError(error)
        if warning and (before is None or where):  # not again at each restart onto as many workers
            log.warning(warning)
        self.outcome.plan = plan
        self.outcome.plans.append(plan)
        self.outcome.checkpoint_via = self._checkpoint_via()
        plan_ref = ray.put(plan)  # one copy in the object store, read by every worker
        self.group.get_watched(self.group.call("setup", plan_ref), "setting up the workers")
        return NextState(RunState.RESTORING, f"planned for {plan.world_size} worker(s), checkpoints via "
                                             f"{self.outcome.checkpoint_via}")

    def _checkpoint_via(self) -> str:
        """`checkpoint.via`, with `auto` resolved from the state's size and the object store's; a
        worker-written checkpoint needs storage every worker shares with the driver."""
        via, state = self.cfg.checkpoint.via, self._state_bytes()
        if via == "auto":
            capacity = self._object_store_bytes()
            via = "storage" if capacity and state > OBJECT_STORE_SHARE * capacity else "object_store"
            log.info("checkpoints via %s: the training state is %.2f GiB, the object store %.2f GiB",
                     via.replace("_", " "), state / 2**30, capacity / 2**30)
        if via == "storage" and not self._workers_write_to(self.checkpoint_uri):
            if self.cfg.checkpoint.via == "auto":
                log.warning("the training state (%.2f GiB) is large for the object store, but the workers on other "
                            "nodes do not see %s to write their shards there: snapshots go through the object "
                            "store (set checkpoint.uri to shared storage to have the workers write them)",
                            state / 2**30, self.checkpoint_uri)
                return "object_store"
            raise ClusterError(
                f"checkpoint.via=storage: the workers on other nodes do not see {self.checkpoint_uri!r}, so they "
                f"cannot write their shards there; set checkpoint.uri to a filesystem every node mounts or to an "
                f"object store URI (s3://..., gs://...), or set checkpoint.via=object_store")
        return via

    def _state_bytes(self) -> int:
        """The training state the ranks hand over at a checkpoint, all together (each sharded chunk's
        shards, and each replicated chunk once: only rank 0 hands those over)."""
        engine = (self.outcome.plan.engine if self.outcome.plan else None) or {}
        numels = engine.get("chunk_numels") or [engine.get("chunk_size", 0)] * len(engine.get("placements", []))
        return STATE_BYTES_PER_PARAM * sum(numels)

    def _object_store_bytes(self) -> float:
        """The driver node's object store capacity (where a one-node run's snapshot lives, and where
        every snapshot is copied on a cluster)."""
        node = ray.get_runtime_context().get_node_id()
        for info in ray.nodes():
            if info.get("NodeID") == node and info.get("Alive"):
                return float(info.get("Resources", {}).get("object_store_memory", 0))
        return float(ray.cluster_resources().get("object_store_memory", 0))

    def _workers_write_to(self, uri: str) -> bool:
        """Whether every worker writes to `uri` where the driver reads: an object store URI always; a
        local path when every worker finds a file the driver just made there (workers on the driver's
        node may still be in containers of their own)."""
        path = storage.local_path(uri)
        if path is None:
            return True
        probe = os.path.join(path, f".elixir_ray-probe-{os.getpid()}-{time.time_ns()}")
        try:
            os.makedirs(path, exist_ok=True)
            open(probe, "x").close()
        except OSError:  # not even the driver can write there: the checkpoint's write will say why
            return True
        try:
            return all(self.group.get_watched(self.group.call("sees_file", probe), "checking the checkpoint path"))
        finally:
            os.remove(probe)

    def _newest_own_checkpoint(self) -> Optional[tuple[str, dict, dict]]:
        """The newest valid checkpoint this run persisted; never one an earlier run of the same name
        left in the same directory (a fresh run that fails before its first checkpoint starts over)."""
        return load_first_valid(path for _, path in reversed(list(self.persister.committed if self.persister else [])))

    def _workers_read(self, checkpoint: str) -> bool:
        """Whether every worker reads the checkpoint at `checkpoint` as the driver does: an object
        store URI always; a local path when each finds there the manifest the driver read."""
        path = storage.local_path(checkpoint)
        if path is None:
            return True
        manifest = os.path.join(path, "manifest.json")
        try:
            with open(manifest, "rb") as f:
                mine = hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return False
        return all(d == mine for d in self.group.get_watched(self.group.call("file_digest", manifest),
                                                             "checking the checkpoint path"))

    def _note_resume(self, path: str, manifest: dict) -> None:
        """Say where a resumed run starts, and warn when its global batch is not the checkpoint's: the
        run then goes on differently from how the checkpoint's run would have (another data order per
        step, another gradient noise), which a change of worker count does silently."""
        self.on_note(f"resuming from {path} (step {manifest['step']})")
        train, world = (manifest.get("config") or {}).get("train") or {}, manifest.get("world_size")
        if "seed" in train and train["seed"] != self.cfg.train.seed:
            log.warning(f"--resume: the checkpoint's run had train.seed={train['seed']}, this run has "
                        f"{self.cfg.train.seed}: the data order from here on is another run's; to continue it "
                        f"exactly, set train.seed={train['seed']}")
        if isinstance(world, int) and world != self.shape.num_workers:
            self._warn_dropout_streams(world)
        if not (isinstance(world, int) and "micro_batch" in train):
            return
        # kept whole across an elastic restart (the plan's grad_accum grows), so the config's product
        # on the workers left is not it: the manifest says it (older ones did not)
        product = train["micro_batch"] * train.get("grad_accum", 1) * world
        theirs = manifest.get("global_batch") or product
        if theirs != self.global_batch:
            how = (f"{world} worker(s) x micro-batch {train['micro_batch']} x grad_accum {train.get('grad_accum', 1)}"
                   if theirs == product else
                   f"its config's micro-batch {train['micro_batch']} x grad_accum {train.get('grad_accum', 1)} over "
                   f"the workers it started on, {world} at the end")
            message = (f"--resume: the checkpoint's run had a global batch of {theirs} ({how}), this run has "
                       f"{self.global_batch} ({self.shape.num_workers} x {self.cfg.train.micro_batch} x "
                       f"{self.cfg.train.grad_accum}): it goes on differently from that run; to continue it exactly, "
                       f"set train.micro_batch or train.grad_accum so that the product is {theirs}")
            log.warning(message)

    def _check_fits(self, path: str, manifest: dict) -> None:
        """The driver checked the newest checkpoint whose manifest reads before the run started; the
        restore takes the newest whose files verify, which may be an older one (another model's, in
        a directory runs of one name share): refused here before any worker reads it."""
        from elixir_ray.model.factory import expected_checkpoint_shapes

        try:
            check_compatible(manifest, expected_checkpoint_shapes(self.cfg))
        except CheckpointError as exc:
            raise ClusterError(f"--resume {self.resume.uri!r}: the newest checkpoint whose files verify, {path}, "
                               f"is the one restored, and {exc}") from None

    def _same_run(self, manifest: dict) -> bool:
        """Whether a --resume checkpoint was written by this run (same name and output_dir), whose
        metrics in the run directory are then its history up to the checkpoint."""
        theirs = manifest.get("config") or {}
        if theirs.get("name") != self.cfg.name or not isinstance(theirs.get("output_dir"), str):
            return False
        return storage.resolve(theirs["output_dir"])[1] == storage.resolve(self.cfg.output_dir)[1]

    def _warn_dropout_streams(self, before: int) -> None:
        """Each rank draws its dropout masks from its own random stream, saved per rank: on another
        number of workers the masks differ from the ones the run would have drawn."""
        if self.cfg.model.dropout > 0:
            log.warning(f"model.dropout={self.cfg.model.dropout:g} and the run goes on on {self.shape.num_workers} "
                        f"worker(s) instead of {before}: each rank draws its dropout masks from its own random "
                        f"stream, so the masks, and the losses, differ slightly from how the run would have gone on "
                        f"(with the same global batch and no dropout it goes on exactly)")

    def _for_the_workers(self, path: str, manifest: dict, tensors):
        """What a durable restore hands the workers: the checkpoint's lazily read tensors (pickled as
        file names and offsets), so each worker reads its own part and the driver holds none, when
        the workers see `path`. Otherwise a whole-tensor checkpoint is read here and put in the object
        store once; one the workers wrote is refused (writing it there was chosen because the state is
        large for the object store)."""
        if self._workers_read(path):
            return tensors
        if manifest.get("format") == SHARDS_FORMAT:
            raise ClusterError(
                f"checkpoint {path!r} was written by workers (checkpoint.via=storage) and is read by them too, but "
                f"the workers do not see it: put it on a filesystem every node mounts or in an object store "
                f"(s3://...)")
        return {name: tensors[name] for name in tensors}

    def _restore(self) -> NextState:
        """Newest object-store snapshot, else the newest valid durable checkpoint, else `--resume`, else scratch."""
        source, tensors, step, consumed, shard_refs = "scratch", None, 0, 0, None
        own_run = False  # resumed (--resume) from a checkpoint this run wrote
        for snap in reversed(self.snapshots):
            found = snap.live_shards()
            if found is not None:  # the workers read the shards themselves: no second copy of the state
                source, step, consumed, shard_refs = "object_store", snap.step, snap.samples_consumed, found[0]
                del found
                break
        if shard_refs is None and (self.snapshots or self.outcome.restarts):
            found = self._newest_own_checkpoint()
            if found is not None:
                path, manifest, tensors = found
                tensors = self._for_the_workers(path, manifest, tensors)
                source, step, consumed = "durable", manifest["step"], manifest["samples_consumed"]
        if shard_refs is None and tensors is None and self.resume is not None:
            errors: list = []
            found = load_newest_valid(self.resume.uri, errors)
            if found is None:
                why = f": {errors[-1]}" if errors else ""
                raise ClusterError(f"--resume {self.resume.uri!r}: no valid checkpoint there{why}")
            path, manifest, tensors = found
            self._check_fits(path, manifest)
            tensors = self._for_the_workers(path, manifest, tensors)
            source, step, consumed = "durable", manifest["step"], manifest["samples_consumed"]
            self._note_resume(path, manifest)
            own_run = self._same_run(manifest)
            if not own_run:  # another run's checkpoint: this run directory's rows are not its history
                self.outcome.metrics = []
            if step >= self.cfg.train.steps:
                raise ClusterError(nothing_left_to_train(self.resume.uri, step, self.cfg.train.steps))
        read = None
        if shard_refs is not None:
            read = self.group.get_watched(self.group.call("load_shards", shard_refs, step, consumed), "restoring state")
        elif tensors is not None:
            tensors_ref = ray.put(tensors)  # lazily read tensors go as file names: each worker reads its part
            read = self.group.get_watched(self.group.call("load_state", tensors_ref, step, consumed), "restoring state")
        if read is not None:
            self.outcome.restores.append(RestoreRecord(step, source, self.group.world_size, read, self._state_bytes()))
            log.info("restored step %d from %s: each rank read at most %.1f MiB of the state's %.1f MiB", step, source,
                     max(read) / 2**20, self._state_bytes() / 2**20)
        self.step = step
        kept = [m for m in self.outcome.metrics if m["step"] <= step]
        last = kept[-1]["step"] if kept else 0
        if own_run and last < step:  # a resume of this run: its earlier rows should reach the checkpoint
            gap = f"steps {last + 1}-{step}" if last + 1 < step else f"step {step}"
            log.warning("the earlier metrics of this run stop at step %d, before the checkpoint's step %d (its driver "
                        "stopped before writing them, or they were removed): %s are missing from metrics.parquet",
                        last, step, gap)
        self.outcome.metrics = kept
        if not self.outcome.restarts:
            self.outcome.start_step = step
        elif self._growing:
            self._growing = False
            self.on_note(f"step {step}: grew back to {self.group.world_size} worker(s); training goes on")
        else:
            record = self.outcome.restarts[-1]
            record.restored_from, record.restored_step = source, step
            where = {"object_store": "the object store", "durable": "durable storage"}.get(source, "scratch")
            self.on_note(f"restored step {step} from {where} on {self.group.world_size} worker(s); training goes on")
        log.info("starting at step %d (from %s)", step, source)
        return NextState(RunState.TRAINING, f"step {step} from {source}")

    def _train(self) -> NextState:
        """Segments of steps up to train.steps, each ending in a snapshot; then the last one persisted.
        A stop ends the segment under way at the step the ranks agree on, which is snapshotted too."""
        total, every = self.cfg.train.steps, self.cfg.checkpoint.every_steps
        start = self.step
        while self.step < total and not self.stop_requested.is_set():
            segment = min(total, (self.step // every + 1) * every if every else total) - self.step
            self._run_segment(segment)
            self._snapshot()
            stopping = self.stop_requested.is_set()
            if self.step < total and self.placement is None and not stopping \
                    and grows_back(self.shape, self.full_workers, ray.available_resources()):
                return self._grow()
        self.persister.flush()
        if self.step < total:
            return NextState(RunState.STOPPED, f"stopped on request at step {self.step} of {total}"
                                               + ("" if self.step > start else " (no step trained)"))
        return NextState(RunState.FINISHED, f"trained {total} step(s)")

    def _run_segment(self, num_steps: int) -> None:
        runs = self.group.call("run", num_steps)
        pending = list(runs)
        last_progress = time.monotonic()
        while pending:
            if self.stop_requested.is_set() and not self._stop_sent:
                self.group.call("stop")  # answered at once (threaded actors); the ranks agree in the step
                self._stop_sent = True
            pending = self.group.wait(pending, self.poll_interval_s)
            if self._drain_metrics():
                last_progress = time.monotonic()
            self.group.check_finished(runs, pending, "training")
            self.group.watch("training")
            if pending and time.monotonic() - last_progress > self.cfg.fault.detect_timeout_s:
                raise self.group.silent_failure("training", f"no step (nor evaluation forward) completed for "
                                                            f"{self.cfg.fault.detect_timeout_s:g}s")
        self.step = self.group.get(runs, "training")[0]
        self._drain_metrics()

    def _drain_metrics(self) -> bool:
        # bounded: a stalled rank 0 must count as a failure, not hang the driver
        new, beats = self.group.get([self.group.call_rank(0, "poll")], "polling worker 0 for metrics",
                                    timeout=self.cfg.fault.detect_timeout_s)[0]
        progressed = bool(new) or beats != self._beats  # an evaluation's forwards count as progress
        self._beats = beats
        for m in new:
            self.outcome.metrics.append(m)
            self.on_metrics(m)
            if self.outcome.restarts and self.outcome.restarts[-1].resumed_at is None:
                self.outcome.restarts[-1].resumed_at = time.time()
        return progressed

    def _snapshot(self) -> None:
        """Every worker hands its shard to the object store; training waits only for that copy-out.

        Every rank's header is checked: a rank that failed or died here (the last step's snapshot
        included) is a worker-group failure, restored from the previous snapshot, never a snapshot
        with a hole queued for the persister. The shards stay on the workers' nodes."""
        if self.outcome.checkpoint_via == "storage":
            self._write_checkpoint()
            return
        start = time.monotonic()
        pairs = call_snapshot(self.group, chunk_count(self.outcome.plan))  # in parts: shard_parts.py
        headers = self.group.get([h for h, _ in pairs], "taking a snapshot", timeout=self._snapshot_timeout())
        shards = with_keys([s for _, s in pairs], headers)
        refs = all_refs(shards)
        ray.wait(refs, num_returns=len(refs), fetch_local=False)  # ready with their headers; not pulled here
        self.outcome.snapshot_stalls.append(time.monotonic() - start)
        if len({(h["step"], h["samples_consumed"]) for h in headers}) != 1:
            raise WorkerGroupFailure("taking a snapshot", f"the ranks are at different steps: {headers}")
        plan = self.outcome.plan
        snap = Snapshot(step=headers[0]["step"], samples_consumed=headers[0]["samples_consumed"], worker_refs=shards,
                        on_driver_node=self.group.on_driver_node,
                        extra={"plan": plan.to_dict() if plan else None, "config": self.cfg.to_dict(),
                               "world_size": self.shape.num_workers, "global_batch": self.global_batch,
                               "schedule_steps": schedule_steps(self.cfg), **self.tokenizer})
        # across nodes the previous snapshot is kept until this one has its driver-node copy; on the
        # driver's node both would be lost together, so one is enough (a whole state less in memory)
        self.snapshots = [snap] if self.group.on_driver_node else self.snapshots[-1:] + [snap]
        self.persister.submit(snap)
        self.outcome.final_step = snap.step

    def _write_checkpoint(self) -> None:
        """checkpoint.via=storage: every rank streams its shard from its live state into a checkpoint
        directory while training waits; the driver then commits it with the manifest. A storage error
        is reported and training goes on (as a failed background write would); a rank that dies or
        fails otherwise is a worker-group failure, restored from the previous checkpoint."""
        start = time.monotonic()
        # trained this far whether or not the write below succeeds: a checkpoint that cannot even be
        # started must leave the run's last checkpoint older than its last step, so it says so
        self.outcome.final_step = self.step
        self.on_note(f"step {self.step}: the workers are writing the checkpoint ({self._state_bytes() / 2**30:.2f} GiB) "
                     f"to {self.checkpoint_uri}; training waits")
        try:
            work = begin_checkpoint(self.checkpoint_uri, self.step)
        except (OSError, CheckpointError) as exc:
            self.persister.report(f"could not persist the checkpoint of step {self.step} to {self.checkpoint_uri}: "
                                  f"{exc}")
            return
        writes = self.group.call("write_shard", work)
        try:
            results = self._wait_for_writes(writes)
        except BaseException:
            # the other ranks may still be writing into `work`: they are killed, and their writes seen
            # to end, before it is removed (else a part file lands in a directory being deleted)
            self._kill_group()
            ray.wait(writes, num_returns=len(writes), timeout=WRITES_END_TIMEOUT_S, fetch_local=False)
            abort_checkpoint(work)
            raise
        self.outcome.snapshot_stalls.append(time.monotonic() - start)
        if len({(r["step"], r["samples_consumed"]) for r in results}) != 1:
            abort_checkpoint(work)
            raise WorkerGroupFailure("writing a checkpoint", f"the ranks are at different steps: "
                                     f"{[(r['step'], r['samples_consumed']) for r in results]}")
        step = results[0]["step"]
        if step != self.step:  # the directory was made for self.step
            abort_checkpoint(work)
            raise WorkerGroupFailure("writing a checkpoint", f"the ranks are at step {step}, not {self.step}")
        errors = [r["error"] for r in results if "error" in r]
        if errors:
            abort_checkpoint(work)
            self.persister.report(f"could not persist the checkpoint of step {step}: {'; '.join(errors)}")
            return
        plan = self.outcome.plan
        try:
            path = commit_checkpoint(
                self.checkpoint_uri, step, work, {k: v for r in results for k, v in r["files"].items()},
                results[0]["layout"], self.shape.num_workers,
                {"samples_consumed": results[0]["samples_consumed"], "plan": plan.to_dict() if plan else None,
                 "config": self.cfg.to_dict(), "world_size": self.shape.num_workers,
                 "global_batch": self.global_batch, "schedule_steps": schedule_steps(self.cfg), **self.tokenizer})
        except (OSError, CheckpointError) as exc:
            self.persister.forget_unreadable(step)
            self.persister.report(f"could not persist the checkpoint of step {step} to {self.checkpoint_uri}: {exc}")
            return
        log.info("checkpoint of step %d written by the workers to %s in %.2fs", step, path, time.monotonic() - start)
        self.on_note(f"step {step}: checkpoint written in {time.monotonic() - start:.1f}s")
        self.persister.record(step, path)

    def _wait_for_writes(self, refs: list) -> list:
        """The ranks' `write_shard` results. A write is as slow as its storage (a network filesystem can
        take many minutes for a large model), so it fails the group only when no rank has written a
        byte for `fault.detect_timeout_s`, or a rank died or raised."""
        detect = self.cfg.fault.detect_timeout_s
        last, last_change = -1, time.monotonic()
        pending = list(refs)
        while pending:
            pending = self.group.wait(pending, WRITE_POLL_S)
            for ref in refs:  # a failed rank at once, not after the others finish
                if ref not in pending:
                    self.group.get([ref], "writing a checkpoint")
            if not pending:
                break
            written = sum(self.group.get(self.group.call("write_progress"), "polling the checkpoint write",
                                         timeout=detect))
            if written != last:
                last, last_change = written, time.monotonic()
            elif time.monotonic() - last_change > detect:
                raise WorkerGroupFailure("writing a checkpoint", f"no rank wrote anything for {detect:g}s",
                                         FailureKind.SILENT)
        return self.group.get(refs, "writing a checkpoint")

    def _snapshot_timeout(self) -> float:
        """fault.detect_timeout_s plus the time to copy out the whole state at SNAPSHOT_BYTES_PER_S."""
        return self.cfg.fault.detect_timeout_s + self._state_bytes() / SNAPSHOT_BYTES_PER_S

    def _grow(self) -> NextState:
        """At a checkpoint of a run on fewer workers than it started with, where the free resources hold
        the missing ones again: end the group and place the full one, restored from that checkpoint."""
        before = self.shape.num_workers
        log.info("step %d: the cluster holds %d worker(s) again: growing from %d", self.step, self.full_workers, before)
        self._kill_group()
        self.shape = self.shape.with_workers(self.full_workers)
        self._growing = True
        self._warn_dropout_streams(before)
        return NextState(RunState.PLACING, f"growing from {before} to {self.full_workers} worker(s) at step {self.step}")

    def _wait_for_workers(self) -> WorkerShape:
        """Wait for the full set of workers; an elastic run (cluster.min_workers, fault.elastic) then
        settles for as many as fit (`elastic.py`). Bundles of a given placement group stay reserved
        across the restart: they fit as they are."""
        if self.placement is not None:
            return self.shape
        deadline = time.monotonic() + self.cfg.fault.wait_for_resources_s
        fit = 0
        while True:
            fit = workers_that_fit(self.shape, ray.available_resources())
            if fit >= self.full_workers:
                return self.shape.with_workers(self.full_workers)
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        minimum = minimum_workers(self.cfg, self.full_workers)
        count = workers_after_loss(fit, self.full_workers, minimum, self.global_batch)
        if count is None or (minimum == self.full_workers and count < self.full_workers):
            raise ClusterError(
                f"after a worker failure only {fit} of {self.full_workers} workers fit in the cluster within "
                f"fault.wait_for_resources_s={self.cfg.fault.wait_for_resources_s:g}s "
                + ("(set cluster.min_workers to continue with fewer)" if minimum == self.full_workers else
                   f"(cluster.min_workers={minimum}: no count from {minimum} to {fit} splits the global batch of "
                   f"{self.global_batch} evenly)" if fit >= minimum else f"(cluster.min_workers={minimum})")
            )
        log.warning("continuing elastically on %d worker(s) instead of %d", count, self.full_workers)
        return self.shape.with_workers(count)

    # -- helpers ------------------------------------------------------------------------------

    def _kill_group(self) -> None:
        if self.group is not None:
            self.group.kill()
            self.group = None
        self._stop_sent = False  # a new group's ranks have not been asked
