"""The `elixir-ray` command (also `python -m elixir_ray`)."""

from __future__ import annotations

import argparse
import logging
import sys

from elixir_ray.checkpoint import CheckpointError
from elixir_ray.errors import ClusterError, ConfigError


def _cmd_train(args) -> int:
    from elixir_ray.api import train

    result = train(args.config, overrides=args.set, progress=not args.quiet, resume=args.resume)
    print(result.summary())
    return 0


def _cmd_prepare_data(args) -> int:
    from elixir_ray.data.dataset import prepare_dataset

    n = prepare_dataset(args.text_files, args.out)
    print(f"wrote {n:,} tokens from {len(args.text_files)} file(s) to {args.out}")
    return 0


def _cmd_export(args) -> int:
    from elixir_ray.checkpoint.export import export_safetensors

    source, n = export_safetensors(args.checkpoint, args.out)
    print(f"wrote {n} tensors from {source} to {args.out}")
    return 0


def _cmd_bench(args) -> int:
    from elixir_ray.bench.run import main_args

    return main_args(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elixir-ray",
        description="Train GPT models larger than GPU memory as a fault-tolerant Ray job.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a YAML config",
                       description="Train from a YAML config. Connects to RAY_ADDRESS when set, "
                                   "otherwise starts an embedded local Ray cluster.")
    p.add_argument("config", help="path to a YAML config (see jobs/configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=50 (repeatable)")
    p.add_argument("--resume", metavar="CKPT_URI",
                   help="continue a stopped run from a checkpoint, or from the newest valid one in a directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("prepare-data", help="tokenise text files into a dataset",
                       description="Tokenise text files (byte level) into an Arrow token dataset.")
    p.add_argument("text_files", nargs="+", help="UTF-8 text files")
    p.add_argument("--out", required=True, help="output path or URI (pyarrow filesystem), e.g. data/my.arrow")
    p.set_defaults(func=_cmd_prepare_data)

    p = sub.add_parser("export", help="write a checkpoint's weights as a plain state dict",
                       description="Export model weights from a checkpoint (or the newest valid one in a "
                                   "directory) as a safetensors file that module.load_state_dict accepts.")
    p.add_argument("checkpoint", metavar="CKPT_URI", help="a checkpoint directory, or a directory of them")
    p.add_argument("--to", choices=["safetensors"], default="safetensors", help="output format")
    p.add_argument("out", metavar="OUT", help="output file path or URI")
    p.set_defaults(func=_cmd_export)

    from elixir_ray.bench.run import add_arguments

    p = sub.add_parser("bench", help="measure elixir_ray against plain PyTorch, FSDP2 and DeepSpeed offload",
                       description="Run the same GPT through each system, each in its own process, and "
                                   "report tokens/s, TFLOPS, peak memory and the ratio to plain PyTorch.")
    add_arguments(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ClusterError, CheckpointError) as exc:
        print(f"elixir-ray: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
