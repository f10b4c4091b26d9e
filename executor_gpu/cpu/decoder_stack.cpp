// A Llama-family model's decoder layers run in one call on the CPU (float32 or bfloat16).
//
// Called layer by layer from Python, a decode step pays the interpreter for every module call
// and every kernel call: ~10 kernels per layer, each crossing the binding and the dispatcher,
// while one of the two cores sits idle. Here the same kernels run in the same order from C++,
// with the GIL released (the executor's other threads convert and send results meanwhile), so
// the result is identical to the layer-by-layer path. Each layer's weights come as kPerLayer
// tensors in one flat list (an absent bias is an empty tensor).
#include "kernels.h"

#include <vector>

namespace tandem {
namespace {

// Positions of one layer's tensors in the flat list.
enum LayerTensor : int64_t {
  kInputNorm, kQkv, kQkvBias, kOut, kOutBias, kPostNorm, kGateUp, kGateUpBias, kDown,
  kDownBias, kKvCache, kPerLayer
};

std::optional<torch::Tensor> bias_of(const torch::Tensor& t) {
  return t.numel() ? std::optional<torch::Tensor>(t) : std::nullopt;
}

}  // namespace

int64_t decoder_stack_tensors_per_layer() { return kPerLayer; }

torch::Tensor decoder_stack(torch::Tensor x, const std::vector<torch::Tensor>& layers,
                            torch::Tensor final_norm, torch::Tensor positions,
                            torch::Tensor cos_sin, torch::Tensor slots,
                            torch::Tensor block_tables, torch::Tensor seq_lens,
                            torch::Tensor query_start_loc, int64_t num_heads,
                            int64_t num_kv_heads, double eps, double scale) {
  TORCH_CHECK(layers.size() % kPerLayer == 0 && !layers.empty(),
              "decoder_stack: ", kPerLayer, " tensors per layer");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "decoder_stack: x is [tokens, hidden]");
  const int64_t tokens = x.size(0);
  const int64_t rotated = num_heads + num_kv_heads;
  torch::Tensor residual = x;  // the first layer's input is its own residual
  for (size_t base = 0; base < layers.size(); base += kPerLayer) {
    const torch::Tensor* w = layers.data() + base;
    torch::Tensor h = base == 0 ? rms_norm(x, w[kInputNorm], eps)
                                : add_rms_norm_(x, residual, w[kInputNorm], eps);
    torch::Tensor qkv = packed_linear(h, w[kQkv], bias_of(w[kQkvBias]));
    const int64_t dim = qkv.size(1) / (rotated + num_kv_heads);
    qkv = qkv.view({tokens, rotated + num_kv_heads, dim});
    rotary_(qkv, rotated, positions, cos_sin);
    torch::Tensor attn = paged_attention(
        qkv.slice(1, 0, num_heads), qkv.slice(1, num_heads, rotated),
        qkv.slice(1, rotated, rotated + num_kv_heads), slots, w[kKvCache], block_tables,
        seq_lens, query_start_loc, scale, /*bf16_dot=*/w[kQkv].dim() == 4);
    torch::Tensor o = packed_linear(attn.view({tokens, num_heads * dim}), w[kOut],
                                    bias_of(w[kOutBias]));
    h = add_rms_norm_(o, residual, w[kPostNorm], eps);
    torch::Tensor gate_up = packed_linear(h, w[kGateUp], bias_of(w[kGateUpBias]));
    x = packed_linear(silu_and_mul(gate_up), w[kDown], bias_of(w[kDownBias]));
  }
  return add_rms_norm_(x, residual, final_norm, eps);
}

}  // namespace tandem
