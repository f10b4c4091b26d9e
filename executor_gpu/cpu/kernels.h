// The CPU kernels of executor_gpu (float32 and bfloat16), bound into one extension by
// kernels.cpp.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace tandem {

// A vector of kLanes floats (one AVX-512 register; two AVX2 ones), aligned (Vec) or not (UVec).
constexpr int64_t kLanes = 16;
typedef float Vec __attribute__((vector_size(kLanes * sizeof(float))));
typedef float UVec __attribute__((vector_size(kLanes * sizeof(float)), aligned(4)));

// bfloat16 storage, float32 arithmetic. Every kernel is a template over its element type T:
// float, or Bf16 (the upper half of a float32's bits). Values are widened to float32 on load
// and rounded to nearest-even on store; where the reference model (transformers in bf16) rounds
// an intermediate value to bf16, the kernels round it too (round_to<T>), so that bf16 results
// follow the reference's arithmetic. For T = float every conversion is the identity and the
// float32 kernels compute exactly what they computed before.
struct Bf16 {
  uint16_t bits;
};
static_assert(sizeof(Bf16) == 2, "Bf16 is two bytes");

typedef uint16_t HVec __attribute__((vector_size(kLanes * sizeof(uint16_t)), aligned(2)));
typedef uint32_t IVec __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline float to_float(float x) { return x; }
inline float to_float(Bf16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// float32 -> bf16 bits, rounded to nearest-even (NaNs stay NaNs: their payload's top bit is set).
inline uint16_t bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

template <class T>
inline T from_float(float x);
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline Bf16 from_float<Bf16>(float x) {
  return Bf16{bf16_bits(x)};
}

// x rounded to T's precision, as a float32.
template <class T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

// kLanes elements at p (any alignment) widened to float32, and stored back rounded.
inline Vec load_vec(const float* p) { return *reinterpret_cast<const UVec*>(p); }
inline Vec load_vec(const Bf16* p) {
  const IVec wide = __builtin_convertvector(*reinterpret_cast<const HVec*>(p), IVec) << 16;
  return reinterpret_cast<const Vec&>(wide);
}
inline void store_vec(float* p, Vec v) { *reinterpret_cast<UVec*>(p) = v; }
inline void store_vec(Bf16* p, Vec v) {
  IVec bits = reinterpret_cast<const IVec&>(v);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *reinterpret_cast<HVec*>(p) = __builtin_convertvector(bits >> 16, HVec);
}

// The cache line at p asked for into L2 (prefetcht2). An asm statement, not __builtin_prefetch:
// GCC deletes a loop whose body is only __builtin_prefetch calls when its trip count is not a
// compile-time constant (a row's length known at run time, say), and with them the gain.
inline void prefetch_l2(const void* p) {
  asm volatile("prefetcht2 %0" : : "m"(*static_cast<const char*>(p)));
}

// The element pointer of a float32 or bfloat16 tensor.
template <class T>
inline T* data_of(const torch::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

// Runs body.template operator()<T>() with T the C++ type of a float32 or bfloat16 tensor.
template <class Body>
inline auto dispatch_float_or_bf16(at::ScalarType type, const char* name, Body&& body) {
  if (type == at::kBFloat16) return body(Bf16{});
  TORCH_CHECK(type == at::kFloat, name, ": float32 or bfloat16 only");
  return body(float{});
}

// e^x in float32 for x in about [-87, 88] (clamped outside): Cody-Waite range reduction by
// ln 2 and a degree-6 polynomial (within ~3 ulp); written without branches so loops over it
// vectorize.
inline float exp_approx(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float t = x * 1.44269504088896341f;  // x / ln 2
  const float n = static_cast<float>(static_cast<int32_t>(t + std::copysign(0.5f, t)));
  float r = x - n * 0.693359375f;  // ln 2 split into an exact high part ...
  r = r + n * 2.12194440e-4f;      // ... and the low remainder
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// Causal attention of a step's query tokens ([T, H, D]; request r's are query_start_loc[r] ..
// query_start_loc[r + 1] - 1, the last of its seq_lens[r] tokens) read in place from the paged
// KV cache; with new_key / new_value / slots ([T, KVH, D], [T]) given, the step's keys and
// values are stored first (paged_attention.cpp). Head sizes: paged_attention_supports.
// bf16_dot: a bf16 cache's scores from the AVX-512 bf16 dot products where the CPU has them.
bool paged_attention_supports(int64_t head_size);
torch::Tensor paged_attention(torch::Tensor query, std::optional<torch::Tensor> new_key,
                              std::optional<torch::Tensor> new_value,
                              std::optional<torch::Tensor> slots, torch::Tensor kv_cache,
                              torch::Tensor block_tables, torch::Tensor seq_lens,
                              torch::Tensor query_start_loc, double scale, bool bf16_dot);

// Linear layers over weights packed into column panels (packed_linear.cpp):
// pack_linear_weight([in, out]) -> [out / kPanel, in, kPanel], or with pairs (bf16 only, for
// the AVX-512 bf16 dot products: bf16_dot_supported()) [out / kPanel, in / 2, kPanel, 2];
// packed_linear(x, packed, bias) takes either.
constexpr int64_t kPanel = 64;
bool bf16_dot_supported();
torch::Tensor pack_linear_weight(torch::Tensor weight, bool pairs);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor packed,
                            std::optional<torch::Tensor> bias);

// Runs `worker` on the calling thread and on up to workers - 1 helper threads (at most torch's
// thread count in all), returning once every thread that ran it has returned (task_pool.cpp).
// How many threads run it is not fixed: `worker` claims its work from a counter it shares with
// the others and returns when none is left.
void run_workers(int64_t workers, c10::function_ref<void()> worker);
// [helper threads started, jobs offered to helpers, helper runs of those jobs].
std::vector<int64_t> task_pool_stats();

// Each row's argmax (torch's: the first maximum) and whether every value in it is finite, for
// float32 logits [rows, vocab], in one read (logits_scan.cpp).
std::tuple<torch::Tensor, torch::Tensor> scan_logits(torch::Tensor logits);

// Per-layer elementwise math of the model (layer_ops.cpp).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            double eps);
void rotary_(torch::Tensor qkv, int64_t num_heads, torch::Tensor positions,
             torch::Tensor cos_sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);

// All decoder layers of a Llama-family model and its final norm over a step's embeddings x
// [T, hidden], the kernels above called in the Python model's order (decoder_stack.cpp).
// `layers` holds decoder_stack_tensors_per_layer() tensors per layer.
int64_t decoder_stack_tensors_per_layer();
torch::Tensor decoder_stack(torch::Tensor x, const std::vector<torch::Tensor>& layers,
                            torch::Tensor final_norm, torch::Tensor positions,
                            torch::Tensor cos_sin, torch::Tensor slots,
                            torch::Tensor block_tables, torch::Tensor seq_lens,
                            torch::Tensor query_start_loc, int64_t num_heads,
                            int64_t num_kv_heads, double eps, double scale);

}  // namespace tandem
