"""The learning-rate schedule's length across a --resume: kept from the checkpoint, or changed with a
warning naming the jump. Real checkpoints on disk, no Ray."""

import warnings

import numpy as np
import pytest

from elixir_ray.checkpoint import save_checkpoint
from elixir_ray.config import config_from_dict
from elixir_ray.run.resolved import resolve_run
from elixir_ray.run.schedule import keep_schedule
from elixir_ray.trainer import lr_at, schedule_steps


def _cfg(tiny_dataset, **optim):
    return config_from_dict({"data": {"path": tiny_dataset}, "train": {"steps": 100},
                             "optim": {"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 0.1, **optim}})


def test_optim_schedule_steps_fixes_the_schedule_whatever_train_steps_is(tiny_dataset):
    short, long_ = _cfg(tiny_dataset, schedule_steps=60), _cfg(tiny_dataset)
    assert schedule_steps(short) == 60 and schedule_steps(long_) == 100
    assert lr_at(59, short) == pytest.approx(1e-4)  # the schedule's last step is at min_lr_ratio * lr
    assert lr_at(60, short) == lr_at(99, short) == pytest.approx(1e-4)  # past its end it stays there
    assert lr_at(59, long_) > 2e-4  # without it, the same step is partway down a longer curve


def test_a_resume_with_more_steps_keeps_the_checkpoints_schedule_and_says_what_the_lr_does(tiny_dataset, tmp_path):
    ckpt = save_checkpoint(str(tmp_path / "ck"), 60, {"x": np.zeros(2, np.float32)},
                           {"samples_consumed": 0, "schedule_steps": 60, "config": {}})
    run = resolve_run(_cfg(tiny_dataset))
    jump = f"{lr_at(60, run.config):.3g}"  # step 61 on the curve of 100 steps
    assert float(jump) > 3e-4
    with pytest.warns(UserWarning, match=r"keeps the checkpoint's length of 60 steps \(train.steps is 100\): the lr "
                                         r"goes on from 0.0001 at step 60 to 0.0001 at step 61; set "
                                         rf"optim.schedule_steps=100 to stretch it .*would then be {jump} at step 61"):
        kept = keep_schedule(run, ckpt)
    assert kept.config.optim.schedule_steps == 60 and schedule_steps(kept.config) == 60
    stretched = resolve_run(_cfg(tiny_dataset, schedule_steps=100))
    with pytest.warns(UserWarning, match=r"optim.schedule_steps=100 changes the learning-rate schedule's length from "
                                         rf"the checkpoint's 60 steps: the lr jumps from 0.0001 at step 60 to {jump} "
                                         r"at step 61"):
        assert keep_schedule(stretched, ckpt).config.optim.schedule_steps == 100
    same = resolve_run(config_from_dict({"data": {"path": tiny_dataset}, "train": {"steps": 60}}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same length: nothing to say, nothing changed
        assert keep_schedule(same, ckpt) is same
    # a checkpoint without the field (an older one) has its run's train.steps as its length
    older = save_checkpoint(str(tmp_path / "older"), 60, {"x": np.zeros(2, np.float32)},
                            {"samples_consumed": 0, "config": {"train": {"steps": 60}}})
    with pytest.warns(UserWarning, match="keeps the checkpoint's length of 60 steps"):
        assert keep_schedule(run, older).config.optim.schedule_steps == 60
