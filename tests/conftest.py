"""Shared fixtures: one small real Ray cluster for the whole test run, a tiny dataset and a held-out one."""

import os

import pytest

os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# Ray starts its workers at niceness 15, below every process the tests start themselves. With
# `make test`'s two xdist workers, the in-process engine tests on one then starve the Ray workers of
# the other (a heartbeat unanswered for over 5 s, where fault tests count on less). At equal
# priority the two share the CPU. Every cluster the tests start (the shared one, `ray start`,
# simulated nodes in subprocesses) inherits this.
os.environ.setdefault("RAY_worker_niceness", "0")


def pytest_configure(config):
    """Compile the package's modules once. The suite starts a few hundred Python processes (Ray
    workers, command-line runs); where PYTHONDONTWRITEBYTECODE is set none of them keeps the
    bytecode it compiles, so each would compile every module it imports again (about 0.2 s of CPU
    per process on a 2-core machine)."""
    import compileall

    import elixir_ray

    compileall.compile_dir(os.path.dirname(elixir_ray.__file__), quiet=1)


# The test files whose tests start Ray: the shared `ray_cluster`, or a cluster of their own (marked
# `ray`). `make test` runs the suite on two pytest-xdist workers with `--dist loadfile`, and these
# files form one unit there: they run one after another on one worker while the other takes the
# remaining files whole. On a 2-core machine two Ray tests side by side (each starting tens of
# processes) take up to 1.6 times as long as alone; beside an in-process engine or planner test a
# Ray test loses less. A test that starts Ray in a file missing here is refused at collection.
RAY_FILES = frozenset({
    "test_checkpoint_via_storage.py", "test_controller.py", "test_fault_injection.py", "test_fault_reports.py",
    "test_fault_tolerance.py", "test_job_submit.py", "test_multinode.py", "test_prepare_data.py",
    "test_restore_parts.py", "test_resume_auto.py", "test_resume_checks.py", "test_run_handle.py",
    "test_sweep.py", "test_train_ray.py", "test_worker_group.py",
})
# Of RAY_FILES, those whose tests use no shared cluster, only one of their own: each is a unit of its
# own, handed out right after the Ray unit, so that it runs beside the Ray unit's first files on the
# other worker. With it the Ray unit was the longest by far, and while it ran alone at the end a Ray
# test left part of the machine idle (it waits on its processes). The three-node test stays in the
# Ray unit: beside it, the Ray unit's tests took up to 1.7 times as long (the sweep-resume test 100 s).
BESIDE_THE_RAY_UNIT = frozenset({"test_job_submit.py"})
# Of the Ray unit's files, those whose tests are each to take under a bound of their own (a sweep
# test under 90 s): they come last in the unit. The Ray unit is the longest, so it usually runs on
# alone once the other worker has taken the last of its files; beside the planner's in-process
# tests the sweep-resume test took 1.5 to 1.9 times as long as alone.
LAST_IN_THE_RAY_UNIT = frozenset({"test_sweep.py"})


def pytest_collection_modifyitems(config, items):
    """The Ray unit's files first (LAST_IN_THE_RAY_UNIT at its end), so that their unit is the first
    one handed out, then BESIDE_THE_RAY_UNIT; each file that starts Ray checked to be listed in
    RAY_FILES."""
    for item in items:
        starts_ray = "ray_cluster" in item.fixturenames or item.get_closest_marker("ray") is not None
        if starts_ray and item.path.name not in RAY_FILES:
            raise pytest.UsageError(f"{item.nodeid} starts Ray: add {item.path.name} to RAY_FILES in "
                                    f"tests/conftest.py")
    items.sort(key=lambda item: _hand_out_order(item.path.name))


def _hand_out_order(name: str) -> int:
    if _in_the_ray_unit(name):
        return 1 if name in LAST_IN_THE_RAY_UNIT else 0
    return 2 if name in BESIDE_THE_RAY_UNIT else 3


def _in_the_ray_unit(name: str) -> bool:
    return name in RAY_FILES and name not in BESIDE_THE_RAY_UNIT


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile`, except that RAY_FILES but BESIDE_THE_RAY_UNIT are one unit (see RAY_FILES)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class RayFilesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = super()._split_scope(nodeid)
            return "ray" if _in_the_ray_unit(os.path.basename(path)) else path

    return RayFilesTogether(config, log)


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
