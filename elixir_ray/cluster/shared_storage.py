"""Data and checkpoints on a cluster: what the workers read must be what the driver checked.

The driver checks the dataset before any worker starts, but the workers open it themselves: a local
`data.path` or `eval.path` on the driver's own disk does not exist on another node (or, copied there
by hand, may be another file), and a local `checkpoint.uri` there is where the workers write
(`checkpoint.via: storage`) and restores read. So once the ranks are placed, each looks for itself,
before training: each local file must be there with the driver's size and sampled content, and the
checkpoint directory must show a file the driver has just written. The built-in corpus is built on
each node (in `data.cache_dir`, or the node's own cache directory) and must match the driver's:
another Python there builds another corpus. Object store URIs (s3://, gs://) are not checked here:
every node reads them alike (`config.check_storage` opens their filesystems).
"""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from typing import Optional

from elixir_ray import storage
from elixir_ray.config import RunConfig
from elixir_ray.data.dataset import resolve_data_uri
from elixir_ray.errors import ConfigError

SAMPLE_BYTES = 2**20  # each of the three blocks (start, middle, end) a fingerprint reads
SHARED = ("on storage every node reads: an object store (s3://..., gs://...) or a filesystem mounted at the same "
          "path on every node (NFS, a cluster filesystem)")


