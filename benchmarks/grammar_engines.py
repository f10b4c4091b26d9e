"""Grammar engines for the controller, measured side by side: llguidance, xgrammar, outlines-core.

For each engine and each vocabulary (the default model's 49,152 tokens, and a ~150k one): the
time to set up its tokenizer, to compile a realistic JSON schema and a regex, and to compute the
allowed-token mask per token while walking a valid output (each step: mask, then accept the
token). Every engine runs in a child process of its own, so that one engine's imports (xgrammar
imports torch) neither slow nor pollute another's; the child also reports whether torch was
imported. Ratios are against the fastest engine of the same run.

The ~150k vocabulary: no Qwen-style tokenizer is on disk (no model hub here), so the default
model's tokenizer.json is extended to 151,643 tokens (Qwen2's count) with BPE merges of two
existing word-like tokens (a deterministic random choice): a valid byte-level BPE tokenizer
whose vocabulary trie is as large as Qwen's, its tokens a little longer on average.

    python benchmarks/grammar_engines.py [--model-dir DIR] [--engines llguidance,xgrammar,outlines]
        [--json out.json] [--timeout 600]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
QWEN_VOCAB = 151_643  # Qwen2's BPE vocabulary (without its added tokens)

# A realistic extraction schema: nested objects, enums, arrays, bounded numbers, required fields.
SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "status": {"type": "string", "enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 64},
                "email": {"type": "string"},
                "tier": {"type": "string", "enum": ["free", "pro", "enterprise"]},
                "age": {"type": "integer", "minimum": 18, "maximum": 120},
            },
            "required": ["name", "tier"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                    "unit_price": {"type": "number", "minimum": 0, "maximum": 100000},
                },
                "required": ["sku", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "total": {"type": "number", "minimum": 0},
        "gift": {"type": "boolean"},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "customer", "items", "total"],
    "additionalProperties": False,
}
INSTANCE = {
    "order_id": "ABC-123456",
    "status": "shipped",
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro", "age": 36},
    "items": [
        {"sku": "PEN-BLUE", "quantity": 12, "unit_price": 1.25},
        {"sku": "NOTEBOOK-A5", "quantity": 3, "unit_price": 4.5},
        {"sku": "INK-BLACK-50ML", "quantity": 2, "unit_price": 7.99},
    ],
    "total": 43.98,
    "gift": False,
    "notes": "Leave at the front desk, please.",
}
REGEX = r"[A-Z][a-z]{2,12} [0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}Z (ok|fail|retry)"
REGEX_TEXT = "Deploy 2026-12-01T22:46:45Z retry"


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted: printable stand-in character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(tok_json: dict) -> list[bytes]:
    """Each token id's bytes (added tokens: their text), for engines that take a byte vocabulary."""
    dec = _byte_decoder()
    vocab = tok_json["model"]["vocab"]
    out = [b""] * (max(vocab.values()) + 1)
    for text, i in vocab.items():
        out[i] = bytes(dec[c] for c in text)
    for added in tok_json.get("added_tokens", []):
        if added["id"] >= len(out):
            out.extend([b""] * (added["id"] + 1 - len(out)))
        out[added["id"]] = added["content"].encode()
    return out


def extend_vocab(tok_json: dict, target: int, seed: int = 0) -> dict:
    """A copy of a byte-level BPE tokenizer.json grown to `target` tokens by merging pairs of
    existing word-like tokens (a valid BPE: every new token has its merge)."""
    data = json.loads(json.dumps(tok_json))
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    words = [t for t in vocab if len(t) >= 2 and t.strip("Ġ").isalpha()]
    rng = random.Random(seed)
    while len(vocab) < target:
        a, b = rng.choice(words), rng.choice(words)
        if b.startswith("Ġ") or a + b in vocab:
            continue
        vocab[a + b] = len(vocab)
        merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
    return data


