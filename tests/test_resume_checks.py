"""The driver's checks before a run starts: `--resume` (check_resume) and the embedded Ray cluster (_ensure_ray)."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings

import pytest

from elixir_ray import ClusterError, ConfigError, train
from elixir_ray.checkpoint import list_checkpoints, save_checkpoint
from elixir_ray.model.factory import init_reference_model
from elixir_ray.run import preflight
from elixir_ray.run.resolved import as_config, resolve_run

from conftest import tiny_config

def check_resume(cfg, uri):
    """The driver's check of a `--resume` checkpoint, on the run as train() resolves it."""
    preflight.check_resume(resolve_run(cfg), uri)


def _cfg(tmp_path, data, n_layers=2, steps=8, **sections):
    """`data`: a dataset's path (check_resume compares the tokenizer it was made with)."""
    return as_config(tiny_config(data, tmp_path, model={"n_layers": n_layers}, train={"steps": steps}, **sections))


def _save_model(uri, step, cfg, **extra):
    """A real checkpoint of the configured model's initial weights, named as the trainer names them."""
    tensors = {f"model/{k}": v.detach().numpy() for k, v in init_reference_model(cfg).state_dict().items()}
    return save_checkpoint(uri, step, tensors, {"samples_consumed": step * 8, **extra})


def _damage_manifest(checkpoint_path):
    with open(os.path.join(checkpoint_path, "manifest.json"), "r+b") as f:
        f.truncate(50)


def test_a_damaged_newest_manifest_checks_the_previous_checkpoint(tmp_path, tiny_dataset):
    """The restore falls back past a damaged checkpoint, so the driver's check must not refuse the directory."""
    cfg = _cfg(tmp_path, tiny_dataset, steps=8)
    root = str(tmp_path / "ck")
    _save_model(root, 2, cfg)
    _damage_manifest(_save_model(root, 4, cfg))
    with pytest.warns(UserWarning, match=r"skipping checkpoint: .*step-00000004' has no readable manifest"):
        check_resume(cfg, root)
    # the previous one is the one checked: a checkpoint of another model there is refused
    bigger = _cfg(tmp_path, tiny_dataset, n_layers=4)
    shutil.rmtree(os.path.join(root, "step-00000002"))
    _save_model(root, 2, bigger)
    with pytest.warns(UserWarning, match="skipping checkpoint"), pytest.raises(ConfigError, match="blocks.2"):
        check_resume(cfg, root)


def test_a_directory_without_any_readable_manifest_is_refused(tmp_path, tiny_dataset):
    cfg = _cfg(tmp_path, tiny_dataset)
    root = str(tmp_path / "ck")
    for step in (2, 4):
        _damage_manifest(_save_model(root, step, cfg))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the refusal says it all: no warnings beside it
        with pytest.raises(ConfigError, match=r"step-00000004' has no readable manifest"):
            check_resume(cfg, root)
        with pytest.raises(ConfigError, match=r"^--resume '.*nothing-here': no such file or directory$"):
            check_resume(cfg, str(tmp_path / "nothing-here"))


def test_a_run_directory_or_a_file_given_for_a_checkpoint_says_where_the_checkpoints_are(tmp_path, tiny_dataset):
    """A manifest file crashed the listing (NotADirectoryError); a run directory said only that it had
    no readable manifest. Export says the same, and refuses an output that is a directory."""
    from elixir_ray.checkpoint.export import export_safetensors
    from elixir_ray.checkpoint.store import CheckpointError

    cfg = _cfg(tmp_path, tiny_dataset)
    checkpoint = _save_model(str(tmp_path / "run" / "checkpoints"), 2, cfg)
    manifest = os.path.join(checkpoint, "manifest.json")
    cases = [(str(tmp_path / "run"), r"\(a run directory\? its checkpoints are in .*run/checkpoints\)"),
             (manifest, rf"\(a checkpoint's manifest: give its directory, {checkpoint}\)")]
    for given, hint in cases:
        with pytest.raises(ConfigError, match=rf"--resume .* {hint}"):
            check_resume(cfg, given)
        with pytest.raises(CheckpointError, match=rf"no valid checkpoint at .* {hint}"):
            export_safetensors(given, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointError, match=r"the output .* is a directory: name the file, for example"):
        export_safetensors(checkpoint, str(tmp_path))
    with pytest.raises(CheckpointError, match=r"names a torch pickle, but export writes safetensors: name it .*w.safetensors"):
        export_safetensors(checkpoint, str(tmp_path / "w.pt"))
    assert not os.path.exists(tmp_path / "w.pt")
    import io

    from safetensors.numpy import load_file

    from elixir_ray.progress import ByteProgress

    log = io.StringIO()
    assert export_safetensors(checkpoint, str(tmp_path / "w.safetensors"), ByteProgress("export", log))[0] == checkpoint
    weights = sum(a.nbytes for a in load_file(str(tmp_path / "w.safetensors")).values())
    assert log.getvalue().startswith(f"export: {weights / 2**20:.1f} MiB in 0:0"), log.getvalue()  # every byte counted


