// The model's per-layer elementwise math on the CPU (float32): RMSNorm with the residual add
// folded in, in-place rotary embedding of queries and keys, and SiLU-and-multiply.
//
// Eager torch runs each of these as several operators (RMSNorm alone is a power, a mean, an
// add, a reciprocal square root and two products), each a dispatch and, past a size threshold,
// a wake-up of the OpenMP team. Here each is one pass over its rows. Decode-sized inputs run on
// the calling thread; only inputs past kParallelElems are split across threads.
#include "kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace tandem {
namespace {

// Inputs smaller than this many floats are cheaper on one thread than waking the team.
constexpr int64_t kParallelElems = int64_t(1) << 18;

int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, kParallelElems / row_elems); }

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat, name, ": float32 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": rows with contiguous elements only");
}

// x * rsqrt(mean(x^2) + eps) * weight for one row, written to out.
inline void norm_row(const float* x, const float* w, float* out, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = (x[i] * inv) * w[i];
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "rms_norm: weight shape");
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * stride, w, o + r * n, n, eps);
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n, "add_rms_norm_: shapes differ");
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "add_rms_norm_: weight shape");
  auto out = torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* rr = res + r * rs;
      const float* xr = xp + r * xs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] = rr[i] + xr[i];
      norm_row(rr, w, o + r * n, n, eps);
    }
  });
  return out;
}

void rotary_(torch::Tensor qkv, int64_t num_heads, torch::Tensor positions,
             torch::Tensor cos_sin) {
  TORCH_CHECK(qkv.scalar_type() == torch::kFloat && cos_sin.scalar_type() == torch::kFloat,
              "rotary_: float32 only");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2),
              "rotary_: qkv must be [T, heads, d] with contiguous heads");
  const int64_t tokens = qkv.size(0), dim = qkv.size(2), half = dim / 2;
  TORCH_CHECK(num_heads <= qkv.size(1) && dim % 2 == 0, "rotary_: bad head count or size");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.size(1) == dim, "rotary_: table shape");
  auto pos = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(pos.numel() == tokens, "rotary_: one position per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t table_rows = cos_sin.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < table_rows, "rotary_: position ", pp[t], " out of range");
  float* base = qkv.data_ptr<float>();
  const float* table = cos_sin.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  at::parallel_for(0, tokens, row_grain(num_heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = table + pp[t] * dim;  // cos of the half frequencies, then sin
      const float* s = c + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        float* x = base + t * stride + h * dim;
        // (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] + (-x2) * s[i];
          x[i + half] = x2 * c[i] + x1 * s[i];
        }
      }
    }
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: odd width");
  auto out = torch::empty({rows, width}, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, row_grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = in + r * stride;
      const float* u = g + width;
      float* orow = o + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) orow[i] = g[i] / (1.0f + exp_approx(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace tandem
