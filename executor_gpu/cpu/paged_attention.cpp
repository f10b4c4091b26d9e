// Causal attention straight from the paged KV cache on the CPU (float32 or bfloat16), for every
// request of a step: decodes (one query token) and prefill chunks (several, after any cached
// tokens). A bf16 cache is read as bf16 (half the bytes of a float32 one), 32 values per load
// (attention_inner.h: the scores on AVX-512 bf16 dot products where the CPU has them and
// bf16_dot asks, the values split into even and odd float32 vectors); the arithmetic is float32
// and the output is rounded to bf16 once.
//
// The torch reference gathers every request's blocks into a padded copy, then runs SDPA over it
// (at batch 64 that copy moves as many bytes per step as the weights; SDPA over one short
// prefill runs at a few GFLOP/s). This kernel reads each key and value where it lies. A task is
// one (request, KV head, run of query tokens), or with many decodes one decode over all its KV
// heads; the query heads that share a KV head (grouped-query attention) are attended together,
// their queries and accumulators held in vector registers. For each query token: the dot
// products with its keys (16 tokens' at a time, summed across lanes together), a softmax per
// head in float32 with the maximum subtracted (as SDPA does), then the values weighted into
// the accumulators. A decode taken whole reads its tokens' whole cache rows instead, every KV
// head's part in one pass (attention_rows.h: the same arithmetic per head). Given the step's
// new keys and values, they are stored first (one pass over the tokens), which saves a separate
// scatter.
#include "attention_inner.h"
#include "attention_rows.h"
#include "kernels.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

namespace tandem {
namespace {

constexpr int kMaxHeadVecs = 8;          // head sizes of 16..128 floats (whole vectors)
constexpr int64_t kQueryRun = 16;        // query tokens of one prefill per task

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
  std::vector<float> scores;    // [pass heads, padded length] softmax numerators
  std::vector<Vec> parts;       // [pass heads, kLanes] partial dot products
  std::vector<float> inv_total;  // [heads] 1 / each head's softmax sum (decodes over rows)
  std::vector<const T*> keys;   // [padded length] each token's key row (or whole row)
  int64_t stride;                  // padded length: scores row stride
  int64_t value_offset;            // elements from a token's key row to its value row

  // Room for passes of kMaxPassHeads heads and for decodes over all `heads` heads at once.
  Scratch(int64_t max_len, int64_t value_offset, int64_t heads)
      : stride((max_len + kLanes - 1) / kLanes * kLanes), value_offset(value_offset) {
    const int64_t pass_heads = std::max<int64_t>(kMaxPassHeads, heads);
    scores.resize(pass_heads * stride);
    parts.resize(pass_heads * kLanes);
    inv_total.resize(heads);
    keys.resize(stride);
  }

  RowScratch rows() { return {scores.data(), stride, parts.data()}; }
};

// The scores of one query token's kHeads heads (kVecs vectors each, sharing a KV head) against
// the keys listed in `keys`, scaled, into s.scores (row h: head h; lanes past the last key -inf).
template <class T, int kVecs, int kHeads>
PREFER_512 void score_keys(const T* q, const T* const* keys, int64_t len, float scale,
                           Scratch<T>& s) {
  constexpr int64_t dim = kVecs * kLanes;
  Vec* parts = s.parts.data();
  Vec qv[kHeads][kVecs];
  for (int h = 0; h < kHeads; ++h)
    for (int v = 0; v < kVecs; ++v) qv[h][v] = load_vec(q + h * dim + v * kLanes);
  // 16 keys at a time: their dot products summed across lanes together.
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* kp = keys[t0 + j];
      prefetch_key_and_value<kVecs>(keys, t0 + j, len, s.value_offset);
      Vec k[kVecs];
      for (int v = 0; v < kVecs; ++v) k[v] = load_vec(kp + v * kLanes);
      for (int h = 0; h < kHeads; ++h) {
        Vec dot = qv[h][0] * k[0];
        for (int v = 1; v < kVecs; ++v) dot += qv[h][v] * k[v];
        parts[h * kLanes + kBitReversed[j]] = dot;
      }
    }
    store_scores(parts, kHeads, n, scale, s.scores.data() + t0, s.stride);
  }
}

