"""Decode steps replayed from CUDA graphs, one graph per padded batch size.

A decode step of a large model on a fast GPU is a few milliseconds of device work spread over
hundreds of small launches; launched one by one from Python, the launches take longer than the
work. ``DecodeGraphs`` captures the model's forward pass plus the logits of a pure decode step
(every request computes one token and samples) for a ladder of batch sizes, over static input
buffers. A step of n requests copies its inputs into the buffers, pads them to the next captured
size and replays that graph: one launch for the whole forward pass.

Padding rows write their key and value to slot 0 (the controller's reserved null block, never
read as context) and attend to one token; their outputs are dropped. Every kernel in the
captured pass must be graph-safe: no host synchronisation and no shapes that depend on values
(the Triton decode attention reads lengths and block tables on the device).

With ``capture=False`` the same static-buffer path runs eagerly (the CPU has no graphs): the
tests check the padding and buffer logic that way.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from common.torch.attention import AttentionMetadata

log = logging.getLogger(__name__)

#: (input_ids [B], positions [B], metadata) -> (hidden [B, H], float32 logits [B, vocab])
DecodeForward = Callable[
    [torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]
]


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then every multiple of 8 up to max_num_seqs (so a
    step pads by at most 7 rows past 8)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs]
    sizes += list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphs:
    """Captured decode passes over static buffers, and their replay."""

    def __init__(
        self,
        forward: DecodeForward,
        sizes: list[int],
        max_blocks: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ):
        self.forward = forward  # the pass to capture
        self.sizes = sorted(set(sizes))  # captured batch sizes, ascending
        self.block_size = block_size
        self.device = device
        self.capture = capture  # False: run the static path eagerly
        n = self.sizes[-1]
        long = {"dtype": torch.int64, "device": device}
        # Static inputs: a step's values are copied in; rows past it keep padding values.
        self.input_ids = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.slot_mapping = torch.zeros(n, **long)  # padding rows: slot 0 (null block)
        self.seq_lens = torch.ones(n, **long)  # padding rows: one token of context
        self.block_tables = torch.zeros(n, max_blocks, **long)
        self.query_start_loc = torch.arange(n + 1, **long)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # batch size -> graph
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # its static outputs

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            block_size=self.block_size,
            num_decodes=size,
            max_decode_seq_len=self.block_tables.shape[1] * self.block_size,
            query_start_loc_host=list(range(size + 1)),
            seq_lens_host=[1] * size,
        )

    def _run(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.forward(self.input_ids[:size], self.positions[:size], self._metadata(size))

    def capture_all(self) -> int:
        """Capture every size, largest first (later graphs reuse the first one's memory pool);
        returns the number captured. Each size runs eagerly twice first (compiles the kernels,
        settles the allocator)."""
        if not self.capture:
            return 0
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(self.sizes):
                for _ in range(2):
                    self._run(size)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[size] = self._run(size)
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    def padded_size(self, num_rows: int) -> int | None:
        """The captured size a step of ``num_rows`` decodes pads to (None: larger than all)."""
        i = bisect.bisect_left(self.sizes, num_rows)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Hidden states and logits [n, ...] of a pure decode step of n rows, by replay; None
        when the step is not one (the caller runs it eagerly)."""
        n = input_ids.shape[0]
        size = self.padded_size(n)
        if (
            size is None
            or n == 0
            or meta.num_decodes != n
            or meta.num_requests != n
            or meta.block_tables.shape[1] > self.block_tables.shape[1]
        ):
            return None
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        if size > n:  # rows a larger earlier step left: back to padding
            self.slot_mapping[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].zero_()
        if self.capture:
            self.graphs[size].replay()
            hidden, logits = self.outputs[size]
        else:
            hidden, logits = self._run(size)
        return hidden[:n], logits[:n]
