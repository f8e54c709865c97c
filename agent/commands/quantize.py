"""``infire-agent quantize``: write a calibrated FP8 checkpoint of an unquantized model folder
(engine/weights/calibrate.py), served like any pre-quantized FP8 checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MAX_TEXT_BYTES = 64 << 20


def _token_count(text: str) -> int:
    from engine.weights.calibrate import MAX_TOKENS, MIN_TOKENS

    if not text.isdigit() or not MIN_TOKENS <= int(text) <= MAX_TOKENS:
        raise argparse.ArgumentTypeError(f"tokens must be an integer in [{MIN_TOKENS}, {MAX_TOKENS}]: {text!r}")
    return int(text)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "quantize",
        help="write a calibrated FP8 checkpoint of a model folder",
        description="Quantize an unquantized model folder's decoder projections to FP8 (e4m3, one scale "
        "per output channel, per-token input scales at serving), the rounding chosen on calibration "
        "text (GPTQ on the e4m3 grid) rather than to nearest at load. Writes a "
        "compressed-tensors checkpoint the daemon loads as quantization fp8.",
    )
    p.add_argument("--model", required=True, help="the unquantized model folder")
    p.add_argument("--out", required=True, help="the folder to write (must not exist)")
    p.add_argument("--calibration", required=True,
                   help="a UTF-8 text file like what the model will serve (tokenized with the model's tokenizer)")
    p.add_argument("--tokens", type=_token_count, default=4096, help="calibration tokens used (default 4096)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="where the float32 calibration runs (an 8B needs a GPU with ~70 GB free)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from engine.errors import EngineError
    from engine.weights.calibrate import CalibrationError, calibrate
    from text.tokenizer import Tokenizer, TokenizerError

    path = Path(args.calibration)
    try:
        if not path.is_file():
            raise CalibrationError(f"calibration text {path} is not a file")
        if path.stat().st_size > MAX_TEXT_BYTES:
            raise CalibrationError(f"calibration text {path} is over {MAX_TEXT_BYTES >> 20} MiB")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise CalibrationError(f"calibration text {path} is not UTF-8: {e}") from None
        ids = Tokenizer.from_dir(args.model).encode(text, add_special_tokens=False)
        if len(ids) < args.tokens:
            raise CalibrationError(f"calibration text {path} has {len(ids)} tokens; --tokens asks for {args.tokens}")
        report = calibrate(args.model, args.out, ids[:args.tokens], device=args.device)
    except (EngineError, TokenizerError, OSError) as e:
        print(f"quantize: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), **report}))
    return 0
