// Causal attention straight from the paged KV cache on the CPU (float32 or bfloat16), for every
// request of a step: decodes (one query token) and prefill chunks (several, after any cached
// tokens). A bf16 cache is read as bf16 (half the bytes of a float32 one) and widened to
// float32 in registers; the arithmetic is float32 and the output is rounded to bf16 once.
//
// The torch reference gathers every request's blocks into a padded copy, then runs SDPA over it
// (at batch 64 that copy moves as many bytes per step as the weights; SDPA over one short
// prefill runs at a few GFLOP/s). This kernel reads each key and value where it lies. A task is
// one (request, KV head, run of query tokens), or with many decodes one decode over all its KV
// heads; the query heads that share a KV head (grouped-query attention) are attended together,
// their queries and accumulators held in vector registers. For each query token: the dot
// products with its keys (16 tokens' at a time, summed across lanes together), a softmax per
// head in float32 with the maximum subtracted (as SDPA does), then the values weighted into
// the accumulators. Given the step's new keys and values, they are stored first (one pass over
// the tokens), which saves a separate scatter.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

namespace tandem {
namespace {

constexpr int kMaxHeadVecs = 8;          // head sizes of 16..128 floats (whole vectors)
constexpr int kRegisterVecs = 16;        // vectors of queries / accumulators held per pass
constexpr int kMaxPassHeads = 4;         // query heads attended together in one pass
constexpr int64_t kPrefetchTokens = 32;  // how far ahead the key loop asks for the next keys
constexpr int64_t kQueryRun = 16;        // query tokens of one prefill per task

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// [N, heads, d] rows (any row stride, contiguous heads): the form the kernel reads.
void check_heads(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16, name,
              ": float32 or bfloat16 only");
  TORCH_CHECK(t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == t.size(2), name,
              ": [N, heads, d] with contiguous heads only");
}

// A thread's working memory for one task at a time (T: the cache's element type).
template <class T>
struct Scratch {
  std::vector<float> scores;    // [kMaxPassHeads, padded length] softmax numerators
  std::vector<Vec> parts;       // [kMaxPassHeads, kLanes] partial dot products
  std::vector<const T*> keys;   // [padded length] each token's key row
  int64_t stride;                  // padded length: scores row stride

  explicit Scratch(int64_t max_len) : stride((max_len + kLanes - 1) / kLanes * kLanes) {
    scores.resize(kMaxPassHeads * stride);
    parts.resize(kMaxPassHeads * kLanes);
    keys.resize(stride);
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

// One query token's attention for kHeads heads of kVecs vectors that share a KV head, over the
// keys listed in `keys` (values at value_offset past each): q and out hold the heads' rows.
template <class T, int kVecs, int kHeads>
#ifdef __AVX512F__
__attribute__((target("prefer-vector-width=512")))
#endif
void attend_heads(const T* q, const T* const* keys, int64_t value_offset, int64_t len,
                  float scale, Scratch<T>& s, T* out) {
  constexpr int64_t dim = kVecs * kLanes;
  const int64_t stride = s.stride;
  Vec* parts = s.parts.data();
  float* scores = s.scores.data();
  Vec qv[kHeads][kVecs];
  for (int h = 0; h < kHeads; ++h)
    for (int v = 0; v < kVecs; ++v) qv[h][v] = load_vec(q + h * dim + v * kLanes);

  // Scores, 16 keys at a time; lanes past the last key are -inf (weight 0).
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* kp = keys[t0 + j];
      if (t0 + j + kPrefetchTokens < len)  // the keys ahead, and the values read next
        for (int v = 0; v < kVecs; ++v) __builtin_prefetch(keys[t0 + j + kPrefetchTokens] + v * kLanes);
      for (int v = 0; v < kVecs; ++v) __builtin_prefetch(kp + value_offset + v * kLanes);
      Vec k[kVecs];
      for (int v = 0; v < kVecs; ++v) k[v] = load_vec(kp + v * kLanes);
      for (int h = 0; h < kHeads; ++h) {
        Vec dot = qv[h][0] * k[0];
        for (int v = 1; v < kVecs; ++v) dot += qv[h][v] * k[v];
        parts[h * kLanes + kBitReversed[j]] = dot;
      }
    }
    for (int64_t j = n; j < kLanes; ++j)
      for (int h = 0; h < kHeads; ++h) parts[h * kLanes + kBitReversed[j]] = Vec{};
    for (int h = 0; h < kHeads; ++h) {
      Vec sums = sum_lanes(parts + h * kLanes) * scale;
      for (int64_t j = n; j < kLanes; ++j) sums[j] = kNegInf;
      *reinterpret_cast<UVec*>(scores + h * stride + t0) = sums;
    }
  }

