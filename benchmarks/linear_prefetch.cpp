// Where the packed linear layer should ask for its next weight panel: the float32 tile of
// executor_gpu/cpu/packed_linear.cpp over weights far larger than the caches, at a decode
// batch's row counts, with the next panel asked for into L1, into L2, not at all, or by the
// kernel's rule (L1 where a tile asks for one line per step along the depth, L2 where it asks
// for two or four).
//
// The weights are those of a layer of SmolLM2-135M (by default gate_up, 576 x 3072) packed as
// the kernel packs them ([out / 64, in, 64] float32), 30 copies (the model's layers), so that
// every pass reads from memory. Each thread takes a contiguous share of the panels; a panel is
// multiplied by row tiles of 6 rows (the last one shorter), and the first tiles ask for the
// thread's next panel as the kernel's do. Beside them, the memory's streaming rate (a plain read
// of the same bytes) and, as the ratio's baseline, the L1 prefetch the kernel had before.
//
//     g++ -O3 -march=native -fopenmp benchmarks/linear_prefetch.cpp -o /tmp/linear_prefetch
//     /tmp/linear_prefetch [in] [out] [threads] [rows...]
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

typedef float Vec __attribute__((vector_size(64)));
typedef float UVec __attribute__((vector_size(64), aligned(4)));

constexpr int64_t kLanes = 16, kPanel = 64, kVecs = kPanel / kLanes, kLine = 64;
constexpr int kRowTile = 6, kCopies = 30, kRepeats = 7;
constexpr int64_t kLinesPerRow = kPanel * sizeof(float) / kLine;  // 4

inline Vec load(const float* p) { return *reinterpret_cast<const UVec*>(p); }
inline void store(float* p, Vec v) { *reinterpret_cast<UVec*>(p) = v; }

// Where a tile's prefetches go.
enum class Hint { kNone, kL1, kL2, kRule };

template <Hint kHint, int kFetch>
inline void prefetch(const char* p) {
  constexpr bool l1 = kHint == Hint::kL1 || (kHint == Hint::kRule && kFetch == 1);
  if constexpr (l1)
    asm volatile("prefetcht0 %0" : : "m"(*p));
  else
    asm volatile("prefetcht2 %0" : : "m"(*p));
}

// c[r][0..64) = sum_k x[r][k] * panel[k][0..64) for kRows rows, asking for kFetch lines of
// `next` per step along the depth.
template <int kRows, int kFetch, Hint kHint>
__attribute__((noinline, target("prefer-vector-width=512"))) void tile(
    const float* x, int64_t depth, const float* panel, float* c, int64_t ldc, const char* next) {
  Vec acc[kRows][kVecs] = {};
  for (int64_t k = 0; k < depth; ++k) {
    Vec w[kVecs];
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVecs; ++v) w[v] = load(panel + k * kPanel + v * kLanes);
#pragma GCC unroll 4
    for (int l = 0; l < kFetch; ++l) prefetch<kHint, kFetch>(next + (k * kFetch + l) * kLine);
#pragma GCC unroll 8
    for (int r = 0; r < kRows; ++r) {
      const float s = x[r * depth + k];
#pragma GCC unroll 4
      for (int64_t v = 0; v < kVecs; ++v) acc[r][v] += s * w[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRows; ++r)
#pragma GCC unroll 4
    for (int64_t v = 0; v < kVecs; ++v) store(c + r * ldc + v * kLanes, acc[r][v]);
}

using Tile = void (*)(const float*, int64_t, const float*, float*, int64_t, const char*);

template <Hint kHint, int kRows>
Tile pick_fetch(int fetch) {
  switch (fetch) {
    case 0: return tile<kRows, 0, kHint>;
    case 1: return tile<kRows, 1, kHint>;
    case 2: return tile<kRows, 2, kHint>;
    default: return tile<kRows, 4, kHint>;
  }
}

template <Hint kHint>
Tile pick(int rows, int fetch) {
  switch (rows) {
    case 1: return pick_fetch<kHint, 1>(fetch);
    case 2: return pick_fetch<kHint, 2>(fetch);
    case 3: return pick_fetch<kHint, 3>(fetch);
    case 4: return pick_fetch<kHint, 4>(fetch);
    case 5: return pick_fetch<kHint, 5>(fetch);
    default: return pick_fetch<kHint, 6>(fetch);
  }
}

// Panels [first, last) of one layer times `rows` rows of x, as the kernel runs them: the first
// tiles of a panel share the asking for the next one (4 lines per step in all).
template <Hint kHint>
void panels(const float* x, int rows, const float* w, float* out, int64_t depth, int64_t width,
            int64_t first, int64_t last) {
  const int64_t tiles = (rows + kRowTile - 1) / kRowTile;
  const int64_t sharing = std::min<int64_t>(tiles, kLinesPerRow);
  const int lines = static_cast<int>((kLinesPerRow + sharing - 1) / sharing);
  for (int64_t p = first; p < last; ++p) {
    const char* next =
        p + 1 < last ? reinterpret_cast<const char*>(w + (p + 1) * depth * kPanel) : nullptr;
    for (int r = 0, i = 0; r < rows; r += kRowTile, ++i) {
      const bool fetch = kHint != Hint::kNone && next != nullptr && i * lines < kLinesPerRow;
      pick<kHint>(std::min(kRowTile, rows - r), fetch ? lines : 0)(
          x + r * depth, depth, w + p * depth * kPanel, out + r * width + p * kPanel, width,
          fetch ? next + i * depth * lines * kLine : nullptr);
    }
  }
}

float stream(const float* w, int64_t n) {
  Vec a{}, b{}, c{}, d{};
  for (int64_t i = 0; i < n; i += 4 * kLanes) {
    a += load(w + i);
    b += load(w + i + kLanes);
    c += load(w + i + 2 * kLanes);
    d += load(w + i + 3 * kLanes);
  }
  const Vec s = a + b + c + d;
  return s[0] + s[kLanes - 1];
}

double seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

}  // namespace

