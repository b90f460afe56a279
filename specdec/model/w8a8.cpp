// specdec::w8a8_linear: int8 weights (a scale per output) times activations
// quantized to int8 per block of 32 inputs (a scale per row and block, as a
// GGUF Q8_0 activation), summed exactly in int32 within each block; the
// blocks' sums are scaled and added in fp32 in block order. Each output
// depends on its own row only, and on the same operations in the same order
// at any number of rows: a one-token step and a tree verify compute the
// same value for the same row. See specdec/model/w8a8.py.
//
// VNNI multiplies unsigned bytes by signed ones. The weights are stored as
// unsigned codes (w + 128) and the activations' signed codes are broadcast,
// so each block's integer sum is sum((w + 128) q) - 128 sum(q): the second
// term, one integer per row and block, is computed with the codes and starts
// the block's accumulator. The rows are interleaved per chunk of ROWS (each
// group of four codes of the chunk's rows side by side) so a chunk's
// broadcasts read one stream.
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
constexpr int64_t GROUPS = BLOCK / 4;
constexpr int64_t COLS = 16;    // outputs per packed column block (one zmm of int32)
constexpr int64_t ROWS = 8;     // rows a column block is multiplied into at once

// One row's block: codes round(x * 127 / amax) as int8, -128 x their sum, and the scale amax / 127.
inline float quantize_block_scalar(const float* x, int8_t* q, int32_t* start) {
  float amax = 0.f;
  for (int64_t i = 0; i < BLOCK; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  int32_t sum = 0;
  for (int64_t i = 0; i < BLOCK; ++i) {
    const int32_t c = static_cast<int32_t>(std::nearbyint(x[i] * inv));
    q[i] = static_cast<int8_t>(c);
    sum += c;
  }
  *start = -128 * sum;
  return amax / 127.f;
}

__attribute__((target("avx512f,avx512bw")))
inline float quantize_block_avx512(const float* x, int8_t* q, int32_t* start) {
  const __m512 a = _mm512_loadu_ps(x), b = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
  const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
  *start = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(qa));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16), _mm512_cvtepi32_epi8(qb));
  return amax / 127.f;
}

// A chunk of nr rows, interleaved: codes [K/4][nr] (four codes an int32), scales and
// accumulator starts [blocks][nr].
struct Chunk {
  const int32_t* codes;
  const float* scales;
  const int32_t* starts;
};

// Column block j (COLS outputs) for the chunk's nr rows from r0: weights w [K/4][COLS][4]
// (unsigned codes), ws the outputs' scales.
void column_block_scalar(const Chunk& a, int64_t nr, const uint8_t* w, const float* ws, float* out,
                         int64_t r0, int64_t K, int64_t N, int64_t j) {
  const int64_t blocks = K / BLOCK, cols = std::min(COLS, N - j * COLS);
  for (int64_t r = 0; r < nr; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      float acc = 0.f;
      for (int64_t b = 0; b < blocks; ++b) {
        int32_t dot = a.starts[b * nr + r];
        for (int64_t g = b * GROUPS; g < (b + 1) * GROUPS; ++g) {
          int8_t q4[4];
          std::memcpy(q4, a.codes + g * nr + r, 4);
          for (int64_t t = 0; t < 4; ++t)
            dot += static_cast<int32_t>(w[(g * COLS + c) * 4 + t]) * static_cast<int32_t>(q4[t]);
        }
        acc = std::fma(static_cast<float>(dot), a.scales[b * nr + r], acc);
      }
      out[(r0 + r) * N + j * COLS + c] = acc * ws[j * COLS + c];
    }
  }
}

template <int NR>
__attribute__((target("avx512f,avx512bw,avx512vnni")))
void column_block_vnni(const Chunk& a, const uint8_t* w, const float* ws, float* out, int64_t r0, int64_t K,
                       int64_t N, int64_t j) {
  const int64_t blocks = K / BLOCK;
  __m512 acc[NR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i dot[NR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) dot[r] = _mm512_set1_epi32(a.starts[b * NR + r]);
    const uint8_t* wb = w + b * BLOCK * COLS;
    const int32_t* qb = a.codes + b * GROUPS * NR;
#pragma GCC unroll 8
    for (int g = 0; g < GROUPS; ++g) {         // unrolled: the accumulators stay in registers
      const __m512i wv = _mm512_loadu_si512(wb + g * COLS * 4);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) dot[r] = _mm512_dpbusd_epi32(dot[r], wv, _mm512_set1_epi32(qb[g * NR + r]));
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r)
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(a.scales[b * NR + r]), acc[r]);
  }
  const int64_t cols = std::min(COLS, N - j * COLS);
  const __mmask16 mask = cols == COLS ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << cols) - 1);
  const __m512 sv = _mm512_maskz_loadu_ps(mask, ws + j * COLS);
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) _mm512_mask_storeu_ps(out + (r0 + r) * N + j * COLS, mask, _mm512_mul_ps(acc[r], sv));
}

