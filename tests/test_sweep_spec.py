"""A sweep's input refused in one line before Ray starts: the space's keys and domains, the metric,
the scheduler, trials_per_gpu. No Ray cluster here."""

import os

import pytest

from elixir_ray.cli import main
from elixir_ray.errors import ConfigError
from elixir_ray.sweeps.schedulers import make_scheduler, parse_scheduler
from elixir_ray.sweeps.spec import build_spec, load_sweep_file


def _base(tiny_dataset):
    return {"name": "s", "data": {"path": tiny_dataset}, "model": {"size": "tiny", "n_layers": 2, "seq_len": 64},
            "train": {"steps": 8, "micro_batch": 4}}


@pytest.mark.parametrize("space, needle", [
    ({"optim.lrr": [1e-3]}, r"space: optim.lrr=0.001: unknown config key 'optim.lrr' \(allowed under 'optim': lr,"),
    ({"optim.lr": {"logunifrom": [1e-4, 1e-2]}}, r"space: optim.lr: unknown domain 'logunifrom' \(one of loguniform,"),
    ({"optim.lr": {"loguniform": [1e-4]}}, r"space: optim.lr: loguniform takes \[low, high\] \(numbers\), got \[0.0001\]"),
    ({"optim.lr": {"loguniform": [0.0, 1e-2]}}, r"loguniform \[0.0, 0.01\] needs a low bound above 0"),
    ({"optim.lr": {"uniform": [1e-2, 1e-4]}}, r"the low bound must be below the high one"),
    ({"optim.lr": []}, r"space: optim.lr: an empty list gives no trial"),
    ({"optim.lr": [1e-3, -1.0]}, r"space: optim.lr=-1.0: optim.lr must be a positive number, got -1.0"),
    ({"train.micro_batch": {"randint": [0, 4]}}, r"space: train.micro_batch=0: train.micro_batch must be a positive"),
    ({"cluster.num_workers": [1, 2]}, r"space: cluster.num_workers is set by the sweep for each trial"),
    ({}, r"space: empty"),
])
def test_a_bad_space_is_refused_in_one_line(tiny_dataset, space, needle):
    with pytest.raises(ConfigError, match=needle) as err:
        build_spec(_base(tiny_dataset), space)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kwargs, needle", [
    ({"metric": "accuracy"}, r"metric 'accuracy' is not one the runs report \(one of loss, eval_loss,"),
    ({"metric": "eval_loss"}, r"metric eval_loss: the base config has no eval.path"),
    ({"mode": "lowest"}, r"mode 'lowest': min or max"),
    ({"trials_per_gpu": 0}, r"trials_per_gpu must be a whole number of at least 1, got 0"),
    ({"num_samples": 0}, r"num_samples must be a whole number of at least 1, got 0"),
    ({"scheduler": "hyperband2"}, r"scheduler type 'hyperband2' is not one this sweep runs on Ray Tune \(one of asha,"),
    ({"scheduler": {"grace_period": 2}}, r"scheduler: give its type"),
    ({"name": "a/b"}, r"name 'a/b': a sweep's name is letters"),
])
def test_bad_sweep_settings_are_refused_in_one_line(tiny_dataset, kwargs, needle):
    with pytest.raises(ConfigError, match=needle):
        build_spec(_base(tiny_dataset), {"optim.lr": [1e-3]}, **kwargs)


def test_a_scheduler_setting_tune_does_not_take_is_one_line():
    with pytest.raises(ConfigError, match=r"scheduler asha: .*'grace'.* \(its settings are AsyncHyperBandScheduler's "):
        make_scheduler(parse_scheduler({"type": "asha", "grace": 2}), steps=8, mutations={}, checkpoint_every=0)
    asha = make_scheduler(parse_scheduler("asha"), steps=8, mutations={}, checkpoint_every=0)
    assert type(asha).__name__ == "AsyncHyperBandScheduler" and asha._time_attr == "step" and asha._max_t == 8
    pbt = make_scheduler(parse_scheduler({"type": "pbt"}), steps=8, mutations={"optim.lr": [1e-3, 1e-2]},
                         checkpoint_every=4)
    assert pbt._perturbation_interval == 4 and "optim.lr" in pbt._hyperparam_mutations
    assert make_scheduler(parse_scheduler("none"), steps=8, mutations={}, checkpoint_every=0) is None


