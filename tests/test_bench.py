"""`elixir-ray bench --smoke`: every system in its own process on a tiny CPU shape, real report files.

Also the engine's StepTimer, which the benchmark's elixir_ray breakdown is made of: which engine
activity lands in which category, and that a disabled timer changes nothing.
"""

import copy
import dataclasses
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time

import pytest
import torch

from elixir_ray import Plan, wrap
from elixir_ray.engine import manual_plan
from elixir_ray.engine.timing import BACKGROUND, CATEGORIES, StepTimer

sys.path.insert(0, os.path.dirname(__file__))
from engine_models import Toy, batches, engine_run, param_groups  # noqa: E402

BREAKDOWN = {*CATEGORIES, "compute_and_waits"}
# measured H100 runs kept as regression data; in the repository only (the sdist leaves them out)
H100_RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "h100")
needs_h100_runs = pytest.mark.skipif(not os.path.isdir(H100_RUNS), reason="tests/data/ is not in the sdist")


@pytest.mark.slow
@pytest.mark.extended
def test_bench_passes_the_memory_margin_to_elixir_ray_and_the_allocator_settings_to_every_system(tmp_path):
    from elixir_ray.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--smoke", "--systems", "reference", "elixir_ray", "fsdp2_offload", "--cap", "64MiB",
                 "--memory-margin", "0.5", "--alloc-conf", "expandable_segments:True", "--fsdp2-pageable",
                 "--out", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    assert {r["alloc_conf"] for r in rows.values()} == {"expandable_segments:True"}
    plan = rows["elixir_ray"]["plan"]
    assert plan["memory_margin"] == 0.5 and plan["predicted_peak_bytes"] <= 32 * 2**20
    # --fsdp2-pageable reaches FSDP2's process alone; on the CPU FSDP2 offloads nothing, so its result
    # does not claim either kind of host memory
    commands = {system: (out / f"{system}.log").read_text().splitlines()[0] for system in rows}
    assert [s for s, line in commands.items() if "--fsdp2-pageable" in line] == ["fsdp2_offload"], commands
    assert rows["fsdp2_offload"]["fsdp2_pinned"] is None and not rows["fsdp2_offload"].get("skipped")
    with pytest.raises(SystemExit):
        main(["bench", "--smoke", "--memory-margin", "1.5", "--out", str(out)])


@pytest.mark.slow
@pytest.mark.extended
def test_bench_on_real_text_gives_every_step_its_batch_and_sets_the_final_losses_side_by_side(tmp_path, tiny_dataset):
    """--data: every system trains on the dataset's windows in the same order, a new one each step,
    at the run config's defaults (clipping at 1.0); each step's loss is kept, the report sets the
    final losses beside the reference's (fp32 on the CPU: elixir_ray's is the reference's), and
    bench-loss.png draws them."""
    from elixir_ray.bench.systems import SHAPES, bench_batches
    from elixir_ray.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--smoke", "--systems", "reference", "elixir_ray", "--cap", "64MiB", "--data", tiny_dataset,
                 "--warmup", "0", "--steps", "10", "--out", str(out)]) == 0
    rows = {r["system"]: r for r in json.loads((out / "bench.json").read_text())["results"]}
    for row in rows.values():
        assert len(row["losses"]) == len(row["step_times"]) == 10 and row["max_grad_norm"] == 1.0
        assert row["first_loss"] == row["losses"][0] and row["final_loss"] == row["losses"][-1]
        assert row["step_seconds"] == statistics.median(row["step_times"])
    ref, ours = rows["reference"]["losses"], rows["elixir_ray"]["losses"]
    assert max(abs(a - b) for a, b in zip(ref, ours)) <= 1e-4
    assert len(set(ref)) == 10  # a new batch each step: no two losses alike
    assert "elixir_ray: final loss" in (out / "bench.md").read_text() and "(within 1%)" in (out / "bench.md").read_text()
    assert (out / "bench-loss.png").stat().st_size > 0
    batches = bench_batches(SHAPES["smoke"], 3, torch.device("cpu"), tiny_dataset)
    assert all(int(b.max()) < 257 for b in batches) and not torch.equal(batches[0], batches[1])
    assert torch.equal(batches[2], bench_batches(SHAPES["smoke"], 3, torch.device("cpu"), tiny_dataset)[2])