def test_nothing_left_to_train_is_judged_on_the_checkpoint_the_restore_would_take(tmp_path, tiny_dataset):
    """The restore takes the newest checkpoint that verifies: refused before any cluster starts when that
    one leaves nothing to train (naming its step). A corrupt file moves the restore back, so with the
    newest damaged only the oldest readable one is judged."""
    cfg = _cfg(tmp_path, tiny_dataset, steps=4)
    root = str(tmp_path / "ck")
    _damage_manifest(_save_model(root, 2, cfg))
    _save_model(root, 4, cfg)
    newest = _save_model(root, 6, cfg)
    with pytest.raises(ConfigError, match=r"the checkpoint is at step 6, and train.steps=5"):
        check_resume(_cfg(tmp_path, tiny_dataset, steps=5), root)
    part = os.path.join(newest, "part-00000.safetensors")
    with open(part, "r+b") as f:  # flip the last byte: same size, another checksum
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    with pytest.raises(ConfigError, match=r"the checkpoint is at step 4, and train.steps=4"):
        check_resume(cfg, root)
    check_resume(_cfg(tmp_path, tiny_dataset, steps=5), root)  # the restore falls back to step 4, which leaves a step


def test_a_checkpoint_of_a_bigger_model_is_refused_naming_its_extra_tensor(tmp_path, tiny_dataset):
    """Every tensor of the 2-layer model is in a 4-layer checkpoint; the extra layers must still refuse it,
    here, rather than fail every worker's restore."""
    root = str(tmp_path / "ck")
    _save_model(root, 2, _cfg(tmp_path, tiny_dataset, n_layers=4))
    with pytest.raises(ConfigError, match=r"it has tensor 'model/blocks\.2\.[\w.]+', which this model does not have"):
        check_resume(_cfg(tmp_path, tiny_dataset, n_layers=2), root)
    # and a smaller model's checkpoint, as before, by the first tensor it lacks
    with pytest.raises(ConfigError, match=r"it has no tensor 'model/blocks\.4\."):
        check_resume(_cfg(tmp_path, tiny_dataset, n_layers=6), root)
    check_resume(_cfg(tmp_path, tiny_dataset, n_layers=4), root)  # the same model fits


ENSURE_RAY = """
import json, ray
from elixir_ray.run.embedded_ray import _ensure_ray
from elixir_ray.config import config_from_dict
cfg = config_from_dict({"data": {"path": "x.arrow"}, "cluster": {"local_num_cpus": 1}})
started = _ensure_ray(cfg)
print(json.dumps({"started": started, "gcs": ray.get_runtime_context().gcs_address}))
ray.shutdown()
"""


