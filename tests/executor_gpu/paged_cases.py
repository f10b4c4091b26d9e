"""Attention metadata of fabricated steps over a random paged cache, shared by the kernel tests
(the CPU kernel and the Triton one are checked against the same torch reference)."""

from __future__ import annotations

import torch

from common.torch.attention import AttentionMetadata


def decode_meta(
    lens: list[int], block_size: int, num_blocks: int, seed: int, extra_columns: int = 1
) -> AttentionMetadata:
    """A pure decode step of requests with ``lens`` tokens on random blocks (never the null
    block, none shared: a request's new token goes to a block no other request reads, as in the
    engine), with ``extra_columns`` zero padding columns in the block tables."""
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens) + extra_columns
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.long)
    free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    for i, n in enumerate(lens):
        used = -(-n // block_size)
        tables[i, :used] = torch.tensor(free[:used])
        del free[:used]
    return AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        query_start_loc=torch.arange(len(lens) + 1),
        seq_lens=torch.tensor(lens),
        block_tables=tables,
        block_size=block_size,
        num_decodes=len(lens),
        max_decode_seq_len=max(lens),
        query_start_loc_host=list(range(len(lens) + 1)),
        seq_lens_host=list(lens),
    )


def step_meta(
    lens: list[int], new: list[int], block_size: int, num_blocks: int, seed: int
) -> AttentionMetadata:
    """A step in which request i computes its last ``new[i]`` of ``lens[i]`` tokens (1: a
    decode; all: a prefill from scratch; else a chunk after cached tokens), on random blocks
    as in ``decode_meta``, each new token with its cache slot."""
    meta = decode_meta(lens, block_size, num_blocks, seed)
    meta.num_decodes = 0
    while meta.num_decodes < len(new) and new[meta.num_decodes] == 1:
        meta.num_decodes += 1
    meta.query_start_loc_host = [0]
    for k in new:
        meta.query_start_loc_host.append(meta.query_start_loc_host[-1] + k)
    meta.query_start_loc = torch.tensor(meta.query_start_loc_host)
    meta.slot_mapping = torch.tensor(
        [
            int(meta.block_tables[i, pos // block_size]) * block_size + pos % block_size
            for i, (n, k) in enumerate(zip(lens, new))
            for pos in range(n - k, n)
        ]
    )
    return meta


def mixed_meta(block_size: int, num_blocks: int, seed: int) -> AttentionMetadata:
    """Two decodes (9 and 14 tokens) then a request computing its last 3 of 7 tokens: five new
    tokens, each with its cache slot."""
    return step_meta([9, 14, 7], [1, 1, 3], block_size, num_blocks, seed)


def last_token_slots(meta: AttentionMetadata) -> torch.Tensor:
    """The cache slot of each request's last token (where a decode writes its key/value)."""
    bs = meta.block_size
    return torch.tensor(
        [
            int(meta.block_tables[i, (n - 1) // bs]) * bs + (n - 1) % bs
            for i, n in enumerate(meta.seq_lens_host)
        ]
    )
