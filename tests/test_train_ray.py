"""End-to-end runs on a real local Ray cluster with real gloo process groups."""

import importlib.util
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from elixir_ray import ConfigError, train
from elixir_ray.checkpoint import load_checkpoint
from elixir_ray.cluster.worker import RankWorker
from elixir_ray.data.dataset import BatchSampler, TokenDataset
from elixir_ray.config import resolve_model_shape
from elixir_ray.model.factory import init_reference_model, loss_of
from elixir_ray.run.preflight import check_data
from elixir_ray.run.resolved import as_config, resolve_run
from elixir_ray.trainer import lr_at, param_groups

from conftest import group_of, tiny_config

pytestmark = pytest.mark.slow


def checked_config(cfg_dict: dict):
    """The config as train() resolves and checks it (an absolute data path)."""
    run = resolve_run(as_config(cfg_dict))
    check_data(run)
    return run.config


def reference_losses(cfg_dict: dict, world_size: int) -> tuple[list[float], dict]:
    """Plain torch, one process, the whole global batch at once: what the workers must reproduce."""
    cfg = checked_config(cfg_dict)
    model = init_reference_model(cfg)
    opt = torch.optim.AdamW(param_groups(model, cfg.optim.weight_decay), lr=cfg.optim.lr,
                            betas=tuple(cfg.optim.betas), eps=cfg.optim.eps)
    seq_len = resolve_model_shape(cfg.model)["seq_len"]
    sampler = BatchSampler(TokenDataset(cfg.data.path), seq_len, cfg.train.seed)
    global_batch = cfg.train.micro_batch * cfg.train.grad_accum * world_size
    losses = []
    for step in range(cfg.train.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        loss = loss_of(cfg)(model, sampler.samples(step * global_batch, global_batch))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_eval_loss(cfg_dict: dict, state: dict) -> float:
    """Plain torch: the mean loss of the final weights over the held-out windows the workers evaluate
    (the first eval.windows in the fixed evaluation order), all in one batch."""
    from elixir_ray.trainer import EVAL_SEED

    cfg = checked_config(cfg_dict)
    model = init_reference_model(cfg)
    model.load_state_dict(state)
    model.eval()
    sampler = BatchSampler(TokenDataset(cfg.eval.path), resolve_model_shape(cfg.model)["seq_len"], EVAL_SEED)
    with torch.no_grad():
        return loss_of(cfg)(model, sampler.samples(0, cfg.eval.windows)).item()


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_two_gloo_workers_match_one_process(ray_cluster, tiny_dataset, held_out, tmp_path, grad_accum):
    # the workers time the model's kernels for the driver's plan, or (turned off) the plan uses FLOPs
    time_kernels = grad_accum == 1
    cfg = tiny_config(tiny_dataset, tmp_path, train={"grad_accum": grad_accum, "steps": 4},
                      engine={"time_kernels": time_kernels},
                      eval={"path": held_out, "every_steps": 3, "windows": 11})  # 2 workers x 4: padded
    result = train(cfg, progress=False)
    timed_note = any("as the workers timed them" in n for n in result.plan.notes)
    assert timed_note == time_kernels, result.plan.notes
    ref_losses, ref_state = reference_losses(cfg, world_size=2)
    losses = result.metrics.column("loss").to_pylist()
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-5)
    # held-out loss after step 3 and after the last step, on the same windows, as plain torch computes it
    evals = result.metrics.column("eval_loss").to_pylist()
    assert [v is not None for v in evals] == [False, False, True, True]
    assert evals[-1] == pytest.approx(reference_eval_loss(cfg, ref_state), abs=1e-5)
    assert "eval loss: step 3" in result.summary()
    _, tensors = load_checkpoint(result.checkpoint_uri)
    for name, ref in ref_state.items():
        np.testing.assert_allclose(tensors[f"model/{name}"], ref.numpy(), atol=1e-5, err_msg=name)
    assert result.plan.world_size == 2 and result.plan.grad_accum == grad_accum


HF_MODELS = {  # no dropout: the workers' streams differ from one process's
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=257, max_position_embeddings=128),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, vocab_size=257, n_positions=64,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),  # tied embeddings
    # a learned router (each rank's tokens pick other experts) and torch's grouped matmul for the experts
    "mixtral": dict(model_type="mixtral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    vocab_size=257, max_position_embeddings=128),
}


# llama in the core suite; gpt2 and mixtral (the same Ray path and export, other modules) are
# extended: tests/test_engine_hf.py trains all three through the engine in one process
@pytest.mark.parametrize("name", [n if n == "llama" else pytest.param(n, marks=pytest.mark.extended)
                                  for n in sorted(HF_MODELS)])
