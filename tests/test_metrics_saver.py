"""MetricsSaver converts only the rows added since its last save, and starts over when the
controller replaces its list (a restore that drops the steps after the checkpoint)."""

import pyarrow.parquet as pq

from elixir_ray.run.outputs import MetricsSaver, metrics_table


def _row(step):
    return {"step": step, "loss": 1.0 / step, "lr": 1e-3, "grad_norm": 0.5, "tokens": 64, "step_seconds": 0.1,
            "tokens_per_s": 640.0, "samples_consumed": 4 * step, "eval_loss": 2.0 if step % 3 == 0 else None}


def test_each_save_writes_every_row_so_far_and_a_replaced_list_starts_over(tmp_path):
    uri = str(tmp_path / "metrics.parquet")
    holder = {"rows": []}
    saver = MetricsSaver(uri, lambda: holder["rows"])
    saver.save()  # nothing yet: no file
    assert not (tmp_path / "metrics.parquet").exists()
    for step in range(1, 80):
        holder["rows"].append(_row(step))
        if step % 2 == 0:
            saver.save()
            assert pq.read_table(uri).equals(metrics_table(holder["rows"]))
    holder["rows"] = [r for r in holder["rows"] if r["step"] <= 30]  # a restore to step 30
    saver.save()
    assert pq.read_table(uri).equals(metrics_table(holder["rows"]))
    holder["rows"].append(_row(31))
    saver.save()
    assert pq.read_table(uri).column("step").to_pylist() == list(range(1, 32))
    rows = holder["rows"]  # the same list cut back and grown again to its old length
    del rows[-3:]
    rows.extend(_row(step) for step in (90, 91, 92))
    saver.save()
    assert pq.read_table(uri).column("step").to_pylist() == list(range(1, 29)) + [90, 91, 92]