// One query token's attention for kHeads heads of kVecs vectors that share a KV head, over the
// keys listed in `keys` (values s.value_offset past each): q and out hold the heads' rows. kDot
// (bf16, an even kVecs): the scores from AVX-512 bf16 dot products (attention_bf16.h).
template <class T, int kVecs, int kHeads, bool kDot>
void attend_heads(const T* q, const T* const* keys, int64_t len, float scale, Scratch<T>& s,
                  T* out) {
  if constexpr (kDot)
    score_keys_dot<kVecs, kHeads>(q, keys, len, scale, s.value_offset, s.parts.data(),
                                  s.scores.data(), s.stride);
  else
    score_keys<T, kVecs, kHeads>(q, keys, len, scale, s);
  float inv_total[kHeads];
  softmax_rows(s.scores.data(), s.stride, kHeads, len, inv_total);
  weigh_values<T, kVecs, kHeads>(keys, s.value_offset, len, s.scores.data(), s.stride, inv_total,
                                 out);
}

// attend_heads for n (1..kHeads) heads, n known only at run time.
template <class T, int kVecs, int kHeads, bool kDot>
void attend_n_heads(int64_t n, const T* q, const T* const* keys, int64_t len, float scale,
                    Scratch<T>& s, T* out) {
  if constexpr (kHeads > 1)
    if (n < kHeads)
      return attend_n_heads<T, kVecs, kHeads - 1, kDot>(n, q, keys, len, scale, s, out);
  attend_heads<T, kVecs, kHeads, kDot>(q, keys, len, scale, s, out);
}

// Every query head of `group` sharing one KV head, in passes of as many heads as registers
// hold (kRegisterVecs / kVecs, at most kMaxPassHeads).
template <class T, int kVecs, bool kDot>
void attend_group(const T* q, const T* const* keys, int64_t len, int64_t group, float scale,
                  Scratch<T>& s, T* out) {
  constexpr int kMax = pass_heads(kVecs);
  constexpr int64_t dim = kVecs * kLanes;
  for (int64_t h = 0; h < group; h += kMax)
    attend_n_heads<T, kVecs, kMax, kDot>(std::min<int64_t>(kMax, group - h), q + h * dim, keys,
                                         len, scale, s, out + h * dim);
}

template <class T>
using GroupKernel = void (*)(const T*, const T* const*, int64_t, int64_t, float, Scratch<T>&,
                             T*);
// kGroupKernels<T, kDot>[kVecs - 1]: attend_group for heads of kVecs vectors; with kDot, the
// bf16 dot-product scores where they apply (bf16, an even kVecs).
template <class T, bool kDot, int... kVecs>
constexpr std::array<GroupKernel<T>, sizeof...(kVecs)> make_group_kernels(
    std::integer_sequence<int, kVecs...>) {
  return {attend_group<T, kVecs + 1,
                       kDot && std::is_same_v<T, Bf16> && (kVecs + 1) % 2 == 0>...};
}
template <class T, bool kDot>
constexpr auto kGroupKernels =
    make_group_kernels<T, kDot>(std::make_integer_sequence<int, kMaxHeadVecs>{});

template <class T>
using RowKernel = void (*)(const T*, const T* const*, int64_t, int64_t, int64_t, float,
                           int64_t, RowScratch&, float*, T*);
// kRowKernels<T, kDot>[kVecs - 1]: attend_rows (a decode over whole rows) for heads of kVecs
// vectors, kDot as in kGroupKernels.
template <class T, bool kDot, int... kVecs>
constexpr std::array<RowKernel<T>, sizeof...(kVecs)> make_row_kernels(
    std::integer_sequence<int, kVecs...>) {
  return {attend_rows<T, kVecs + 1, kDot && std::is_same_v<T, Bf16> && (kVecs + 1) % 2 == 0>...};
}
template <class T, bool kDot>
constexpr auto kRowKernels =
    make_row_kernels<T, kDot>(std::make_integer_sequence<int, kMaxHeadVecs>{});

// One unit of work: a run of one request's query tokens against a range of KV heads.
struct Task {
  int64_t request;  // index into the step's requests
  int64_t kv_head;  // the first KV head (each with its group of query heads)
  int64_t kv_end;   // one past the last KV head
  int64_t first;    // first query token of the run, in the flat batch
  int64_t last;     // one past its last
};

