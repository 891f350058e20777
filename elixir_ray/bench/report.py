"""Benchmark results as a markdown table, JSON and a PNG chart."""

from __future__ import annotations

import json
import os

from elixir_ray.units import format_bytes


def add_ratios(results: list[dict]) -> list[dict]:
    ref = next((r for r in results if r["system"] == "reference" and not r.get("skipped")), None)
    for r in results:
        if ref and not r.get("skipped"):
            r["ratio_to_reference"] = r["tokens_per_s"] / ref["tokens_per_s"]
    return results


def markdown_table(results: list[dict]) -> str:
    lines = ["| system | cap | tokens/s | TFLOPS | ratio to reference | peak device | peak host | step (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("skipped"):
            lines.append(f"| {r['system']} | | skipped: {r['skipped']} | | | | | |")
            continue
        cap = format_bytes(r["cap_bytes"]) if r.get("cap_bytes") else "none"
        lines.append(
            f"| {r['system']} | {cap} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
            f"{r.get('ratio_to_reference', float('nan')):.2f} | {format_bytes(r['peak_device_bytes'])} | "
            f"{format_bytes(r['peak_host_bytes'])} | {r['step_seconds']:.3f} |"
        )
    breakdowns = [r for r in results if r.get("breakdown")]
    for r in breakdowns:
        lines.append("")
        lines.append(f"{r['system']} step breakdown (seconds per step): " +
                     ", ".join(f"{k} {v:.3f}" for k, v in r["breakdown"].items()))
    return "\n".join(lines)


def write_chart(results: list[dict], path: str, title: str) -> None:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the benchmark chart needs matplotlib: pip install 'elixir_ray[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    done = [r for r in results if not r.get("skipped")]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["system"] for r in done]
    ax1.bar(names, [r["tokens_per_s"] for r in done], color="#4472c4")
    ax1.set_ylabel("tokens/s")
    ax1.set_title("throughput")
    xs = list(range(len(done)))
    ax2.bar([x - 0.2 for x in xs], [r["peak_device_bytes"] / 2**30 for r in done], width=0.4,
            color="#ed7d31", label="device")
    ax2.bar([x + 0.2 for x in xs], [r["peak_host_bytes"] / 2**30 for r in done], width=0.4,
            color="#a5a5a5", label="host")
    ax2.set_xticks(xs, names)
    ax2.set_ylabel("GiB")
    ax2.set_title("peak memory")
    ax2.legend()
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(results: list[dict], out_dir: str, title: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, "bench.json"), "markdown": os.path.join(out_dir, "bench.md"),
             "png": os.path.join(out_dir, "bench.png")}
    with open(paths["json"], "w") as f:
        json.dump({"title": title, "results": results}, f, indent=1)
    with open(paths["markdown"], "w") as f:
        f.write(f"## {title}\n\n{markdown_table(results)}\n")
    write_chart(results, paths["png"], title)
    return paths
