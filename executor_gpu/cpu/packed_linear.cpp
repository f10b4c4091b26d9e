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
//
// bfloat16 has two forms. Where the CPU has AVX-512 bf16 (`vdpbf16ps`, detected at run time)
// the panels are pair-interleaved ([out / kPanel, in / 2, kPanel, 2]: rows k and k + 1 of a
// column side by side) and each instruction adds x[k] * w[k] + x[k + 1] * w[k + 1] for 16
// columns into float32 sums: the bf16 rows of x are read as they are (pairs broadcast), with no
// widening of x or of the weights, and twice the multiply-adds per instruction of the float32
// FMAs (prefill is compute-bound: that is where it pays most). Elsewhere (or with
// TANDEM_CPU_BF16_DOT=0) the panels are plain bf16 ([out / kPanel, in, kPanel]) widened to
// float32 in registers, and the rows of x are widened once per call. Either way the sums are
// float32 and each output is rounded to bf16 once, as the reference's GEMM does.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <immintrin.h>

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

// A line of the thread's next panel asked for while a tile runs: into L1 where the tile asks
// for one line per step along the depth, into L2 where it asks for two or four (a panel of a
// few row tiles). Asked into L1 at two or more lines a step, the next panel's lines evict the
// current panel's from L1 and hold the core's few L1 miss buffers while the tiles' own loads
// wait (benchmarks/linear_prefetch.cpp, float32 576 x 3072: 16 rows 1.04-1.19x slower than
// into L2, 12 rows up to 1.25x; a batch-16 decode step's kernels 1.17x float32, 1.20x bf16).
// At one line a step (24+ rows) L1 measured up to 5% faster.
template <int kFetch>
inline void prefetch_next(const char* p) {
  if constexpr (kFetch == 1)
    __builtin_prefetch(p);
  else
    prefetch_l2(p);
}

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
    for (int l = 0; l < kFetch; ++l) prefetch_next<kFetch>(prefetch + (k * kFetch + l) * kLine);
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

// The pair-interleaved bf16 form of panel_tile: c[r][0..kPanel) = bias + sum_k x[r][k] *
// panel[k][0..kPanel) for rows r < kRows over a panel [depth / 2, kPanel, 2], with `vdpbf16ps`
// (each product of two bf16 values is exact in float32; the two of a pair are added into the
// float32 sum). Compiled for these instructions whatever the build's -march, and called only
// where bf16_dot_supported().
template <int kRows, int kFetch>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,prefer-vector-width=512")))
void panel_tile_dot(const Bf16* x, int64_t ldx, const Bf16* panel, const Bf16* bias, Bf16* c,
                    int64_t ldc, int64_t depth, const char* prefetch) {
  __m512 acc[kRows][kVecs];
#pragma GCC unroll 8
  for (int64_t v = 0; v < kVecs; ++v) {
    const __m512 start = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(
                                    _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                        reinterpret_cast<const __m256i*>(bias + v * kLanes))),
                                    16))
                              : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) acc[r][v] = start;
  }
  for (int64_t k = 0; k < depth / 2; ++k) {
    const Bf16* w = panel + k * 2 * kPanel;
    __m512bh wk[kVecs];
#pragma GCC unroll 8
    for (int64_t v = 0; v < kVecs; ++v)
      wk[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + v * 2 * kLanes));
#pragma GCC unroll 4
    for (int l = 0; l < kFetch; ++l) prefetch_next<kFetch>(prefetch + (k * kFetch + l) * kLine);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      int32_t pair;  // x[r][2k] in the low half, x[r][2k + 1] in the high half
      std::memcpy(&pair, x + r * ldx + 2 * k, sizeof(pair));
      const __m512bh xs = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