def test_a_hugging_face_model_from_its_config_fields_trains_on_two_workers_as_in_one_process(
        ray_cluster, tiny_dataset, held_out, tmp_path, name):
    """model.hf: the model built from its transformers config (random weights, no download) trains
    through the Ray job as plain torch trains it, and the checkpoint holds the model's own keys."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    from elixir_ray.cli import main

    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 3}, eval={"path": held_out, "every_steps": 0,
                                                                        "windows": 6})
    cfg["model"] = {"seq_len": 64, "hf": HF_MODELS[name]}
    result = train(cfg, progress=False)
    ref_losses, ref_state = reference_losses(cfg, world_size=2)
    np.testing.assert_allclose(result.metrics.column("loss").to_pylist(), ref_losses, rtol=1e-5, atol=1e-5)
    assert result.final_eval_loss == pytest.approx(reference_eval_loss(cfg, ref_state), abs=1e-5)
    _, tensors = load_checkpoint(result.checkpoint_uri)
    for key, ref in ref_state.items():
        np.testing.assert_allclose(tensors[f"model/{key}"], ref.numpy(), atol=1e-5, err_msg=key)
    # exported, the weights load into the model transformers builds from the same fields
    fields = dict(HF_MODELS[name])
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(fields.pop("model_type"),
                                                                                            **fields))
    assert main(["export", result.checkpoint_uri, str(tmp_path / "w.safetensors")]) == 0
    model.load_state_dict(load_file(str(tmp_path / "w.safetensors")))
    assert torch.equal(model.state_dict()["lm_head.weight"], torch.from_numpy(tensors["model/lm_head.weight"]))


def test_run_writes_metrics_checkpoint_and_plan(ray_cluster, tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, tmp_path, train={"steps": 3})
    rows = []
    result = train(cfg, progress=False, on_metrics=rows.append)
    table = pq.read_table(result.metrics_uri)
    assert table.column("step").to_pylist() == [1, 2, 3]
    # on_metrics gets each row as it arrives, with the plan's predicted step time beside the measured one
    assert [r["step"] for r in rows] == [1, 2, 3] and [r["loss"] for r in rows] == table.column("loss").to_pylist()
    assert all(r["predicted_step_seconds"] == result.plan.predicted_step_seconds for r in rows)
    assert all(v > 0 for v in table.column("tokens_per_s").to_pylist())
    assert all(v > 0 for v in table.column("grad_norm").to_pylist())  # clipped by default: the norm is known
    manifest, tensors = load_checkpoint(result.checkpoint_uri)
    assert manifest["step"] == 3
    assert manifest["samples_consumed"] == 3 * 4 * 2
    assert manifest["plan"]["world_size"] == 2 and manifest["tokenizer"] == "bytes"  # what a resume compares
    assert any(k.startswith("optim/") for k in tensors)
    assert "rng/rank1/torch_cpu" in tensors
    assert os.path.exists(os.path.join(result.run_dir, "plan.json"))
    assert "loss: first" in result.summary()
    # the steps after the first beside the plan's prediction
    median = sorted(table.column("step_seconds").to_pylist()[1:])[0:2]
    line = next(x for x in result.summary().splitlines() if x.startswith("step time:"))
    assert line.startswith(f"step time: median {sum(median) / 2:.3f}s over 2 step(s) after the first")
    assert f"the plan predicted {result.plan.predicted_step_seconds:.3f}s" in line
    # a CPU step well over its prediction says why (the model leaves out the engine's Python work)
    assert result.plan.engine["hardware"]["device"] == "cpu"
    assert ('"Limits, honestly"' in line) == (sum(median) / 2 > 1.3 * result.plan.predicted_step_seconds), line
    assert result.final_loss == table.column("loss").to_pylist()[-1] and result.final_eval_loss is None
    assert result.config.train.steps == 3 and result.config.name == "t"  # what a sweep compares runs by


@pytest.fixture(scope="module")
def unclipped_run(ray_cluster, tiny_dataset, tmp_path_factory):
    """One run of two steps on one worker, unclipped, with a snapshot at each step; and the objects
    the driver owned before and after it, with the garbage collector off throughout. One worker:
    what the driver owns does not depend on how many ranks wrote the snapshots."""
    import gc

    from ray._private.worker import global_worker

    def owned() -> set:
        return set(global_worker.core_worker.get_all_reference_counts())

    cfg = tiny_config(tiny_dataset, tmp_path_factory.mktemp("unclipped"), train={"steps": 2},
                      optim={"max_grad_norm": None}, checkpoint={"every_steps": 1}, cluster={"num_workers": 1})
    gc.collect()
    gc.disable()
    try:
        before = owned()
        result = train(cfg, progress=False)
        return result, before, owned()
    finally:
        gc.enable()


def test_without_clipping_the_gradient_norm_is_not_logged_as_zero(unclipped_run):
    """The engine computes the global norm only to clip by it: unclipped, the metrics hold nulls, not
    0.0 (which reads as a zero gradient)."""
    result, _, _ = unclipped_run
    assert result.metrics.column("grad_norm").to_pylist() == [None, None]


def test_a_finished_run_leaves_nothing_of_its_own_in_the_object_store(unclipped_run):
    """The controller's snapshots were freed only when the garbage collector broke a reference
    cycle between the controller and the metrics callbacks: a sweep of runs in one process kept
    every run's last state in the object store."""
    result, before, after = unclipped_run
    assert result.checkpoint_step == 2
    assert after <= before