def test_bench_smoke_writes_json_markdown_and_png(tmp_path, capsys):
    from elixir_ray.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--smoke", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {r["system"]: r for r in report["results"]}
    for system, row in rows.items():  # each also kept on its own as it finished
        assert json.loads((out / f"{system}.json").read_text()) == {k: v for k, v in row.items()
                                                                    if k != "ratio_to_reference"}
    assert set(rows) == {"reference", "fsdp2_offload", "deepspeed_z3_offload", "elixir_ray"}
    for system in ("reference", "fsdp2_offload", "elixir_ray"):
        r = rows[system]
        assert not r.get("skipped"), r
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["peak_host_bytes"] > 0
        assert r["params"] == rows["reference"]["params"], (system, r["params"])  # same (tied) GPT
    assert rows["reference"]["ratio_to_reference"] == pytest.approx(1.0)
    for system in ("fsdp2_offload", "elixir_ray"):  # the same GPT (random weights apart) from the same batch
        for key in ("first_loss", "final_loss"):
            assert rows[system][key] == pytest.approx(rows["reference"][key], abs=0.1), (system, key)
        assert rows[system]["final_loss"] < rows[system]["first_loss"]  # and it trains
    for system in ("reference", "fsdp2_offload", "elixir_ray"):  # each took the logits a slice of rows at a time
        assert rows[system]["sliced_loss"] is True, system
    assert rows["deepspeed_z3_offload"].get("skipped") or rows["deepspeed_z3_offload"]["tokens_per_s"] > 0

    ex = rows["elixir_ray"]
    parts, step = ex["breakdown"], ex["breakdown_step_seconds"]
    assert set(parts) == BREAKDOWN
    assert all(v >= 0 for v in parts.values()), parts
    assert parts["h2d"] > 0 and parts["d2h"] > 0  # every step fetches (the optimizer drops copies) and reduces
    assert ex["background"]["cpu_adam"] + parts["device_adam"] > 0  # host chunks update on the background thread
    assert set(ex["background"]) == set(BACKGROUND)
    timed = sum(parts[k] for k in CATEGORIES)
    assert 0 < timed <= step * (1 + 1e-6) + 1e-6
    assert sum(parts.values()) == pytest.approx(step, rel=1e-6, abs=1e-9)  # the remainder closes the sum
    for system in ("reference", "fsdp2_offload"):
        assert not rows[system]["breakdown"] and rows[system]["breakdown_step_seconds"] is None
        assert rows[system]["predicted_step_seconds"] is None and rows[system]["last_updates_seconds"] is None
    assert ex["last_updates_seconds"] >= 0
    assert ex["predicted_step_seconds"] > 0 and ex["predicted_peak_bytes"] > 0  # the searched plan's prediction
    plan = Plan.from_dict(ex["plan"])  # the plan it ran, with the rates its prediction rests on
    assert plan.predicted_step_seconds == ex["predicted_step_seconds"]
    assert any(n.startswith("rates (") and "CPU AdamW" in n for n in plan.notes)
    pool = ex["pool"]  # the pool's loads per timed step: every step loads every chunk it uses again
    assert pool["fetches"] >= plan.n_chunks and 0 <= pool["prefetches"] <= pool["fetches"]
    assert not rows["reference"]["pool"]
    profile = ex["host_profile"]  # one profiled step: its wall time, then the engine's ranges, longest first
    assert profile[0][0] == "step" and profile[0][2] > 0, profile
    names = [name for name, _, _ in profile[1:]]
    assert "elixir.fetch" in names and "elixir.step" in names, profile
    ms = [t for _, _, t in profile[1:]]
    assert ms == sorted(ms, reverse=True)
    assert not rows["reference"]["host_profile"] and not ex["allocator"]  # the allocator counts are CUDA's
    for system in ("reference", "elixir_ray"):  # every system: one step's Python on the training thread
        py = rows[system]["python_profile"]
        assert py[0][0] == "step" and py[0][1] > 0 and py[0][2] > 0, py
        self_ms = [row[2] for row in py[1:]]
        assert self_ms == sorted(self_ms, reverse=True) and all(row[3] >= row[2] for row in py[1:])
    for system in ("reference", "fsdp2_offload", "elixir_ray"):  # the training thread's CPU time, and the process's
        r = rows[system]
        assert 0 < r["host_thread_cpu_seconds"] <= r["process_cpu_seconds"] * (1 + 1e-6) + 1e-6, r
    # the profiled thread is the one running the engine's hooks: they add Python calls to the same
    # model's step (which of them rank among the busiest by self time depends on the machine's load)
    assert ex["python_profile"][0][1] > rows["reference"]["python_profile"][0][1], (ex["python_profile"][0],
                                                                                  rows["reference"]["python_profile"][0])
    for system in rows:  # each system's whole output, beside the report
        log = (out / f"{system}.log").read_text()
        assert log.startswith("$ ") and "--system " + system in log and "# exit 0" in log

    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "bench.md").read_text()
    assert "| reference |" in md
    assert md.count("| elixir_ray |") == 2 and "| compute_and_waits |" in md  # main table and breakdown
    assert "| cpu_adam (background) |" in md
    assert "- elixir_ray: predicted step" in md and "chunk loads per step" in md and "one profiled step" in md
    assert f"(a pool of {plan.n_blocks} blocks, loading up to {plan.prefetch_depth} chunk(s) ahead)" in md
    assert "the plan's critical path: the forward's compute" in md
    assert "Loss from the first warm-up step to the last timed one: reference " in md
    assert "does not train as plain PyTorch does" not in md  # every system here trains the reference's way
    assert "took the head's logits all at once" not in md
    assert "CPU time per timed step of the training thread" in md and " ms in all threads)" in md
    assert "Python on the training thread" in md and "- reference: step " in md and "Python calls; " in md
    assert "| reference |" in capsys.readouterr().out


