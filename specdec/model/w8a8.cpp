// specdec::w8a8_linear: int8 weights (a scale per output) times activations
// quantized to int8 per block of 32 inputs (a scale per row and block, as a
// GGUF Q8_0 activation), summed exactly in int32 within each block; the
// blocks' sums are scaled and added in fp32 in block order. Each output
// depends on its own row only, and on the same operations in the same order
// at any number of rows: a one-token step and a tree verify compute the
// same value for the same row. See specdec/model/w8a8.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

namespace {

constexpr int64_t BLOCK = 32;   // inputs per activation scale
constexpr int64_t COLS = 16;    // outputs per packed column block (one zmm of int32)
constexpr int64_t ROWS = 8;     // rows a column block is multiplied into at once

// One row's block: the scale (amax / 127) and the codes q + 128 as bytes.
inline float quantize_block_scalar(const float* x, uint8_t* q) {
  float amax = 0.f;
  for (int64_t i = 0; i < BLOCK; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < BLOCK; ++i) q[i] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(x[i] * inv)) + 128);
  return amax / 127.f;
}

__attribute__((target("avx512f,avx512bw")))
inline float quantize_block_avx512(const float* x, uint8_t* q) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i off = _mm512_set1_epi32(128);
  const __m512i qa = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), off);
  const __m512i qb = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(b, inv)), off);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  return amax / 127.f;
}

// Column block j (COLS outputs) for rows [r0, r0 + nr): packed weights
// [K/4][COLS][4], corrections [blocks][COLS] (128 x each block's weight sum).
void column_block_scalar(const uint8_t* q, const float* sa, const int8_t* w, const int32_t* corr,
                         const float* ws, float* out, int64_t r0, int64_t nr, int64_t K, int64_t N,
                         int64_t j) {
  const int64_t blocks = K / BLOCK, cols = std::min(COLS, N - j * COLS);
  for (int64_t r = r0; r < r0 + nr; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = 0;
        for (int64_t g = b * BLOCK / 4; g < (b + 1) * BLOCK / 4; ++g)
          for (int64_t t = 0; t < 4; ++t)
            dot += static_cast<int32_t>(q[r * K + g * 4 + t]) * static_cast<int32_t>(w[(g * COLS + c) * 4 + t]);
        acc = std::fma(static_cast<float>(dot - corr[b * COLS + c]), sa[r * blocks + b], acc);
      }
      out[r * N + j * COLS + c] = acc * ws[j * COLS + c];
    }
  }
}

template <int NR>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void column_block_vnni(const uint8_t* q, const float* sa, const int8_t* w, const int32_t* corr,
                       const float* ws, float* out, int64_t r0, int64_t K, int64_t N, int64_t j) {
  const int64_t blocks = K / BLOCK;
  __m512 acc[NR];
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[NR];
    for (int r = 0; r < NR; ++r) dot[r] = _mm512_setzero_si512();
    for (int64_t g = b * BLOCK / 4; g < (b + 1) * BLOCK / 4; ++g) {
      const __m512i wv = _mm512_loadu_si512(w + g * COLS * 4);
      for (int r = 0; r < NR; ++r) {
        int32_t a4;
        std::memcpy(&a4, q + (r0 + r) * K + g * 4, 4);
        dot[r] = _mm512_dpbusd_epi32(dot[r], _mm512_set1_epi32(a4), wv);
      }
    }
    const __m512i cv = _mm512_loadu_si512(corr + b * COLS);
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(dot[r], cv)),
                               _mm512_set1_ps(sa[(r0 + r) * blocks + b]), acc[r]);
  }
  const int64_t cols = std::min(COLS, N - j * COLS);
  const __mmask16 mask = cols == COLS ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 sv = _mm512_maskz_loadu_ps(mask, ws + j * COLS);
  for (int r = 0; r < NR; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * N + j * COLS, mask, _mm512_mul_ps(acc[r], sv));
}

template <int NR>
void rows_vnni(const uint8_t* q, const float* sa, const int8_t* w, const int32_t* corr, const float* ws,
               float* out, int64_t r0, int64_t nr, int64_t K, int64_t N, int64_t j) {
  if constexpr (NR > 0) {
    if (nr == NR) return column_block_vnni<NR>(q, sa, w, corr, ws, out, r0, K, N, j);
    return rows_vnni<NR - 1>(q, sa, w, corr, ws, out, r0, nr, K, N, j);
  }
}

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
}

}  // namespace

// x [M, K] float32; packed [ceil(N/16), K/4, 16, 4] int8; corr [ceil(N/16), K/32, 16] int32
// (128 x the weights' sum over each block); scales [ceil(N/16) * 16] float32; vnni: use the
// AVX512-VNNI loops where the CPU has them (both paths compute the same values).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& corr,
                       const at::Tensor& scales, int64_t n, bool vnni) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w8a8_linear: x must be [M, K] float32");
  TORCH_CHECK(packed.scalar_type() == at::kChar && corr.scalar_type() == at::kInt &&
              scales.scalar_type() == at::kFloat, "w8a8_linear: packed int8, corr int32, scales float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), blocks = K / BLOCK, cblocks = (n + COLS - 1) / COLS;
  TORCH_CHECK(K % BLOCK == 0 && packed.numel() == cblocks * K * COLS && corr.numel() == cblocks * blocks * COLS,
              "w8a8_linear: shapes do not match (K a multiple of 32)");
  at::Tensor out = at::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return out;
  at::Tensor q = at::empty({M, K}, xc.options().dtype(at::kByte));
  at::Tensor sa = at::empty({M, blocks}, xc.options());
  const bool fast = vnni && has_vnni();
  const float* xp = xc.data_ptr<float>();
  uint8_t* qp = q.data_ptr<uint8_t>();
  float* sp = sa.data_ptr<float>();
  for (int64_t i = 0; i < M * blocks; ++i)
    sp[i] = fast ? quantize_block_avx512(xp + i * BLOCK, qp + i * BLOCK) : quantize_block_scalar(xp + i * BLOCK, qp + i * BLOCK);
  const int8_t* wp = packed.data_ptr<int8_t>();
  const int32_t* cp = corr.data_ptr<int32_t>();
  const float* wsp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, cblocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const int8_t* wj = wp + j * K * COLS;
      const int32_t* cj = cp + j * blocks * COLS;
      for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
        const int64_t nr = std::min(ROWS, M - r0);
        if (fast) rows_vnni<ROWS>(qp, sp, wj, cj, wsp, op, r0, nr, K, n, j);
        else column_block_scalar(qp, sp, wj, cj, wsp, op, r0, nr, K, n, j);
      }
    }
  });
  return out;
}

TORCH_LIBRARY(specdec, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor corr, Tensor scales, int n, bool vnni) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
