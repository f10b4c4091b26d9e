// Linear layers on the CPU (float32, or bfloat16 with float32 accumulation) over weights
// packed into column panels.
//
// A decode step multiplies a handful of rows by each weight matrix: every weight is used once
// per row, so the layer is a stream over its weights, and general GEMM libraries (tiled for
// reuse such shapes do not have, reading [in, out] rows with a stride) reach a fraction of the
// memory bandwidth. Here each weight matrix is stored once, at load, as panels of kPanel output
// columns ([out / kPanel, in, kPanel]): a panel is one contiguous run of memory, read front to
// back. A task owns a panel and a range of rows; it keeps kRowTile rows' accumulators for the
// panel's columns in vector registers and streams the panel once per row tile (from cache
// after the first). The same code serves prefill-sized batches, where it is compute-bound.
// In bfloat16 the panels hold bf16 weights (half the bytes to stream: a decode step is that
// much shorter), widened to float32 in registers; the rows of x are widened to float32 once per
// call (a pass over x, against one over the weights per row tile); the sums are float32 and
// each output is rounded to bf16 once, as the reference's GEMM does.
#include "kernels.h"

#include <ATen/Parallel.h>

namespace tandem {
namespace {

constexpr int64_t kVecs = kPanel / kLanes;   // vectors per panel row
#ifdef __AVX512F__
constexpr int kRowTile = 6;  // 6 rows x 4 vectors of accumulators: 24 of the 32 registers
#else
constexpr int kRowTile = 2;  // 16 ymm registers hold 2 rows x 4 (double-width) vectors
#endif
constexpr int64_t kRowsPerTask = 32 * kRowTile;  // rows per task: a decode batch is one range
constexpr int64_t kLine = 64;                    // bytes per cache line
// Cache lines per panel row: 4 of float32, 2 of bf16.
template <class T>
constexpr int64_t kLinesPerRow = kPanel * sizeof(T) / kLine;

static_assert(kPanel % kLanes == 0, "a panel is whole vectors");
static_assert(kLinesPerRow<float> == 4 && kLinesPerRow<Bf16> == 2,
              "the prefetching tiles cover up to 4 lines per panel row");

// c[r][0..kPanel) = bias + sum_k x[r][k] * panel[k][0..kPanel) for rows r < kRows. (Full
// 512-bit vectors even where the compiler would prefer 256-bit ones for auto-vectorization; the
// loops are unrolled so that the accumulators live in registers.)
template <class T, int kRows, int kFetch>
#ifdef __AVX512F__
__attribute__((target("prefer-vector-width=512")))
#endif
void panel_tile(const float* x, int64_t ldx, const T* panel, const T* bias, T* c, int64_t ldc,
                int64_t depth, const char* prefetch) {
  Vec acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int64_t v = 0; v < kVecs; ++v) {
    const Vec start = bias ? load_vec(bias + v * kLanes) : Vec{};
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) acc[r][v] = start;
  }
  for (int64_t k = 0; k < depth; ++k) {
    const T* w = panel + k * kPanel;
    Vec wk[kVecs];
#pragma GCC unroll 8
    for (int64_t v = 0; v < kVecs; ++v) wk[v] = load_vec(w + v * kLanes);
#pragma GCC unroll 4
    for (int l = 0; l < kFetch; ++l) __builtin_prefetch(prefetch + (k * kFetch + l) * kLine);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float s = x[r * ldx + k];
#pragma GCC unroll 8
      for (int64_t v = 0; v < kVecs; ++v) acc[r][v] += s * wk[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int64_t v = 0; v < kVecs; ++v) store_vec(c + r * ldc + v * kLanes, acc[r][v]);
}

template <class T>
using TileFn = void (*)(const float*, int64_t, const T*, const T*, T*, int64_t, int64_t,
                        const char*);
template <class T, int kFetch, int... kRows>
constexpr std::array<TileFn<T>, sizeof...(kRows)> make_tiles(
    std::integer_sequence<int, kRows...>) {
  return {panel_tile<T, kRows + 1, kFetch>...};
}
// kTiles<T>[f][n - 1]: the tile of n rows that prefetches kFetch = 0, 1, 2, 4 (f = 0..3) lines
// of the next panel per panel row.
template <class T>
constexpr std::array<std::array<TileFn<T>, kRowTile>, 4> kTiles = {
    make_tiles<T, 0>(std::make_integer_sequence<int, kRowTile>{}),
    make_tiles<T, 1>(std::make_integer_sequence<int, kRowTile>{}),
    make_tiles<T, 2>(std::make_integer_sequence<int, kRowTile>{}),
    make_tiles<T, 4>(std::make_integer_sequence<int, kRowTile>{})};

template <class T>
void run_panels(const float* xp, int64_t ldx, const T* wp, const T* bp, T* op, int64_t rows,
                int64_t depth, int64_t panels) {
  constexpr int64_t lines_per_row = kLinesPerRow<T>;
  const int64_t width = panels * kPanel;
  // Row ranges of equal size (whole tiles), at most kRowsPerTask rows each: the threads split
  // the tasks evenly, so unequal ranges would leave one thread waiting for the other.
  const int64_t row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t range = ((rows + row_tasks - 1) / row_tasks + kRowTile - 1) / kRowTile * kRowTile;
  // Tasks: (row range, panel), row-range-major: a thread keeps its rows in cache and streams
  // panels past them; a decode step is one row range, split by panel.
  at::parallel_for(0, panels * row_tasks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task % panels;
      const int64_t first = (task / panels) * range;
      const int64_t last = std::min(rows, first + range);
      // While this panel's row tiles run, the first of them (up to lines_per_row) ask for the
      // thread's next panel, a share of its cache lines each, so that it arrives from memory
      // during the arithmetic instead of after it.
      const int64_t tiles = (last - first + kRowTile - 1) / kRowTile;
      const int64_t sharing = std::min(tiles, lines_per_row);
      const int lines = static_cast<int>((lines_per_row + sharing - 1) / sharing);  // 4, 2, 1
      const char* next =
          task + 1 < end
              ? reinterpret_cast<const char*>(wp + ((task + 1) % panels) * depth * kPanel)
              : nullptr;
      for (int64_t r = first, i = 0; r < last; r += kRowTile, ++i) {
        const int n = static_cast<int>(std::min<int64_t>(kRowTile, last - r));
        const bool fetch = next != nullptr && i * lines < lines_per_row;
        const int f = fetch ? (lines == 4 ? 3 : lines) : 0;
        kTiles<T>[f][n - 1](xp + r * ldx, ldx, wp + p * depth * kPanel,
                            bp ? bp + p * kPanel : nullptr, op + r * width + p * kPanel, width,
                            depth, fetch ? next + i * depth * lines * kLine : nullptr);
      }
    }
  });
}

}  // namespace