#pragma GCC unroll 8
      for (int64_t v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xs, wk[v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 8
    for (int64_t v = 0; v < kVecs; ++v)
      store_vec(c + r * ldc + v * kLanes, reinterpret_cast<const Vec&>(acc[r][v]));
}

// A tile kernel: X is the element type of x's rows as the tile reads them, W the panels'.
template <class X, class W>
using TileFn = void (*)(const X*, int64_t, const W*, const W*, W*, int64_t, int64_t,
                        const char*);
template <class T, int kFetch, int... kRows>
constexpr std::array<TileFn<float, T>, sizeof...(kRows)> make_tiles(
    std::integer_sequence<int, kRows...>) {
  return {panel_tile<T, kRows + 1, kFetch>...};
}
template <int kFetch, int... kRows>
constexpr std::array<TileFn<Bf16, Bf16>, sizeof...(kRows)> make_dot_tiles(
    std::integer_sequence<int, kRows...>) {
  return {panel_tile_dot<kRows + 1, kFetch>...};
}
// kTiles<T>[f][n - 1]: the tile of n rows that prefetches kFetch = 0, 1, 2, 4 (f = 0..3) lines
// of the next panel per step along the depth (a panel row; a pair of them in kDotTiles).
template <class T>
constexpr std::array<std::array<TileFn<float, T>, kRowTile>, 4> kTiles = {
    make_tiles<T, 0>(std::make_integer_sequence<int, kRowTile>{}),
    make_tiles<T, 1>(std::make_integer_sequence<int, kRowTile>{}),
    make_tiles<T, 2>(std::make_integer_sequence<int, kRowTile>{}),
    make_tiles<T, 4>(std::make_integer_sequence<int, kRowTile>{})};
constexpr std::array<std::array<TileFn<Bf16, Bf16>, kRowTile>, 4> kDotTiles = {
    make_dot_tiles<0>(std::make_integer_sequence<int, kRowTile>{}),
    make_dot_tiles<1>(std::make_integer_sequence<int, kRowTile>{}),
    make_dot_tiles<2>(std::make_integer_sequence<int, kRowTile>{}),
    make_dot_tiles<4>(std::make_integer_sequence<int, kRowTile>{})};

// The rows of x times every panel: `tiles` are kTiles<T> (x widened to float32, a step along
// the depth is one panel row of kLinesPerRow<T> lines) or kDotTiles (x in bf16, a step is a
// pair of rows: 4 lines).
template <class X, class T>
void run_panels(const std::array<std::array<TileFn<X, T>, kRowTile>, 4>& tiles,
                int64_t lines_per_step, const X* xp, int64_t ldx, const T* wp, const T* bp,
                T* op, int64_t rows, int64_t depth, int64_t panels) {
  const int64_t steps = depth * kLinesPerRow<T> / lines_per_step;  // along the depth
  const int64_t width = panels * kPanel;
  // Row ranges of equal size (whole tiles), at most kRowsPerTask rows each, so that tasks take
  // about equally long and the last one claimed leaves the other threads waiting least.
  const int64_t row_tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  const int64_t range = ((rows + row_tasks - 1) / row_tasks + kRowTile - 1) / kRowTile * kRowTile;
  // With one range, panels that do not divide evenly among the threads (9 panels of a 576-wide
  // layer over 2) would leave one thread running the last alone while the others wait: those
  // last `tail` panels are instead split into `parts` row ranges of `part` rows, one per thread.
  // (A row's outputs are computed the same way whichever tile holds it: the results do not
  // depend on the split, so not on the thread count.)
  const int64_t threads = at::get_num_threads();
  const int64_t part = (rows + threads - 1) / threads;
  const int64_t tail = row_tasks == 1 && threads > 1 && part >= kRowTile ? panels % threads : 0;
  const int64_t parts = tail > 0 ? (rows + part - 1) / part : 1;
  // Tasks: (row range, panel), row-range-major, then the tail's (panel, part)s, claimed one at
  // a time from a shared counter (run_workers) so that a thread the OS has paused (the
  // controller shares these cores) delays only the task it holds. Each thread claims its next
  // task before running the current one, so it knows which panel to prefetch.
  const int64_t whole = (panels - tail) * row_tasks;
  const int64_t total = whole + tail * parts;
  struct Share {
    int64_t panel, first, last;  // a task's panel and its rows [first, last)
  };
  const auto share_of = [&](int64_t task) -> Share {
    if (task < whole) {
      const int64_t first = task / panels * range;
      return {task % panels, first, std::min(rows, first + range)};
    }
    const int64_t j = task - whole, first = j % parts * part;
    return {panels - tail + j / parts, first, std::min(rows, first + part)};
  };
  std::atomic<int64_t> claimed{0};
  run_workers(total, [&] {
    for (int64_t task = claimed.fetch_add(1), following; task < total; task = following) {
      following = claimed.fetch_add(1);
      const auto [p, first, last] = share_of(task);
      // While this panel's row tiles run, the first of them (up to lines_per_step) ask for the
      // thread's next panel (unless it is this one), a share of its cache lines each, so that
      // it arrives from memory during the arithmetic instead of after it.
      const int64_t tiles_n = (last - first + kRowTile - 1) / kRowTile;
      const int64_t sharing = std::min(tiles_n, lines_per_step);
      const int lines = static_cast<int>((lines_per_step + sharing - 1) / sharing);  // 4, 2, 1
      const int64_t next_p = following < total ? share_of(following).panel : p;
      const char* next =
          next_p != p ? reinterpret_cast<const char*>(wp + next_p * depth * kPanel) : nullptr;
      for (int64_t r = first, i = 0; r < last; r += kRowTile, ++i) {
        const int n = static_cast<int>(std::min<int64_t>(kRowTile, last - r));
        const bool fetch = next != nullptr && i * lines < lines_per_step;
        const int f = fetch ? (lines == 4 ? 3 : lines) : 0;
        tiles[f][n - 1](xp + r * ldx, ldx, wp + p * depth * kPanel,
                        bp ? bp + p * kPanel : nullptr, op + r * width + p * kPanel, width,
                        depth, fetch ? next + i * steps * lines * kLine : nullptr);
      }
    }
  });
}

}  // namespace

