"""Shared fixtures: one small real Ray cluster for the whole test run, a tiny dataset and a held-out one."""

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def pytest_configure(config):
    """Compile the package's modules once. The suite starts a few hundred Python processes (Ray
    workers, command-line runs); where PYTHONDONTWRITEBYTECODE is set none of them keeps the
    bytecode it compiles, so each would compile every module it imports again (about 0.2 s of CPU
    per process on a 2-core machine)."""
    import compileall

    import elixir_ray

    compileall.compile_dir(os.path.dirname(elixir_ray.__file__), quiet=1)


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster with 4 logical CPUs, shared by every test that needs one: always a new
    one (a bare ray.init() would join a cluster `ray start` left running on this machine)."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="elixir_ray_tests",
                 object_store_memory=200 * 2**20, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A small token dataset made from a few standard-library files."""
    from elixir_ray.data.dataset import builtin_corpus_files, prepare_dataset

    out = tmp_path_factory.mktemp("data") / "tiny.arrow"
    prepare_dataset(builtin_corpus_files(max_bytes=400_000), str(out))
    return str(out)


@pytest.fixture(scope="session")
def held_out(tmp_path_factory):
    """A held-out token dataset: this project's docs, which the standard-library training data lacks."""
    import glob

    from elixir_ray.data.dataset import prepare_dataset

    out = tmp_path_factory.mktemp("held-out") / "held-out.arrow"
    prepare_dataset(sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "*.md"))), str(out))
    return str(out)


def tiny_config(dataset: str, tmp_path, **sections) -> dict:
    """A config dict for a few fast steps of the tiny GPT. Its plan is searched without
    activation checkpointing and costed from FLOPs, not from kernels the workers time: each
    checkpointing setting is one more trace of the model on the driver, and timing kernels one
    more per setting on every rank, together about 5 s of CPU a run. The tests of those paths
    turn them on (`engine.search_checkpointing`, `engine.time_kernels`)."""
    cfg = {
        "name": "t",
        "output_dir": str(tmp_path / "runs"),
        "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
        "data": {"path": dataset},
        "train": {"steps": 4, "micro_batch": 4, "log_every": 1},
        "cluster": {"num_workers": 2},
        "engine": {"time_kernels": False, "search_checkpointing": False},
    }
    for key, value in sections.items():
        cfg.setdefault(key, {}).update(value)
    return cfg


def group_of(worker_cls) -> type:
    """A `WorkerGroup` whose ranks are actors of `worker_cls`, a `RankWorker` subclass that injects a
    fault: what a test hands `train(..., worker_group_cls=...)`."""
    from elixir_ray.cluster.worker import rank_actor
    from elixir_ray.cluster.worker_group import WorkerGroup

    return type(f"{worker_cls.__name__}Group", (WorkerGroup,), {"actor_cls": rank_actor(worker_cls)})