int main(int argc, char** argv) {
  const int64_t depth = argc > 1 ? atoll(argv[1]) : 576, width = argc > 2 ? atoll(argv[2]) : 3072;
  const int threads = argc > 3 ? atoi(argv[3]) : 2;
  std::vector<int> row_counts;
  for (int i = 4; i < argc; ++i) row_counts.push_back(atoi(argv[i]));
  if (row_counts.empty()) row_counts = {1, 4, 8, 12, 16, 24, 32, 64};
  const int64_t layer = depth * width, n_panels = width / kPanel;
  std::vector<float> w(layer * kCopies);
  for (size_t i = 0; i < w.size(); ++i) w[i] = static_cast<float>(i % 97) * 0.01f;
  const double bytes = 4.0 * w.size();
  float sink = 0;

  // Best of kRepeats passes over every copy; `body(weights, first, last)` per thread.
  auto best = [&](auto&& body) {
    double t_best = 1e30;
    for (int rep = 0; rep < kRepeats; ++rep) {
      const double t0 = seconds();
      for (int copy = 0; copy < kCopies; ++copy) {
#pragma omp parallel num_threads(threads)
        {
          const int t = omp_get_thread_num(), n = omp_get_num_threads();
          body(w.data() + copy * layer, n_panels * t / n, n_panels * (t + 1) / n);
        }
      }
      t_best = std::min(t_best, seconds() - t0);
    }
    return t_best;
  };
  const double t_stream = best([&](const float* wl, int64_t a, int64_t b) {
    const float s = stream(wl + a * depth * kPanel, (b - a) * depth * kPanel);
#pragma omp atomic
    sink += s;
  });
  printf("%ld x %ld float32 x %d layers (%.0f MB), %d threads; streaming read %.1f GB/s\n",
         depth, width, kCopies, bytes / 1e6, threads, bytes / t_stream / 1e9);
  printf("rows | next panel into L1 (GFLOP/s per thread) | none, L1 / none | into L2 | rule\n");
  for (const int rows : row_counts) {
    std::vector<float> x(rows * depth), out(rows * width);
    for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 13) * 0.1f;
    auto run = [&](auto hint) {
      constexpr Hint h = decltype(hint)::value;
      return best([&](const float* wl, int64_t a, int64_t b) {
        panels<h>(x.data(), rows, wl, out.data(), depth, width, a, b);
      });
    };
    const double l1 = run(std::integral_constant<Hint, Hint::kL1>{});
    const double none = run(std::integral_constant<Hint, Hint::kNone>{});
    const double l2 = run(std::integral_constant<Hint, Hint::kL2>{});
    const double rule = run(std::integral_constant<Hint, Hint::kRule>{});
    const double gflops = 2.0 * rows * layer * kCopies / l1 / 1e9 / threads;
    printf("%4d | %7.2f ms (%5.1f) | %7.2f ms x%.2f | %7.2f ms x%.2f | %7.2f ms x%.2f\n",
           rows, l1 * 1e3, gflops, none * 1e3, l1 / none, l2 * 1e3, l1 / l2, rule * 1e3,
           l1 / rule);
  }
  return sink == 1234.5f;
}
