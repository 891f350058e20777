"""What a sweep leaves: a table of its trials (`trials.parquet`), a chart of every trial's metric
(`trials.png`, stopped trials marked), the best trial, and the leaderboard printed at the end.

Read from each trial's own outputs (`<sweep>/<trial>/metrics.parquet` and `trial.json`), with Ray
Tune's result for the trial's sampled values and its error, so the table is the same whether the
sweep ran in one go or was resumed.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Optional

import pyarrow as pa
import pyarrow.parquet as pq

from elixir_ray import storage
from elixir_ray.run.outputs import read_metrics
from elixir_ray.sweeps.trial import TRIAL_SUMMARY, newest_checkpoint

TRIALS_FILE = "trials.parquet"
CHART_FILE = "trials.png"


@dataclass(frozen=True)
class BestTrial:
    trial_id: str
    config: dict  # the trial's sampled values, by dotted config key
    metric: float  # its final value of the sweep's metric
    checkpoint_uri: Optional[str]


@dataclass
class SweepResult:
    trials: pa.Table  # trial_id, the sampled values, status, steps, final_<metric>, best_<metric>, checkpoint_uri, error
    best: Optional[BestTrial]  # the trial with the best final metric; None when no trial reported it
    metric: str
    mode: str
    keys: list  # the space's dotted config keys: the table's columns of sampled values
    sweep_dir: str
    trials_uri: str
    chart_uri: str

    def leaderboard(self, limit: int = 20) -> str:
        """The trials from best to worst by their final metric, as lines of text."""
        rows = sorted(self.trials.to_pylist(), key=lambda r: _order(r[f"final_{self.metric}"], self.mode))
        keys = list(self.keys)
        head = ["rank", "trial", *keys, "status", "steps", f"final {self.metric}", f"best {self.metric}"]
        table = [head] + [[str(i + 1), r["trial_id"], *(_fmt(r[k]) for k in keys), r["status"], str(r["steps"]),
                           _fmt(r[f"final_{self.metric}"]), _fmt(r[f"best_{self.metric}"])]
                          for i, r in enumerate(rows[:limit])]
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
        errors = [f"{r['trial_id']}: {r['error']}" for r in rows if r["error"]]
        best = (f"best: {self.best.trial_id} ({', '.join(f'{k}={_fmt(v)}' for k, v in self.best.config.items())}), "
                f"final {self.metric} {_fmt(self.best.metric)}, checkpoint {self.best.checkpoint_uri}"
                if self.best else f"best: none (no trial reported {self.metric})")
        return "\n".join([f"sweep {self.sweep_dir}: {self.trials.num_rows} trial(s), by final {self.metric} "
                          f"({self.mode})", *lines, *(f"error: {e}" for e in errors), best,
                          f"trials: {self.trials_uri}", f"chart:  {self.chart_uri}"])


def _order(value, mode: str):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return (1, 0.0)
    return (0, value if mode == "min" else -value)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def trial_row(sweep_dir: str, trial_id: str, values: dict, metric: str, mode: str, steps_total: int,
              error: Optional[str]) -> tuple[dict, list[tuple[int, float]]]:
    """One trial's row of the table, and its metric's curve [(step, value)]."""
    run_dir = f"{sweep_dir}/{trial_id}"
    try:
        rows = read_metrics(f"{run_dir}/metrics.parquet")
    except (OSError, ValueError):
        rows = []
    curve = [(int(r["step"]), float(r[metric])) for r in rows if r.get(metric) is not None]
    summary = storage.read_json(f"{run_dir}/{TRIAL_SUMMARY}") or {}
    steps = max((int(r["step"]) for r in rows), default=0)
    if error:
        status = "error"
    elif summary.get("status") in ("finished", "stopped"):
        status = summary["status"]
    else:
        status = "finished" if steps >= steps_total else "stopped"
    pick = min if mode == "min" else max
    newest = newest_checkpoint(f"{run_dir}/checkpoints")
    return ({"trial_id": trial_id, **values, "status": status, "steps": steps,
             f"final_{metric}": curve[-1][1] if curve else None,
             f"best_{metric}": pick(v for _, v in curve) if curve else None,
             "checkpoint_uri": newest[0] if newest else None, "error": error,
             "stop_seconds": summary.get("stop_seconds")}, curve)


def trials_table(rows: list[dict], keys: list[str], metric: str) -> pa.Table:
    fields = [pa.field("trial_id", pa.string())]
    for key in keys:  # a sampled value keeps its type; mixed types (a choice of a number and a word) as text
        values = [r.get(key) for r in rows]
        try:
            fields.append(pa.field(key, pa.array(values).type))
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            fields.append(pa.field(key, pa.string()))
            for r in rows:
                r[key] = None if r.get(key) is None else str(r[key])
    fields += [pa.field("status", pa.string()), pa.field("steps", pa.int64()),
               pa.field(f"final_{metric}", pa.float64()), pa.field(f"best_{metric}", pa.float64()),
               pa.field("checkpoint_uri", pa.string()), pa.field("error", pa.string()),
               pa.field("stop_seconds", pa.float64())]
    schema = pa.schema(fields)
    return pa.Table.from_pylist([{f.name: r.get(f.name) for f in schema} for r in rows], schema=schema)


def write_table(table: pa.Table, uri: str) -> None:
    fs, path = storage.resolve(uri)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    storage.write_bytes_atomic(fs, path, sink.getvalue().to_pybytes())


def write_chart(curves: dict[str, list], statuses: dict[str, str], metric: str, uri: str, title: str) -> None:
    """Every trial's metric by step; a stopped trial's last point marked x, a failed one's o."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    for trial_id, curve in sorted(curves.items()):
        if not curve:
            continue
        steps, values = zip(*curve)
        status = statuses.get(trial_id, "")
        (line,) = ax.plot(steps, values, linewidth=1.2, label=f"{trial_id} ({status})",
                          linestyle=":" if status == "error" else "-")
        if status in ("stopped", "error"):
            ax.plot(steps[-1], values[-1], marker="x" if status == "stopped" else "o", markersize=9,
                    color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if any(curves.values()):
        ax.legend(fontsize=7, loc="best")
    else:  # every trial failed before its first step
        ax.text(0.5, 0.5, f"no trial reported {metric}", ha="center", va="center", transform=ax.transAxes)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    fs, path = storage.resolve(uri)
    storage.write_bytes_atomic(fs, path, buffer.getvalue())


def best_trial(table: pa.Table, metric: str, mode: str, keys: list[str]) -> Optional[BestTrial]:
    rows = [r for r in table.to_pylist() if r[f"final_{metric}"] is not None]
    if not rows:
        return None
    best = min(rows, key=lambda r: _order(r[f"final_{metric}"], mode))
    return BestTrial(trial_id=best["trial_id"], config={k: best[k] for k in keys}, metric=best[f"final_{metric}"],
                     checkpoint_uri=best["checkpoint_uri"])