torch::Tensor pack_linear_weight(torch::Tensor weight) {
  TORCH_CHECK((weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16) &&
                  weight.dim() == 2,
              "pack_linear_weight: float32 or bfloat16 [in, out] only");
  const int64_t depth = weight.size(0), width = weight.size(1);
  TORCH_CHECK(width % kPanel == 0, "pack_linear_weight: out_features must divide by ", kPanel);
  // [in, out] -> [out / kPanel, in, kPanel]
  return weight.reshape({depth, width / kPanel, kPanel}).permute({1, 0, 2}).contiguous();
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed,
                            std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(),
              "packed_linear: x and weight must share their dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear: x rows must be contiguous");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear: weight must come from pack_linear_weight");
  const int64_t rows = x.size(0), depth = x.size(1), panels = packed.size(0);
  const int64_t width = panels * kPanel;
  TORCH_CHECK(packed.size(1) == depth, "packed_linear: x and weight disagree on in_features");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == width &&
                    bias->scalar_type() == x.scalar_type(),
                "packed_linear: bias [out] of x's dtype");
  auto out = torch::empty({rows, width}, x.options());
  if (rows == 0) return out;
  // bf16 rows widened once (float32 rows are read in place).
  const torch::Tensor xf = x.scalar_type() == torch::kFloat ? x : x.to(torch::kFloat);
  dispatch_float_or_bf16(x.scalar_type(), "packed_linear", [&](auto tag) {
    using T = decltype(tag);
    run_panels<T>(xf.data_ptr<float>(), xf.stride(0), data_of<T>(packed),
                  bias.has_value() ? data_of<T>(*bias) : nullptr, data_of<T>(out), rows, depth,
                  panels);
  });
  return out;
}

}  // namespace tandem