@pytest.mark.slow
@pytest.mark.extended
def test_without_ray_address_a_new_local_cluster_starts_beside_an_existing_one(ray_cluster):
    """With RAY_ADDRESS unset a bare ray.init() joins the cluster `ray start` recorded on this machine and
    refuses num_cpus there. A `ray start` cluster is recorded in <RAY_TMPDIR>/ray/ray_current_cluster:
    a private RAY_TMPDIR naming the tests' own cluster stands for one, touching no one else's."""
    existing = ray_cluster.get_runtime_context().gcs_address
    tmpdir = tempfile.mkdtemp(prefix="er-", dir="/tmp")  # short: Ray's socket paths must stay under 108 bytes
    try:
        os.makedirs(os.path.join(tmpdir, "ray"))
        with open(os.path.join(tmpdir, "ray", "ray_current_cluster"), "w") as f:
            f.write(existing)
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env["RAY_TMPDIR"] = tmpdir
        proc = subprocess.run([sys.executable, "-c", ENSURE_RAY], env=env, capture_output=True, text=True,
                              timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["started"] is True
        assert out["gcs"] != existing
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.extended
def test_resume_past_a_damaged_newest_manifest_trains_from_the_previous_one(ray_cluster, tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 4}, checkpoint={"every_steps": 2, "keep": 3})
    first = train(cfg, progress=False)
    root = os.path.dirname(first.checkpoint_uri)
    assert [p[-8:] for p in list_checkpoints(root)] == ["00000002", "00000004"]
    _damage_manifest(first.checkpoint_uri)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = train({**cfg, "name": "resumed", "train": {**cfg["train"], "steps": 6}}, progress=False,
                        resume=root)
    assert any("no readable manifest" in str(w.message) for w in caught)
    assert resumed.metrics.column("step").to_pylist() == [3, 4, 5, 6]


def test_a_checkpoint_larger_than_the_free_disk_is_refused_before_ray(tmp_path):
    """A model whose checkpoint (12 bytes per parameter) cannot fit on checkpoint.uri's filesystem
    would lose its weights at the end of the run: refused with the sizes and the fix, before any
    cluster starts. One sized to fit this disk twice but not three times (keep 2, plus the one being
    written) is warned about, with the keep that fits; a tiny one passes silently."""
    import math

    from elixir_ray.run.preflight import check_checkpoint_space
    from elixir_ray.config import config_from_dict
    from elixir_ray.model.factory import build_model

    def cfg(d_model: int, **sections):
        return config_from_dict({"output_dir": str(tmp_path / "runs"), "checkpoint": {"every_steps": 5, "keep": 2},
                                 "model": {"size": "tiny", "d_model": d_model, "n_heads": 64, "n_layers": 1,
                                           "vocab_size": 64}, "data": {"path": "unused.arrow"}, **sections})

    free = shutil.disk_usage(tmp_path).free
    huge = cfg(64 * 2**10)  # 51B parameters: 0.6 TB
    if 12 * 12 * huge.model.d_model ** 2 <= free:
        pytest.skip(f"this machine's disk has {free / 2**30:.0f} GiB free: more than the test's model needs")
    with pytest.raises(ConfigError, match=r"one checkpoint of this model takes .* GiB free: point checkpoint.uri "
                                          r"at larger storage"):
        check_checkpoint_space(resolve_run(huge))
    # a checkpoint of about 0.4 of the free space: room for two
    d_model = 64 * round(math.sqrt(0.4 * free / 12 / 12) / 64)
    twice = cfg(d_model)
    need = 12 * sum(p.numel() for p in build_model(twice, device="meta").parameters())
    assert free // need == 2, (free, need)
    with pytest.warns(UserWarning, match=r"room for 2 checkpoint\(s\).*up to 3 at once.*set checkpoint.keep=1"):
        check_checkpoint_space(resolve_run(twice))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_checkpoint_space(resolve_run(cfg(d_model, checkpoint={"every_steps": 5, "keep": 1})))  # two at once: fits
        check_checkpoint_space(resolve_run(config_from_dict({"output_dir": str(tmp_path / "runs"), "model": {"size": "tiny"},
                                                             "data": {"path": "unused.arrow"}})))