  // Softmax numerators in place; their sums divide the output at the end.
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  float inv_total[kHeads];
  for (int h = 0; h < kHeads; ++h) {
    float* row = scores + h * stride;
    Vec top = *reinterpret_cast<const UVec*>(row);
    for (int64_t t = kLanes; t < padded; t += kLanes) {
      const Vec x = *reinterpret_cast<const UVec*>(row + t);
      top = x > top ? x : top;
    }
    float m = top[0];
    for (int i = 1; i < kLanes; ++i) m = top[i] > m ? top[i] : m;
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t t = 0; t < padded; ++t) {
      row[t] = exp_approx(row[t] - m);  // padding: e^-inf = 0
      total += row[t];
    }
    inv_total[h] = 1.f / total;
  }

  Vec acc[kHeads][kVecs] = {};
  for (int64_t t = 0; t < len; ++t) {
    const T* vp = keys[t] + value_offset;
    Vec val[kVecs];
    for (int v = 0; v < kVecs; ++v) val[v] = load_vec(vp + v * kLanes);
    for (int h = 0; h < kHeads; ++h) {
      const float p = scores[h * stride + t];
      for (int v = 0; v < kVecs; ++v) acc[h][v] += p * val[v];
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int v = 0; v < kVecs; ++v)
      store_vec(out + h * dim + v * kLanes, acc[h][v] * inv_total[h]);
}

// attend_heads for n (1..kHeads) heads, n known only at run time.
template <class T, int kVecs, int kHeads>
void attend_n_heads(int64_t n, const T* q, const T* const* keys, int64_t value_offset,
                    int64_t len, float scale, Scratch<T>& s, T* out) {
  if constexpr (kHeads > 1)
    if (n < kHeads)
      return attend_n_heads<T, kVecs, kHeads - 1>(n, q, keys, value_offset, len, scale, s, out);
  attend_heads<T, kVecs, kHeads>(q, keys, value_offset, len, scale, s, out);
}

// Every query head of `group` sharing one KV head, in passes of as many heads as registers
// hold (kRegisterVecs / kVecs, at most kMaxPassHeads).
template <class T, int kVecs>
void attend_group(const T* q, const T* const* keys, int64_t value_offset, int64_t len,
                  int64_t group, float scale, Scratch<T>& s, T* out) {
  constexpr int kMax = std::min(kMaxPassHeads, std::max(1, kRegisterVecs / kVecs));
  constexpr int64_t dim = kVecs * kLanes;
  for (int64_t h = 0; h < group; h += kMax)
    attend_n_heads<T, kVecs, kMax>(std::min<int64_t>(kMax, group - h), q + h * dim, keys,
                                value_offset, len, scale, s, out + h * dim);
}

template <class T>
using GroupKernel = void (*)(const T*, const T* const*, int64_t, int64_t, int64_t, float,
                             Scratch<T>&, T*);
template <class T, int... kVecs>
constexpr std::array<GroupKernel<T>, sizeof...(kVecs)> make_group_kernels(
    std::integer_sequence<int, kVecs...>) {
  return {attend_group<T, kVecs + 1>...};
}
template <class T>
constexpr auto kGroupKernels =
    make_group_kernels<T>(std::make_integer_sequence<int, kMaxHeadVecs>{});

// One unit of work: a run of one request's query tokens against a range of KV heads.
struct Task {
  int64_t request;  // index into the step's requests
  int64_t kv_head;  // the first KV head (each with its group of query heads)
  int64_t kv_end;   // one past the last KV head
  int64_t first;    // first query token of the run, in the flat batch
  int64_t last;     // one past its last
};

}  // namespace

