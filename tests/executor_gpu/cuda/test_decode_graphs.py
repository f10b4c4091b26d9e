"""Decode replay over static, padded buffers (executor_gpu.cuda.graphs), run eagerly on the CPU.

CUDA graph capture itself needs a GPU (benchmarks/gpu_step.py checks it there); what these tests
check everywhere is the part that decides correctness: inputs copied into the static buffers,
padding rows that write only the null block, stale rows reset after a larger step, and greedy
output through the padded path token-identical to transformers.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from common.torch.attention import AttentionMetadata  # noqa: E402
from executor_gpu.cuda.graphs import DecodeGraphs, capture_sizes  # noqa: E402
from tests.support.cpu_runner import cpu_runner  # noqa: E402
from tests.support.mini_controller import MiniController  # noqa: E402


def count_replays(runner) -> list[bool]:
    """Record, per step from now on, whether the runner replayed a decode graph (the list
    grows as steps run)."""
    replays: list[bool] = []
    run = runner.graphs.run

    def counting_run(*args):
        out = run(*args)
        replays.append(out is not None)
        return out

    runner.graphs.run = counting_run
    return replays


def test_capture_sizes():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(64)[-3:] == [48, 56, 64]


def _meta(seq_lens: list[int], slots: list[int], tables: list[list[int]]) -> AttentionMetadata:
    n = len(seq_lens)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(n + 1),
        seq_lens=torch.tensor(seq_lens),
        block_tables=torch.tensor(tables),
        block_size=4,
        num_decodes=n,
        max_decode_seq_len=max(seq_lens),
        query_start_loc_host=list(range(n + 1)),
        seq_lens_host=list(seq_lens),
    )


def test_padding_rows_touch_only_the_null_block():
    seen = []

    def forward(ids, positions, meta):
        seen.append(
            (
                ids.clone(),
                meta.slot_mapping.clone(),
                meta.seq_lens.clone(),
                meta.block_tables.clone(),
            )
        )
        hidden = ids[:, None].float() * 10 + positions[:, None]
        return hidden, hidden * 2

    graphs = DecodeGraphs(
        forward, [2, 4], max_blocks=3, block_size=4, device=torch.device("cpu"), capture=False
    )
    assert graphs.capture_all() == 0
    # Three rows pad to four; the fourth writes slot 0 and reads one token of block 0.
    hidden, logits = graphs.run(
        torch.tensor([7, 8, 9]),
        torch.tensor([5, 6, 1]),
        _meta([6, 7, 2], [21, 26, 33], [[5, 6], [6, 2], [8, 0]]),
    )
    ids, slots, lens, tables = seen[-1]
    assert ids.shape[0] == 4 and slots.tolist()[:3] == [21, 26, 33]
    assert slots[3] == 0 and lens[3] == 1 and tables[3, 0] == 0
    assert tables[:3, :2].tolist() == [[5, 6], [6, 2], [8, 0]]
    assert hidden[:, 0].tolist() == [75.0, 86.0, 91.0] and logits.shape[0] == 3
    # A smaller step after it: the rows it does not fill go back to padding.
    graphs.run(torch.tensor([1]), torch.tensor([0]), _meta([1], [40], [[10]]))
    graphs.run(torch.tensor([3, 4]), torch.tensor([1, 2]), _meta([2, 3], [41, 42], [[10], [11]]))
    _, slots, lens, tables = seen[-1]
    assert slots.tolist() == [41, 42] and lens.tolist() == [2, 3]
    graphs.run(torch.tensor([3]), torch.tensor([1]), _meta([2], [41], [[10]]))
    _, slots, lens, tables = seen[-1]
    assert slots.tolist() == [41, 0] and lens.tolist() == [2, 1] and tables[1, 0] == 0
    # Not pure decode, or larger than every size: the caller runs it eagerly.
    mixed = _meta([3, 5], [1, 2], [[1], [2]])
    mixed.num_decodes = 1
    assert graphs.run(torch.tensor([1, 2]), torch.tensor([0, 1]), mixed) is None
    assert graphs.run(torch.arange(5), torch.arange(5), _meta([1] * 5, [0] * 5, [[0]] * 5)) is None


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    path = tmp_path_factory.mktemp("tiny-llama")
    hf.save_pretrained(path)
    return str(path), hf


def test_padded_decode_path_matches_hf_generate(tiny_checkpoint):
    path, hf = tiny_checkpoint
    runner = cpu_runner(path, graphs=True)
    replays = count_replays(runner)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (5, 19, 33)]
    ctl = MiniController(runner, budget=64)
    reqs = [ctl.add(f"r{i}", p, max_tokens=12 + 3 * i) for i, p in enumerate(prompts)]
    ctl.run()
    # One prefill step, then 17 decode steps of 3, 2 and 1 requests (padded to 4, 2, 1).
    assert replays.count(True) == 17 and replays[0] is False
    for req, prompt in zip(reqs, prompts):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=req.max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert req.output == ref[0, len(prompt) :].tolist()
    # Reallocating the KV cache drops the buffers bound to the old one.
    runner.initialize_kv_cache(32)
    assert runner.graphs is None
