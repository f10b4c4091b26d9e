// Decode attention straight from the paged KV cache on the CPU (float32).
//
// The torch reference gathers every request's blocks into a padded copy, then runs SDPA over it:
// at batch 64 that copy moves as many bytes per step as the weights. This kernel reads each key
// and value once, where it lies, one (request, KV head) per task; query heads that share a KV head
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

constexpr int kMaxHeadVecs = 8;  // head sizes up to 128 floats take the vectorized path
constexpr int64_t kPrefetchTokens = 32;  // how far ahead the key loop asks for the next keys

// [N, heads, d] rows (any row stride, contiguous heads): the form the kernel reads.
void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat, name, ": float32 only");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": [N, heads, d] with contiguous heads only");
}


// Where one KV head's keys lie for one request: token t's row is at
// base + (table[t / block_size] * block_size + t % block_size) * row_elems (values at
// value_offset past it).
struct TokenRows {
  const float* base;     // the cache's first key row, offset to this KV head
  const int64_t* table;  // the request's block table
  int64_t block_size;    // tokens per block
  int64_t row_elems;     // floats per token slot (all KV heads)

  const float* key(int64_t t) const {
    return base + (table[t / block_size] * block_size + t % block_size) * row_elems;
  }
};

// A thread's working memory for one (request, KV head) at a time.
struct Scratch {
  std::vector<float> scores;  // [group, padded length] softmax numerators
  std::vector<Vec> parts;     // [group, kLanes] per-token partial dot products
  std::vector<Vec> acc;       // [group, kMaxHeadVecs] output accumulators
  std::vector<float> totals;  // [group] softmax denominators
  int64_t stride;             // padded length: scores row stride

  Scratch(int64_t group, int64_t max_len)
      : stride((max_len + kLanes - 1) / kLanes * kLanes) {
    scores.resize(group * stride);
    parts.resize(group * kLanes);
    acc.resize(group * kMaxHeadVecs);
    totals.resize(group);
  }
};

// Lane i of the result is the sum of the lanes of p[kBitReversed[i]]: a transposing tree of
// shuffles and adds (30 shuffles and 15 adds for 16 sums instead of 16 separate reductions).
constexpr int kBitReversed[kLanes] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