bool bf16_dot_supported() {
  // cpuid, once: the tiles above run only where the CPU executes them.
  static const bool supported = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  }();
  return supported;
}

torch::Tensor pack_linear_weight(torch::Tensor weight, bool pairs) {
  TORCH_CHECK((weight.scalar_type() == torch::kFloat || weight.scalar_type() == torch::kBFloat16) &&
                  weight.dim() == 2,
              "pack_linear_weight: float32 or bfloat16 [in, out] only");
  const int64_t depth = weight.size(0), width = weight.size(1);
  TORCH_CHECK(width % kPanel == 0, "pack_linear_weight: out_features must divide by ", kPanel);
  if (!pairs)  // [in, out] -> [out / kPanel, in, kPanel]
    return weight.reshape({depth, width / kPanel, kPanel}).permute({1, 0, 2}).contiguous();
  TORCH_CHECK(weight.scalar_type() == torch::kBFloat16 && depth % 2 == 0,
              "pack_linear_weight: pairs take a bfloat16 weight of even in_features");
  // [in, out] -> [out / kPanel, in / 2, kPanel, 2]
  return weight.reshape({depth / 2, 2, width / kPanel, kPanel})
      .permute({2, 0, 3, 1})
      .contiguous();
}

torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed,
                            std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(),
              "packed_linear: x and weight must share their dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "packed_linear: x rows must be contiguous");
  const bool pairs = packed.dim() == 4;
  TORCH_CHECK((packed.dim() == 3 || (pairs && packed.size(3) == 2)) &&
                  packed.size(2) == kPanel && packed.is_contiguous(),
              "packed_linear: weight must come from pack_linear_weight");
  const int64_t rows = x.size(0), depth = x.size(1), panels = packed.size(0);
  const int64_t width = panels * kPanel;
  TORCH_CHECK(packed.size(1) * (pairs ? 2 : 1) == depth,
              "packed_linear: x and weight disagree on in_features");
  TORCH_CHECK(!pairs || bf16_dot_supported(),
              "packed_linear: pair-interleaved panels need a CPU with AVX-512 bf16");
  if (bias.has_value())
    TORCH_CHECK(bias->is_contiguous() && bias->numel() == width &&
                    bias->scalar_type() == x.scalar_type(),
                "packed_linear: bias [out] of x's dtype");
  auto out = torch::empty({rows, width}, x.options());
  if (rows == 0) return out;
  const Bf16* b16 = bias.has_value() && pairs ? data_of<Bf16>(*bias) : nullptr;
  if (pairs) {  // bf16 rows read in place
    run_panels<Bf16, Bf16>(kDotTiles, 4, data_of<Bf16>(x), x.stride(0), data_of<Bf16>(packed),
                           b16, data_of<Bf16>(out), rows, depth, panels);
    return out;
  }
  // bf16 rows widened once (float32 rows are read in place).
  const torch::Tensor xf = x.scalar_type() == torch::kFloat ? x : x.to(torch::kFloat);
  dispatch_float_or_bf16(x.scalar_type(), "packed_linear", [&](auto tag) {
    using T = decltype(tag);
    run_panels<float, T>(kTiles<T>, kLinesPerRow<T>, xf.data_ptr<float>(), xf.stride(0),
                         data_of<T>(packed), bias.has_value() ? data_of<T>(*bias) : nullptr,
                         data_of<T>(out), rows, depth, panels);
  });
  return out;
}

}  // namespace tandem
