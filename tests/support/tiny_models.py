"""Tiny random checkpoints of every served architecture, saved by transformers, and the checks
that hold Tandem's runners to transformers on them (greedy tokens through chunked prefill,
recompute after preemption and prefix-cache hits).

Each kind is a few layers of width 64 (4 query heads, 2 KV heads of 16) over a 256-token
vocabulary, float32, with weights drawn N(0, 0.3^2) (larger than transformers' init, so
that every part of a layer moves the logits); sliding-window kinds have a window of 24 tokens,
so the prompts here (up to ~70 tokens) run past it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

WINDOW = 24
VOCAB = 256
_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


def tiny_config(kind: str, vocab_size: int = VOCAB) -> Any:
    """The transformers config of a tiny checkpoint of ``kind`` (see KINDS)."""
    import transformers

    _BASE = {**_SHAPE, "vocab_size": vocab_size}

    if kind == "qwen3":
        return transformers.Qwen3Config(**_BASE)
    if kind == "mistral-window":
        return transformers.MistralConfig(
            **{**_BASE, "num_hidden_layers": 3}, sliding_window=WINDOW
        )
    if kind == "gemma2":
        return transformers.Gemma2Config(
            **{**_BASE, "num_hidden_layers": 4, "tie_word_embeddings": True},
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,  # not head_dim: the query scale is its own setting
            attn_logit_softcapping=5.0,  # low enough to bend these tiny models' scores
            final_logit_softcapping=3.0,
        )
    if kind == "gemma3":
        return transformers.Gemma3TextConfig(
            **{**_BASE, "num_hidden_layers": 6, "tie_word_embeddings": True},
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    if kind == "qwen3-moe":
        return transformers.Qwen3MoeConfig(
            **{**_BASE, "num_hidden_layers": 3},
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],  # one dense layer between sparse ones
        )
    if kind == "mixtral-window":
        return transformers.MixtralConfig(
            **_BASE, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW
        )
    raise ValueError(kind)


#: Every tiny kind, with whether it has sliding-window layers.
KINDS = {
    "qwen3": False,
    "mistral-window": True,
    "gemma2": True,
    "gemma3": True,
    "qwen3-moe": False,
    "mixtral-window": True,
}


def save_tiny_checkpoint(kind: str, path: str, seed: int = 0, vocab_size: int = VOCAB) -> Any:
    """Save a random tiny checkpoint of ``kind`` to ``path``; returns the transformers model
    (float32, eval mode) holding the same weights."""
    import torch
    import transformers

    config = tiny_config(kind, vocab_size)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(path)
    return hf


def random_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    """Prompts of random token ids of the given lengths."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def hf_greedy(hf: Any, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of ``n`` tokens (no EOS stop)."""
    import torch

    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@dataclass
class GreedyChecks:
    """What ``run_greedy_checks`` compared (for the report)."""

    tokens: int = 0  # generated tokens compared with transformers'
    mismatches: list[str] = field(default_factory=list)  # which checks differed


def run_greedy_checks(runner: Any, hf: Any, budget: int = 12) -> GreedyChecks:
    """Greedy tokens of ``runner`` against transformers: three prompts batched under a small
    token budget (chunked prefill), one preempted after 3 tokens and resumed by recompute, and
    one that hits the cached prefix of another (its first blocks shared, computed already)."""
    from tests.support.mini_controller import BLOCK, MiniController

    checks = GreedyChecks()

    def compare(name: str, got: list[int], prompt: list[int]) -> None:
        want = hf_greedy(hf, prompt, len(got))
        checks.tokens += len(got)
        if got != want:
            checks.mismatches.append(f"{name}: {got} != {want}")

    prompts = random_prompts(1, [70, 37, 9])
    runner.reset()
    ctl = MiniController(runner, budget=budget)
    reqs = [ctl.add(f"g{i}", p, max_tokens=8) for i, p in enumerate(prompts)]
    ctl.run()
    for i, (req, p) in enumerate(zip(reqs, prompts)):
        compare(f"batched {i}", req.output, p)

    runner.reset()
    ctl = MiniController(runner, budget=budget)
    part = ctl.add("p", prompts[0], max_tokens=3)
    ctl.run()
    resumed = ctl.add("p", prompts[0], max_tokens=10, output=part.output)
    ctl.run()
    compare("recompute", resumed.output, prompts[0])

    runner.reset()
    ctl = MiniController(runner, budget=budget)
    first = ctl.add("a", prompts[0], max_tokens=2)
    ctl.run()
    shared = 3  # blocks of "a"'s prompt that "b" reuses as a cached prefix
    other = prompts[0][: shared * BLOCK] + prompts[1][:20]
    hit = ctl.add("b", other, max_tokens=8, blocks=first.blocks[:shared], computed=shared * BLOCK)
    ctl.run()
    compare("prefix hit", hit.output, other)
    return checks