def test_outputs_inside_rays_copy_of_a_jobs_working_directory_are_warned_about(tmp_path, monkeypatch):
    """Under `ray job submit --working-dir .` the entrypoint runs in Ray's unpacked copy of the
    upload, so the default relative `output_dir` puts the metrics, plan and checkpoints where the
    cluster deletes them, and the job still succeeds: warned about, naming what is in the copy."""
    from elixir_ray.run.preflight import check_output_dir
    from elixir_ray.config import config_from_dict

    copy = tmp_path / "session_1" / "runtime_resources" / "working_dir_files" / "_ray_pkg_0123abcd"
    copy.mkdir(parents=True)
    monkeypatch.chdir(copy)
    with pytest.warns(UserWarning, match=r"^output_dir \(.*_ray_pkg_0123abcd/runs/t\) and checkpoint.uri .*inside "
                                         r"Ray's copy of the job's working directory"):
        check_output_dir(config_from_dict({"name": "t"}))
    lasting = str(tmp_path / "lasting")
    with pytest.warns(UserWarning, match=r"^checkpoint.uri \(.*_ray_pkg_0123abcd/ckpt\): inside Ray's copy"):
        check_output_dir(config_from_dict({"name": "t", "output_dir": lasting, "checkpoint": {"uri": "ckpt"}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_output_dir(config_from_dict({"name": "t", "output_dir": lasting}))
        check_output_dir(config_from_dict({"name": "t", "output_dir": lasting, "checkpoint": {"uri": "s3://b/ckpt"}}))


def test_a_checkpoint_whose_model_differs_without_changing_a_shape_is_warned_about(tmp_path, tiny_dataset):
    """Every tensor of a 4-head GPT has the shape of the 2-head one's: the resume loaded it silently,
    and trained its weights as another attention layout."""
    four_heads = as_config(tiny_config(tiny_dataset, tmp_path, model={"n_layers": 2, "n_heads": 4}, train={"steps": 8}))
    two_heads = as_config(tiny_config(tiny_dataset, tmp_path, model={"n_layers": 2, "n_heads": 2}, train={"steps": 8}))
    root = str(tmp_path / "ck")
    _save_model(root, 2, four_heads, config=four_heads.to_dict())
    with pytest.warns(UserWarning, match=r"the checkpoint's model had model.n_heads=4 \(this run: 2\): every tensor "
                                         r"has the shape"):
        check_resume(two_heads, root)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same model, written out in full or by its named size: nothing to say
        check_resume(as_config({**four_heads.to_dict(), "model": {"size": "tiny", "n_layers": 2, "n_heads": 4,
                                                                  "seq_len": 64, "activation_checkpointing": True}}),
                     root)


@pytest.mark.extended
def test_a_resume_whose_restore_falls_back_to_another_models_checkpoint_is_refused(ray_cluster, tiny_dataset,
                                                                                   tmp_path):
    """The driver checks the newest checkpoint whose manifest reads; the restore takes the newest whose
    files verify. With the newest damaged, an older checkpoint of a bigger model was handed to the
    workers, and every rank failed reading it."""
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 6})
    root = str(tmp_path / "ck")
    _save_model(root, 2, _cfg(tmp_path, tiny_dataset, n_layers=4))
    newest = _save_model(root, 4, as_config(cfg))
    part = os.path.join(newest, "part-00000.safetensors")
    with open(part, "r+b") as f:
        f.seek(os.path.getsize(part) - 4)
        f.write(b"\xff\xff\xff\xff")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ClusterError, match=r"the newest checkpoint whose files verify, .*step-00000002"
                                                          r", is the one restored, and checkpoint does not fit this "
                                                          r"model: it has tensor 'model/blocks.2"):
            train(cfg, progress=False, resume=root)


