"""The per-GPU (or per-CPU-slot) actor. It owns one rank: its process group, device and trainer.

The actor is threaded (max_concurrency > 1) so that `poll` and `stop` are answered while `run`
is busy training; `__init__` touches no CUDA, because the device mask is set afterwards. A CUDA
device is current per thread, and Ray may run each call on another of the actor's threads, so
every method that touches the device makes it current first (else CUDA would create a context on
device 0, about half a GiB of another rank's GPU).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import re
import socket
import tempfile
import threading
import traceback
import uuid
from datetime import timedelta
from urllib.parse import urlsplit

import ray
import torch
import torch.distributed as dist

from elixir_ray.cluster.collective_rates import measure_collectives
from elixir_ray.cluster.cpu_shares import reserved_threads
from elixir_ray.cluster.failure import StepError, error_line, is_peer_error
from elixir_ray.cluster.network import interface_with_address, is_loopback
from elixir_ray.cluster.shard_parts import CountedReads, RestoreReads, read_snapshot, split_shard
from elixir_ray.cluster.worker_profile import WorkerProfile, profile_worker
from elixir_ray.config import RunConfig, config_from_dict
from elixir_ray.engine.allocator import use_expandable_segments
from elixir_ray.errors import NonFiniteLossError
from elixir_ray.run_plan import RunPlan
from elixir_ray.trainer import DTYPES, RankTrainer


LOOPBACK_IFNAME = "lo"  # Linux's loopback interface
# elements the profiling round's collectives gather and reduce: a chunk of a model of a few billion
# parameters on a GPU (32 MiB gathered in bf16); on a CPU, 4 MiB, which gloo moves in milliseconds
COLLECTIVE_NUMEL = {"cuda": 16 * 2**20, "cpu": 2**20}
log = logging.getLogger("elixir_ray")


def worker_actor_name(run_name: str, rank: int) -> str:
    """The actor's name in the cluster's namespace: the run's name in it, so that two runs (two `ray job
    submit`s) can share a cluster, and fault injection can find a rank by name."""
    return f"{run_name}/worker-{rank}"


class RankWorker:
    def __init__(self, config: dict, rank: int, world_size: int):
        self.cfg: RunConfig = config_from_dict(config)
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cpu")
        self.node_of_rank: list[int] = []  # every rank's node, numbered (one node until set_devices says)
        self.trainer: RankTrainer | None = None
        self._metrics: list[dict] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._bytes_written = 0  # by `write_shard`, read by the driver's `write_progress` polls
        self._beats = 0  # forwards of an evaluation under way: progress the driver sees before the step ends
        self._store_socket: socket.socket | None = None  # rank 0's rendezvous listener, until the store takes it
        torch.set_num_threads(reserved_threads(self.cfg.cluster.cpus_per_worker))  # until placed: cpu_shares.py

    def alive(self) -> bool:
        """Answered on another of the actor's threads while a long call runs: the driver's sign that
        this worker is busy rather than hung."""
        return True

    def run_here(self, fn, *args):
        """`fn(*args)` in this rank's process, a module-level function of the cluster package: what a
        placed rank sets or checks of its node (its threads, the storage it sees), kept out of here."""
        return fn(*args)

    def node_info(self) -> dict:
        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
        }

    def set_devices(self, visible_gpu_ids: list[str], local_rank: int, node_of_rank: list[int] = ()) -> None:
        """Show every GPU of this node to each of its ranks (so peers can use P2P), then pick ours;
        `node_of_rank`: every rank's node, numbered (for the profiling round's collectives)."""
        self.node_of_rank = list(node_of_rank)
        os.environ["LOCAL_RANK"] = str(local_rank)
        if visible_gpu_ids:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(visible_gpu_ids)
            self.device = torch.device("cuda", local_rank)
            torch.cuda.set_device(self.device)
            use_expandable_segments(self.device)  # before the profiling round allocates (engine/allocator.py)

    def _use_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def rendezvous_file(self, run_name: str) -> str:
        """A fresh path on this node for a FileStore rendezvous: ranks on one node meet through a file
        and open no listening socket (torch's TCPStore listens on every interface, whatever the
        address it is given)."""
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", run_name)  # a '#' or '?' would end the file:// URL's path
        path = os.path.join(tempfile.gettempdir(), f"elixir_ray-{safe}-{uuid.uuid4().hex}.store")
        open(path, "x").close()  # made here, so the other ranks can tell whether they see this directory
        return path

    def sees_file(self, path: str) -> bool:
        """Whether this rank sees `path` (ranks in containers of their own have a /tmp each)."""
        return os.path.exists(path)

    def file_digest(self, path: str):
        """sha256 of the file at `path` as this rank sees it, or None: whether a checkpoint the driver
        reads is the one this rank would read (a read-only mount takes no probe file)."""
        try:
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()
        except OSError:
            return None

    def remove_files(self, paths: list[str]) -> None:
        """Delete rendezvous files of this node that no group uses any more (a group reads its file
        until it is destroyed: the controller calls this before killing the workers)."""
        for path in paths:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def open_store(self, address: str) -> int:
        """Listen for the rendezvous on `address` only (this node's address that the other ranks
        reach, or 127.0.0.1), on a port the kernel picks, and return the port. torch's TCPStore,
        given an address and a port, listens on every interface; given this socket, it listens
        where the socket does (`init_process_group` hands it over)."""
        self._close_store_socket()
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, 0))
            sock.listen(max(128, self.world_size))
        except OSError:
            sock.close()
            raise
        self._store_socket = sock
        return sock.getsockname()[1]

    def _close_store_socket(self) -> None:
        if self._store_socket is not None:
            self._store_socket.close()
            self._store_socket = None

    def init_process_group(self, init_method: str, backend: str, timeout_s: float) -> None:
        """`init_method`: "file://PATH" on one node, "tcp://ADDR:PORT" across nodes (rank 0 then
        listens on the socket `open_store` opened)."""
        self._use_device()
        if dist.is_initialized():
            dist.destroy_process_group()
        if backend == "nccl":
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        url = urlsplit(init_method)
        if init_method.startswith("file://") or is_loopback(url.hostname):
            # one node: gloo's pairs and NCCL's bootstrap listen where the hostname resolves (the
            # container's or the machine's address) unless told the interface; loopback is enough
            os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_IFNAME)
            os.environ.setdefault("NCCL_SOCKET_IFNAME", LOOPBACK_IFNAME)
        elif backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
            self._gloo_on_node_interface()
        timeout = timedelta(seconds=timeout_s)
        rendezvous = {"init_method": init_method}
        if url.scheme == "tcp":
            listen_fd = self._store_socket.detach() if self._store_socket is not None else None  # the store's now
            self._store_socket = None
            rendezvous = {"store": dist.TCPStore(url.hostname, url.port, self.world_size, self.rank == 0, timeout,
                                                 master_listen_fd=listen_fd)}
        dist.init_process_group(
            backend=backend, rank=self.rank, world_size=self.world_size, timeout=timeout,
            device_id=self.device if backend == "nccl" else None, **rendezvous,
        )

    def _gloo_on_node_interface(self) -> None:
        """Across nodes, gloo listens on the interface holding Ray's address for this node, which
        the other nodes reach (else where the hostname resolves: often loopback, see network.py)."""
        node_ip = ray.util.get_node_ip_address()
        name = interface_with_address(node_ip)
        if name is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = name
            log.info("rank %d: gloo listens on %s (%s, this node's Ray address)", self.rank, name, node_ip)
        else:
            log.warning("rank %d: no network interface here holds this node's Ray address %s, so gloo listens "
                        "where the hostname %s resolves; if the group times out, set GLOO_SOCKET_IFNAME to the "
                        "interface the other nodes reach (in the job's runtime_env env_vars)",
                        self.rank, node_ip, socket.gethostname())

    def profile(self, micro_batch: int) -> WorkerProfile:
        """Measure this worker's device and rates, time the model's kernels at `micro_batch` on its
        device (the driver traces the model too, without weights, and plans), and, with every other
        rank at once, the collectives within its node, across all ranks and between nodes (the
        nodes `set_devices` was given)."""
        from elixir_ray.run_plan import resolve_dtype

        self._use_device()
        dtype = DTYPES[resolve_dtype(self.cfg.train.dtype, self.device.type)]
        profile = profile_worker(self.rank, self.device, dtype, self.cfg, micro_batch)
        network = measure_collectives(self.node_of_rank, self.device, COLLECTIVE_NUMEL[self.device.type], dtype) \
            if self.world_size > 1 else {}
        return dataclasses.replace(profile, node_id=ray.get_runtime_context().get_node_id(), network=network)

    def setup(self, plan: RunPlan) -> None:
        self._use_device()
        self.trainer = RankTrainer(self.cfg, plan, self.rank, self.device, group=None, on_progress=self._beat)

    def _beat(self) -> None:
        self._beats += 1

    def run(self, num_steps: int) -> int | StepError | NonFiniteLossError:
        """Train num_steps steps, or fewer when a stop is agreed (see `stop`); rank 0 queues each
        step's metrics for `poll`. Returns the step reached, or the error that ended the steps when
        every rank meets it (a non-finite loss) or when it is a peer's doing (a collective's error
        after a peer died or stopped): returned rather than raised, so that the result the driver
        leaves unread, once it has the one that names the cause, is not printed by Ray as an
        unhandled error, traceback and all. The run's own errors are raised, with their traceback."""
        assert self.trainer is not None, "setup() must run before run()"
        self._use_device()
        try:
            for _ in range(num_steps):
                metrics = self.trainer.step(stop_requested=self._stop.is_set())
                if self.rank == 0:
                    with self._lock:
                        self._metrics.append(metrics)
                if self.trainer.stop_agreed:
                    break
        except NonFiniteLossError as exc:
            return exc
        except Exception as exc:
            if is_peer_error(exc):
                return StepError(self.rank, self.trainer.state.step, str(exc), "", "")
            raise StepError(self.rank, self.trainer.state.step, str(exc), error_line(exc),
                            traceback.format_exc()) from exc
        return self.trainer.state.step

    def poll(self) -> tuple[list[dict], int]:
        """The metrics of the steps finished since the last poll, and how many pieces of work within
        a step (evaluation forwards) this rank has done so far."""
        with self._lock:
            out, self._metrics = self._metrics, []
        return out, self._beats

    def stop(self) -> None:
        """Ask the group to end `run` after the step under way: every rank learns of it in that
        step's loss all-reduce, so all of them end at the same step (at most one step later, when
        the request arrives after this rank's all-reduce)."""
        self._stop.set()

    def current_step(self) -> int:
        return self.trainer.state.step if self.trainer else 0

    def load_state(self, tensors: dict, step: int, samples_consumed: int) -> int:
        """Restore from whole tensors (a checkpoint's, read lazily: this rank reads its own part);
        the bytes this rank read of them."""
        assert self.trainer is not None, "setup() must run before load_state()"
        self._use_device()
        reads = RestoreReads()
        self.trainer.load_state_tensors(CountedReads(tensors, reads), step, samples_consumed)
        return reads.bytes

    def load_shards(self, shard_refs: list, step: int, samples_consumed: int) -> int:
        """Restore from a snapshot's shards (any number of ranks made them), fetched from the object
        store here, only the parts this rank reads (`shard_parts.py`); the bytes it fetched."""
        reads = RestoreReads()
        self.load_state(read_snapshot(shard_refs, reads), step, samples_consumed)
        return reads.bytes

    @ray.method(num_returns=2)  # the driver calls it with num_returns=2 + chunks (shard_parts.call_snapshot)
    def snapshot_parts(self, chunks: int) -> tuple:
        """`state_shard`'s result as (header, rest, one object per chunk): a restore then fetches only
        the chunks' parts it reads."""
        header, shard = self.state_shard()
        return split_shard(header, shard, chunks)

    @ray.method(num_returns=2)
    def state_shard(self) -> tuple[dict, dict]:
        """(header, shard): this rank's step and data position, and its part of the training state as
        numpy arrays (zero-copy in the object store). Two objects, so the driver can check every rank's
        header (a rank that failed here fails both) without pulling any shard to its own node."""
        assert self.trainer is not None
        self._use_device()
        header = self._position()
        # views of the host state, not copies (12 bytes per parameter): Ray serialises the returns
        # into the object store before this call completes, and no step runs until the driver has
        # read the header, which is only after that
        return header, {"tensors": self.trainer.state_shard(copy=False),
                        "layout": self.trainer.layout() if self.rank == 0 else None}

    def write_shard(self, work_uri: str) -> dict:
        """Write this rank's part of the training state straight from its live host state into files
        under `work_uri` (a checkpoint the driver commits when every rank has written). Returns the
        step, data position and the files' manifest entries, or the storage error (a full disk or an
        unwritable URI is reported, not a reason to restart the workers)."""
        from elixir_ray.checkpoint.shards import write_rank_shard

        assert self.trainer is not None
        self._use_device()
        header = self._position()

        def wrote(nbytes: int) -> None:
            self._bytes_written += nbytes

        try:
            files = write_rank_shard(work_uri, self.rank, self.trainer.state_shard(copy=False, lazy=True),
                                     on_bytes=wrote)
        except OSError as exc:
            return {**header, "error": f"rank {self.rank} could not write its shard to {work_uri}: {exc}"}
        return {**header, "files": files, "layout": self.trainer.layout() if self.rank == 0 else None}

    def _position(self) -> dict:
        """This rank's step and data position, which every rank's snapshot or checkpoint reports."""
        return {"step": self.trainer.state.step, "samples_consumed": self.trainer.state.samples_consumed}

    def write_progress(self) -> int:
        """Bytes this rank has written in checkpoints so far: a write that moves is not a stall."""
        return self._bytes_written

    def shutdown(self) -> None:
        self._use_device()
        if dist.is_initialized():
            dist.destroy_process_group()


def rank_actor(worker_cls: type[RankWorker]):
    """The Ray actor class of `worker_cls`, threaded so that `poll`, `alive` and `stop` are answered
    while a long call runs. `RankWorker` stays a plain class, so that fault injection (tests,
    benchmarks) can subclass it and give a `WorkerGroup` subclass the actor class of its own."""
    return ray.remote(max_concurrency=4)(worker_cls)


TrainWorker = rank_actor(RankWorker)  # the actor class a `WorkerGroup` places by default
