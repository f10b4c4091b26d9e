// The inner loops of the CPU attention kernel (paged_attention.cpp) that its float32 and bf16
// forms share, and the bf16 forms of its two dot-product loops.
//
// bf16 keys and values widened to float32 cost two operations per 16 values (a zero-extension
// and a shift) before any arithmetic; with the cache in bf16 that made the kernel as slow as
// float32 on data in cache, although it reads half the bytes. The bf16 forms read 32 values at
// a time:
// - scores (QK): where the CPU has AVX-512 bf16, `vdpbf16ps` multiplies 32 bf16 query and key
//   values into 16 float32 sums (each product of two bf16 values is exact in float32, as in the
//   widened form; the sums are grouped by pairs of dimensions instead of by lanes 16 apart);
// - the weighted values (PV): a 512-bit load of 32 values is two float32 vectors at once, the
//   even dimensions shifted up and the odd ones masked. Per dimension the multiply-adds are the
//   same as the widened form's, in the same order: the output is identical.
#pragma once

#include <immintrin.h>

#include <limits>

#include "kernels.h"

namespace tandem {

#ifdef __AVX512F__
// Full 512-bit vectors even where the compiler would prefer 256-bit ones for auto-vectorization.
#define PREFER_512 __attribute__((target("prefer-vector-width=512")))
#else
#define PREFER_512
#endif

constexpr int kRegisterVecs = 16;  // vectors of queries / accumulators held per pass
constexpr int kMaxPassHeads = 4;   // query heads attended together in one pass
constexpr int64_t kPrefetchTokens = 32;  // how far ahead the key loop asks for the next keys
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Query heads of kVecs vectors attended together in one pass.
constexpr int pass_heads(int kVecs) {
  return std::min(kMaxPassHeads, std::max(1, kRegisterVecs / kVecs));
}

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

// Before key t is used: ask for the key kPrefetchTokens ahead, and for key t's value (read in the
// values loop), one request per cache line of a head's row.
template <int kVecs, class T>
inline void prefetch_key_and_value(const T* const* keys, int64_t t, int64_t len,
                                   int64_t value_offset) {
  constexpr int64_t kStep = 64 / sizeof(T);  // elements per cache line
  if (t + kPrefetchTokens < len)
    for (int64_t e = 0; e < kVecs * kLanes; e += kStep)
      __builtin_prefetch(keys[t + kPrefetchTokens] + e);
  for (int64_t e = 0; e < kVecs * kLanes; e += kStep) __builtin_prefetch(keys[t] + value_offset + e);
}

// The n (<= kLanes) keys' partial dot products in parts (head h's at h * kLanes + kBitReversed
// [j]) summed, scaled, and stored at scores (row stride `stride`) for `heads` heads; lanes past
// n are -inf.
PREFER_512 inline void store_scores(Vec* parts, int64_t heads, int64_t n, float scale,
                                    float* scores, int64_t stride) {
  for (int64_t j = n; j < kLanes; ++j)
    for (int64_t h = 0; h < heads; ++h) parts[h * kLanes + kBitReversed[j]] = Vec{};
  for (int64_t h = 0; h < heads; ++h) {
    Vec sums = sum_lanes(parts + h * kLanes) * scale;
    for (int64_t j = n; j < kLanes; ++j) sums[j] = kNegInf;
    *reinterpret_cast<UVec*>(scores + h * stride) = sums;
  }
}

// Softmax numerators of `heads` rows of scores (row stride `stride`, len scores each, -inf up
// to the next multiple of kLanes) in place, in float32 with the maximum subtracted (as SDPA
// does); inv_total[h] is 1 / the sum of row h, which divides the output at the end.
PREFER_512 inline void softmax_rows(float* scores, int64_t stride, int64_t heads, int64_t len,
                                    float* inv_total) {
  const int64_t padded = (len + kLanes - 1) / kLanes * kLanes;
  for (int64_t h = 0; h < heads; ++h) {
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
}

typedef uint32_t UIVec __attribute__((vector_size(kLanes * sizeof(uint32_t)), aligned(4)));

// 32 bf16 values at p as two float32 vectors: the even-indexed values and the odd ones.
inline void load_bf16_pairs(const Bf16* p, Vec& even, Vec& odd) {
  const IVec w = *reinterpret_cast<const UIVec*>(p);
  const IVec lo = w << 16, hi = w & 0xFFFF0000u;
  even = reinterpret_cast<const Vec&>(lo);
  odd = reinterpret_cast<const Vec&>(hi);
}

// The inverse of load_bf16_pairs for e * scale and o * scale, each rounded to nearest-even as
// store_vec does.
inline void store_bf16_pairs(Bf16* p, Vec e, Vec o, float scale) {
  e *= scale;
  o *= scale;
  IVec lo = reinterpret_cast<const IVec&>(e), hi = reinterpret_cast<const IVec&>(o);
  lo += 0x7FFFu + ((lo >> 16) & 1u);
  hi += 0x7FFFu + ((hi >> 16) & 1u);
  *reinterpret_cast<UIVec*>(p) = (lo >> 16) | (hi & 0xFFFF0000u);
}

// The scores of kHeads bf16 query heads (kVecs vectors each, kVecs even) against the keys, with
// the AVX-512 bf16 dot products: called only where bf16_dot_supported().
template <int kVecs, int kHeads>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,prefer-vector-width=512")))
void score_keys_dot(const Bf16* q, const Bf16* const* keys, int64_t len, float scale,
                    int64_t value_offset, Vec* parts, float* scores, int64_t stride) {
  constexpr int kPairs = kVecs / 2;  // 512-bit vectors of 32 bf16 values per head
  constexpr int64_t dim = kVecs * kLanes;
  __m512bh qv[kHeads][kPairs];
  for (int h = 0; h < kHeads; ++h)
    for (int u = 0; u < kPairs; ++u)
      qv[h][u] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + h * dim + u * 2 * kLanes));
  for (int64_t t0 = 0; t0 < len; t0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, len - t0);
    for (int64_t j = 0; j < n; ++j) {
      prefetch_key_and_value<kVecs>(keys, t0 + j, len, value_offset);
      __m512bh k[kPairs];
      for (int u = 0; u < kPairs; ++u)
        k[u] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(keys[t0 + j] + u * 2 * kLanes));
      for (int h = 0; h < kHeads; ++h) {
        __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[h][0], k[0]);
        for (int u = 1; u < kPairs; ++u) dot = _mm512_dpbf16_ps(dot, qv[h][u], k[u]);
        parts[h * kLanes + kBitReversed[j]] = reinterpret_cast<const Vec&>(dot);
      }
    }
    store_scores(parts, kHeads, n, scale, scores + t0, stride);
  }
}