def _engine(base, placements, dos_gap=0):
    sample = (batches(1, 8)[0],)
    plan = manual_plan(base, sample, chunk_size=1024, n_blocks=3)
    plan = dataclasses.replace(plan, placements=[placements[i % len(placements)] for i in range(plan.n_chunks)],
                               dos_gap=dos_gap)
    opt = torch.optim.AdamW(param_groups(base), lr=1e-2)
    return wrap(base, opt, sample_inputs=sample, plan=plan, max_grad_norm=0.5, device="cpu")


@pytest.mark.extended
def test_bench_with_several_caps_runs_each_capped_system_once_per_cap(tmp_path):
    """Several budgets beside one reference (the planner issue's 16, 24 and 40 GiB in one run):
    each capped result kept under its cap's name and named with it in the report."""
    from elixir_ray.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "--smoke", "--systems", "elixir_ray", "--cap", "24MiB", "48MiB", "--out", str(out)]) == 0
    rows = json.loads((out / "bench.json").read_text())["results"]
    assert [(r["system"], r["cap_bytes"]) for r in rows] == [("elixir_ray", 24 << 20), ("elixir_ray", 48 << 20)]
    for r, name in zip(rows, ("24MiB", "48MiB")):
        assert json.loads((out / f"elixir_ray-{name}.json").read_text()) == r
        assert r["plan"]["budget_bytes"] == r["cap_bytes"]  # each planned under its own cap
    md = (out / "bench.md").read_text()
    assert "- elixir_ray at 24.0 MiB: predicted step" in md and "- elixir_ray at 48.0 MiB: predicted step" in md


@pytest.mark.extended
def test_a_system_keeps_its_timed_figures_before_the_extra_steps():
    """elixir_ray's breakdown and profiled steps come after the timed ones: the result is handed to
    `keep` before each, so a process that dies there (a profiler's crash) leaves what was measured."""
    from elixir_ray.bench.systems import SHAPES, run_system

    kept = []
    result = run_system("elixir_ray", SHAPES["smoke"], torch.device("cpu"), None, steps=1, warmup=1,
                        keep=lambda r: kept.append(json.loads(json.dumps(r.to_dict()))))
    assert len(kept) == 2 and all(k["tokens_per_s"] == result.tokens_per_s for k in kept)
    assert not kept[0]["breakdown"] and kept[1]["breakdown"] and not kept[1]["host_profile"]
    assert result.host_profile and result.breakdown == kept[1]["breakdown"]


def test_the_timed_window_stops_before_the_last_steps_updates_are_waited_for():
    """The last timed step's background updates belong to the next step's wait (as the warm-up's
    belong to the first timed step's), so the clock stops before `settle`; it is still called, and
    how long it took is returned."""
    from elixir_ray.bench.systems import _timed_window

    calls = []

    def step(batch):
        calls.append("step")
        return torch.zeros(())

    def settle():
        calls.append("settle")
        time.sleep(1.0)  # stands for updates still running when the device is done

    step.settle = settle
    times, loss, _, _, last_updates = _timed_window(step, [None] * 3, torch.device("cpu"))
    assert calls == ["step"] * 3 + ["settle"]
    assert len(times) == 3 and sum(times) < 1.0 <= last_updates  # a window with settle in it would take 1 s


def test_the_step_interval_leaves_out_the_first_step():
    """The first timed step of a run timed after a synced warm-up step found fewer CPU updates
    pending than any later one, so the estimate of a long run's step starts at the second."""
    from elixir_ray.bench.report import step_interval

    marks = [["device step start", t, t, -1, 0] for t in (0.0, 1.0, 3.0, 6.0)]
    assert step_interval(marks + [["step start", 0.5, 0.5, -1, 0]]) == pytest.approx(2.5)
    assert step_interval(marks[:2]) is None


def test_timer_is_off_by_default_and_timing_does_not_change_training():
    torch.manual_seed(0)
    base = Toy()
    data = batches(4, 8)
    plain, popt = _engine(copy.deepcopy(base), ["host", "device"], dos_gap=2)
    timed, topt = _engine(copy.deepcopy(base), ["host", "device"], dos_gap=2)
    timed.store.timer.enabled = True
    assert engine_run(plain, popt, data, 2, 2) == engine_run(timed, topt, data, 2, 2)
    assert plain.store.timer.seconds == dict.fromkeys(CATEGORIES, 0.0)
    assert plain.store.timer.calls == dict.fromkeys(CATEGORIES, 0)
    assert "seconds" not in plain.engine_stats()
    stats = timed.engine_stats()
    timed.store.settle_all()
    assert set(stats["seconds"]) == set(CATEGORIES)
    assert all(stats["seconds"][k] > 0 for k in ("h2d", "d2h", "device_adam"))
    assert timed.store.timer.background()["cpu_adam"] > 0
    assert plain.store.timer.background() == dict.fromkeys(BACKGROUND, 0.0)