def fingerprint(path: str) -> Optional[str]:
    """The file's size and the sha256 of its first, middle and last MiB: the same file's copies agree,
    another file almost surely not, whatever its size; None where it cannot be read."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            digest = hashlib.sha256(str(size).encode())
            for offset in sorted({0, max(0, size // 2 - SAMPLE_BYTES // 2), max(0, size - SAMPLE_BYTES)}):
                f.seek(offset)
                digest.update(f.read(SAMPLE_BYTES))
    except OSError:
        return None
    return f"{size}:{digest.hexdigest()}"


def what_this_rank_sees(files: dict[str, str], builtin_cache: Optional[str], builtin: bool,
                        probe: Optional[tuple[str, str]]) -> dict:
    """Run on a rank: the fingerprint of each of `files` (setting -> local path) as this rank reads
    it; with `builtin`, of the built-in corpus built here (in `builtin_cache`, or this node's cache
    directory); and whether the `probe` file (path, contents) reads back as the driver wrote it."""
    seen = {"files": {key: fingerprint(path) for key, path in files.items()}}
    if builtin:
        seen["builtin"] = fingerprint(resolve_data_uri("builtin", builtin_cache))
    if probe is not None:
        try:
            with open(probe[0]) as f:
                seen["probe"] = f.read() == probe[1]
        except OSError:
            seen["probe"] = False
    return seen


def _local_files(cfg: RunConfig) -> dict[str, str]:
    """The dataset settings that name a local file (the built-in corpus is checked apart)."""
    files = {}
    for key, uri in (("data.path", cfg.data.path), ("eval.path", cfg.eval.path)):
        if uri is not None and uri != "builtin" and storage.local_path(uri) is not None:
            files[key] = storage.local_path(uri)
    return files


def _write_probe(cfg: RunConfig) -> Optional[tuple[str, str, list[str]]]:
    """A fresh file in a local checkpoint directory, with the directories made for it (deepest first,
    removed again with the probe), or None for an object store or a directory the driver cannot
    write (the checkpoint's own write then says why)."""
    path = storage.local_path(cfg.checkpoint_uri)
    if path is None:
        return None
    made, missing = [], os.path.abspath(path)
    while not os.path.exists(missing):
        made.append(missing)
        missing = os.path.dirname(missing)
    probe = os.path.join(path, f".elixir_ray-probe-{uuid.uuid4().hex}")
    try:
        os.makedirs(path, exist_ok=True)
        with open(probe, "x") as f:
            f.write(probe)
    except OSError:
        return None
    return probe, probe, made


def _remove_probe(probe: tuple[str, str, list[str]]) -> None:
    """The probe file, and the directories made for it while they are still empty."""
    try:
        os.remove(probe[0])
        for directory in probe[2]:
            os.rmdir(directory)
    except OSError:
        pass


@dataclass
class StorageViews:
    """What each placed rank sees of the run's local data and checkpoint directory, beside the driver."""

    files: dict[str, str]  # setting -> local path of each dataset checked (`builtin` under data.path)
    driver: dict[str, Optional[str]]  # setting -> the driver's fingerprint of it
    seen: dict[int, dict]  # rank -> what_this_rank_sees
    probed: bool  # a probe file was written in the local checkpoint directory

    def reads(self, rank: int) -> dict[str, bool]:
        """Setting -> whether `rank` reads it as the driver does (only the local ones checked)."""
        seen, out = self.seen[rank], {}
        for key in self.files:
            theirs = seen["builtin"] if self.files[key] == "builtin" else seen["files"][key]
            out[key] = theirs is not None and theirs == self.driver[key]
        if self.probed:
            out["checkpoint.uri"] = bool(seen.get("probe"))
        return out


def look_from_the_ranks(group, cfg: RunConfig) -> StorageViews:
    """Ask every placed rank what it sees of the run's data and checkpoint directory. The first rank
    of each node goes first, so that it alone builds that node's built-in corpus."""
    files = _local_files(cfg)
    builtin = cfg.data.path == "builtin"
    driver = {key: fingerprint(path) for key, path in files.items()}
    if builtin:
        files["data.path"] = "builtin"
        driver["data.path"] = fingerprint(resolve_data_uri("builtin", cfg.data.cache_dir))
    paths = {key: path for key, path in files.items() if path != "builtin"}
    probe = _write_probe(cfg)
    seen: dict[int, dict] = {}
    try:
        firsts = _first_rank_of_each_node(group.node_ids)
        for ranks in (firsts, [rank for rank in range(group.world_size) if rank not in firsts]):
            if ranks:
                refs = [group.call_rank(rank, "run_here", what_this_rank_sees, paths, cfg.data.cache_dir, builtin,
                                        probe and probe[:2]) for rank in ranks]
                seen.update(zip(ranks, group.get_watched(refs, "checking what the workers read")))
    finally:
        if probe is not None:
            _remove_probe(probe)
    return StorageViews(files=files, driver=driver, seen=seen, probed=probe is not None)


def check_workers_see_storage(group, cfg: RunConfig) -> None:
    """Refuse the run (ConfigError) when some placed rank does not read the run's data, or see its
    checkpoint directory, as the driver does: naming the setting, the ranks and the storage a
    cluster needs."""
    views = look_from_the_ranks(group, cfg)
    problems = []
    for key in [*views.files, *(["checkpoint.uri"] if views.probed else [])]:
        ranks = [rank for rank in sorted(views.seen) if not views.reads(rank)[key]]
        if ranks:
            problems.append(_problem(key, views, ranks, cfg, group.node_ids))
    if problems:
        raise ConfigError("; ".join(problems))


def _first_rank_of_each_node(node_ids: list[str]) -> list[int]:
    firsts: dict[str, int] = {}
    for rank, node in enumerate(node_ids):
        firsts.setdefault(node, rank)
    return list(firsts.values())


def _problem(key: str, views: StorageViews, ranks: list[int], cfg: RunConfig, node_ids: list[str]) -> str:
    """The sentence for one setting `ranks` do not read as the driver does."""
    nodes = sorted({node_ids[r][:8] for r in ranks})
    where = f"worker(s) {', '.join(map(str, ranks))} (node {', '.join(nodes)})"
    if key == "checkpoint.uri":
        return (f"checkpoint.uri {cfg.checkpoint_uri!r} is a directory of the driver's that {where} do not see, where "
                f"they write checkpoints and restores read them: set checkpoint.uri (or output_dir) {SHARED}")
    path = views.files[key]
    if path == "builtin":
        return (f"data.path builtin: the corpus built where {where} run differs from the driver's (another "
                f"Python's standard library, or a cache directory that cannot be written there): prepare a dataset "
                f"(elixir-ray prepare-data) {SHARED}, and set data.path to it")
    if any(views.seen[r]["files"][key] is None for r in ranks):
        return f"{key} {path!r} is read by the driver but not where {where} run: on a cluster, put it {SHARED}"
    return (f"{key} {path!r} is another file where {where} run (its size or content differs from the driver's): "
            f"put one copy {SHARED}")