def test_the_global_batch_of_an_elastic_run_is_read_from_its_checkpoint(tmp_path, tiny_dataset, caplog):
    """An elastic run keeps its global batch on fewer workers by raising grad_accum in its plan, which
    its config does not show: resuming it on its first worker count, which continues it exactly, was
    told to change the batch, and resuming it on fewer, which halves it, was not warned."""
    from elixir_ray.cluster.controller import TrainController
    from elixir_ray.cluster.placement import WorkerShape

    cfg = as_config(tiny_config(tiny_dataset, tmp_path))  # micro-batch 4, grad_accum 1
    shrunk = {"step": 4, "world_size": 1, "config": cfg.to_dict()}  # started on 2 workers, 1 at the end

    def warnings_for(manifest, workers):
        caplog.clear()
        controller = TrainController(cfg, WorkerShape(num_workers=workers, use_gpu=False, cpus_per_worker=1))
        with caplog.at_level("WARNING", logger="elixir_ray"):
            controller._note_resume("ck/step-00000004", manifest)
        return [r.getMessage() for r in caplog.records if "global batch" in r.getMessage()]

    assert warnings_for({**shrunk, "global_batch": 8}, workers=2) == []
    (message,) = warnings_for({**shrunk, "global_batch": 8}, workers=1)
    assert "had a global batch of 8 (its config's micro-batch 4 x grad_accum 1 over the workers it started on, 1 at " \
           "the end), this run has 4" in message, message
    # a checkpoint from before the manifest said it: the config's product over its last worker count
    (message,) = warnings_for(shrunk, workers=2)
    assert "had a global batch of 4 (1 worker(s) x micro-batch 4 x grad_accum 1)" in message, message


def test_a_checkpoint_trained_on_another_tokenizers_ids_is_refused(tmp_path, tiny_dataset):
    """The shapes match (the vocabulary size is the model's), so only the tokenizer the checkpoint's
    run read says that its embeddings would be read as another vocabulary's."""
    cfg = _cfg(tmp_path, tiny_dataset)
    root = str(tmp_path / "ck")
    _save_model(root, 2, cfg, tokenizer="tokenizers:sha256:0123456789abcdef", tokenizer_file="llama/tokenizer.json")
    with pytest.raises(ConfigError, match=r"trained on tokens of llama/tokenizer.json \(tokenizers:sha256:0123456789abcdef\)"
                                          r" and data.path holds tokens of bytes: .* Prepare data.path with the "
                                          r"checkpoint's tokenizer \(elixir-ray prepare-data with --tokenizer naming "
                                          r"llama/tokenizer.json\)"):
        check_resume(cfg, root)
    shutil.rmtree(root)
    _save_model(root, 2, cfg, tokenizer="bytes")
    check_resume(cfg, root)
    shutil.rmtree(root)
    _save_model(root, 2, cfg)  # from before checkpoints said: every one of them was trained on bytes
    check_resume(cfg, root)


def test_a_checkpoint_from_before_checkpoints_named_their_tokenizer_is_bytes(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from elixir_ray.data.dataset import prepare_dataset

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"a": 0, "b": 1, "</s>": 2}, unk_token="a"))
    tok.save(str(tmp_path / "tokenizer.json"))
    data = str(tmp_path / "words.arrow")
    prepare_dataset([_text(tmp_path / "t.txt", "ab" * 400)], data, tokenizer=str(tmp_path / "tokenizer.json"))
    cfg = _cfg(tmp_path, data)
    _save_model(str(tmp_path / "ck"), 2, cfg)
    with pytest.raises(ConfigError, match=r"trained on tokens of bytes and data.path holds tokens of "
                                          r".*tokenizer.json: .*\(elixir-ray prepare-data without --tokenizer\)"):
        check_resume(cfg, str(tmp_path / "ck"))


def _text(path, text):
    path.write_text(text)
    return str(path)


def test_a_new_run_whose_checkpoint_directory_holds_an_earlier_runs_checkpoints_says_so(tmp_path, tiny_dataset):
    """A run started afresh under an earlier run's name writes beside its checkpoints, where a
    directory given to --resume, export or sample takes the highest step, whichever run wrote it."""
    from elixir_ray.run.preflight import warn_of_earlier_checkpoints

    cfg = _cfg(tmp_path, tiny_dataset)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_of_earlier_checkpoints(cfg)  # nothing there yet: no warning
    newest = _save_model(cfg.checkpoint_uri, 40, cfg)
    _save_model(cfg.checkpoint_uri, 30, cfg)
    with pytest.warns(UserWarning, match=rf"already holds 2 checkpoint\(s\) of an earlier run \(the newest: "
                                         rf"step-00000040\).* pass --resume {newest};"):
        warn_of_earlier_checkpoints(cfg)
