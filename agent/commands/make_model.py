"""``infire-agent make-model``: write a random-weight model folder (test and benchmark model)."""

from __future__ import annotations

import argparse
import os
import sys

from agent.units import parse_size

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral", "llama4")
PRESETS = ("tiny", "small", "llama-3.1-8b", "qwen3-30b-a3b", "mixtral-8x7b", "llama4-scout")


def _shard_size(text: str) -> int:
    """``5GB`` (decimal, as Hugging Face counts), ``512MiB`` or plain bytes."""
    try:
        size = parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 512MiB, 1000000)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return size


def _seed(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < 2**63:
        raise argparse.ArgumentTypeError(f"seed must be in [0, 2**63): {text}")
    return value


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "make-model",
        help="write a random-weight Hugging Face model folder",
        description="Write config.json, safetensors weights (normal, std 0.02), a byte-level "
        "BPE tokenizer and a chat template: the model tests and benchmarks run on.",
    )
    p.add_argument("--arch", required=True, choices=ARCHS, help="model architecture (its config.json and weight names)")
    p.add_argument("--preset", required=True, choices=PRESETS,
                   help="shapes: tiny and small (test models); the real models' shapes in bfloat16: llama-3.1-8b (dense "
                        "archs), qwen3-30b-a3b (qwen3_moe), mixtral-8x7b (mixtral)")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty; see --force)")
    p.add_argument("--force", action="store_true",
                   help="replace --out when it exists (only once the new model is written)")
    p.add_argument("--seed", type=_seed, default=0, help="weights seed (default 0)")
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where random numbers are drawn (auto: CUDA when present); the same seed gives "
        "the same weights on the same device type",
    )
    p.add_argument(
        "--max-shard-size",
        type=_shard_size,
        default=5 * 10**9,
        help="largest safetensors shard (default 5GB)",
    )
    p.add_argument("--quantize", choices=("fp8",), help="write a pre-quantized checkpoint (the hub's layouts)")
    p.add_argument("--fp8-layout", choices=("channel", "tensor", "block128"), default="channel",
                   help="with --quantize fp8: compressed-tensors with a scale per output channel (channel) or "
                        "per tensor (tensor), or quant_method fp8 with 128x128 blocks (block128)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from modelgen.make import ModelGenError, make_model

    from pathlib import Path

    final = Path(args.out)
    try:
        if final.exists() and (not final.is_dir() or any(final.iterdir())):
            if not args.force:
                raise ModelGenError(f"output {final} exists and is not an empty folder: pass --force to replace "
                                    "it, or choose another --out")
            if not final.is_dir() or not (final / "config.json").is_file():
                raise ModelGenError(f"--force replaces a model folder only; {final} has no config.json")
            args.out = str(final.parent / f".{final.name}.new-{os.getpid()}")  # swapped in at the end
        target = args.out
        if args.quantize:  # the unquantized folder next to the output, then written again quantized
            out_path = Path(args.out)
            if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
                raise ModelGenError(f"output {out_path} exists and is not an empty folder")
            target = out_path.parent / f".{out_path.name}.unquantized-{os.getpid()}"
        out = make_model(
            target,
            args.arch,
            args.preset,
            seed=args.seed,
            device=args.device,
            max_shard_bytes=args.max_shard_size,
            progress=lambda msg: print(msg, file=sys.stderr, flush=True),
        )
        if args.quantize:
            import shutil

            from engine.weights.fp8_writer import quantize_folder

            try:
                out = quantize_folder(out, args.out, args.fp8_layout)
            finally:
                shutil.rmtree(target, ignore_errors=True)
        if Path(out) != final:  # --force: the old folder goes only now that the new one is whole
            import shutil

            old = final.parent / f".{final.name}.old-{os.getpid()}"
            final.rename(old)
            Path(out).rename(final)
            shutil.rmtree(old, ignore_errors=True)
            out = final
    except ModelGenError as e:
        if Path(args.out) != final:
            import shutil

            shutil.rmtree(args.out, ignore_errors=True)
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