def test_each_engine_activity_lands_in_its_category():
    torch.manual_seed(0)
    model, opt = _engine(Toy(), ["host", "device", "host", "host"], dos_gap=2)
    store, timer = model.store, model.store.timer
    timer.enabled = True
    before = dict(store.counts)
    engine_run(model, opt, batches(1, 8), 1, 1)
    store.settle_all()
    assert timer.calls["h2d"] == store.counts["fetches"] - before["fetches"] > 0
    assert timer.calls["d2h"] == store.counts["reduces"] - before["reduces"] > 0
    updated = [c for c in store.chunks if any(s.step > 0 for s in c.slots)]  # chunks the step updated
    host = [c for c in store.chunks if c.placement == "host"]
    dos = {c.index for i, c in enumerate(host) if i % 2 == 1}  # every 2nd host chunk runs on the device
    assert timer.background_calls["cpu_adam"] == sum(c.placement == "host" and c.index not in dos for c in updated) > 0
    # one region per device chunk, and one for all of the step's Deep Optimizer States chunks
    assert any(c.index in dos for c in updated)
    assert timer.calls["device_adam"] == sum(c.placement == "device" for c in updated) + 1


def test_nested_regions_count_once_and_unknown_categories_are_refused():
    timer = StepTimer(torch.device("cpu"))
    with timer.region("h2d"):  # disabled: nothing recorded
        pass
    assert timer.calls["h2d"] == 0
    timer.enabled = True
    with timer.region("h2d"):
        with timer.region("d2h"):  # inside h2d's time already
            pass
    assert timer.calls == {**dict.fromkeys(CATEGORIES, 0), "h2d": 1} and timer.seconds["d2h"] == 0.0
    with pytest.raises(KeyError, match="unknown timing category"):
        timer.region("compute")
    timer.reset()
    assert timer.totals() == dict.fromkeys(CATEGORIES, 0.0)


