"""Qwen3-MoE: Qwen3 attention with a mixture-of-experts feed-forward block.

The router (``mlp.gate``, [experts, hidden]) scores every expert per token; a softmax in
float32, the top ``num_experts_per_tok`` experts, their probabilities renormalized to sum to 1
when ``norm_topk_prob`` says so (cast back to the activations' dtype); the token's output is the
probability-weighted sum of those experts' SwiGLU MLPs. Layers listed in ``mlp_only_layers``,
or off the ``decoder_sparse_step`` grid, keep a dense MLP of ``intermediate_size``.

The checkpoint stores every expert separately (``mlp.experts.E.gate_proj`` etc.); they are
loaded into per-expert holders, then stacked once into two [experts, in, out] tensors
(``post_load``), which the forward reads:

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

from common.torch.models.llama import Linear, LlamaArgs, LlamaMLP, ShardedWeight
from common.torch.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


@dataclass
class Qwen3MoeArgs(LlamaArgs):
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
        return dict(
            LlamaArgs.fields_from_config(cfg),
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            moe_intermediate_size=int(cfg["moe_intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            sparse_layers=[
                experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(n)
            ],
        )


class Expert(nn.Module):
    """One expert's checkpoint weights, held only until ``SparseMoeBlock.stack_experts``."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ShardedWeight(hidden, [inter, inter], False, dtype)
        self.down_proj = ShardedWeight(inter, [hidden], False, dtype)


class SparseMoeBlock(nn.Module):
    """Router, top-k selection and the experts' SwiGLU MLPs."""

    def __init__(self, args: Qwen3MoeArgs, dtype: torch.dtype):
        super().__init__()
        self.num_experts = args.num_experts
        self.top_k = args.top_k
        self.inter = args.moe_intermediate_size
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = Linear(args.hidden_size, [args.num_experts], False, dtype)
        hidden, inter = args.hidden_size, args.moe_intermediate_size
        self.experts: nn.ModuleList | None = nn.ModuleList(
            Expert(hidden, inter, dtype) for _ in range(args.num_experts)
        )
        # Stacked by stack_experts: [E, hidden, 2 inter] (gate | up) and [E, inter, hidden].
        self.w_gate_up: nn.Parameter | None = None
        self.w_down: nn.Parameter | None = None

    def stack_experts(self) -> None:
        """Stack the loaded experts into the two tensors the forward reads, and drop the
        per-expert copies (the memory is held once)."""
        if self.experts is None:
            return
        experts = list(self.experts)
        self.w_gate_up = nn.Parameter(
            torch.stack([e.gate_up_proj.weight.data for e in experts]), requires_grad=False
        )
        self.w_down = nn.Parameter(
            torch.stack([e.down_proj.weight.data for e in experts]), requires_grad=False
        )
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
            return self._dense(x, experts, weights)
        return self._grouped(x, experts, weights)

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


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """A Qwen3 layer whose feed-forward block is a mixture of experts where the config says."""

    def make_mlp(self, args: LlamaArgs, dtype: torch.dtype, index: int) -> nn.Module:
        """The sparse block on sparse layers, a dense MLP elsewhere."""
        assert isinstance(args, Qwen3MoeArgs)
        if args.sparse_layers[index]:
            return SparseMoeBlock(args, dtype)
        return LlamaMLP(args, dtype)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE checkpoints (``Qwen3MoeForCausalLM``)."""

    args_class = Qwen3MoeArgs
    layer_class = Qwen3MoeDecoderLayer

    def post_load(self, device: torch.device | str) -> None:
        """Stack every sparse layer's experts, then rebuild the RoPE table."""
        for module in self.modules():
            if isinstance(module, SparseMoeBlock):
                module.stack_experts()
        super().post_load(device)
