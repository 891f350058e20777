"""The planner's refusal when nothing fits: at most three short lines, each clause true to the
arguments given, its parts (`min_bytes`, `dominant`, `remedy`) attributes of the PlanError; and a
hardware profile's recorded host memory, which `plan --hardware FILE` plans with.

Found by a user walkthrough: the smallest budget was only in the text (parsed with a regex), the
refusal ran to about 600 characters, said "or even micro-batch 1" at micro-batch 1 and "unless
--host-memory sets it" when it was set, named "gradient staging needs 10.0 GiB" with nothing to
change, and `plan --hardware FILE` bounded the host by the laptop it ran on.
"""

import dataclasses
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import elixir_ray
from elixir_ray.cli import main
from elixir_ray.planner.hardware import profile_hardware
from elixir_ray.units import format_bytes

GPU = elixir_ray.HardwareProfile(device="cuda:0", h2d_gbps=25.0, d2h_gbps=22.0, cpu_adam_params_per_s=1.5e9,
                                 device_adam_params_per_s=60e9, matmul_tflops=400.0, cpu_threads=16)
VOCAB = 64


class Blocks(nn.Module):
    def __init__(self, n: int = 2, width: int = 256, d: int = 32):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(d, width), nn.GELU(), nn.Linear(width, d))
                                    for _ in range(n))
        self.head = nn.Linear(d, VOCAB, bias=False)

    def forward(self, x):
        h = self.emb(x[:, :-1])
        for block in self.blocks:
            h = h + block(h)
        return F.cross_entropy(self.head(h).reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def _refusal(rows: int, seq: int, budget, n: int = 2, **kw) -> elixir_ray.PlanError:
    with torch.device("meta"):
        model = Blocks(n)
    with pytest.raises(elixir_ray.PlanError) as err:
        elixir_ray.plan(model, (torch.zeros(rows, seq, dtype=torch.long),), device_memory=budget,
                        search_checkpointing=False, **kw)
    return err.value


def _short(err: elixir_ray.PlanError) -> list[str]:
    lines = str(err).splitlines()
    assert len(lines) <= 3 and len(str(err)) <= 360 and all(len(line) <= 160 for line in lines), str(err)
    return lines


def test_a_refusal_is_three_short_lines_whose_parts_are_attributes():
    refused = _refusal(64, 65, "2MiB", hardware=GPU)
    lines = _short(refused)
    assert isinstance(refused.min_bytes, int) and refused.min_bytes > 2 * 2**20
    assert lines[0] == f"device_memory 2.0 MiB is too small: the smallest plan needs {format_bytes(refused.min_bytes)}"
    assert refused.dominant.startswith("activations at micro-batch 64 need") and refused.dominant in lines[1]
    assert lines[2] == refused.remedy and refused.remedy.startswith("use micro-batch ")
    # min_bytes is the smallest budget that fits
    with torch.device("meta"):
        model = Blocks()
    sample = (torch.zeros(64, 65, dtype=torch.long),)
    plan = elixir_ray.plan(model, sample, device_memory=refused.min_bytes, hardware=GPU, search_checkpointing=False)
    assert plan.predicted_peak_bytes <= refused.min_bytes
    with pytest.raises(elixir_ray.PlanError):
        elixir_ray.plan(model, sample, device_memory=int(refused.min_bytes * 0.99), hardware=GPU,
                        search_checkpointing=False)
    # pickled with its parts, as a Ray task's error travels
    again = pickle.loads(pickle.dumps(refused))
    assert (str(again), again.min_bytes, again.dominant, again.remedy) == \
        (str(refused), refused.min_bytes, refused.dominant, refused.remedy)
    # a config's keys go into the remedy, the last line, and the parts stay
    keyed = refused.with_remedy(f"{refused.remedy} (--set train.micro_batch=3)")
    assert str(keyed) == "\n".join(lines[:2] + [keyed.remedy]) and keyed.min_bytes == refused.min_bytes


def test_at_micro_batch_1_no_smaller_micro_batch_is_named():
    refused = _refusal(1, 65, "64KiB", hardware=GPU)
    _short(refused)
    assert refused.dominant.startswith("activations at micro-batch 1 need")
    assert "even micro-batch" not in str(refused) and "or less" not in str(refused)
    assert refused.remedy == (f"use shorter sequences or a smaller model, or give the device at least "
                              f"{format_bytes(refused.min_bytes)}")


def test_a_host_limit_is_named_by_what_set_it():
    given = _refusal(4, 17, "100KiB", n=4, hardware=GPU, host_memory="1KiB")
    lines = _short(given)
    assert lines[1].startswith("host memory sets part of that: only 1.0 KiB per rank may hold optimizer state "
                               "(host_memory);")
    assert "unless" not in str(given) and "sets it" not in str(given) and given.remedy.endswith("or raise host_memory")
    # with no host_memory, the default's source, and the option that sets it
    recorded = dataclasses.replace(GPU, host_memory_free=2**10)  # a host with 1 KiB free, as its profile says
    default = _refusal(4, 17, "100KiB", n=4, hardware=recorded)
    assert "(80% of the free host RAM)" in _short(default)[1]
    assert default.remedy.endswith("or free host RAM or set host_memory (--host-memory)")
    # the device would do, were the host roomier: the host is named first
    host_first = _refusal(4, 17, "950KiB", n=4, hardware=GPU, host_memory="1KiB")
    lines = _short(host_first)
    assert lines[0].startswith("host memory is too small for device_memory 950.0 KiB: only 1.0 KiB per rank")
    assert host_first.remedy == f"raise host_memory, or give the device at least {format_bytes(host_first.min_bytes)}"


def test_gradient_staging_that_dominates_comes_with_a_remedy():
    refused = _refusal(1, 3, "1KiB", hardware=GPU, dtype=torch.float32)
    _short(refused)
    assert refused.dominant.startswith("gradient staging needs")
    assert refused.remedy.startswith(f"give the device at least {format_bytes(refused.min_bytes)}, or shrink the "
                                     f"largest parameter, blocks.0.0.weight: each gradient buffer is a whole fp32 "
                                     f"chunk (")


def test_plan_with_a_hardware_file_bounds_the_host_by_the_memory_it_records(tmp_path, capsys):
    """A profile written by --save-hardware on a large host plans for that host on a small one: the
    device budget that needs most optimizer state on the host plans with the file's host memory
    (here scaled: the tiny GPT's ~13 MiB of state), and is refused naming the host when the file
    records too little, whatever this machine has free."""
    png = str(tmp_path / "plan.png")

    def plan(recorded: int) -> int:
        hw = tmp_path / f"hw-{recorded}.json"
        hw.write_text(dataclasses.replace(GPU, host_memory_free=recorded).to_json())
        return main(["plan", "jobs/configs/tiny.yaml", "--hardware", str(hw), "--device-memory", "16MiB",
                     "--png", png])

    assert plan(64 * 2**30) == 0
    out = capsys.readouterr()
    assert "host RAM for optimizer state: 51.2 GiB per rank (80% of the free RAM" in out.out
    assert "records, 64.0 GiB, over 1 rank(s)" in out.out and "warning" not in out.err
    assert plan(2**10) == 2
    assert "error: host memory is too small for device_memory 16.0 MiB: only 819 B per rank" in capsys.readouterr().err


def test_a_saved_hardware_profile_records_its_host_and_older_files_still_read(tmp_path):
    measured = profile_hardware("cpu", copy_bytes=2**20, adam_numel=2**16, matmul_n=64)
    assert measured.host_memory_free > 0
    older = {k: v for k, v in dataclasses.asdict(GPU).items() if k != "host_memory_free"}
    assert elixir_ray.HardwareProfile(**older).host_memory_free == 0  # not recorded
    with pytest.raises(ValueError, match="host_memory_free must be a non-negative number"):
        elixir_ray.HardwareProfile(**older, host_memory_free=-1)
    both = elixir_ray.HardwareProfile.slowest([dataclasses.replace(GPU, host_memory_free=2**30), GPU])
    assert both.host_memory_free == 2**30  # a profile that recorded none sets no limit of 0