def _stats(times: list[float]) -> dict:
    """Per-token mask times in microseconds."""
    us = sorted(t * 1e6 for t in times)
    return {
        "mean_us": statistics.fmean(us),
        "p50_us": us[len(us) // 2],
        "max_us": us[-1],
        "tokens": len(us),
    }


# --- one engine, in its own process -----------------------------------------------------------


def _walk(mask_fn, accept_fn, ids: list[int]) -> dict:
    """Mask then accept along `ids`; per-token mask times (the first mask is reported apart:
    engines build lazily)."""
    times = []
    for t in ids:
        start = time.perf_counter()
        mask_fn()
        times.append(time.perf_counter() - start)
        if not accept_fn(t):
            raise RuntimeError(f"token {t} refused")
    start = time.perf_counter()
    mask_fn()  # the final mask (only EOS allowed)
    times.append(time.perf_counter() - start)
    return {"first_mask_us": times[0] * 1e6, **_stats(times[1:])}


def run_llguidance(tok_str: str, cases: list[dict]) -> dict:
    import llguidance as llg

    start = time.perf_counter()
    tok = llg.LLTokenizer(tok_str)
    out = {"tokenizer_s": time.perf_counter() - start}
    for case in cases:
        start = time.perf_counter()
        if case["kind"] == "json":
            grammar = llg.LLMatcher.grammar_from_json_schema(case["spec"])
        else:
            grammar = llg.LLMatcher.grammar_from_regex(case["spec"])
        matcher = llg.LLMatcher(tok, grammar)
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        compile_s = time.perf_counter() - start
        walk = _walk(matcher.compute_bitmask, matcher.consume_token, case["ids"])
        ok = matcher.is_accepting()
        # Replay (the failover path): a fresh matcher fed the accepted tokens, no masks.
        start = time.perf_counter()
        again = llg.LLMatcher(tok, grammar)
        again.consume_tokens(case["ids"])
        replay = (time.perf_counter() - start) / len(case["ids"]) * 1e6
        out[case["name"]] = {
            "compile_s": compile_s,
            **walk,
            "accepting": ok,
            "replay_us_per_token": replay,
        }
    return out


def run_xgrammar(vocab: list[bytes], eos: int, cases: list[dict]) -> dict:
    start = time.perf_counter()
    import xgrammar as xgr

    out = {"import_s": time.perf_counter() - start}
    start = time.perf_counter()
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
    out["tokenizer_s"] = time.perf_counter() - start
    bitmask = xgr.allocate_token_bitmask(1, len(vocab))
    for case in cases:
        start = time.perf_counter()
        if case["kind"] == "json":
            compiled = compiler.compile_json_schema(
                json.dumps(case["spec"]), any_whitespace=False, separators=(",", ":")
            )
        else:
            compiled = compiler.compile_regex(case["spec"])
        matcher = xgr.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - start
        walk = _walk(
            lambda m=matcher: m.fill_next_token_bitmask(bitmask), matcher.accept_token, case["ids"]
        )
        ok = matcher.accept_token(eos)
        out[case["name"]] = {"compile_s": compile_s, **walk, "accepting": ok}
    return out


def run_outlines(vocab: list[bytes], eos: int, cases: list[dict]) -> dict:
    import numpy as np
    import outlines_core as oc

    start = time.perf_counter()
    table: dict[bytes, list[int]] = {}
    for i, b in enumerate(vocab):
        if i != eos and b:
            table.setdefault(b, []).append(i)
    voc = oc.Vocabulary(eos, table)
    out = {"tokenizer_s": time.perf_counter() - start}
    words = np.zeros((len(vocab) + 31) // 32, dtype=np.int32)
    for case in cases:
        start = time.perf_counter()
        if case["kind"] == "json":
            regex = oc.json_schema.build_regex_from_schema(json.dumps(case["spec"]), r"")
        else:
            regex = case["spec"]
        index = oc.Index(regex, voc)
        guide = oc.Guide(index)
        compile_s = time.perf_counter() - start

        def mask(g=guide):
            g.write_mask_into(words.ctypes.data, words.size, 4)

        def accept(t, g=guide):
            g.advance(t)
            return True

        walk = _walk(mask, accept, case["ids"])
        out[case["name"]] = {"compile_s": compile_s, **walk, "accepting": guide.is_finished()}
    return out


def child(engine: str, tok_path: str, cases_path: str) -> None:
    """Measure one engine; print its JSON on stdout."""
    tok_str = Path(tok_path).read_text()
    tok_json = json.loads(tok_str)
    cases = json.loads(Path(cases_path).read_text())
    vocab = token_bytes(tok_json)
    eos = next(a["id"] for a in tok_json["added_tokens"] if a["content"] == "<|im_end|>")
    if engine == "llguidance":
        out = run_llguidance(tok_str, cases)
    elif engine == "xgrammar":
        out = run_xgrammar(vocab, eos, cases)
    else:
        out = run_outlines(vocab, eos, cases)
    out["torch_imported"] = "torch" in sys.modules
    print(json.dumps(out))


# --- the parent: vocabularies, cases, children, table ------------------------------------------


def _cases(tok_str: str) -> list[dict]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_str)
    text = json.dumps(INSTANCE, separators=(",", ":"))
    return [
        {"name": "json", "kind": "json", "spec": SCHEMA, "ids": tok.encode(text).ids},
        {"name": "regex", "kind": "regex", "spec": REGEX, "ids": tok.encode(REGEX_TEXT).ids},
    ]


def _run_child(engine: str, tok_file: Path, cases_file: Path, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", engine, str(tok_file), str(cases_file)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: dict) -> None:
    for vocab_name, per_engine in results.items():
        print(f"\n== vocabulary {vocab_name}")
        ok = {e: r for e, r in per_engine.items() if "error" not in r}
        for e, r in per_engine.items():
            if "error" in r:
                print(f"{e:<11} ERROR {r['error']}")
        for case in ("json", "regex"):
            best_c = min((r[case]["compile_s"] for r in ok.values()), default=1)
            best_m = min((r[case]["mean_us"] for r in ok.values()), default=1)
            print(f"-- {case}")
            print(
                f"{'engine':<11} {'tok init s':>10} {'compile ms':>11} {'x':>6} "
                f"{'1st mask us':>11} {'mask mean us':>12} {'x':>6} {'p50':>8} {'max':>9} "
                f"{'torch':>6}"
            )
            for e, r in ok.items():
                c = r[case]
                print(
                    f"{e:<11} {r['tokenizer_s']:>10.2f} {c['compile_s'] * 1e3:>11.1f} "
                    f"{c['compile_s'] / best_c:>6.1f} {c['first_mask_us']:>11.0f} "
                    f"{c['mean_us']:>12.1f} {c['mean_us'] / best_m:>6.1f} {c['p50_us']:>8.1f} "
                    f"{c['max_us']:>9.1f} {str(r['torch_imported']):>6}"
                )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(*sys.argv[2:5])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=os.environ.get("TANDEM_MODEL_DIR", str(DEFAULT_MODEL)))
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines")
    ap.add_argument("--vocabs", default="49k,150k", help="49k (the model's), 150k (extended)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per engine and vocab")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--workdir", default="/tmp/tandem-grammar-bench")
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    base = json.loads((Path(args.model_dir) / "tokenizer.json").read_text())
    vocabs = {"49k": base}
    if "150k" in args.vocabs:
        vocabs["150k"] = extend_vocab(base, QWEN_VOCAB)
    results: dict = {}
    for name, tok_json in vocabs.items():
        if name not in args.vocabs.split(","):
            continue
        tok_str = json.dumps(tok_json)
        tok_file, cases_file = work / f"tokenizer-{name}.json", work / f"cases-{name}.json"
        tok_file.write_text(tok_str)
        cases_file.write_text(json.dumps(_cases(tok_str)))
        label = f"{name} ({len(token_bytes(tok_json))} tokens)"
        results[label] = {}
        for engine in args.engines.split(","):
            results[label][engine] = _run_child(engine, tok_file, cases_file, args.timeout)
            print(f"{label} {engine}: done", file=sys.stderr, flush=True)
    _table(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
