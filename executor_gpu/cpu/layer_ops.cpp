// The model's per-layer elementwise math on the CPU (float32 or bfloat16): RMSNorm with the
// residual add folded in, in-place rotary embedding of queries and keys, and SiLU-and-multiply.
//
// Eager torch runs each of these as several operators (RMSNorm alone is a power, a mean, an
// add, a reciprocal square root and two products), each a dispatch and, past a size threshold,
// a wake-up of the OpenMP team. Here each is one pass over its rows. Decode-sized inputs run on
// the calling thread; only inputs past kParallelElems are split across threads. In bfloat16 the
// arithmetic is float32 and the values the reference rounds to bf16 are rounded here too
// (round_to, kernels.h).
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
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, name,
              ": float32 or bfloat16 only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": rows with contiguous elements only");
}

void check_same_dtype(const torch::Tensor& a, const torch::Tensor& b, const char* name) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), name, ": tensors of one dtype only");
}

// x * rsqrt(mean(x^2) + eps) * weight for one row, written to out; the normalized value is
// rounded to T before the weight multiplies it (the reference's order).
template <class T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < n; ++i) squares += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i)
    out[i] = from_float<T>(round_to<T>(to_float(x[i]) * inv) * to_float(w[i]));
}

template <class T>
void rms_norm_rows(const torch::Tensor& x, const torch::Tensor& weight, torch::Tensor& out,
                   float eps) {
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  const T* xp = data_of<T>(x);
  const T* w = data_of<T>(weight);
  T* o = data_of<T>(out);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) norm_row(xp + r * stride, w, o + r * n, n, eps);
  });
}

template <class T>
void add_rms_norm_rows(const torch::Tensor& x, torch::Tensor& residual,
                       const torch::Tensor& weight, torch::Tensor& out, float eps) {
  const int64_t rows = x.size(0), n = x.size(1);
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  const T* xp = data_of<T>(x);
  T* res = data_of<T>(residual);
  const T* w = data_of<T>(weight);
  T* o = data_of<T>(out);
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* rr = res + r * rs;
      const T* xr = xp + r * xs;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) rr[i] = from_float<T>(to_float(rr[i]) + to_float(xr[i]));
      norm_row(rr, w, o + r * n, n, eps);
    }
  });
}

// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) over the first num_heads heads of each token.
// In bf16 the reference rounds cos and sin, each product and each sum to bf16.
template <class T>
void rotate_rows(torch::Tensor& qkv, int64_t num_heads, const int64_t* pp,
                 const float* table) {
  const int64_t tokens = qkv.size(0), dim = qkv.size(2), half = dim / 2;
  T* base = data_of<T>(qkv);
  const int64_t stride = qkv.stride(0);
  at::parallel_for(0, tokens, row_grain(num_heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = table + pp[t] * dim;  // cos of the half frequencies, then sin
      const float* s = c + half;
      for (int64_t h = 0; h < num_heads; ++h) {
        T* x = base + t * stride + h * dim;
        if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = x[i], x2 = x[i + half];
            x[i] = x1 * c[i] + (-x2) * s[i];
            x[i + half] = x2 * c[i] + x1 * s[i];
          }
        } else {
#pragma omp simd
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
            const float ci = round_to<T>(c[i]), si = round_to<T>(s[i]);
            x[i] = from_float<T>(round_to<T>(x1 * ci) + round_to<T>(-x2 * si));
            x[i + half] = from_float<T>(round_to<T>(x2 * ci) + round_to<T>(x1 * si));
          }
        }
      }
    }
  });
}

// silu(gate) * up; in bf16 the reference rounds silu(gate) before the product.
template <class T>
void silu_mul_rows(const torch::Tensor& gate_up, torch::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  const T* in = data_of<T>(gate_up);
  T* o = data_of<T>(out);
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, rows, row_grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * stride;
      const T* u = g + width;
      T* orow = o + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) {
        const float gi = to_float(g[i]);
        orow[i] = from_float<T>(round_to<T>(gi / (1.0f + exp_approx(-gi))) * to_float(u[i]));
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "rms_norm");
  check_same_dtype(x, weight, "rms_norm");
  TORCH_CHECK(weight.numel() == x.size(1) && weight.is_contiguous(), "rms_norm: weight shape");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  dispatch_float_or_bf16(x.scalar_type(), "rms_norm", [&](auto tag) {
    rms_norm_rows<decltype(tag)>(x, weight, out, static_cast<float>(eps));
  });
  return out;
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            double eps) {
  check_rows(x, "add_rms_norm_");
  check_rows(residual, "add_rms_norm_");
  check_same_dtype(x, residual, "add_rms_norm_");
  check_same_dtype(x, weight, "add_rms_norm_");
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(residual.size(0) == rows && residual.size(1) == n, "add_rms_norm_: shapes differ");
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous(), "add_rms_norm_: weight shape");
  auto out = torch::empty({rows, n}, x.options());
  dispatch_float_or_bf16(x.scalar_type(), "add_rms_norm_", [&](auto tag) {
    add_rms_norm_rows<decltype(tag)>(x, residual, weight, out, static_cast<float>(eps));
  });
  return out;
}

void rotary_(torch::Tensor qkv, int64_t num_heads, torch::Tensor positions,
             torch::Tensor cos_sin) {
  TORCH_CHECK(cos_sin.scalar_type() == torch::kFloat, "rotary_: a float32 cos|sin table only");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2),
              "rotary_: qkv must be [T, heads, d] with contiguous heads");
  const int64_t tokens = qkv.size(0), dim = qkv.size(2);
  TORCH_CHECK(num_heads <= qkv.size(1) && dim % 2 == 0, "rotary_: bad head count or size");
  TORCH_CHECK(cos_sin.is_contiguous() && cos_sin.size(1) == dim, "rotary_: table shape");
  auto pos = positions.to(torch::kLong).contiguous();
  TORCH_CHECK(pos.numel() == tokens, "rotary_: one position per token");
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t table_rows = cos_sin.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(pp[t] >= 0 && pp[t] < table_rows, "rotary_: position ", pp[t], " out of range");
  dispatch_float_or_bf16(qkv.scalar_type(), "rotary_", [&](auto tag) {
    rotate_rows<decltype(tag)>(qkv, num_heads, pp, cos_sin.data_ptr<float>());
  });
}

torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: odd width");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  dispatch_float_or_bf16(gate_up.scalar_type(), "silu_and_mul", [&](auto tag) {
    silu_mul_rows<decltype(tag)>(gate_up, out);
  });
  return out;
}

}  // namespace tandem
