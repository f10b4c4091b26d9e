// How fast one core reads a paged KV cache in each order the CPU attention kernel could take.
//
// The cache is laid out as the executor's: per layer [2 (keys, values), blocks, 16 tokens,
// KV heads, head size] float32, here 30 layers of a batch of 64 requests x 128 tokens with 3 KV
// heads of 64 (SmolLM2-135M's shape at batch 64). Each pass reads every request's keys and then
// its values, adding the values into a few vector accumulators (no other arithmetic), so the
// figures are the memory system's rate for the order alone:
//
// - sequential: the whole buffer front to back (the streaming rate);
// - one KV head at a time: a request's keys for head 0 token by token, then its values, then
//   head 1 and so on (the kernel's order before its rows form: a third of every row at a time);
// - whole rows: every KV head of a token at once, token by token (the rows form);
// - whole rows + next block: the same, asking for the next block's rows into L2 while reading
//   the current block (what the rows form's prefetch does, one block ahead).
//
// Blocks are given to requests in order, or shuffled (SHUFFLE=1) as a long-running server's
// free list leaves them. Prefetches are asm statements: GCC may delete a loop of
// __builtin_prefetch calls whose trip count is not a compile-time constant.
//
//     g++ -O3 -march=native benchmarks/cache_read_order.cpp -o /tmp/cache_read_order
//     /tmp/cache_read_order && SHUFFLE=1 /tmp/cache_read_order
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

typedef float Vec __attribute__((vector_size(64)));
typedef float UVec __attribute__((vector_size(64), aligned(4)));

constexpr int64_t kLayers = 30, kRequests = 64, kTokens = 128, kKvHeads = 3, kDim = 64;
constexpr int64_t kBlock = 16;                             // tokens per block
constexpr int64_t kBlocksEach = kTokens / kBlock;          // blocks per request
constexpr int64_t kBlocks = kRequests * kBlocksEach + 1;   // block 0: the null block
constexpr int64_t kRow = kKvHeads * kDim;                  // floats per token row
constexpr int64_t kHalf = kBlocks * kBlock * kRow;         // keys (or values) of one layer
constexpr int64_t kLayer = 2 * kHalf;

inline Vec load(const float* p) { return *reinterpret_cast<const UVec*>(p); }
inline void prefetch_l2(const float* p) { asm volatile("prefetcht2 %0" : : "m"(*p)); }

double seconds() {
  using clock = std::chrono::steady_clock;
  return std::chrono::duration<double>(clock::now().time_since_epoch()).count();
}

struct Cache {
  std::vector<float> data;       // every layer's keys and values
  std::vector<int64_t> table;    // [request, block] -> block index

  const float* block(int64_t layer, int64_t half, int64_t request, int64_t b) const {
    return data.data() + layer * kLayer + half * kHalf + table[request * kBlocksEach + b] * kBlock * kRow;
  }
};

Vec sequential(const Cache& c) {
  Vec acc[4] = {};
  for (int64_t i = 0; i < static_cast<int64_t>(c.data.size()); i += 64)
    for (int k = 0; k < 4; ++k) acc[k] += load(c.data.data() + i + 16 * k);
  return acc[0] + acc[1] + acc[2] + acc[3];
}

Vec one_head_at_a_time(const Cache& c) {
  Vec acc[4] = {};
  for (int64_t l = 0; l < kLayers; ++l)
    for (int64_t r = 0; r < kRequests; ++r)
      for (int64_t g = 0; g < kKvHeads; ++g)
        for (int64_t half = 0; half < 2; ++half)
          for (int64_t b = 0; b < kBlocksEach; ++b) {
            const float* p = c.block(l, half, r, b) + g * kDim;
            for (int64_t t = 0; t < kBlock; ++t)
              for (int64_t e = 0; e < kDim; e += 16) acc[e / 16] += load(p + t * kRow + e);
          }
  return acc[0] + acc[1] + acc[2] + acc[3];
}

template <bool kPrefetchNext>
Vec whole_rows(const Cache& c) {
  Vec acc[4] = {};
  for (int64_t l = 0; l < kLayers; ++l)
    for (int64_t r = 0; r < kRequests; ++r)
      for (int64_t half = 0; half < 2; ++half)
        for (int64_t b = 0; b < kBlocksEach; ++b) {
          const float* p = c.block(l, half, r, b);
          const float* next = b + 1 < kBlocksEach ? c.block(l, half, r, b + 1) : nullptr;
          for (int64_t t = 0; t < kBlock; ++t) {
            if (kPrefetchNext && next)
              for (int64_t e = 0; e < kRow; e += 16) prefetch_l2(next + t * kRow + e);
            for (int64_t e = 0; e < kRow; e += 16) acc[(e / 16) % 4] += load(p + t * kRow + e);
          }
        }
  return acc[0] + acc[1] + acc[2] + acc[3];
}

}  // namespace

int main() {
  Cache c;
  c.data.assign(kLayers * kLayer, 0.f);
  for (size_t i = 0; i < c.data.size(); ++i) c.data[i] = 1e-9f * static_cast<float>(i % 1000);
  for (int64_t i = 1; i < kBlocks; ++i) c.table.push_back(i);
  const bool shuffle = std::getenv("SHUFFLE") && std::getenv("SHUFFLE")[0] == '1';
  if (shuffle) std::shuffle(c.table.begin(), c.table.end(), std::mt19937(0));
  const double attended = 2.0 * kLayers * kRequests * kTokens * kRow * sizeof(float);
  struct Order {
    const char* name;
    Vec (*pass)(const Cache&);
    double bytes;
  };
  const Order orders[] = {
      {"sequential", sequential, static_cast<double>(c.data.size() * sizeof(float))},
      {"one KV head at a time", one_head_at_a_time, attended},
      {"whole rows", whole_rows<false>, attended},
      {"whole rows + next block", whole_rows<true>, attended},
  };
  std::printf("blocks %s; GB/s per pass, three rounds\n", shuffle ? "shuffled" : "in order");
  float sink = 0.f;
  for (const Order& o : orders) {
    std::printf("%-26s", o.name);
    for (int round = 0; round < 3; ++round) {
      const double start = seconds();
      sink += o.pass(c)[0];
      std::printf(" %6.1f", o.bytes / (seconds() - start) / 1e9);
    }
    std::printf("\n");
  }
  return sink == 12345.f;  // keeps the passes from being optimized away
}
