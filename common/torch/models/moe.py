"""The mixture-of-experts feed-forward block (Qwen3-MoE in qwen3_moe.py, Mixtral in mixtral.py).

The router (``gate``, [experts, hidden]) scores every expert per token; a softmax in float32,
the top ``num_experts_per_tok`` experts, their probabilities renormalized to sum to 1 when the
family says so (Mixtral always, Qwen3-MoE with ``norm_topk_prob``; cast back to the activations'
dtype); the token's output is the probability-weighted sum of those experts' SwiGLU MLPs.

The checkpoint stores every expert separately (``experts.E.gate_proj`` etc., Mixtral's
``experts.E.w1`` etc.); they are loaded into per-expert holders, then stacked once into two
[experts, in, out] tensors (``stack_experts``, from the model's ``post_load``), which the
forward reads:

- eagerly (CPU, CUDA), tokens are grouped by expert (one sort of the (token, slot) pairs),
  each expert runs two matmuls over its tokens, and the outputs are scattered back, weighted:
  one loop over the experts, none over tokens;
- on XLA (static shapes: the split by expert would change every step's program), and while a
  CUDA graph is captured (the split reads the counts on the host, which a capture forbids;
  captured graphs replay decode steps), every expert runs over every token and a dense
  routing matrix (zero for unselected experts) combines them: experts / top_k times the
  arithmetic, but one program for any routing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.torch.models.linear import Linear, ShardedWeight
from common.torch.models.llama import LlamaArgs
from common.torch.parallel import split_range


@dataclass
class MoeArgs(LlamaArgs):
    """Llama's hyper-parameters plus the mixture of experts'."""

    num_experts: int  # experts per sparse layer
    top_k: int  # experts per token
    moe_intermediate_size: int  # MLP width of one expert
    norm_topk_prob: bool  # renormalize the top-k probabilities to sum to 1
    sparse_layers: list[bool]  # per layer: a mixture of experts (else a dense MLP)

    @staticmethod
    def fields_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """The MoE fields beside Llama's."""
        n = int(cfg["num_hidden_layers"])
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        mixtral = cfg.get("model_type") == "mixtral"  # its experts are intermediate_size wide
        return dict(
            LlamaArgs.fields_from_config(cfg),
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(
                cfg["intermediate_size"] if mixtral else cfg["moe_intermediate_size"]
            ),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", mixtral)),
            sparse_layers=[
                experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)
            ],
        )


class Expert(nn.Module):
    """One expert's checkpoint weights (Qwen3-MoE names: ``gate_proj`` and ``up_proj`` fused by
    the loader, ``down_proj``), held only until ``SparseMoeBlock.stack_experts``. Under tensor
    parallelism it holds ``inter`` of its MLP width from ``start`` (None: the whole width)."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, start: int | None = None):
        super().__init__()
        cols = None if start is None else [start, start]
        self.gate_up_proj = ShardedWeight(hidden, [inter, inter], False, dtype, out_offsets=cols)
        self.down_proj = ShardedWeight(inter, [hidden], False, dtype, in_offset=start)

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate | up [hidden, 2 inter], down [inter, hidden])."""
        return self.gate_up_proj.weight.data, self.down_proj.weight.data


class SparseMoeBlock(nn.Module):
    """Router, top-k selection and the experts' SwiGLU MLPs. Under tensor parallelism every
    rank routes every token (the router is whole on each), each holds a slice of every
    expert's width, and the ranks' partial outputs are all-reduced."""

    def __init__(self, args: MoeArgs, dtype: torch.dtype, expert_class: type[nn.Module] = Expert):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.inter = args.moe_intermediate_size
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(args.hidden_size, [args.num_experts], False, dtype)
        self.tp = args.tp
        start, stop = split_range(args.moe_intermediate_size, self.tp.size, self.tp.rank)
        self.inter = stop - start  # this rank's slice of each expert's width
        sliced = start if self.tp.size > 1 else None
        self.experts: nn.ModuleList | None = nn.ModuleList(
            expert_class(args.hidden_size, self.inter, dtype, sliced)
            for _ in range(args.num_experts)
        )
        # Stacked by stack_experts: [E, hidden, 2 inter] (gate | up) and [E, inter, hidden].
        self.w_gate_up: nn.Parameter | None = None
        self.w_down: nn.Parameter | None = None

    def stack_experts(self) -> None:
        """Stack the loaded experts into the two tensors the forward reads, and drop the
        per-expert copies (the memory is held once)."""
        if self.experts is None:
            return
        gate_up, down = zip(*(expert.stacked() for expert in self.experts))
        self.w_gate_up = nn.Parameter(torch.stack(gate_up), requires_grad=False)
        self.w_down = nn.Parameter(torch.stack(down), requires_grad=False)
        self.experts = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token, its top-k experts [T, k] and their weights [T, k] (x's dtype)."""
        probs = self.gate(x).float().softmax(dim=-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        experts, weights = self.route(x)
        if x.device.type == "xla" or (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            out = self._dense(x, experts, weights)
        else:
            out = self._grouped(x, experts, weights)
        return self.tp.all_reduce(out)

    def _expert_mlp(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = (rows @ self.w_gate_up[e]).split(self.inter, dim=-1)
        return (F.silu(gate) * up) @ self.w_down[e]

    def _grouped(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """Tokens grouped by expert, one pair of matmuls per expert that has any."""
        flat = experts.reshape(-1)  # expert of each (token, slot) pair
        order = flat.argsort(stable=True)
        tokens = order // self.top_k  # the pairs' tokens, grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, tokens)
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self._expert_mlp(e, rows[start : start + n])
                start += n
        out *= weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, tokens, out)

    def _dense(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """Every expert over every token, combined by a dense routing matrix (static shapes)."""
        route = torch.zeros(x.shape[0], self.num_experts, dtype=x.dtype, device=x.device)
        route = route.scatter(1, experts, weights)  # [T, E], zero off the top k
        gate, up = torch.einsum("th,ehi->eti", x, self.w_gate_up).split(self.inter, dim=-1)
        out = torch.einsum("eti,eih->eth", F.silu(gate) * up, self.w_down)
        return torch.einsum("eth,te->th", out, route)


def stack_all_experts(model: nn.Module) -> None:
    """Stack the experts of every sparse block of ``model`` (after loading)."""
    for module in model.modules():
        if isinstance(module, SparseMoeBlock):
            module.stack_experts()