def test_too_many_workers_fails_before_any_worker_starts(ray_cluster, tiny_dataset, tmp_path):
    started = tmp_path / "started"

    class Marked(RankWorker):  # leaves a file when any worker is created
        def __init__(self, *args, **kwargs):
            started.touch()
            super().__init__(*args, **kwargs)

    marked = group_of(Marked)
    cfg = tiny_config(tiny_dataset, tmp_path, cluster={"num_workers": 64})
    with pytest.raises(ConfigError, match="cluster.num_workers=64"):
        train(cfg, progress=False, worker_group_cls=marked)
    with pytest.raises(ConfigError, match="no GPUs"):
        train(tiny_config(tiny_dataset, tmp_path, cluster={"use_gpu": True}), progress=False, worker_group_cls=marked)
    assert not started.exists()  # no worker was ever created
    train(tiny_config(tiny_dataset, tmp_path, train={"steps": 1}, cluster={"num_workers": 1}), progress=False,
          worker_group_cls=marked)
    assert started.exists()  # the marker does mark a worker that starts


def test_too_many_workers_for_the_local_cluster_fails_before_it_starts(tmp_path, tiny_dataset):
    """Where `elixir-ray train` would start a local cluster (RAY_ADDRESS unset), the workers are
    checked against the CPUs it would have before it starts (a dozen seconds on this machine)."""
    import subprocess
    import sys

    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(tiny_config(tiny_dataset, tmp_path, cluster={"num_workers": 3,
                                                                                   "local_num_cpus": 2})))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-m", "elixir_ray", "train", str(path), "--quiet"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("elixir-ray: error: cluster.num_workers=3 x cluster.cpus_per_worker=1 needs 3 "
                                  "CPUs but the Ray cluster has 2: lower one of them (the local cluster a run starts "
                                  "where RAY_ADDRESS is unset: 2 CPUs, cluster.local_num_cpus sets how many"), done.stderr
    assert "Ray" not in done.stdout and done.stderr.count("\n") == 1  # one line: no cluster was started


def test_missing_dataset_fails_before_ray(tmp_path, tiny_dataset):
    cfg = tiny_config(str(tmp_path / "missing.arrow"), tmp_path)
    with pytest.raises(ConfigError, match="data.path .* does not exist"):
        train(cfg, progress=False)
    cfg = tiny_config(tiny_dataset, tmp_path, eval={"path": str(tmp_path / "held-out.arrow")})
    with pytest.raises(ConfigError, match="eval.path .* does not exist"):
        train(cfg, progress=False)


def test_vocabulary_smaller_than_the_data_is_refused(ray_cluster, tiny_dataset, tmp_path):
    cfg = tiny_config(tiny_dataset, tmp_path)
    with pytest.raises(ConfigError, match="model.vocab_size"):
        train({**cfg, "model": {**cfg["model"], "vocab_size": 100}}, progress=False)
    if importlib.util.find_spec("transformers") is not None:  # the key to change is the model's own
        with pytest.raises(ConfigError, match=r"^model.hf.vocab_size=100 is smaller than the dataset's vocabulary"):
            train({**cfg, "model": {"seq_len": 64, "hf": {**HF_MODELS["llama"], "vocab_size": 100}}}, progress=False)


def test_a_hugging_face_model_that_cannot_step_is_refused_before_the_run_starts(ray_cluster, tiny_dataset, tmp_path):
    pytest.importorskip("transformers")
    cfg = tiny_config(tiny_dataset, tmp_path)
    model = {"seq_len": 64, "hf": {**HF_MODELS["llama"], "num_key_value_heads": 3}}
    with pytest.raises(ConfigError, match=r"^model.hf: transformers builds LlamaForCausalLM .* one training step"):
        train({**cfg, "model": model}, progress=False)
    assert not os.path.exists(os.path.join(cfg["output_dir"], cfg["name"]))  # no run directory, no worker started


def test_a_ray_address_that_is_not_a_cluster_is_one_line(tiny_dataset, tmp_path):
    """RAY_ADDRESS set to the job server's http:// address (as for `ray job submit`): one line naming
    the variable, not Ray's traceback."""
    import subprocess
    import sys

    env = {**os.environ, "RAY_ADDRESS": "http://127.0.0.1:8265"}
    proc = subprocess.run([sys.executable, "-m", "elixir_ray", "train", "jobs/configs/tiny.yaml", "--quiet",
                           "--set", f"data.path={tiny_dataset}", "--set", f"output_dir={tmp_path}"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "cannot join the Ray cluster at RAY_ADDRESS='http://127.0.0.1:8265'" in proc.stderr
    assert "Traceback" not in proc.stderr
