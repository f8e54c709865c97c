"""``infire-agent make-model``: write a random-weight model folder (test and benchmark model)."""

from __future__ import annotations

import argparse
import os
import sys

from agent.units import parse_size

ARCHS = ("llama", "qwen2", "qwen3", "mistral")
PRESETS = ("tiny", "small", "llama-3.1-8b")


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
                   help="shapes: tiny and small (test models), llama-3.1-8b (the real model's shapes, bfloat16)")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
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

    try:
        target = args.out
        if args.quantize:  # the unquantized folder next to the output, then written again quantized
            from pathlib import Path

            out_path = Path(args.out)
            if out_path.exists() and (not out_path.is_dir() or any(out_path.iterdir())):
                raise ModelGenError(f"output {out_path} exists and is not an empty directory")
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
    except ModelGenError as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0