// The values (value_offset past each key) weighted by the softmax numerators of kHeads heads
// (row h of scores), times inv_total[h], rounded into out's rows; bf16 values, kVecs even.
// acc[h][2u] holds the even dimensions of the u-th 32 values, acc[h][2u + 1] the odd ones.
template <int kVecs, int kHeads>
PREFER_512 void weigh_values_bf16(const Bf16* const* keys, int64_t value_offset, int64_t len,
                                  const float* scores, int64_t stride, const float* inv_total,
                                  Bf16* out) {
  constexpr int kPairs = kVecs / 2;
  constexpr int64_t dim = kVecs * kLanes;
  Vec acc[kHeads][kVecs] = {};
  for (int64_t t = 0; t < len; ++t) {
    const Bf16* vp = keys[t] + value_offset;
    Vec even[kPairs], odd[kPairs];
    for (int u = 0; u < kPairs; ++u) load_bf16_pairs(vp + u * 2 * kLanes, even[u], odd[u]);
    for (int h = 0; h < kHeads; ++h) {
      const float p = scores[h * stride + t];
      for (int u = 0; u < kPairs; ++u) {
        acc[h][2 * u] += p * even[u];
        acc[h][2 * u + 1] += p * odd[u];
      }
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int u = 0; u < kPairs; ++u)
      store_bf16_pairs(out + h * dim + u * 2 * kLanes, acc[h][2 * u], acc[h][2 * u + 1],
                       inv_total[h]);
}

// out (the kHeads heads' rows) = the values (value_offset past each key) weighted by the
// numerators (row h of scores for head h), times inv_total[h].
template <class T, int kVecs, int kHeads>
PREFER_512 void weigh_values(const T* const* keys, int64_t value_offset, int64_t len,
                             const float* scores, int64_t stride, const float* inv_total,
                             T* out) {
  if constexpr (std::is_same_v<T, Bf16> && kVecs % 2 == 0)
    return weigh_values_bf16<kVecs, kHeads>(keys, value_offset, len, scores, stride, inv_total,
                                            out);
  constexpr int64_t dim = kVecs * kLanes;
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

}  // namespace tandem
