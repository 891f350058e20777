"""`elixir-ray bench --smoke`: every system in its own process on a tiny CPU shape, real report files."""

import json
import os

import pytest

from elixir_ray.cli import main

pytestmark = pytest.mark.slow


def test_bench_smoke_writes_json_markdown_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["bench", "--smoke", "--out", str(out)]) == 0
    report = json.loads((out / "bench.json").read_text())
    rows = {r["system"]: r for r in report["results"]}
    assert set(rows) == {"reference", "fsdp2_offload", "deepspeed_z3_offload", "elixir_ray"}
    for system in ("reference", "fsdp2_offload"):
        r = rows[system]
        assert not r.get("skipped"), r
        assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["peak_host_bytes"] > 0
    assert rows["reference"]["ratio_to_reference"] == pytest.approx(1.0)
    assert rows["deepspeed_z3_offload"].get("skipped") or rows["deepspeed_z3_offload"]["tokens_per_s"] > 0
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| reference |" in (out / "bench.md").read_text()
    assert "| reference |" in capsys.readouterr().out