@pytest.mark.extended
def test_plan_comparison_smoke_runs_every_fitting_plan(tmp_path):
    out = tmp_path / "plans.json"
    proc = subprocess.run([sys.executable, "jobs/bench_plans.py", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["plan"] == "searched" and rows[0]["fits"]
    assert "# searched\n$ " in (tmp_path / "plan-0.log").read_text()  # each run's output, beside the table
    assert {r["plan"] for r in rows} >= {"all optimizer state on the host", "as much as fits on the device",
                                        "offload fraction 0.5"}
    for r in rows:
        if r["fits"]:
            assert not r.get("skipped"), r
            assert r["step_seconds"] > 0 and r["predicted_peak_bytes"] <= 24 * 2**20
            assert rows[0]["predicted_step_seconds"] <= r["predicted_step_seconds"] * (1 + 1e-9)
    assert "| searched |" in proc.stdout


@pytest.mark.extended
def test_compute_prediction_smoke_sets_both_models_beside_a_measured_step(tmp_path):
    out = tmp_path / "compute.json"
    proc = subprocess.run([sys.executable, "jobs/bench_compute.py", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["rows"]
    assert row["shape"] == "smoke" and row["estimated_kernels"] == 0 and row["distinct_kernels"] > 10
    assert row["measured_seconds"] > 0 and row["replayed_seconds"] > 0 and row["flop_model_seconds"] > 0
    assert "| smoke |" in proc.stdout


@pytest.mark.extended
def test_benchmark_matrix_refuses_unknown_stages_and_packs_what_it_ran(tmp_path):
    out = tmp_path / "matrix"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", "jobs/bench_matrix.sh", str(out), "cuda-tests", "gpt-4b-32"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown stage: gpt-4b-32" in proc.stdout
    assert not out.exists()
    # as an offline GPU machine runs it (../shared/device/gpu-call.sh): the machine recorded, each
    # stage under a time limit and packed into one archive as it finishes
    packed = tmp_path / "device-out"
    (out / "cuda-tests").mkdir(parents=True)  # a run before on the same (warm) machine left a result
    (out / "cuda-tests" / "stale.json").write_text("{}")
    proc = subprocess.run(["bash", "jobs/bench_matrix.sh", str(out), "cuda-tests"], capture_output=True, text=True,
                          timeout=600, env={**env, "PACK_INTO": str(packed), "STAGE_TIMEOUT_S": "240"})
    assert proc.returncode == 0, proc.stdout[-2000:]
    assert "== cuda-tests exited 0" in proc.stdout and (out / "cuda-tests" / "log.txt").exists()
    assert f"torch {torch.__version__}" in (packed / "machine.txt").read_text()
    with tarfile.open(packed / "cuda-tests.tgz") as archive:
        assert "cuda-tests/log.txt" in archive.getnames()
        assert "cuda-tests/stale.json" not in archive.getnames()


@pytest.mark.extended
def test_host_adam_bench_times_the_update_alone_and_beside_a_training_thread(tmp_path):
    """`jobs/bench_host_adam.py --smoke`: the engine's CPU update from bf16 gradients, timed on a
    thread of its own alone and beside the training stand-in, for each thread count and kernel."""
    from elixir_ray.bench.host_adam import thread_counts
    from elixir_ray.engine.host_kernel import host_adam_kernel

    out = tmp_path / "host_adam.json"
    proc = subprocess.run([sys.executable, "jobs/bench_host_adam.py", "--smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["beside"] for r in rows} == {"nothing", "python+kernels"}  # no device stand-ins on a CPU
    assert {r["threads"] for r in rows} == set(thread_counts(result["cpu_threads"]))
    assert all(r["params_per_s"] > 0 and 0 < r["tile"] <= result["params"] for r in rows)
    assert len({(r["beside"], r["kernel"], r["threads"], r["memory"], r["switch_interval_ms"]) for r in rows}) == len(rows)
    assert "| python+kernels |" in proc.stdout
    # each stand-in and thread count through torch's passes, and through the C kernel where it builds
    # (its threads claiming blocks as the engine runs it, and an even share each, side by side)
    kernels = {"c", "c, even shares", "torch"} if host_adam_kernel() is not None else {"torch"}
    for beside in ("nothing", "python+kernels"):
        assert {r["kernel"] for r in rows if r["beside"] == beside} == kernels
    assert all((r["tile_rule"] == "one pass") == r["kernel"].startswith("c") for r in rows)
    assert thread_counts(16) == [15, 14, 12, 8] and thread_counts(1) == [1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
@pytest.mark.parametrize("flags,message", [
    ([], "no CUDA device here, and the gpt-4b shape is a GPU benchmark"),
    (["--smoke", "--cap", "lots"], "--cap: expected a size"),
    (["--smoke", "--steps", "0"], "--steps: expected a whole number of at least 1"),
    (["--smoke", "--cap", "24MiB", "24MiB"], "--cap: each cap once"),
    (["--smoke", "--cap", "24MiB", "24.01MiB"], "--cap: each cap once"),  # the same file name
])
def test_bench_refuses_what_it_cannot_run_before_running_anything(flags, message, tmp_path, capsys):
    from elixir_ray.cli import main

    try:
        code = main(["bench", "--out", str(tmp_path / "bench"), *flags])
    except SystemExit as exc:  # argparse's own refusal
        code = exc.code
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()


@needs_h100_runs
def test_the_memory_model_predicts_the_h100s_measured_peaks_within_ten_percent():
    """The fifteen H100 runs of tests/data/h100/2026-11-26, 2026-11-26-b and 2026-11-27 (GPT 1.5B to
    10.3B, 16 to 70 GiB caps, with and without Deep Optimizer States) re-costed by
    jobs/bench_repredict.py with the memory model as it is now: each prediction within 10% of the peak the H100 measured (the
    planning acceptance bound), so a change to the model that drifts from the hardware fails here,
    without a GPU."""
    import glob
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    runs = H100_RUNS
    results = sorted(glob.glob(os.path.join(runs, "2026-11-26", "gpt-*", "elixir_ray.json"))
                     + glob.glob(os.path.join(runs, "2026-11-26-b", "call*", "gpt-*", "elixir_ray.json"))
                     + glob.glob(os.path.join(runs, "2026-11-27", "call*", "gpt-*", "elixir_ray.json")))
    assert len(results) == 15
    out = subprocess.run([sys.executable, os.path.join(root, "jobs", "bench_repredict.py"), *results],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ratios = [float(x) for x in re.findall(r"\| [\d.]+ [KMG]iB \(([\d.]+)x\) \| [^|]*\|$", out.stdout, re.M)]
    assert len(ratios) == 15, out.stdout
    assert all(0.9 <= r <= 1.1 for r in ratios), out.stdout


@pytest.mark.extended
def test_repredict_re_costs_a_plan_of_this_version_to_its_own_prediction(tmp_path):
    """A plan keeps the rates and forward compute it was costed with (version 4), so re-costing it
    with the same model gives back its predicted step and peak: what makes the re-costed figures
    of older GPU runs comparable. The smoke shape, planned on the meta device with made-up rates."""
    import re
    import subprocess
    import sys

    from elixir_ray.bench.systems import SHAPES
    from elixir_ray.model.gpt import build_gpt
    from elixir_ray.planner.api import plan
    from elixir_ray.planner.hardware import HardwareProfile

    shape = SHAPES["smoke"]
    hw = HardwareProfile(device="cpu", h2d_gbps=2.0, d2h_gbps=2.0, cpu_adam_params_per_s=2e8,
                         device_adam_params_per_s=4e8, matmul_tflops=0.05, cpu_threads=1,
                         copies_beside_cpu_adam_gbps=1.5, cpu_adam_low_grad_params_per_s=2e10)  # not this fp32 plan's
    model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device="meta")
    sample = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1))
    made = plan(model, (sample,), device_memory="8MiB", hardware=hw, dtype=torch.float32, updates_in_backward=True,
                time_compute=False)
    assert made.hardware["copies_beside_cpu_adam_gbps"] == 1.5 and made.forward_compute_seconds > 0
    assert made.updates_in_backward and made.grad_accum == 1
    assert "host" in made.placements  # the budget leaves some state on the host: copies are costed
    result = tmp_path / "elixir_ray.json"
    result.write_text(json.dumps({"system": "elixir_ray", "shape": "smoke", "cap_bytes": 8 << 20,
                                  "peak_device_bytes": made.predicted_peak_bytes, "step_seconds": 1.0,
                                  "plan": made.to_dict()}))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "jobs", "bench_repredict.py"), str(result)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    then, now = re.search(r"\| smoke \| [^|]+ \| 1\.000 s \| ([\d.]+) s \([\d.]+x\) \| ([\d.]+) s", out.stdout).groups()
    assert float(now) == pytest.approx(made.predicted_step_seconds, abs=1e-3) and then == now, out.stdout
    assert "(1.00x) | " in out.stdout.splitlines()[2]  # the peak too
    # and where the re-costed step goes: a CPU run has no device marks to set beside it
    row = re.search(r"\| smoke \| [^|]+ \| (\d+) \+ (\d+) ms \((updates, loads|copies)\) \|  \| (\d+) ms \|  \|", out.stdout)
    assert row is not None, out.stdout
    # searched afresh at the same cap and rates (and every checkpointing setting): no slower than
    # the plan searched with its module's own setting
    out = subprocess.run([sys.executable, os.path.join(root, "jobs", "bench_repredict.py"), "--search", str(result)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    found = re.search(r"\| smoke \| [^|]+ \| ([\d.]+) s \| ([\d.]+) s \(([\d.]+)x faster\) \| \d+ chunks of .* "
                      r"\((\d+) ahead\)", out.stdout)
    assert found is not None and float(found[2]) <= float(found[1]) + 1e-3 and int(found[4]) >= 1, out.stdout
    out = subprocess.run([sys.executable, os.path.join(root, "jobs", "bench_repredict.py"), "--memory-margin", "0.1",
                          str(result)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--memory-margin is for --search" in out.stderr
    # at the rate the run's own updates ran (its timeline's median): the plan's own rate (fp32
    # gradients here) gives back its prediction; one far below it, a far longer step
    for rate, check in ((2e8, lambda s: s == pytest.approx(made.predicted_step_seconds, abs=1e-3)),
                        (2e6, lambda s: s > 2 * made.predicted_step_seconds)):
        ran_at = json.loads(result.read_text())
        ran_at["timeline"] = [["cpu_adam", 0.0, 1.0, 0, int(rate)], ["cpu_adam", 1.0, 2.0, 1, int(rate)]]
        result.write_text(json.dumps(ran_at))
        out = subprocess.run([sys.executable, os.path.join(root, "jobs", "bench_repredict.py"), "--run-cpu-rate",
                              str(result)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        ran = re.search(r"\| smoke \| [^|]+ \| 1\.000 s \| [\d.]+ s \([\d.]+x\) \| ([\d.]+) s", out.stdout).group(1)
        assert check(float(ran)), (rate, out.stdout)


@needs_h100_runs
@pytest.mark.extended
def test_repredict_refuses_a_file_that_is_not_a_bench_result_before_tracing_anything(tmp_path):
    """Every input is checked first: a missing file, or JSON that is not an elixir_ray result of a
    CUDA run, is one error line naming it (exit 2), and no model is traced for the good ones."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    good = os.path.join(H100_RUNS, "2026-11-26", "gpt-1.5b", "elixir_ray.json")
    other = tmp_path / "compute.json"
    other.write_text(json.dumps({"rows": []}))
    for bad, said in ((str(tmp_path / "missing.json"), "cannot read it as JSON"),
                      (str(other), "not an elixir_ray result of a CUDA run")):
        out = subprocess.run([sys.executable, os.path.join(root, "jobs", "bench_repredict.py"), good, bad],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and said in out.stderr and bad in out.stderr, out.stderr
        assert "| shape |" not in out.stdout  # nothing was costed


def test_the_timeline_summaries_say_how_fast_updates_ran_and_how_far_the_device_trailed():
    """`update_job_rates` and `device_lag` over a made-up timeline of two steps: the rates of the
    updates inside a wait against the others, and per step the host's and the device's forward and
    backward and the device's lag at step() (the device's marks come from CUDA events on a GPU)."""
    from elixir_ray.bench.report import device_lag, update_job_rates

    timeline = [
        ["step start", 0.0, 0.0, -1, 0], ["device step start", 0.0, 0.0, -1, 0],
        ["cpu_adam_wait", 0.01, 0.05, 0, 0], ["cpu_adam", 0.0, 0.05, 0, 100_000_000],  # 2 G/s, waited for
        ["backward", 0.10, 0.10, -1, 0], ["device backward", 0.12, 0.12, -1, 0],
        ["cpu_adam", 0.15, 0.35, 3, 100_000_000],  # 0.5 G/s beside a busy training thread
        ["step", 0.30, 0.30, -1, 0], ["device step", 0.42, 0.42, -1, 0],
        ["step start", 0.31, 0.31, -1, 0], ["device step start", 0.43, 0.43, -1, 0],
        ["backward", 0.45, 0.45, -1, 0], ["device backward", 0.57, 0.57, -1, 0],
        ["step", 0.65, 0.65, -1, 0], ["device step", 0.80, 0.80, -1, 0],
    ]
    jobs = update_job_rates(timeline)
    assert jobs["updates"] == 2 and jobs["while_waited"] == pytest.approx(2e9) and jobs["while_busy"] == pytest.approx(0.5e9)
    lag = device_lag(timeline)
    assert lag["steps"] == 2
    assert lag["host_forward"] == pytest.approx((0.10 + 0.14) / 2) and lag["host_backward"] == pytest.approx((0.20 + 0.20) / 2)
    assert lag["device_forward"] == pytest.approx((0.12 + 0.14) / 2) and lag["device_backward"] == pytest.approx((0.30 + 0.23) / 2)
    assert lag["behind_at_step"] == pytest.approx((0.12 + 0.15) / 2)
    assert device_lag([e for e in timeline if not e[0].startswith("device")]) == {}  # a CPU run: no device marks


def test_the_load_summary_splits_each_steps_loads_and_stalls_at_backward():
    """`load_stalls`: per step, the compute stream's stalls for chunk loads and the loads' own time
    on their stream, in the forward and in backward (by when each ends), the median over steps."""
    from elixir_ray.bench.report import load_stalls

    def step(t0, stall_forward, stall_backward):
        return [["device step start", t0, t0, -1, 0],
                ["device load", t0 + 0.01, t0 + 0.01, 5, 0], ["device load done", t0 + 0.03, t0 + 0.03, 5, 0],
                ["device load wait", t0 + 0.02, t0 + 0.02, 5, 0],
                ["device load waited", t0 + 0.02 + stall_forward, t0 + 0.02 + stall_forward, 5, 0],
                ["device backward", t0 + 0.10, t0 + 0.10, -1, 0],
                ["device load wait", t0 + 0.12, t0 + 0.12, 2, 0], ["device load", t0 + 0.12, t0 + 0.12, 2, 0],
                ["device load done", t0 + 0.12 + stall_backward, t0 + 0.12 + stall_backward, 2, 0],
                ["device load waited", t0 + 0.12 + stall_backward, t0 + 0.12 + stall_backward, 2, 0],
                ["device step", t0 + 0.20, t0 + 0.20, -1, 0]]

    timeline = step(0.0, 0.010, 0.005) + step(0.3, 0.004, 0.007) + step(0.6, 0.006, 0.003)
    summary = load_stalls(timeline)
    assert summary["steps"] == 3
    assert summary["forward_stall"] == pytest.approx(0.006) and summary["backward_stall"] == pytest.approx(0.005)
    assert summary["forward_loads"] == pytest.approx(0.02) and summary["backward_loads"] == pytest.approx(0.005)
    assert load_stalls([e for e in timeline if "load" not in e[0]]) == {}  # marks from before the loads had them


def test_off_cuda_a_mark_records_no_device_event():
    from elixir_ray.engine.timing import StepTimer

    timer = StepTimer(torch.device("cpu"))
    timer.mark("step")  # timeline off: nothing at all
    timer.timeline = []
    timer.mark("step")
    timer.device_mark("load", None, 3)  # a mark on the device alone: none off CUDA
    assert [e[0] for e in timer.timeline] == ["step"] and timer.device_marks == [] and timer.device_timeline() == []


@pytest.mark.extended
def test_checkpoint_host_bench_times_every_mode_and_refuses_bad_sizes():
    """jobs/bench_checkpoint_host.py: a row per checkpointing mode with its fastest and median host
    times, the checkpointed modes set against the kept blocks; a bad size is one error, exit 2."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "jobs", "bench_checkpoint_host.py")
    out = subprocess.run([sys.executable, script, "--layers", "3", "--steps", "2", "--warmup", "1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {line.split("|")[1].strip(): line for line in out.stdout.splitlines() if line.startswith("| ")}
    assert set(rows) == {"mode", "none", "selective", "full"}, out.stdout
    assert re.search(r"\| full \| [\d.]+ / [\d.]+ \([\d.]+x\) \| [\d.]+ / [\d.]+ \([\d.]+x\) \|", rows["full"]), out.stdout
    bad = subprocess.run([sys.executable, script, "--width", "15"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--width" in bad.stderr


@needs_h100_runs
@pytest.mark.extended
def test_engine_host_bench_runs_a_measured_plan_on_a_small_gpt_and_refuses_other_files(tmp_path):
    """jobs/bench_engine_host.py: an H100 run's gpt-1.5b plan (24 GiB, 2026-11-27), its chunks scaled
    to a GPT of the same depth 50 wide, through the engine beside plain PyTorch on the CPU; a file
    that is not a bench result is one error naming it, exit 2."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "jobs", "bench_engine_host.py")
    out = subprocess.run([sys.executable, script, "--steps", "1", "--warmup", "0"], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "(11 chunks, 5 on the device, pool 3, 30 of 48 blocks recomputed whole)" in out.stdout, out.stdout
    for name in ("plain PyTorch", "the engine"):
        assert re.search(rf"\| {name} \| [\d.]+ / [\d.]+ \| [\d.]+ / [\d.]+ \|", out.stdout), out.stdout
    other = tmp_path / "compute.json"
    other.write_text(json.dumps({"rows": []}))
    bad = subprocess.run([sys.executable, script, str(other)], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and str(other) in bad.stderr and "not an elixir_ray result" in bad.stderr


def test_a_peers_single_rank_group_sets_what_a_launcher_would():
    """DeepSpeed asserts LOCAL_RANK in the environment even where the process group exists (a
    DeepSpeed run on the H100 stopped there, 2026-11-27): the benchmark's one-rank group sets the
    launcher's variables, each only where unset."""
    code = ("import os; from elixir_ray.bench.systems import _single_rank_group; _single_rank_group('gloo'); "
            "import torch.distributed as dist; print(dist.get_world_size(), "
            "*(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR')))")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1", "0", "0", "1", "127.0.0.1"]


def _result(system: str, first: float, final: float, **extra) -> dict:
    """A result as `elixir-ray bench` writes it, with what the report's tables read."""
    return dict(system=system, cap_bytes=24 * 2**30, tokens_per_s=1000.0, tflops=100.0, device="cuda:0",
                peak_device_bytes=2**30, peak_host_bytes=2**30, step_seconds=1.0, first_loss=first,
                final_loss=final, **extra)


def test_the_report_says_which_peer_does_not_train_as_plain_pytorch_does():
    """FSDP2 offload on the H100 (2026-11-27) ended at 13.9 where plain PyTorch fell to 9.5: a
    report that reads as if its speed compared misleads, so a system whose loss falls by less than
    half the reference's gets a line saying so. Different first losses (each its own initial
    weights) alone are not that."""
    from elixir_ray.bench.report import markdown_table, training_apart

    results = [_result("reference", 11.455, 9.512), _result("elixir_ray", 11.426, 9.647),
               _result("fsdp2_offload", 11.2, 13.945), _result("slow_learner", 11.0, 10.2),
               _result("deepspeed_z3_offload", 0, 0, skipped="deepspeed is not installed")]
    apart = training_apart(results)
    assert len(apart) == 2 and apart[0].startswith("fsdp2_offload does not train as plain PyTorch does")
    assert "from 11.200 to 13.945 where the reference's fell by 1.943" in apart[0]
    assert apart[1].startswith("slow_learner ")
    assert f"**{apart[0]}**" in markdown_table(results)
    # a reference that barely moved (a tiny shape, few steps) tells nothing apart
    assert training_apart([_result("reference", 5.0, 4.9), _result("fsdp2_offload", 5.0, 5.1)]) == []
    assert training_apart([_result("elixir_ray", 5.0, 4.0)]) == []  # no reference


def test_the_report_names_a_system_whose_loss_took_the_logits_whole():
    """DeepSpeed's hooks on the head make the GPT take all its logits at once (more activation
    memory, the same values): the report says so where the others sliced them, and is silent
    for runs from before the sliced loss, which do not say."""
    from elixir_ray.bench.report import markdown_table

    sliced = [_result("reference", 11.0, 9.5, sliced_loss=True), _result("elixir_ray", 11.0, 9.6, sliced_loss=True)]
    md = markdown_table(sliced + [_result("deepspeed_z3_offload", 11.0, 9.6, sliced_loss=False)])
    assert "all at once (not a slice of rows at a time, as the others did) in: deepspeed_z3_offload." in md
    assert "all at once" not in markdown_table(sliced)
    assert "all at once" not in markdown_table([_result("reference", 11.0, 9.5), _result("elixir_ray", 11.0, 9.6)])


def test_the_report_names_fsdp2_offloading_to_pageable_memory():
    from elixir_ray.bench.report import label, markdown_table

    pinned, pageable = _result("fsdp2_offload", 11.0, 9.6, fsdp2_pinned=True), _result("fsdp2_offload", 11.0, 9.6,
                                                                                        fsdp2_pinned=False)
    assert (label(pinned), label(pageable), label(_result("reference", 11.0, 9.5))) == (
        "fsdp2_offload", "fsdp2_offload (pageable)", "reference")
    assert "| fsdp2_offload (pageable) |" in markdown_table([_result("reference", 11.0, 9.5), pageable])
    failed = {"system": "fsdp2_offload", "skipped": "failed: OutOfMemoryError", "fsdp2_pinned": False}
    assert "| fsdp2_offload (pageable) | | skipped: failed: OutOfMemoryError |" in markdown_table([failed])


def test_a_report_without_the_reference_says_its_ratio_does_not_apply():
    from elixir_ray.bench.report import add_ratios, markdown_table

    md = markdown_table(add_ratios([_result("elixir_ray", 11.0, 9.6)]))
    assert "| elixir_ray | 24.0 GiB | 1,000 | 100.0 | n/a |" in md and "nan" not in md
    assert "| 1.00 |" in markdown_table(add_ratios([_result("reference", 11.0, 9.5)]))