inline Vec sum_lanes(const Vec* p) {
  Vec a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)
    a[i] = __builtin_shufflevector(p[2 * i], p[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                   19, 20, 21, 22, 23) +
           __builtin_shufflevector(p[2 * i], p[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10,
                                   11, 24, 25, 26, 27) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                   14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24,
                                   25, 12, 13, 28, 29) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                   26, 27, 14, 15, 30, 31);
  return __builtin_shufflevector(c[0], c[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28,
                                 14, 30) +
         __builtin_shufflevector(c[0], c[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29,
                                 15, 31);
}

// Attention of the `group` query heads that share one KV head, over `len` tokens, for heads
// of kVecs vectors: the queries' dot products with each key (16 tokens' at a time, summed
// across lanes together), a softmax per head, then the values weighted into accumulators.
template <int kVecs>
#ifdef __AVX512F__
__attribute__((target("prefer-vector-width=512")))
#endif
void attend_group(const float* q, const TokenRows& rows, int64_t value_offset, int64_t len,
                  int64_t group, float scale, Scratch& s, float* out) {
  constexpr int64_t dim = kVecs * kLanes;
  const int64_t stride = s.stride;
  Vec* parts = s.parts.data();
  for (int64_t t = 0; t < std::min(len, kPrefetchTokens); ++t)  // the first keys, all at once
    for (int v = 0; v < kVecs; ++v) __builtin_prefetch(rows.key(t) + v * kLanes);
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - t0);
    for (int64_t j = 0; j < kLanes; ++j) {
      Vec k[kVecs];
      if (j < n) {
        const float* kp = rows.key(t0 + j);
        if (t0 + j + kPrefetchTokens < len) {  // the keys ahead, and the values to be read next
          const float* ahead = rows.key(t0 + j + kPrefetchTokens);
          for (int v = 0; v < kVecs; ++v) __builtin_prefetch(ahead + v * kLanes);
        }
        for (int v = 0; v < kVecs; ++v) __builtin_prefetch(kp + value_offset + v * kLanes);
        for (int v = 0; v < kVecs; ++v) k[v] = *reinterpret_cast<const UVec*>(kp + v * kLanes);
      } else {
        for (int v = 0; v < kVecs; ++v) k[v] = Vec{};
      }
      for (int64_t h = 0; h < group; ++h) {
        const float* qh = q + h * dim;
        Vec dot = *reinterpret_cast<const UVec*>(qh) * k[0];
        for (int v = 1; v < kVecs; ++v) dot += *reinterpret_cast<const UVec*>(qh + v * kLanes) * k[v];
        parts[h * kLanes + kBitReversed[j]] = dot;
      }
    }
    for (int64_t h = 0; h < group; ++h) {
      Vec sums = sum_lanes(parts + h * kLanes) * scale;
      for (int64_t j = n; j < kLanes; ++j) sums[j] = -std::numeric_limits<float>::infinity();
      *reinterpret_cast<UVec*>(s.scores.data() + h * stride + t0) = sums;
    }
  }
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  float* totals = s.totals.data();
  for (int64_t h = 0; h < group; ++h) {
    float* row = s.scores.data() + h * stride;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < len; ++t) top = row[t] > top ? row[t] : top;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < padded; ++t) {
      row[t] = exp_approx(row[t] - top);  // padding: e^-inf = 0
      total += row[t];
    }
    totals[h] = total;
  }
  Vec* acc = s.acc.data();
  for (int64_t i = 0; i < group * kVecs; ++i) acc[i] = Vec{};
  for (int64_t t = 0; t < len; ++t) {
    const float* vp = rows.key(t) + value_offset;
    Vec val[kVecs];
    for (int v = 0; v < kVecs; ++v) val[v] = *reinterpret_cast<const UVec*>(vp + v * kLanes);
    for (int64_t h = 0; h < group; ++h) {
      const float p = s.scores[h * stride + t];
      for (int v = 0; v < kVecs; ++v) acc[h * kVecs + v] += p * val[v];
    }
  }
  for (int64_t h = 0; h < group; ++h) {
    const float inv = 1.f / totals[h];
    for (int v = 0; v < kVecs; ++v)
      *reinterpret_cast<UVec*>(out + h * dim + v * kLanes) = acc[h * kVecs + v] * inv;
  }
}

using GroupKernel = void (*)(const float*, const TokenRows&, int64_t, int64_t, int64_t, float,
                             Scratch&, float*);
template <int... kVecs>
constexpr std::array<GroupKernel, sizeof...(kVecs)> make_group_kernels(
    std::integer_sequence<int, kVecs...>) {
  return {attend_group<kVecs + 1>...};
}
constexpr auto kGroupKernels = make_group_kernels(std::make_integer_sequence<int, kMaxHeadVecs>{});

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

  if (dim % kLanes == 0 && dim / kLanes <= kMaxHeadVecs) {
    // One task per (request, KV head): even a single request splits across threads.
    const GroupKernel kernel = kGroupKernels[dim / kLanes - 1];
    at::parallel_for(0, n_req * kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch scratch(group, max_blocks * block_size);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t n = task / kv_heads, g = task % kv_heads;
        const int64_t head_offset = g * dim;  // this KV head's place in a token's row
        if (store) {
          std::memcpy(kv + sp[n] * token_elems + head_offset, nk + n * nk_stride + head_offset,
                      dim * sizeof(float));
          std::memcpy(kv + value_offset + sp[n] * token_elems + head_offset,
                      nv + n * nv_stride + head_offset, dim * sizeof(float));
        }
        const TokenRows rows{kv + head_offset, bt + n * max_blocks, block_size, token_elems};
        kernel(q + n * q_stride + g * group * dim, rows, value_offset, sl[n], group, sc,
               scratch, o + (n * heads + g * group) * dim);
      }
    });
    return out;
  }
  // Head sizes that are not whole vectors: one task per request, all heads together.
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