// rows[t] = token t's row in the cache for a request's `len` tokens under its block table, from
// `first_elem` on (0: the row of every KV head's keys; g * d: KV head g's keys); the first
// kPrefetchTokens rows' `prefetch_elems` elements are asked for now, into L2.
template <class T>
void list_rows(const T* kv, const int64_t* table, int64_t len, int64_t block_size,
               int64_t token_elems, int64_t first_elem, int64_t prefetch_elems,
               const T** rows) {
  constexpr int64_t kStep = 64 / sizeof(T);  // elements per cache line
  for (int64_t first = 0, b = 0; first < len; first += block_size, ++b) {
    const T* block = kv + first_elem + table[b] * block_size * token_elems;
    for (int64_t j = 0; j < std::min(block_size, len - first); ++j) {
      rows[first + j] = block + j * token_elems;
      if (first + j < kPrefetchTokens)  // the kernels' loops ask for the rest
        for (int64_t e = 0; e < prefetch_elems; e += kStep) prefetch_l2(rows[first + j] + e);
    }
  }
}

}  // namespace

bool paged_attention_supports(int64_t head_size) {
  return head_size % kLanes == 0 && head_size / kLanes <= kMaxHeadVecs;
}

torch::Tensor paged_attention(torch::Tensor query, std::optional<torch::Tensor> new_key,
                              std::optional<torch::Tensor> new_value,
                              std::optional<torch::Tensor> slots, torch::Tensor kv_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, double scale, bool bf16_dot) {
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
  // KV heads: a token's heads lie side by side in the cache, so one thread reads each token's
  // whole rows once (attention_rows.h; 1.4-1.8x faster than one KV head at a time, cold, at
  // 16-64 decodes). Fewer decodes are split by KV head, to keep every thread busy.
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
  const bool dot = bf16_dot && bf16_dot_supported();
  const GroupKernel<T> kernel = dot ? kGroupKernels<T, true>[dim / kLanes - 1]
                                    : kGroupKernels<T, false>[dim / kLanes - 1];
  const RowKernel<T> row_kernel = dot ? kRowKernels<T, true>[dim / kLanes - 1]
                                      : kRowKernels<T, false>[dim / kLanes - 1];
  std::atomic<int64_t> next{0};
  run_workers(static_cast<int64_t>(tasks.size()), [&] {
    Scratch<T> scratch(max_len, value_offset, heads);
    RowScratch rows = scratch.rows();
    int64_t listed = -1;  // the request whose key rows scratch.keys holds
    for (int64_t i = next.fetch_add(1); i < static_cast<int64_t>(tasks.size());
         i = next.fetch_add(1)) {
      const Task& task = tasks[i];
      const int64_t n = task.request, len = sl[n];
      const int64_t cached = len - (qs[n + 1] - qs[n]);  // tokens before the query chunk
      if (task.kv_end - task.kv_head == kv_heads && task.last - task.first == 1) {
        // A decode taken whole: its tokens' whole rows (attention_rows.h).
        list_rows(kv, bt + n * max_blocks, len, block_size, token_elems, 0, token_elems,
                  scratch.keys.data());
        listed = -1;
        row_kernel(q + task.first * q_stride, scratch.keys.data(), len, kv_heads, group, sc,
                   value_offset, rows, scratch.inv_total.data(), o + task.first * heads * dim);
        continue;
      }
      for (int64_t g = task.kv_head; g < task.kv_end; ++g) {
        if (listed != n * kv_heads + g) {  // KV head g's key rows
          list_rows(kv, bt + n * max_blocks, len, block_size, token_elems, g * dim, dim,
                    scratch.keys.data());
          listed = n * kv_heads + g;
        }
        for (int64_t t = task.first; t < task.last; ++t) {
          const int64_t head = g * group;
          kernel(q + t * q_stride + head * dim, scratch.keys.data(), cached + (t - qs[n]) + 1,
                 group, sc, scratch, o + (t * heads + head) * dim);
        }
      }
    }
  });
  return out;
  });
}

}  // namespace tandem
