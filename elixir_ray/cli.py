"""The `elixir-ray` command (also `python -m elixir_ray`)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from elixir_ray.checkpoint import CheckpointError
from elixir_ray.config import shipped_names
from elixir_ray.errors import ClusterError, ConfigError


def _cmd_train(args) -> int:
    from elixir_ray.run.train import train

    result = train(args.config, overrides=args.set, progress=not args.quiet, resume=args.resume)
    print(result.summary())
    if not result.final_checkpoint_written:  # the trained state is lost: a job must not read as a success
        print(f"error: training reached step {result.final_step}, but its checkpoint was not written", file=sys.stderr)
        return 1
    return 0


def _cmd_sweep(args) -> int:
    from elixir_ray.run.resolved import as_config
    from elixir_ray.sweeps.api import run_sweep
    from elixir_ray.sweeps.spec import build_spec, load_sweep_file

    kwargs = load_sweep_file(args.sweep_file, args.set)
    base = kwargs.pop("base")
    if base is None:
        raise ConfigError(f"sweep file {args.sweep_file!r}: give the base config (base: tiny, a path, or a mapping)")
    base = as_config(base, kwargs.pop("base_overrides") or None)
    spec = build_spec(base, **kwargs)
    result = run_sweep(spec, resume="auto" if args.resume == "auto" else bool(args.resume), progress=not args.quiet)
    if args.quiet:
        print(result.leaderboard())
    failed = [r for r in result.trials.to_pylist() if r["status"] == "error"]
    return 1 if failed and len(failed) == result.trials.num_rows else 0


def _cmd_prepare_data(args) -> int:
    from elixir_ray.data.dataset import prepare_dataset, read_metadata
    from elixir_ray.progress import ByteProgress

    progress = None if args.quiet else ByteProgress("tokenising")
    n = prepare_dataset(args.text_files, args.out, tokenizer=args.tokenizer, eos_token=args.eos_token,
                        text_field=args.text_field, progress=progress)
    meta = read_metadata(args.out)
    docs = int(meta["documents"])
    print(f"wrote {n:,} tokens ({docs:,} document{'s' * (docs != 1)}) from {len(args.text_files)} file(s) to "
          f"{args.out}; token ids lie below {int(meta['vocab_size']):,}: the model's vocab_size must be at least that")
    return 0


def _cmd_sample(args) -> int:
    from elixir_ray.generate import sample

    out = sample(args.checkpoint, args.prompt, max_tokens=args.tokens, temperature=args.temperature,
                 top_k=args.top_k or None, seed=args.seed, tokenizer=args.tokenizer, eos_token=args.eos_token,
                 device=args.device)
    print(f"{out.checkpoint} (step {out.step}): {out.tokens} token(s)" + (", then end of document" if out.ended else ""),
          file=sys.stderr)
    print(out.prompt + out.text)
    return 0


def _cmd_export(args) -> int:
    from elixir_ray.checkpoint.export import export_safetensors
    from elixir_ray.progress import ByteProgress

    progress = None if args.quiet else ByteProgress(f"writing {args.out}")
    source, n = export_safetensors(args.checkpoint, args.out, progress)
    print(f"wrote {n} tensors from {source} to {args.out}")
    return 0


def _cmd_plan(args) -> int:
    import json
    import os

    import torch

    from elixir_ray.config import load_config
    from elixir_ray.chunk_plan.errors import PlanError
    from elixir_ray.engine.device import resolve_device
    from elixir_ray.model.factory import check_model_step
    from elixir_ray.planner.for_config import comparison_table, plan_config
    from elixir_ray.planner.hardware import HardwareProfile, profile_hardware
    from elixir_ray.units import parse_bytes

    cfg = load_config(args.config, overrides=args.set)
    png = args.png or os.path.splitext(args.config)[0] + ".plan.png"
    if not png.lower().endswith(".png"):
        raise ConfigError(f"--png {png}: the chart is a PNG; name the file *.png")
    for flag, path in (("--png", png), ("--json", args.json), ("--save-hardware", args.save_hardware)):
        if path:
            _check_writable(flag, path)
    for flag, value in (("--device-memory", args.device_memory), ("--host-memory", args.host_memory)):
        if value is not None:
            try:
                size = parse_bytes(value)
            except ValueError as exc:
                raise ConfigError(f"{flag}: {exc}") from None
            if size <= 0:
                raise ConfigError(f"{flag} {value}: a budget must be above 0, for example {flag}=24GiB")
    if args.hardware:
        from elixir_ray.config import shipped_file

        if not os.path.isfile(args.hardware):  # --hardware h100_anchors: the rates the package ships
            args.hardware = shipped_file("hardware", args.hardware, ".json") or args.hardware
        try:
            with open(args.hardware) as f:
                hardware = HardwareProfile.from_json(f.read())
        except (OSError, ValueError, TypeError) as exc:
            what = "cannot read it" if isinstance(exc, OSError) else "not a hardware profile"
            raise ConfigError(f"--hardware {args.hardware}: {what} ({type(exc).__name__}: {exc}); "
                              f"write one with `elixir-ray plan CONFIG --save-hardware FILE` on the machine to "
                              f"plan for, or name one the package ships: "
                              f"{', '.join(shipped_names('hardware', '.json'))}") from None
        source = f"rates from {args.hardware}"
        check_model_step(cfg, torch.device(hardware.device).type)
    else:
        check_model_step(cfg, resolve_device(None).type)  # where profile_hardware measures
        _stage("measuring this machine's copy, AdamW and matmul rates")
        hardware = profile_hardware()
        source = "rates measured on this machine"
    if args.save_hardware:
        _write_text(args.save_hardware, hardware.to_json())
        print(f"... wrote the rates to {args.save_hardware} (--hardware reads them)", file=sys.stderr)
    try:
        result = plan_config(cfg, hardware, args.device_memory, args.world_size, args.host_memory, progress=_stage)
    except PlanError as exc:
        print(f"elixir-ray: error: {exc}", file=sys.stderr)
        return 2
    print(f"{source}: {hardware.device}, h2d {hardware.h2d_gbps:.1f} GB/s, d2h {hardware.d2h_gbps:.1f} GB/s, "
          f"CPU AdamW {hardware.cpu_adam_params_per_s / 1e6:,.0f} M params/s"
          + (f" ({hardware.cpu_adam_low_grad_params_per_s / 1e6:,.0f} M from bf16 gradients)"
             if hardware.cpu_adam_low_grad_params_per_s else "")
          + (f", x{hardware.cpu_adam_beside_copies:.2f} beside the device's copies"
             if hardware.cpu_adam_beside_copies else "")
          + (f", copies both ways beside it {hardware.copies_beside_cpu_adam_gbps:.1f} GB/s each"
             if hardware.copies_beside_cpu_adam_gbps else "")
          + f", matmul {hardware.matmul_tflops:.3g} TFLOPS")
    print(_host_memory_line(args, hardware, result.host_budget))
    print(result.plan.explain())
    print()
    print(comparison_table(result))
    from elixir_ray.planner.chart import write_plan_chart

    write_plan_chart(result.plan, result.profile, result.elem_bytes, png)
    print(f"chart: {png}")
    if args.json:
        _write_text(args.json, json.dumps(result.plan.to_dict(), indent=1))
        print(f"plan: {args.json}")
    return 0


def _host_memory_line(args, hardware, host_budget: int) -> str:
    """Where the host RAM limit on optimizer state came from: it moves chunks between host and
    device, so a plan for another machine must not silently take this one's."""
    from elixir_ray.planner.api import HOST_FRACTION
    from elixir_ray.planner.op_timing import device_is_here
    from elixir_ray.units import format_bytes

    line = f"host RAM for optimizer state: {format_bytes(host_budget)} per rank"
    if args.host_memory:
        return line + " (--host-memory)"
    share = f"{HOST_FRACTION:.0%} of"
    over = f"over {args.world_size} rank(s); --host-memory sets it"
    if args.hardware and hardware.host_memory_free:  # the profile's record of the host it was measured on
        recorded = format_bytes(hardware.host_memory_free)
        return line + f" ({share} the free RAM {args.hardware} records, {recorded}, {over})"
    line += f" ({share} this machine's free RAM {over})"
    if args.hardware and not device_is_here(hardware):
        print(f"elixir-ray: warning: {args.hardware} records no host memory, so the host RAM limit is this "
              f"machine's: give --host-memory for the machine the plan is for (a profile written by "
              f"--save-hardware records its host's)", file=sys.stderr)
    return line