def test_the_sweep_file_takes_set_overrides_for_itself_and_for_the_base_config(tiny_dataset, tmp_path):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: lr\nbase: {{data: {{path: {tiny_dataset}}}}}\nspace:\n  optim.lr: {{loguniform: [1.0e-4, "
                     f"1.0e-2]}}\nscheduler: {{type: asha, grace_period: 2}}\n")
    kwargs = load_sweep_file(str(sweep), ["num_samples=3", "scheduler.reduction_factor=3", "train.steps=12",
                                          "space.optim.weight_decay=[0.0, 0.1]"])
    assert kwargs["num_samples"] == 3 and kwargs["base_overrides"] == ["train.steps=12"]
    assert kwargs["scheduler"] == {"type": "asha", "grace_period": 2, "reduction_factor": 3}
    assert kwargs["space"] == {"optim.lr": {"loguniform": [1e-4, 1e-2]}, "optim.weight_decay": [0.0, 0.1]}
    # YAML reads 1e-4 (no dot) as text: in a domain it is the number
    spec = build_spec({"data": {"path": tiny_dataset}}, {"optim.lr": {"loguniform": ["1e-4", "1e-2"]},
                                                        "optim.weight_decay": ["0", "1e-1"]})
    assert spec.space["optim.lr"].args == (1e-4, 1e-2) and spec.space["optim.weight_decay"].args == ("0", 0.1)
    sweep.write_text("name: lr\nbase: tiny\nspace: {optim.lr: [1.0e-3]}\nschedular: asha\n")
    with pytest.raises(ConfigError, match=r"unknown key 'schedular' \(allowed: name, base, space,"):
        load_sweep_file(str(sweep))


def test_the_command_refuses_bad_input_before_starting_anything(tiny_dataset, tmp_path, capsys):
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(f"name: lr\nbase: {{data: {{path: {tiny_dataset}}}}}\nspace:\n  optim.lr: {{grid: [1.0e-3]}}\n"
                     f"metric: perplexity\nstorage: {tmp_path / 'sweeps'}\n")
    assert main(["sweep", str(sweep)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == ("elixir-ray: error: metric 'perplexity' is not one the runs report (one of loss, eval_loss, "
                           "lr, grad_norm, tokens_per_s, step_seconds)")
    assert not (tmp_path / "sweeps").exists()  # nothing started, nothing written


def test_packed_trials_reserve_shares_ray_can_count(tiny_dataset):
    from elixir_ray.config import config_from_dict
    from elixir_ray.sweeps.packing import trial_resources

    cfg = config_from_dict({**_base(tiny_dataset), "cluster": {"num_workers": 2, "cpus_per_worker": 2}})
    three = trial_resources(cfg, 3, {"CPU": 8})
    assert three.bundles == [{"CPU": 1.0}, {"CPU": 0.6666}, {"CPU": 0.6666}]  # 3 x 0.6666 fit in 2 CPUs
    assert trial_resources(cfg, 3, {"CPU": 8, "GPU": 2}).rank_bundle == {"CPU": 2.0, "GPU": 0.3333}
    with pytest.raises(ConfigError, match=r"trials_per_gpu=10001: Ray reserves a GPU \(or CPU\) in steps of "
                                          r"1/10000, so at most 10000 trials can share one"):
        trial_resources(cfg, 10001, {"CPU": 8})


def test_a_resumed_sweep_keeps_the_budget_its_trials_started_with_while_it_fits(tiny_dataset, tmp_path):
    """Its continued trials then find their plans in the plan cache. A recorded budget above what
    is free now, one recorded for another trials_per_gpu, or a record that does not read is cut
    again from the memory free now."""
    from elixir_ray.config import config_from_dict
    from elixir_ray.sweeps.packing import PACKING_FILE, packed, read_packing, trial_resources, write_packing

    cfg = config_from_dict({**_base(tiny_dataset), "cluster": {"num_workers": 1}})
    two, gib = trial_resources(cfg, 2, {"CPU": 4}), 2**30
    first = packed(cfg, two, 8 * gib)
    assert first.device_memory == 4 * gib and not first.budget_kept
    sweep_dir = str(tmp_path / "sweep")
    assert read_packing(sweep_dir) is None
    write_packing(sweep_dir, first)
    assert os.listdir(sweep_dir) == [PACKING_FILE]  # no temporary file left beside it
    recorded = read_packing(sweep_dir)
    assert recorded == {"trials_per_gpu": 2, "device_memory": 4 * gib, "device_free": 8 * gib}

    more = packed(cfg, two, 8 * gib + 300 * 2**20, started_with=recorded)  # a little more free now
    assert more.device_memory == 4 * gib and more.budget_kept
    assert "budget of 4.0 GiB each (the one its trials started with, within 1/2 of 8.3 GiB free now)" \
        in more.describe(), more.describe()
    less = packed(cfg, two, 8 * gib - 2**20, started_with=recorded)  # less: another process took some
    assert less.device_memory == (8 * gib - 2**20) // 2 and not less.budget_kept
    three = packed(cfg, trial_resources(cfg, 3, {"CPU": 4}), 9 * gib, started_with=recorded)
    assert three.device_memory == 3 * gib and not three.budget_kept
    (tmp_path / "sweep" / PACKING_FILE).write_text("{not json")
    assert read_packing(sweep_dir) is None


def test_a_trial_continues_from_the_checkpoint_its_tune_pointer_names_or_its_own_newest(tiny_dataset, tmp_path):
    """Population Based Training's exploit gives a trial another trial's pointer: it continues from
    that checkpoint (that trial's newest when it was pruned since); otherwise from its own newest."""
    import json

    import numpy as np
    from ray.tune import Checkpoint

    from elixir_ray.checkpoint import save_checkpoint
    from elixir_ray.config import config_from_dict
    from elixir_ray.sweeps.trial import POINTER_FILE, resume_point

    def pointer(uri, step, trial):
        folder = tmp_path / f"pointer-{trial}-{step}"
        folder.mkdir()
        (folder / POINTER_FILE).write_text(json.dumps({"uri": uri, "step": step, "trial": trial}))
        return Checkpoint.from_directory(str(folder))

    state = {"x": np.zeros(2, np.float32)}
    donor = [save_checkpoint(str(tmp_path / "sweep" / "a_00000" / "checkpoints"), s, state, {"samples_consumed": 0})
             for s in (4, 8)]
    mine = save_checkpoint(str(tmp_path / "sweep" / "a_00001" / "checkpoints"), 12, state, {"samples_consumed": 0})
    cfg = config_from_dict({"name": "a_00001", "output_dir": str(tmp_path / "sweep"), "data": {"path": tiny_dataset}})
    assert resume_point(cfg, pointer(donor[0], 4, "a_00000"), "a_00001") == (donor[0], 4)
    assert resume_point(cfg, pointer(mine, 12, "a_00001"), "a_00001") == (mine, 12)
    assert resume_point(cfg, None, "a_00001") == (mine, 12)
    gone = str(tmp_path / "sweep" / "a_00000" / "checkpoints" / "step-00000002")  # pruned by its trial since
    assert resume_point(cfg, pointer(gone, 2, "a_00000"), "a_00001") == (donor[1], 8)
