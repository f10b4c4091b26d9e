// One pass over a step's float32 logits for what every step asks of them: each row's argmax
// (the greedy token) and whether the row is finite (a non-finite row fails its request alone).
//
// At batch 64 the logits are 64 x vocab floats (12.6 MB for a 49k vocabulary), written by the
// output projection and then read twice by torch: a row sum for the finiteness check and an
// argmax for greedy sampling, each on one thread, together ~9% of a float32 decode step. Here
// both come from a single read, the rows shared out over the task pool.
//
// The argmax is torch's: the first index of the row's maximum. Per lane, a value replaces the
// lane's best only when strictly greater (so each lane keeps its first maximum); across lanes
// the greatest value wins and, among equal ones, the smallest index. A row with a NaN or an
// infinity is reported not finite (its argmax is then of no use: the request fails).
#include "kernels.h"

#include <atomic>

namespace tandem {
namespace {

typedef int32_t IdxVec __attribute__((vector_size(kLanes * sizeof(int32_t))));

// The argmax of row[0..n) and whether every value is finite.
#ifdef __AVX512F__
__attribute__((target("prefer-vector-width=512")))
#endif
std::pair<int64_t, bool> scan_row(const float* row, int64_t n) {
  const int64_t whole = n / kLanes * kLanes;
  float best = -std::numeric_limits<float>::infinity();
  int64_t best_at = 0;
  Vec poison = Vec{};  // x * 0 is NaN exactly when x is infinite or NaN
  if (whole > 0) {
    Vec top = load_vec(row);
    IdxVec at, lane;
    for (int i = 0; i < kLanes; ++i) lane[i] = i;
    at = lane;
    poison = top * 0.0f;
    for (int64_t k = kLanes; k < whole; k += kLanes) {
      const Vec x = load_vec(row + k);
      poison += x * 0.0f;
      const IdxVec greater = x > top;  // lanes whose new value beats their best (-1 / 0)
      top = greater ? x : top;
      at = greater ? lane + static_cast<int32_t>(k) : at;
    }
    best = top[0];
    best_at = at[0];
    for (int i = 1; i < kLanes; ++i)
      if (top[i] > best || (top[i] == best && at[i] < best_at)) best = top[i], best_at = at[i];
  }
  bool finite = true;
  for (int i = 0; i < kLanes; ++i) finite = finite && poison[i] == 0.0f;
  for (int64_t k = whole; k < n; ++k) {
    finite = finite && std::isfinite(row[k]);
    if (row[k] > best || k == 0) best = row[k], best_at = k;
  }
  return {best_at, finite};
}

}  // namespace

std::tuple<torch::Tensor, torch::Tensor> scan_logits(torch::Tensor logits) {
  TORCH_CHECK(logits.scalar_type() == torch::kFloat && logits.dim() == 2 &&
                  (logits.stride(1) == 1 || logits.size(0) == 0 || logits.size(1) == 1) &&
                  logits.size(1) > 0,
              "scan_logits: float32 [rows, vocab] with contiguous rows");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "scan_logits: a vocabulary of at most 2^31 - 1");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto argmax = torch::empty({rows}, torch::kLong);
  auto finite = torch::empty({rows}, torch::kBool);
  const float* data = logits.data_ptr<float>();
  int64_t* am = argmax.data_ptr<int64_t>();
  bool* ok = finite.data_ptr<bool>();
  std::atomic<int64_t> next{0};
  run_workers(rows, [&] {
    for (int64_t r = next.fetch_add(1); r < rows; r = next.fetch_add(1)) {
      const auto [index, fine] = scan_row(data + r * stride, vocab);
      am[r] = index;
      ok[r] = fine;
    }
  });
  return {argmax, finite};
}

}  // namespace tandem
