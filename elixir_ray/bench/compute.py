"""How well the planner predicts compute: a plain forward and backward measured beside its predictions.

For each GPT shape the model is built in the compute dtype on the device (weights in that dtype,
as the engine's pool holds them; no optimizer) and a forward and backward is timed. Beside it:
the planner's two compute models, the traced FLOPs at the measured matmul rate, and the traced
kernels each replayed on the device (`elixir_ray.planner.op_timing`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch

from elixir_ray.bench.systems import SHAPES, BenchShape
from elixir_ray.engine.trace import trace_step
from elixir_ray.model.gpt import build_gpt
from elixir_ray.planner.cost import compute_seconds
from elixir_ray.planner.hardware import HardwareProfile
from elixir_ray.planner.op_timing import time_ops

# small shapes for a CPU (fp32): (d_model, layers, seq, micro-batch)
CPU_SHAPES = [BenchShape(f"d{d}-L{n}-T{t}-B{b}", d, n, max(1, d // 64), 2048, t, b, False, "float32")
              for d, n, t, b in [(128, 2, 64, 4), (256, 4, 256, 8), (512, 4, 256, 8), (768, 2, 512, 4)]]


@dataclass
class ComputeRow:
    shape: str
    measured_seconds: float
    flop_model_seconds: float
    replayed_seconds: float
    distinct_kernels: int
    estimated_kernels: int

    def to_dict(self) -> dict:
        return asdict(self)


def measure_shape(shape: BenchShape, hw: HardwareProfile, steps: int = 5) -> ComputeRow:
    device, dtype = torch.device(hw.device), getattr(torch, shape.dtype)
    torch.manual_seed(0)
    model = build_gpt(shape.model_shape(), shape.activation_checkpointing, device=device).to(dtype)
    batch = torch.randint(0, shape.vocab_size, (shape.micro_batch, shape.seq_len + 1), device=device)
    trace = trace_step(model, (batch,), None, dtype)
    replayed = time_ops(trace.ops, hw)
    times = []
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        model(batch).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i >= 2:  # two warm-up steps
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return ComputeRow(shape=shape.name, measured_seconds=statistics.median(times),
                      flop_model_seconds=compute_seconds(trace.flops, hw), replayed_seconds=replayed.step_seconds,
                      distinct_kernels=replayed.timed + len(replayed.estimated),
                      estimated_kernels=len(replayed.estimated))


def default_shapes(device: torch.device) -> list[BenchShape]:
    return [SHAPES["gpt-1.5b"], SHAPES["gpt-4b"]] if device.type == "cuda" else CPU_SHAPES


def markdown(rows: list[ComputeRow]) -> str:
    lines = ["| shape | measured forward+backward | replayed kernels | (error) | traced FLOPs / matmul rate "
             "| (error) |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        m = r.measured_seconds
        lines.append(f"| {r.shape} | {m * 1e3:,.1f} ms | {r.replayed_seconds * 1e3:,.1f} ms | "
                     f"{(r.replayed_seconds - m) / m:+.0%} | {r.flop_model_seconds * 1e3:,.1f} ms | "
                     f"{(r.flop_model_seconds - m) / m:+.0%} |")
    return "\n".join(lines)
