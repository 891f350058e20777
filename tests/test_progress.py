"""The progress output when it is not a terminal (a log file, `ray job logs`)."""

import io

from elixir_ray.progress import ByteProgress, ProgressBar


def test_a_log_shows_the_first_step_seen_every_nth_and_the_last_with_notes_between():
    """A resumed run starts past step 1: its first line came only at the next multiple of log_every."""
    out = io.StringIO()
    bar = ProgressBar(total=30, every=10, stream=out)
    for step in range(13, 31):
        bar.update(step, 2.0, 1000.0)
        if step == 15:
            bar.note("step 15: eval loss 2.5000")
    lines = out.getvalue().splitlines()
    assert [line.split("  ")[0].split()[-1] for line in lines if line.startswith("[")] == ["13/30", "20/30", "30/30"]
    assert "step 15: eval loss 2.5000" in lines
    first = next(line for line in lines if line.startswith("["))
    assert first.endswith("ETA --")  # nothing to estimate from before a second step: not "0:00"


def test_the_summary_says_when_a_restart_failed_again_before_its_restore():
    """A second failure before the first restart's restore left "restored step 0 from  on 2 worker(s)"."""
    from types import SimpleNamespace

    import pyarrow as pa

    from elixir_ray.run.outputs import Result
    from elixir_ray.cluster.controller import RestartRecord

    restarts = [RestartRecord(reason="worker 1 died (training)", failed_at=0.0, failed_step=2, world_size=2),
                RestartRecord(reason="worker 0 died (setting up the workers)", failed_at=1.0, failed_step=2,
                              world_size=2, restored_from="object_store", restored_step=2)]
    result = Result(metrics=pa.table({"step": [1, 2, 3], "loss": [3.0, 2.5, 2.0]}), checkpoint_uri=None,
                    plan=SimpleNamespace(world_size=2, strategy="chunked", dtype="float32"), run_dir="runs/t",
                    metrics_uri="runs/t/metrics.parquet", seconds=1.0, restarts=restarts, final_step=3)
    lines = [line for line in result.summary().splitlines() if line.startswith("restart:")]
    assert lines == ["restart: worker 1 died (training); failed again before its restore",
                     "restart: worker 0 died (setting up the workers); restored step 2 from object_store on 2 "
                     "worker(s)"]


def test_a_long_write_in_a_log_shows_a_line_every_interval_and_the_total_at_the_end():
    now = [100.0]
    out = io.StringIO()
    progress = ByteProgress("writing w.safetensors", stream=out, every_s=10.0, clock=lambda: now[0])
    progress.begin(4 * 2**30)
    for _ in range(4 * 8):  # 128 MiB blocks, 4 s apart: 512 MiB in each 16 s
        now[0] += 4.0
        progress.add(2**27)
    progress.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == "writing w.safetensors: 384.0 MiB of 4.00 GiB (9%), 32.0 MiB/s, 1:56 left"  # 12 s in
    assert len(lines) == 32 * 4 // 12 + 1  # one every 12 s (the first block at least 10 s after the last line)
    assert lines[-1] == "writing w.safetensors: 4.00 GiB in 2:08"