def _check_writable(flag: str, path: str) -> None:
    """An output the command would fail to write after minutes of planning is refused first."""
    import os

    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory: give a file name")
    if not os.path.isdir(folder):
        raise ConfigError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot write in {folder}")


def _stage(line: str) -> None:
    """What the plan command is doing, on stderr (so stdout stays the plan): planning a 10B model takes
    tens of seconds."""
    print(f"... {line}", file=sys.stderr, flush=True)


def _write_text(path: str, text: str) -> None:
    """Written under a temporary name, then renamed: never half a file."""
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _cmd_bench(args) -> int:
    from elixir_ray.bench.run import main_args

    return main_args(args)


def _cmd_doctor(args) -> int:
    from elixir_ray.cluster.doctor import diagnose
    from elixir_ray.config import config_from_dict, load_config
    from elixir_ray.run.embedded_ray import RAY_STARTED_BY_TRAIN
    from elixir_ray.run.resolved import resolve_run

    cfg = load_config(args.config, overrides=args.set) if args.config else config_from_dict({}, args.set)
    cfg = resolve_run(cfg).config  # data and eval paths as a run hands them to its workers
    started = RAY_STARTED_BY_TRAIN.join(cfg)
    try:
        print(diagnose(cfg).table())
    finally:
        if started:
            RAY_STARTED_BY_TRAIN.leave()
    return 0