template <int NR>
void rows_vnni(const Chunk& a, int64_t nr, const uint8_t* w, const float* ws, float* out, int64_t r0, int64_t K,
               int64_t N, int64_t j) {
  if constexpr (NR > 0) {
    if (nr == NR) return column_block_vnni<NR>(a, w, ws, out, r0, K, N, j);
    return rows_vnni<NR - 1>(a, nr, w, ws, out, r0, K, N, j);
  }
}

bool has_vnni() {
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
}

}  // namespace

// x [M, K] float32; packed [ceil(N/16), K/4, 16, 4] int8 holding the unsigned codes w + 128;
// scales [ceil(N/16) * 16] float32; vnni: use the AVX512-VNNI loops where the CPU has them
// (both paths compute the same values).
at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                       bool vnni) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "w8a8_linear: x must be [M, K] float32");
  TORCH_CHECK(packed.scalar_type() == at::kChar && scales.scalar_type() == at::kFloat,
              "w8a8_linear: packed int8, scales float32");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), blocks = K / BLOCK, cblocks = (n + COLS - 1) / COLS;
  TORCH_CHECK(K % BLOCK == 0 && packed.numel() == cblocks * K * COLS && scales.numel() == cblocks * COLS,
              "w8a8_linear: shapes do not match (K a multiple of 32)");
  at::Tensor out = at::empty({M, n}, xc.options());
  if (M == 0 || n == 0) return out;
  const bool fast = vnni && has_vnni();
  // each row's codes, scales and accumulator starts, written straight into its chunk's interleaved layout
  at::Tensor q = at::empty({M, K}, xc.options().dtype(at::kChar));
  at::Tensor sa = at::empty({M, blocks}, xc.options());
  at::Tensor st = at::empty({M, blocks}, xc.options().dtype(at::kInt));
  const float* xp = xc.data_ptr<float>();
  int32_t* k4 = reinterpret_cast<int32_t*>(q.data_ptr<int8_t>());
  float* ks = sa.data_ptr<float>();
  int32_t* kt = st.data_ptr<int32_t>();
  for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
    const int64_t nr = std::min(ROWS, M - r0);
    for (int64_t r = 0; r < nr; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* x = xp + (r0 + r) * K + b * BLOCK;
        const int64_t at = r0 * blocks + b * nr + r;
        int32_t codes[GROUPS];
        int8_t* q8 = reinterpret_cast<int8_t*>(codes);
        ks[at] = fast ? quantize_block_avx512(x, q8, kt + at) : quantize_block_scalar(x, q8, kt + at);
        for (int64_t g = 0; g < GROUPS; ++g) k4[r0 * K / 4 + (b * GROUPS + g) * nr + r] = codes[g];
      }
  }
  const uint8_t* wp = reinterpret_cast<const uint8_t*>(packed.data_ptr<int8_t>());
  const float* wsp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(K, 1));
  at::parallel_for(0, cblocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t j = begin; j < end; ++j) {
      const uint8_t* wj = wp + j * K * COLS;
      for (int64_t r0 = 0; r0 < M; r0 += ROWS) {
        const int64_t nr = std::min(ROWS, M - r0);
        const Chunk a{k4 + r0 * K / 4, ks + r0 * blocks, kt + r0 * blocks};
        if (fast) rows_vnni<ROWS>(a, nr, wj, wsp, op, r0, K, n, j);
        else column_block_scalar(a, nr, wj, wsp, op, r0, K, n, j);
      }
    }
  });
  return out;
}

TORCH_LIBRARY(specdec, m) {
  m.def("w8a8_linear(Tensor x, Tensor packed, Tensor scales, int n, bool vnni) -> Tensor");
}

TORCH_LIBRARY_IMPL(specdec, CPU, m) { m.impl("w8a8_linear", &w8a8_linear); }