bool paged_attention_supports(int64_t head_size) {
  return head_size % kLanes == 0 && head_size / kLanes <= kMaxHeadVecs;
}

torch::Tensor paged_attention(torch::Tensor query, std::optional<torch::Tensor> new_key,
                              std::optional<torch::Tensor> new_value,
                              std::optional<torch::Tensor> slots, torch::Tensor kv_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, double scale) {
  check_heads(query, "query");
  TORCH_CHECK(kv_cache.scalar_type() == query.scalar_type() && kv_cache.is_contiguous(),
              "kv_cache: contiguous, of the query's dtype");
  auto tables = block_tables.to(torch::kLong).contiguous();
  auto lens = seq_lens.to(torch::kLong).contiguous();
  auto starts = query_start_loc.to(torch::kLong).contiguous();
  const int64_t tokens = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t n_req = lens.numel();
  const int64_t num_blocks = kv_cache.size(1), block_size = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3);
  TORCH_CHECK(heads % kv_heads == 0 && kv_cache.size(4) == dim, "shape mismatch");
  TORCH_CHECK(paged_attention_supports(dim), "paged_attention: head size ", dim,
              " is not a multiple of ", kLanes, " up to ", kLanes * kMaxHeadVecs);
  TORCH_CHECK(starts.numel() == n_req + 1 && tables.size(0) >= n_req,
              "query_start_loc [R + 1] and block_tables [R, ...] for seq_lens [R]");
  const int64_t group = heads / kv_heads;
  const int64_t max_blocks = tables.size(1);
  const int64_t value_offset = num_blocks * block_size * kv_heads * dim;
  const int64_t token_elems = kv_heads * dim;  // one token's keys (or values) in the cache
  const int64_t* bt = tables.data_ptr<int64_t>();
  const int64_t* sl = lens.data_ptr<int64_t>();
  const int64_t* qs = starts.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[n_req] == tokens, "query_start_loc must span the query tokens");
  for (int64_t n = 0; n < n_req; ++n)
    TORCH_CHECK(qs[n + 1] >= qs[n] && sl[n] >= qs[n + 1] - qs[n] &&
                    sl[n] <= max_blocks * block_size,
                "request ", n, ": its query tokens must fit its length and its block table");
  return dispatch_float_or_bf16(query.scalar_type(), "paged_attention", [&](auto tag) {
  using T = decltype(tag);
  T* kv = data_of<T>(kv_cache);

  const bool store = new_key.has_value();
  TORCH_CHECK(store == new_value.has_value() && store == slots.has_value(),
              "new_key, new_value and slots come together");
  if (store) {
    check_heads(*new_key, "new_key");
    check_heads(*new_value, "new_value");
    TORCH_CHECK(new_key->scalar_type() == query.scalar_type() &&
                    new_value->scalar_type() == query.scalar_type(),
                "new keys / values: of the query's dtype");
    auto slot_ids = slots->to(torch::kLong).contiguous();
    TORCH_CHECK(new_key->size(0) == tokens && new_value->size(0) == tokens &&
                    slot_ids.numel() == tokens &&
                    new_key->size(1) * new_key->size(2) == token_elems &&
                    new_value->size(1) * new_value->size(2) == token_elems,
                "new keys / values: every KV head of every query token");
    const T* nk = data_of<T>(*new_key);
    const T* nv = data_of<T>(*new_value);
    const int64_t nk_stride = new_key->stride(0), nv_stride = new_value->stride(0);
    const int64_t* sp = slot_ids.data_ptr<int64_t>();
    for (int64_t t = 0; t < tokens; ++t)
      TORCH_CHECK(sp[t] >= 0 && sp[t] < num_blocks * block_size, "slot out of range");
    for (int64_t t = 0; t < tokens; ++t) {
      std::memcpy(kv + sp[t] * token_elems, nk + t * nk_stride, token_elems * sizeof(T));
      std::memcpy(kv + value_offset + sp[t] * token_elems, nv + t * nv_stride,
                  token_elems * sizeof(T));
    }
  }

  // Prefill runs first (the longest work), then the decodes; threads take tasks in that order
  // from a shared counter, so a long prefill does not leave the other thread idle.
  // With decodes enough to share out whole (4 per thread), a decode is one task over all its
  // KV heads: a token's heads lie side by side in the cache, so one thread reads whole runs of
  // cache lines instead of two threads each reading every other head's share (~8% faster at
  // 16-256 decodes). Fewer decodes are split by KV head, to keep every thread busy.
  int64_t decodes = 0;
  for (int64_t n = 0; n < n_req; ++n) decodes += qs[n + 1] - qs[n] == 1;
  const bool whole_decodes = decodes >= 4 * at::get_num_threads();
  std::vector<Task> tasks;
  int64_t max_len = 1;
  for (int pass = 0; pass < 2; ++pass)
    for (int64_t n = 0; n < n_req; ++n) {
      const bool single = qs[n + 1] - qs[n] == 1;
      if (single != (pass == 1)) continue;
      max_len = std::max(max_len, sl[n]);
      if (single && whole_decodes) {
        tasks.push_back({n, 0, kv_heads, qs[n], qs[n + 1]});
        continue;
      }
      for (int64_t first = qs[n]; first < qs[n + 1]; first += kQueryRun)
        for (int64_t g = 0; g < kv_heads; ++g)
          tasks.push_back({n, g, g + 1, first, std::min(qs[n + 1], first + kQueryRun)});
    }

  auto out = torch::empty({tokens, heads, dim}, query.options());
  const T* q = data_of<T>(query);
  const int64_t q_stride = query.stride(0);
  T* o = data_of<T>(out);
  const float sc = static_cast<float>(scale);
  const GroupKernel<T> kernel = kGroupKernels<T>[dim / kLanes - 1];
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), tasks.size());
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<T> scratch(max_len);
    int64_t listed = -1;  // the request whose key rows scratch.keys holds
    for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(tasks.size());
         i = next.fetch_add(1)) {
      const Task& task = tasks[i];
      const int64_t n = task.request, len = sl[n];
      const int64_t cached = len - (qs[n + 1] - qs[n]);  // tokens before the query chunk
      for (int64_t g = task.kv_head; g < task.kv_end; ++g) {
        if (listed != n * kv_heads + g) {  // key rows, block by block
          const int64_t* table = bt + n * max_blocks;
          for (int64_t first = 0, b = 0; first < len; first += block_size, ++b) {
            const T* row = kv + g * dim + table[b] * block_size * token_elems;
            for (int64_t j = 0; j < std::min(block_size, len - first); ++j) {
              scratch.keys[first + j] = row + j * token_elems;
              if (first + j < kPrefetchTokens)  // the first keys now; the loop asks for the rest
                for (int64_t v = 0; v < dim; v += kLanes) __builtin_prefetch(row + j * token_elems + v);
            }
          }
          listed = n * kv_heads + g;
        }
        for (int64_t t = task.first; t < task.last; ++t) {
          const int64_t head = g * group;
          kernel(q + t * q_stride + head * dim, scratch.keys.data(), value_offset,
                 cached + (t - qs[n]) + 1, group, sc, scratch, o + (t * heads + head) * dim);
        }
      }
    }
  });
  return out;
  });
}

}  // namespace tandem
