// Decode attention straight from the paged KV cache on the CPU (float32).
//
// The torch reference gathers every request's blocks into a padded copy, then runs SDPA over it:
// at batch 64 that copy moves as many bytes per step as the weights. This kernel reads each key
// and value once, where it lies, one request per task; query heads that share a KV head
// (grouped-query attention) read the same key and value. Softmax is computed in float32
// with the running maximum subtracted, as SDPA does. Given the step's new keys and values, each
// task first stores its request's own (one slot per request), which saves a separate scatter.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace tandem {
namespace {

// [N, heads, d] rows (any row stride, contiguous heads): the form the kernel reads.
void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat, name, ": float32 only");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": [N, heads, d] with contiguous heads only");
}

}  // namespace

// query [N, H, D]; new_key / new_value [N, KVH, D] with slots [N] (int64), all or none;
// kv_cache [2, num_blocks, block_size, KVH, D]; block_tables [N, max_blocks] (int64);
// seq_lens [N] (int64). Returns [N, H, D].
torch::Tensor paged_decode_attention(torch::Tensor query, std::optional<torch::Tensor> new_key,
                                     std::optional<torch::Tensor> new_value,
                                     std::optional<torch::Tensor> slots, torch::Tensor kv_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens,
                                     double scale) {
  check_heads(query, "query");
  TORCH_CHECK(kv_cache.scalar_type() == torch::kFloat && kv_cache.is_contiguous(),
              "kv_cache: contiguous float32 only");
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  const int64_t n_req = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(heads % kv_heads == 0 && kv_cache.size(4) == dim, "shape mismatch");
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = tables.size(1);
  const int64_t value_offset = num_blocks * block_size * kv_heads * dim;
  const int64_t token_elems = kv_heads * dim;  // one token's keys (or values) in the cache
  const bool store = new_key.has_value();
  TORCH_CHECK(store == new_value.has_value() && store == slots.has_value(),
              "new_key, new_value and slots come together");
  const float* nk = nullptr;
  const float* nv = nullptr;
  const int64_t* sp = nullptr;
  int64_t nk_stride = 0, nv_stride = 0;
  torch::Tensor slot_ids;
  if (store) {
    check_heads(*new_key, "new_key");
    check_heads(*new_value, "new_value");
    slot_ids = slots->to(torch::kLong).contiguous();
    TORCH_CHECK(new_key->size(0) == n_req && new_value->size(0) == n_req &&
                    slot_ids.numel() == n_req && new_key->size(1) * new_key->size(2) == token_elems &&
                    new_value->size(1) * new_value->size(2) == token_elems,
                "new keys / values: one token of every KV head per request");
    nk = new_key->data_ptr<float>();
    nv = new_value->data_ptr<float>();
    nk_stride = new_key->stride(0);
    nv_stride = new_value->stride(0);
    sp = slot_ids.data_ptr<int64_t>();
    for (int64_t n = 0; n < n_req; ++n)
      TORCH_CHECK(sp[n] >= 0 && sp[n] < num_blocks * block_size, "slot out of range");
  }
  auto out = torch::empty({n_req, heads, dim}, query.options());
  const float* q = query.data_ptr<float>();
  const int64_t q_stride = query.stride(0);
  float* kv = kv_cache.data_ptr<float>();
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const float sc = static_cast<float>(scale);

  // One task per request, all heads together: a token's keys (or values) for every KV head lie
  // next to each other, so the cache is read sequentially, block after block.
  at::parallel_for(0, n_req, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(heads * dim);
    for (int64_t n = begin; n < end; ++n) {
      if (store) {
        std::memcpy(kv + sp[n] * token_elems, nk + n * nk_stride, token_elems * sizeof(float));
        std::memcpy(kv + value_offset + sp[n] * token_elems, nv + n * nv_stride,
                    token_elems * sizeof(float));
      }
      const int64_t len = sl[n];
      const float* qn = q + n * q_stride;
      scores.assign(heads * len, 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = bt[n * max_blocks + t / block_size];
        const float* k_tok = kv + (block * block_size + t % block_size) * kv_heads * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const float* k = k_tok + (h / group) * dim;
          const float* qh = qn + h * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qh[d] * k[d];
          scores[h * len + t] = s * sc;
        }
      }
      for (int64_t h = 0; h < heads; ++h) {
        float* row = scores.data() + h * len;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t t = 0; t < len; ++t) top = row[t] > top ? row[t] : top;
        float total = 0.f;
#pragma omp simd reduction(+ : total)
        for (int64_t t = 0; t < len; ++t) {
          row[t] = exp_approx(row[t] - top);
          total += row[t];
        }
        const float inv = 1.f / total;
        for (int64_t t = 0; t < len; ++t) row[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < len; ++t) {
        const int64_t block = bt[n * max_blocks + t / block_size];
        const float* v_tok =
            kv + value_offset + (block * block_size + t % block_size) * kv_heads * dim;
        for (int64_t h = 0; h < heads; ++h) {
          const float p = scores[h * len + t];
          const float* v = v_tok + (h / group) * dim;
          float* a = acc.data() + h * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
        }
      }
      std::copy(acc.begin(), acc.end(), o + n * heads * dim);
    }
  });
  return out;
}

}  // namespace tandem
