"""The ranks of one try of a run, as one object: their actors in a placement group, the process
group they form, the calls made on all of them, and the failure detection every wait needs.

The group knows nothing of steps, plans or checkpoints: the controller's states decide what to
call and when, the group runs the calls and turns a dead, failed or silent rank into a
`WorkerGroupFailure`. A group places its ranks into a placement group it reserves (one bundle per
rank, ordered by node with the driver's node first), or into bundles of a placement group
it is given (a Ray Tune trial's reservation), which it then leaves in place when it is killed.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import Optional

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from elixir_ray.cluster.failure import FailureKind, StepError, WorkerGroupFailure, error_line
from elixir_ray.cluster.heartbeat import Heartbeats
from elixir_ray.cluster.placement import WorkerShape, bundle_rank_order, create_placement_group
from elixir_ray.cluster.worker import TrainWorker, worker_actor_name
from elixir_ray.config import RunConfig
from elixir_ray.errors import ClusterError, NonFiniteLossError

log = logging.getLogger("elixir_ray")

NAME_RELEASE_S = 10.0  # how long a restart waits for a killed worker's actor name to be free again
NAME_GRACE_S = 2.0  # a first try's wait: a resubmitted run's crashed driver may still hold the names
DEATH_GRACE_S = 5.0  # how long a rank's failure waits for news of a peer's death, to name the dead one
DEATH_NAMING_S = 1.0  # how long a dead call's failure waits for the heartbeats to say whose it was
# a rank whose ping went unanswered this long before another failure came (a collective's timeout,
# no step for fault.detect_timeout_s) is the one named: a busy rank answers within milliseconds
STALL_NAMING_S = 1.0
HEARTBEAT_POLL_S = 0.2  # how often a long call's wait collects the heartbeats and sends the next
RENDEZVOUS_TRIES = 3  # each on a fresh file or port: a try can fail on a rank slow to start
FILES_REMOVE_S = 5.0  # how long a kill waits for a live worker to remove the rendezvous files


@dataclass(frozen=True)
class GivenPlacement:
    """Bundles of a placement group reserved by the caller (a Ray Tune trial's), one per rank, in
    rank order. The group is ready, and it stays reserved when the workers are killed: a restart
    places its ranks into the same bundles. Each rank's actor asks for what its bundle holds (a
    sweep that packs trials gives each rank a part of a GPU, or of its CPUs)."""

    placement_group: PlacementGroup
    bundle_indices: tuple[int, ...]


class WorkerGroup:
    """One actor per rank, started together, called together, killed together.

    `actor_cls` is the Ray actor class of a rank: a subclass names another (a `RankWorker`
    subclass made into an actor with `worker.rank_actor`) to inject faults."""

    actor_cls = TrainWorker

    def __init__(self, cfg: RunConfig, shape: WorkerShape, *, placement: Optional[GivenPlacement] = None):
        self.cfg, self.shape, self.given = cfg, shape, placement
        self.actors: list = []  # in rank order
        self.placement_group: Optional[PlacementGroup] = None  # one this group reserved (and removes)
        self.on_driver_node = False  # every rank runs on the driver's node (known after the rendezvous)
        self.workers_per_node: dict[str, int] = {}  # node id -> ranks there (known after the rendezvous)
        self.node_ids: list[str] = []  # per rank, its node's id (known after the rendezvous)
        self._rendezvous_files: list[str] = []  # FileStore files of a one-node group, removed at kill
        self.heartbeats: Optional[Heartbeats] = None  # every rank's liveness, once placed

    @property
    def world_size(self) -> int:
        return len(self.actors)

    # -- placing -------------------------------------------------------------------------------

    def place(self, *, first_try: bool) -> None:
        """Reserve the bundles (or take the given ones) and start one actor per rank, named
        `<run>/worker-<rank>` in `cluster.namespace`. On a first try a run of the same name whose
        workers are still on the cluster is refused before waiting for resources (on a full cluster
        it would wait for that run to end, then overwrite its outputs). Raises `PlacementTimeoutError`
        when the cluster does not reserve the bundles within `cluster.placement_timeout_s`."""
        if first_try:
            self._refuse_a_running_namesake()
        group, bundles = self._reserve()
        config = self.cfg.to_dict()
        # after a restart the killed rank's name may take a moment to be released
        name_wait_s = NAME_GRACE_S if first_try else NAME_RELEASE_S
        for rank, bundle in enumerate(bundles):
            self.actors.append(self._start_actor(config, rank, group, bundle, name_wait_s))
        self.heartbeats = Heartbeats(self.actors)

    def _reserve(self) -> tuple[PlacementGroup, list[int]]:
        """The placement group and the bundle index of each rank, in rank order."""
        if self.given is not None:
            if len(self.given.bundle_indices) != self.shape.num_workers:
                raise ClusterError(f"the placement group given holds {len(self.given.bundle_indices)} bundle(s) for "
                                   f"{self.shape.num_workers} worker(s)")
            return self.given.placement_group, list(self.given.bundle_indices)
        self.placement_group = create_placement_group(self.shape, self.cfg.cluster.placement_timeout_s)
        return self.placement_group, bundle_rank_order(self.placement_group, ray.get_runtime_context().get_node_id())

    def _refuse_a_running_namesake(self) -> None:
        name, namespace = worker_actor_name(self.cfg.name, 0), self.cfg.cluster.namespace
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        raise self._namesake_error(name)

    def _namesake_error(self, actor: str) -> ClusterError:
        return ClusterError(f"a run named {self.cfg.name!r} already has workers on this Ray cluster (actor {actor!r} "
                            f"in namespace {self.cfg.cluster.namespace!r}): wait for it to end, or give this run "
                            f"another name (--set name=...)")

    def _start_actor(self, config: dict, rank: int, group: PlacementGroup, bundle: int, name_wait_s: float):
        name, namespace = worker_actor_name(self.cfg.name, rank), self.cfg.cluster.namespace
        resources = group.bundle_specs[bundle] if self.given is not None else self.shape.bundle
        options = self.actor_cls.options(
            name=name, namespace=namespace, num_cpus=resources.get("CPU", 0),
            num_gpus=resources.get("GPU", 0), max_restarts=0, max_task_retries=0,
            resources={k: v for k, v in resources.items() if k not in ("CPU", "GPU")},
            runtime_env=self.cfg.cluster.runtime_env,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=bundle))
        deadline = time.monotonic() + name_wait_s
        while True:
            try:
                return options.remote(config, rank, self.shape.num_workers)
            except ray.exceptions.ActorAlreadyExistsError:
                if time.monotonic() >= deadline:
                    raise self._namesake_error(name) from None
                time.sleep(0.2)

    # -- the process group ---------------------------------------------------------------------

    def rendezvous(self) -> None:
        """Show each rank its node's GPUs, then form the process group (NCCL on GPU, gloo on CPU):
        through a file on one node (no listening socket), else through a TCP store on rank 0 that
        listens on its node's address only."""
        # the first call each new worker answers: it waits for the worker's process to start, which a
        # liveness ping cannot tell from a hang, so it gets the rendezvous's own limit
        infos = self.get(self.call("node_info"),
                         "waiting for the workers to start (cluster.init_timeout_s: raise it where a worker's "
                         "runtime_env or image takes longer to set up)", timeout=self.cfg.cluster.init_timeout_s)
        driver_node = ray.get_runtime_context().get_node_id()
        self.on_driver_node = all(info["node_id"] == driver_node for info in infos)
        # Every rank on a node sees all of that node's GPUs; local rank = order within the node.
        by_node: dict[str, list[int]] = {}
        for rank, info in enumerate(infos):
            by_node.setdefault(info["node_id"], []).append(rank)
        self.workers_per_node = {node: len(ranks) for node, ranks in by_node.items()}
        self.node_ids = [info["node_id"] for info in infos]
        calls = []
        for ranks in by_node.values():
            gpus = sorted({g for r in ranks for g in infos[r]["gpu_ids"]}, key=lambda g: int(g) if g.isdigit() else g)
            for local_rank, rank in enumerate(ranks):
                calls.append(self.actors[rank].set_devices.remote(gpus, local_rank, self.node_of_rank))
        self.get_watched(calls, "setting devices")
        last_error = None
        for _try in range(RENDEZVOUS_TRIES):
            init_method = self._init_method(one_node=len(by_node) == 1, rank0_ip=infos[0]["node_ip"])
            try:
                self.get(self.call("init_process_group", init_method, self.shape.backend,
                                   self.cfg.fault.detect_timeout_s),
                         "initialising the process group", timeout=self.cfg.cluster.init_timeout_s)
                return
            except WorkerGroupFailure as exc:
                last_error = exc
                log.warning("process group through %s failed, retrying: %s", init_method, exc)
        raise WorkerGroupFailure("initialising the process group", f"three tries failed: {last_error}")

    def _init_method(self, *, one_node: bool, rank0_ip: str) -> str:
        """A fresh rendezvous address: a new file (or port) for each try."""
        if not one_node:
            return self._tcp_store(rank0_ip)
        path = self.get_watched([self.call_rank(0, "rendezvous_file", self.cfg.name)], "choosing a file")[0]
        self._rendezvous_files.append(path)
        if all(self.get_watched(self.call("sees_file", path), "checking the file")):
            return f"file://{path}"
        # ranks in containers of their own share no temp directory: a TCP store on loopback
        init_method = self._tcp_store("127.0.0.1")
        log.warning("the ranks do not share %s: meeting through a TCP store on %s instead",
                    os.path.dirname(path), init_method[len("tcp://"):])
        return init_method

    def _tcp_store(self, address: str) -> str:
        """A TCP store on rank 0, listening on `address` only (its node's address, or loopback)."""
        port = self.get_watched([self.call_rank(0, "open_store", address)], "opening the rendezvous store")[0]
        host = f"[{address}]" if ":" in address else address
        return f"tcp://{host}:{port}"

    @property
    def node_of_rank(self) -> list[int]:
        """Per rank, its node numbered in the order of the nodes' first ranks (after the rendezvous)."""
        order = list(dict.fromkeys(self.node_ids))
        return [order.index(node) for node in self.node_ids]

    # -- calling and watching ------------------------------------------------------------------

    def call(self, method: str, *args) -> list:
        """Call `method` on every rank; the object refs of the calls, in rank order."""
        return [getattr(actor, method).remote(*args) for actor in self.actors]

    def call_rank(self, rank: int, method: str, *args):
        """Call `method` on one rank; the object ref of the call."""
        return getattr(self.actors[rank], method).remote(*args)

    def get(self, refs: list, what: str, timeout: Optional[float] = None) -> list:
        """The calls' results. A rank that died, raised or timed out is a `WorkerGroupFailure`
        (the group is rebuilt); an error that is a bug rather than a lost worker (ValueError,
        TypeError, KeyError, AssertionError) is a `ClusterError` (the run ends), as is a
        non-finite loss (`NonFiniteLossError`). A rank's error may come back as its call's result
        (`RankWorker.run` returns a peer's doing rather than raise it): read alike."""
        try:
            results = ray.get(refs, timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise self.silent_failure(what, f"timed out after {timeout:g}s") from None
        except ray.exceptions.RayActorError as exc:
            raise self._death(what, exc) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            raise self._raised(what, cause) from exc
        for result in results:
            if isinstance(result, BaseException):
                raise self._raised(what, result)
        return results

    def _raised(self, what: str, cause: BaseException) -> Exception:
        """What a rank's error is to the driver: the end of the run, or a failure of the group."""
        if isinstance(cause, NonFiniteLossError):
            return cause
        if isinstance(cause, (ValueError, TypeError, KeyError, AssertionError)):
            return ClusterError(f"a worker failed while {what}: {cause}")  # a bug, not a lost worker
        first = (str(cause).splitlines() or [""])[0]
        error = cause.error if isinstance(cause, StepError) else error_line(cause)
        failure = WorkerGroupFailure(what, f"a worker failed: {first}", FailureKind.RAISED, error=error)
        if isinstance(cause, StepError):
            failure.step = cause.step
        return failure

    def _death(self, what: str, exc: BaseException) -> WorkerGroupFailure:
        """A call's actor died: named by the heartbeats (a fresh ping to it fails at once, Ray
        knowing of the death already), else as "a worker"."""
        line = (str(exc).splitlines() or [""])[0]
        if self.heartbeats is not None:
            deadline = time.monotonic() + DEATH_NAMING_S
            while not self.heartbeats.dead and time.monotonic() < deadline:
                self.heartbeats.beat()
                time.sleep(0.02)
            if self.heartbeats.dead:
                ranks = sorted(self.heartbeats.dead)
                return WorkerGroupFailure(what, f"worker {_ranks(ranks)} died: {line}", FailureKind.DIED)
        return WorkerGroupFailure(what, f"a worker died: {line}", FailureKind.DIED)

    def silent_failure(self, what: str, reason: str) -> WorkerGroupFailure:
        """A wait that ran out (a call's timeout, no step in `fault.detect_timeout_s`): the ranks that
        stopped answering their heartbeat, when some did, else `reason`."""
        if self.heartbeats is not None:
            self.heartbeats.beat()
            limit = min(STALL_NAMING_S, self.cfg.fault.detect_timeout_s)
            silent = self.heartbeats.silent(limit)
            if silent:
                seconds = max(self.heartbeats.silent_for(rank) for rank in silent)
                return WorkerGroupFailure(what, f"{_did_not_answer(silent, round(seconds, 1))}; meanwhile {reason}",
                                          FailureKind.SILENT)
        return WorkerGroupFailure(what, reason, FailureKind.SILENT)

    def watch(self, what: str) -> None:
        """One heartbeat of every rank (never blocking): a rank whose ping failed died, and one that
        has not answered for fault.detect_timeout_s (stopped, or hung in a driver call) fails the
        group. Called by every wait that polls."""
        if self.heartbeats is None:
            return
        self.heartbeats.beat()
        if self.heartbeats.dead:
            rank, line = min(self.heartbeats.dead.items())
            raise WorkerGroupFailure(what, f"worker {rank} died: {line}", FailureKind.DIED)
        limit = self.cfg.fault.detect_timeout_s
        silent = self.heartbeats.silent(limit)
        if silent:
            raise WorkerGroupFailure(what, _did_not_answer(silent, limit, "(fault.detect_timeout_s)"),
                                     FailureKind.SILENT)

    def get_watched(self, refs: list, what: str) -> list:
        """Wait for calls that take as long as they take (profiling, setting up, restoring),
        watching every worker's heartbeat meanwhile: a worker that no longer answers for
        fault.detect_timeout_s (stopped, hung in a driver call) fails the group, where a bare wait
        would wait forever. The workers are threaded, so a busy one still answers."""
        while True:
            done, pending = ray.wait(refs, num_returns=len(refs), timeout=HEARTBEAT_POLL_S)
            if not pending:
                return self.get(refs, what)
            self.get(done, what)  # a worker that failed or died says so at once
            self.watch(what)

    @staticmethod
    def wait(refs: list, timeout_s: float) -> list:
        """Wait up to `timeout_s` for all of `refs`; those still running."""
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
        return pending

    def check_finished(self, calls: list, pending: list, what: str) -> None:
        """Raise for a rank whose call (`calls`, one per rank in rank order) ended in an error, at
        once rather than after the others hang, naming the rank that died or stopped answering
        where it did rather than a survivor whose collective failed after it."""
        for rank, ref in enumerate(calls):
            if ref in pending:
                continue
            try:
                self.get([ref], what)
            except WorkerGroupFailure as failure:
                if isinstance(failure.__cause__, ray.exceptions.RayActorError):  # this rank itself died
                    raise WorkerGroupFailure(what, f"worker {rank} died: {str(failure.__cause__).splitlines()[0]}",
                                             FailureKind.DIED) from failure.__cause__
                raise self._culprit(calls, rank, what) or failure

    def _culprit(self, calls: list, failed: int, what: str) -> Optional[WorkerGroupFailure]:
        """When a worker dies or stops, its peers' collectives fail ("connection closed by peer", a
        receive that times out), and Ray reports a death a moment later: the failure names the
        worker that died, or that had stopped answering its heartbeat before the failure came,
        with the survivors' errors summed up in one line. None when every other rank answers a
        ping sent after the failure (the error is the failed rank's own)."""
        since = time.monotonic()
        deadline = since + DEATH_GRACE_S
        others = [rank for rank in range(len(calls)) if rank != failed]
        while True:
            self.heartbeats.beat()
            died = dict(self.heartbeats.dead)
            for rank in others:
                try:
                    ray.get(calls[rank], timeout=0)
                except ray.exceptions.RayActorError as exc:
                    died[rank] = (str(exc).splitlines() or [""])[0]
                except Exception:  # still running, or another survivor's error
                    continue
            died.pop(failed, None)
            if died:
                rank = min(died)
                return WorkerGroupFailure(what, f"worker {rank} died: {died[rank]}{self._follow_on(calls, rank)}",
                                          FailureKind.DIED)
            waited = time.monotonic() - since
            # silent since well before the failure came: stopped (a just-killed rank is silent only
            # since the failure, and its death is reported within the grace below)
            stalled = [rank for rank in others if self.heartbeats.silent_for(rank) - waited > STALL_NAMING_S]
            if not stalled and time.monotonic() >= deadline:
                stalled = [rank for rank in others if self.heartbeats.silent_for(rank) > STALL_NAMING_S]
            recent = self.cfg.fault.detect_timeout_s / 2  # a stopped rank's peers time out after detect_timeout_s
            if stalled and waited < DEATH_NAMING_S and all(self.heartbeats.silent_for(r) < recent for r in stalled):
                # a rank killed over a second before the failure was seen (a busy driver) is as silent
                # as a stopped one until Ray reports its death, a moment later: wait for that news
                time.sleep(0.05)
                continue
            if stalled:
                seconds = max(self.heartbeats.silent_for(rank) for rank in stalled)
                return WorkerGroupFailure(what, _did_not_answer(stalled, round(seconds, 1))
                                          + self._follow_on(calls, *stalled),
                                          FailureKind.SILENT)
            if time.monotonic() >= deadline or all(self.heartbeats.answered_since(rank, since) for rank in others):
                return None
            time.sleep(0.05)

    @staticmethod
    def _follow_on(calls: list, *culprits: int) -> str:
        """The survivors' errors that followed a rank's death or silence, in one line."""
        errors = {}
        for rank, ref in enumerate(calls):
            if rank in culprits:
                continue
            try:
                result = ray.get(ref, timeout=0)
            except Exception:  # still running, or an error raised: not a peer's doing alone
                continue
            if isinstance(result, StepError):
                errors[rank] = result.message
        if not errors:
            return ""
        first = _short(next(iter(errors.values())))
        return f" (the collective of worker(s) {_ranks(sorted(errors))} then failed: {first})"

    # -- ending --------------------------------------------------------------------------------

    def kill(self) -> None:
        """Kill, don't drain: a graceful shutdown can hang on a collective whose peer is gone. The
        placement group goes too when this group reserved it; a given one stays reserved."""
        self._remove_rendezvous_files()
        self.heartbeats = None
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already dead
                pass
        self.actors = []
        if self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception:
                pass
            self.placement_group = None

    def _remove_rendezvous_files(self) -> None:
        """Best effort: any live worker of the node can remove them, and the first that does is enough."""
        if not (self._rendezvous_files and self.actors):
            return
        remaining = self.call("remove_files", self._rendezvous_files)
        deadline = time.monotonic() + FILES_REMOVE_S
        while remaining and time.monotonic() < deadline:
            done, remaining = ray.wait(remaining, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            try:
                ray.get(done)
            except Exception:  # that worker is gone: wait for another
                continue
            if done:
                self._rendezvous_files = []
                return


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def _did_not_answer(ranks: list[int], seconds: float, why: str = "") -> str:
    return f"worker(s) {_ranks(ranks)} did not answer for {seconds:g}s{' ' + why if why else ''}: hung or stopped"


def _short(message: str, limit: int = 120) -> str:
    """A collective's error in a few words: its first line, without gloo's source-file prefix."""
    line = (message.splitlines() or [""])[0]
    line = re.sub(r"^\[[^\]]*\]\s*", "", line)
    return line if len(line) <= limit else line[:limit - 3] + "..."