def _resume_choice(text: str):
    if text == "auto":
        return "auto"
    raise argparse.ArgumentTypeError(f"--resume takes no value, or auto; got {text!r}")


def at_least(low: int):
    """An argparse type: a whole number of at least `low`."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {low}, got {text!r}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elixir-ray",
        description="Train language models larger than GPU memory (the built-in GPT, or a Hugging Face model "
                    "from its config) as a fault-tolerant Ray job.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train from a YAML config. Connects to RAY_ADDRESS when set, "
                                   "otherwise starts an embedded local Ray cluster.")
    p.add_argument("config", help="path to a YAML config, or the name of one the package ships "
                   f"({', '.join(shipped_names('configs', '.yaml'))})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--resume", metavar="CKPT_URI",
                   help="continue a stopped run from a checkpoint, or from the newest valid one in a directory "
                        "(the highest step there, whichever run wrote it); train.steps must be above its step, "
                        "and the same global batch (workers x micro_batch x grad_accum) continues it exactly. "
                        "auto: this run's newest checkpoint in checkpoint.uri if it has one, else start afresh "
                        "(a resubmitted job goes on where its lost driver got to; a directory named auto: ./auto)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_train, parser=p)

    p = sub.add_parser("sweep", help="run a sweep of a config over a search space, on Ray Tune",
                       description="Run many trials of a base config over a search space (SWEEP.yaml: name, base, "
                                   "space, num_samples, metric, mode, scheduler, max_concurrent_trials, "
                                   "trials_per_gpu, storage), each a fault-tolerant run in a placement group of its "
                                   "own, the weak ones stopped early by the scheduler. Writes trials.parquet and "
                                   "trials.png in <storage>/<name> and prints a leaderboard. Connects to RAY_ADDRESS "
                                   "when set, otherwise starts an embedded local Ray cluster.")
    p.add_argument("sweep_file", metavar="SWEEP.yaml", help="the sweep file (see docs/sweeps.md)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a sweep setting (num_samples=8, scheduler.grace_period=5, space.optim.lr=[...]) "
                        "or, for any other key, the base config (train.steps=40); repeatable")
    p.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_choice, metavar="auto",
                   help="continue the sweep of this name: finished trials are kept, running ones continue from "
                        "their newest checkpoints (--resume auto: continue it if there is one, else start it)")
    p.add_argument("--quiet", action="store_true", help="no progress from Ray Tune; the leaderboard only")
    p.set_defaults(func=_cmd_sweep, parser=p)

    p = sub.add_parser("prepare-data", help="tokenise text files into a dataset",
                       description="Tokenise documents into an Arrow token dataset: each document's tokens, "
                                   "then the end-of-document token. A .jsonl, .ndjson or .json file is read as "
                                   "JSON lines, one document per line, and a .parquet file holds one per row (the "
                                   "text in --text-field); any other file is one text document. Names ending in "
                                   ".gz, .bz2, .zst or .lz4 are decompressed. Byte-level by default; --tokenizer "
                                   "takes a Hugging Face tokenizer.json.")
    p.add_argument("text_files", nargs="+", metavar="FILE",
                   help="input files: text (any bytes with the byte-level tokenizer, UTF-8 with --tokenizer), "
                        "JSON lines or Parquet")
    p.add_argument("--out", required=True, help="output path or URI (pyarrow filesystem), e.g. data/my.arrow; "
                                                "a dataset already there is replaced")
    p.add_argument("--tokenizer", default="bytes", metavar="PATH",
                   help="bytes (default: 257 ids, no file needed), or a tokenizer.json / a directory holding one "
                        "(needs the tokenizers package, in elixir_ray[hf]); set model.vocab_size (or "
                        "model.hf.vocab_size) to at least the bound the command prints")
    p.add_argument("--eos-token", metavar="TOKEN",
                   help="the token that ends each document (default: the eos_token of a tokenizer_config.json "
                        "beside the tokenizer, else the first of <|endoftext|>, </s>, ... it has)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the field of a .jsonl line, or the column of a .parquet file, that holds the text "
                        "(default: text)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr while the files are tokenised")
    p.set_defaults(func=_cmd_prepare_data, parser=p)

    p = sub.add_parser("export", help="write a checkpoint's weights as a plain state dict",
                       description="Export model weights from a checkpoint (or the newest valid one in a "
                                   "directory, such as a run's checkpoints/) as a safetensors file that "
                                   "module.load_state_dict accepts. Only the weights: no optimizer state.")
    p.add_argument("checkpoint", metavar="CKPT_URI", help="a checkpoint directory, or a directory of them")
    p.add_argument("--to", choices=["safetensors"], default="safetensors", help="output format")
    p.add_argument("out", metavar="OUT",
                   help="output file path or URI, e.g. weights.safetensors (not .pt: the file is safetensors)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr while the weights are written")
    p.set_defaults(func=_cmd_export, parser=p)

    p = sub.add_parser("sample", help="write text with a checkpoint's model",
                       description="Continue a prompt with the model of a checkpoint (or of the newest valid "
                                   "one in a directory, such as a run's checkpoints/), to see what a run "
                                   "learned. The model is rebuilt from the run config the checkpoint keeps and "
                                   "its fp32 weights are copied onto the device it runs on, where the whole "
                                   "model must fit.")
    p.add_argument("checkpoint", metavar="CKPT_URI", help="a checkpoint directory, or a directory of them")
    p.add_argument("--prompt", default="", help="the text to continue (default: none, a new document)")
    p.add_argument("--tokens", type=at_least(1), default=200, metavar="N", help="at most this many new tokens "
                                                                                  "(default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0: the likeliest token each time (default 0.8)")
    p.add_argument("--top-k", type=at_least(0), default=50, metavar="K",
                   help="sample among the K likeliest tokens; 0: all (default 50)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the sampling (default 0)")
    p.add_argument("--tokenizer", metavar="PATH", help="the tokenizer.json the run's data was prepared with "
                                                       "(not needed for the byte-level tokenizer)")
    p.add_argument("--eos-token", metavar="TOKEN", help="as given to prepare-data, if it was")
    p.add_argument("--device", help="cpu, cuda, cuda:1, ... (default: cuda when there is a GPU)")
    p.set_defaults(func=_cmd_sample, parser=p)

    p = sub.add_parser("plan", help="show the plan the planner picks for a config, and why",
                       description="Profile the config's model on the meta device (no weights), search the "
                                   "fastest placement within the budget, print the explanation beside the "
                                   "hand-made alternatives, and write a PNG of the predicted memory timeline.")
    p.add_argument("config", help="path to a YAML config, or the name of one the package ships "
                   f"({', '.join(shipped_names('configs', '.yaml'))})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.add_argument("--device-memory", metavar="BYTES", help="budget, e.g. 24GiB (default: engine.device_memory, "
                                                             "else what the device has free)")
    p.add_argument("--world-size", type=at_least(1), default=1, metavar="N", help="ranks to plan for (default 1)")
    p.add_argument("--host-memory", metavar="BYTES", help="host RAM per rank for optimizer state "
                                                          "(default: 80%% of free RAM over the ranks)")
    p.add_argument("--hardware", metavar="JSON", help="rates measured elsewhere (see --save-hardware), or h100_anchors "
                                                      "(shipped), instead of measuring this machine; give the budget too")
    p.add_argument("--save-hardware", metavar="JSON", help="also write the rates used, to plan elsewhere later")
    p.add_argument("--png", metavar="PATH", help="chart output (default: CONFIG.plan.png beside a config file; "
                                                 "NAME.plan.png here for a config the package ships, given by name)")
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON (elixir_ray.Plan.from_json reads it)")
    p.set_defaults(func=_cmd_plan, parser=p)

    p = sub.add_parser("doctor", help="probe the Ray cluster as a run would use it, one row per node",
                       description="Place one probe per worker as the config places its workers (RAY_ADDRESS's "
                                   "cluster, else an embedded local one), and print per node: its CPUs, GPUs and "
                                   "RAM, the copy and CPU AdamW rates, the all-gather bandwidth within and across "
                                   "nodes, whether each configured path reads there as on the driver, and the "
                                   "threads and placement a run would take. Nothing is trained.")
    p.add_argument("config", nargs="?", help="a run's YAML config, or the name of one the package ships (default: "
                                             "every setting's default)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    p.set_defaults(func=_cmd_doctor, parser=p)

    from elixir_ray.bench.run import add_arguments

    p = sub.add_parser("bench", help="measure elixir_ray against plain PyTorch, FSDP2 and DeepSpeed offload",
                       description="Run the same GPT through each system, each in its own process, and "
                                   "report tokens/s, TFLOPS, peak memory and the ratio to plain PyTorch.")
    add_arguments(p)
    p.set_defaults(func=_cmd_bench, parser=p)
    return parser


def _set_hint(args, unknown: list[str], argv: list[str]) -> str:
    """What was probably meant by an unknown option: one of the command's own with dashes for
    underscores (`plan --device_memory`), or a config key (`train --steps 20`: --set train.steps=20)."""
    import difflib

    from elixir_ray.config import config_keys_named

    options = list(args.parser._option_string_actions)
    for arg in unknown:
        if not arg.startswith("--"):
            continue
        flag, _, value = arg.partition("=")
        close = difflib.get_close_matches(flag.replace("_", "-"), options, n=1, cutoff=0.8)
        if close:
            return f" (did you mean {close[0]}?)"
        if hasattr(args, "set"):
            name = flag[2:]
            keys = [k for k in config_keys_named(name.rsplit(".", 1)[-1]) if "." not in name or k == name]
            if keys:
                if not value:  # the word after it as typed (argparse may have taken it as the config)
                    after = argv[argv.index(arg) + 1:argv.index(arg) + 2] if arg in argv else []
                    value = after[0] if after and not after[0].startswith("-") else "VALUE"
                return f" (config values are set with --set: --set {keys[0]}={value})"
    return " (config values are set with --set KEY=VALUE, e.g. --set train.steps=50)" if hasattr(args, "set") else ""


def _format_warning(message, category, filename, lineno, line=None) -> str:
    """Our warnings (a UserWarning raised from elixir_ray's code) as one line, like the errors: the
    file and line they were raised at say nothing to someone running the command. Others (a
    library's own) keep Python's form."""
    if issubclass(category, UserWarning) and os.path.abspath(filename).startswith(_PACKAGE_DIR):
        return f"elixir-ray: warning: {message}\n"
    return _python_format_warning(message, category, filename, lineno, line)


_python_format_warning = warnings.formatwarning
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # said by the subcommand's parser, with its usage and what was probably meant
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}{_set_hint(args, unknown, argv)}")
    before, warnings.formatwarning = warnings.formatwarning, _format_warning
    try:
        return args.func(args)
    except (ConfigError, ClusterError, CheckpointError) as exc:
        print(f"elixir-ray: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what was kept is said above (a run names its checkpoint), no traceback
        print("elixir-ray: stopped", file=sys.stderr)
        return 130
    finally:
        warnings.formatwarning = before  # for a caller in the same process (tests)


if __name__ == "__main__":
    sys.exit(main())
