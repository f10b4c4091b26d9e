// Decode attention over whole cache rows (paged_attention.cpp's form for decodes taken whole).
//
// A token's keys for all its KV heads lie side by side in the cache (one row of kv_heads * d
// values), and so do its values. Attending one KV head at a time reads a third of every row
// (with 3 KV heads), then the next third, and so on: a strided pattern that the CPU's
// prefetchers follow poorly. One core reading a batch-64, 128-token float32 cache of 30 layers
// in each order (benchmarks/cache_read_order.cpp) ran at 7-10 GB/s one KV head at a time
// against 15-19 GB/s reading whole rows with the next block asked for into L2 (blocks shuffled,
// as a long-running server's are).
//
// So a decode (one query token) reads each key row once, scoring every query head against its
// KV head's part of the row, and asks for the key row kPrefetchTokens ahead and for the token's
// value row, both into L2; the values are then weighted one KV head at a time from there, each
// head's accumulators in registers. The arithmetic per head is that of the one-head-at-a-time
// form, in the same order: dot products summed across lanes 16 keys at a time, a float32
// softmax with the maximum subtracted, the values accumulated in token order (bf16: the same
// dot-product and even/odd forms, attention_inner.h).
#pragma once

#include "attention_inner.h"

namespace tandem {

// The working memory of one decode over whole rows (the caller's, sized for its heads).
struct RowScratch {
  float* scores;  // [heads, stride] scores, then softmax numerators
  int64_t stride;  // scores' row stride: the longest length rounded up to kLanes
  Vec* parts;      // [heads, kLanes] partial dot products of 16 keys
};

// Before row t is used: ask for the key row kPrefetchTokens ahead and for row t's values (read
// in the values pass), one request per cache line, into L2 (asked into L1 they measured no
// faster than one KV head at a time: a core's few L1 miss buffers then bound the stream).
template <class T>
inline void prefetch_rows(const T* const* rows, int64_t t, int64_t len, int64_t row_elems,
                          int64_t value_offset) {
  constexpr int64_t kStep = 64 / sizeof(T);  // elements per cache line
  if (t + kPrefetchTokens < len)
    for (int64_t e = 0; e < row_elems; e += kStep) prefetch_l2(rows[t + kPrefetchTokens] + e);
  for (int64_t e = 0; e < row_elems; e += kStep) prefetch_l2(rows[t] + value_offset + e);
}

// One query head's dot products with one KV head's key (kVecs vectors at k); float32 keys, or
// bf16 widened to float32.
template <class T, int kVecs>
PREFER_512 inline Vec dot_head(const T* q, const Vec* k) {
  Vec dot = load_vec(q) * k[0];
  for (int v = 1; v < kVecs; ++v) dot += load_vec(q + v * kLanes) * k[v];
  return dot;
}

// The same with the AVX-512 bf16 dot products (kVecs even; only where bf16_dot_supported()).
template <int kVecs>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,prefer-vector-width=512")))
inline void score_row_dot(const Bf16* q, const Bf16* kp, int64_t kv_heads, int64_t group,
                          int64_t j, Vec* parts) {
  constexpr int kPairs = kVecs / 2;
  constexpr int64_t dim = kVecs * kLanes;
  for (int64_t g = 0; g < kv_heads; ++g) {
    __m512bh k[kPairs];
    for (int u = 0; u < kPairs; ++u)
      k[u] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kp + g * dim + u * 2 * kLanes));
    for (int64_t h = g * group; h < (g + 1) * group; ++h) {
      const Bf16* qh = q + h * dim;
      __m512 dot = _mm512_dpbf16_ps(
          _mm512_setzero_ps(), reinterpret_cast<__m512bh>(_mm512_loadu_si512(qh)), k[0]);
      for (int u = 1; u < kPairs; ++u)
        dot = _mm512_dpbf16_ps(
            dot, reinterpret_cast<__m512bh>(_mm512_loadu_si512(qh + u * 2 * kLanes)), k[u]);
      parts[h * kLanes + kBitReversed[j]] = reinterpret_cast<const Vec&>(dot);
    }
  }
}

// The scores of every query head (kv_heads groups of `group`) against the key rows, scaled,
// into s.scores (row h: head h; lanes past the last key -inf).
template <class T, int kVecs, bool kDot>
PREFER_512 void score_rows(const T* q, const T* const* rows, int64_t len, int64_t kv_heads,
                           int64_t group, float scale, int64_t value_offset, RowScratch& s) {
  constexpr int64_t dim = kVecs * kLanes;
  const int64_t heads = kv_heads * group;
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      const T* kp = rows[t0 + j];
      prefetch_rows(rows, t0 + j, len, kv_heads * dim, value_offset);
      if constexpr (kDot) {
        score_row_dot<kVecs>(q, kp, kv_heads, group, j, s.parts);
      } else {
        for (int64_t g = 0; g < kv_heads; ++g) {
          Vec k[kVecs];
          for (int v = 0; v < kVecs; ++v) k[v] = load_vec(kp + g * dim + v * kLanes);
          for (int64_t h = g * group; h < (g + 1) * group; ++h)
            s.parts[h * kLanes + kBitReversed[j]] = dot_head<T, kVecs>(q + h * dim, k);
        }
      }
    }
    store_scores(s.parts, heads, n, scale, s.scores + t0, s.stride);
  }
}

// weigh_values for n (1..kHeads) heads, n known only at run time.
template <class T, int kVecs, int kHeads>
void weigh_n_values(int64_t n, const T* const* rows, int64_t value_offset, int64_t len,
                    const float* scores, int64_t stride, const float* inv_total, T* out) {
  if constexpr (kHeads > 1)
    if (n < kHeads)
      return weigh_n_values<T, kVecs, kHeads - 1>(n, rows, value_offset, len, scores, stride,
                                                   inv_total, out);
  weigh_values<T, kVecs, kHeads>(rows, value_offset, len, scores, stride, inv_total, out);
}

// out (every head's row) = the value rows weighted by the numerators, over their sums. The
// score pass asked for every value row (whole, in token order), so they are read here from
// the CPU's caches, one KV head's part at a time with its heads' accumulators in registers.
template <class T, int kVecs>
void weigh_rows(const T* const* rows, int64_t len, int64_t kv_heads, int64_t group,
                int64_t value_offset, const float* inv_total, const RowScratch& s, T* out) {
  constexpr int kMax = pass_heads(kVecs);
  constexpr int64_t dim = kVecs * kLanes;
  for (int64_t g = 0; g < kv_heads; ++g)
    for (int64_t h = g * group; h < (g + 1) * group; h += kMax)
      weigh_n_values<T, kVecs, kMax>(std::min<int64_t>(kMax, (g + 1) * group - h), rows,
                                     value_offset + g * dim, len, s.scores + h * s.stride,
                                     s.stride, inv_total + h, out + h * dim);
}

// One decode's attention over every KV head: q and out hold all heads' rows, rows[t] is
// token t's key row (its value row value_offset further); inv_total has room for every head.
template <class T, int kVecs, bool kDot>
void attend_rows(const T* q, const T* const* rows, int64_t len, int64_t kv_heads,
                 int64_t group, float scale, int64_t value_offset, RowScratch& s,
                 float* inv_total, T* out) {
  score_rows<T, kVecs, kDot>(q, rows, len, kv_heads, group, scale, value_offset, s);
  softmax_rows(s.scores, s.stride, kv_heads * group, len, inv_total);
  weigh_rows<T, kVecs>(rows, len, kv_heads, group, value_offset, inv_total, s, out);
}

}  // namespace tandem
