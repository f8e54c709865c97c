"""``infire-agent quantize``: write a calibrated FP8 checkpoint of an unquantized model folder
(engine/weights/calibrate.py), served like any pre-quantized FP8 checkpoint."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MAX_TEXT_BYTES = 64 << 20
# The calibration text is tokenized a piece at a time, each cut at whitespace when there is some
# near its end, and only until enough tokens are in: a text with no whitespace (one "word" to
# the tokenizer's BPE) costs a piece's worth of memory, not the whole file's (50 MB: 7 GB).
PIECE_CHARS = 1 << 16


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
        _check_device(args.device)
        ids = calibration_ids(Tokenizer.from_dir(args.model), text, args.tokens)
        if len(ids) < args.tokens:
            raise CalibrationError(f"calibration text {path} has {len(ids)} tokens; --tokens asks for {args.tokens}")
        report = calibrate(args.model, args.out, ids[:args.tokens], device=args.device)
    except (EngineError, TokenizerError, OSError) as e:
        print(f"quantize: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"out": str(args.out), **report}))
    return 0


def _check_device(device: str) -> None:
    """CalibrationError for ``--device cuda`` where torch sees no CUDA device."""
    from engine.weights.calibrate import CalibrationError

    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise CalibrationError("--device cuda: this host has no CUDA device that torch can use; "
                               "run with --device cpu (or auto, which takes the GPU when there is one)")


def calibration_ids(tokenizer, text: str, tokens: int, piece_chars: int = PIECE_CHARS) -> list[int]:
    """The first ``tokens`` token ids of ``text`` (or all of them when it has fewer), tokenized a
    piece of at most ``piece_chars`` characters at a time and no further than needed."""
    ids: list[int] = []
    start = 0
    while start < len(text) and len(ids) < tokens:
        end = min(len(text), start + piece_chars)
        if end < len(text):  # cut before the last whitespace in the piece's last quarter, if any
            cut = max(text.rfind(c, end - piece_chars // 4, end) for c in " \n\t")  # (it starts a word)
            end = cut if cut > start else end
        ids.extend(tokenizer.encode(text[start:end], add_special_tokens=False))
        start = end
    return ids[:tokens]
