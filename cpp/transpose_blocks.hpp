// Transposing blocks: side x side items, line j of the source (items contiguous, lines
// `source_stride` apart) becomes column j of the destination (lines `destination_stride`
// apart). Hand-written SSE2 shuffles where the target has SSE2 (every x86-64), AVX2 ones
// compiled for any x86-64 and run only where the CPU has AVX2 (the kernel asks once), plain
// loads elsewhere. Each block is a BlockFn; copy_kernel.cpp walks a tile over them.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__x86_64__)
#include <immintrin.h>
// AVX2 code is compiled for any x86-64 and only run where the CPU has it.
#define AOA_AVX2 __attribute__((target("avx2")))
#endif

namespace aoa {
namespace blocks {

using BlockFn = void (*)(const uint8_t* source, int64_t source_stride, uint8_t* destination,
                         int64_t destination_stride);

template <int64_t Size, int64_t Side>
inline void transpose_block_plain(const uint8_t* source, int64_t source_stride,
                                  uint8_t* destination, int64_t destination_stride) {
  for (int64_t i = 0; i < Side; ++i)
    for (int64_t j = 0; j < Side; ++j)
      std::memcpy(destination + i * destination_stride + j * Size,
                  source + j * source_stride + i * Size, Size);
}

#if defined(__SSE2__)
inline void transpose_block_4(const uint8_t* source, int64_t source_stride,
                              uint8_t* destination, int64_t destination_stride) {
  __m128 a = _mm_loadu_ps(reinterpret_cast<const float*>(source));
  __m128 b = _mm_loadu_ps(reinterpret_cast<const float*>(source + source_stride));
  __m128 c = _mm_loadu_ps(reinterpret_cast<const float*>(source + 2 * source_stride));
  __m128 d = _mm_loadu_ps(reinterpret_cast<const float*>(source + 3 * source_stride));
  _MM_TRANSPOSE4_PS(a, b, c, d);
  _mm_storeu_ps(reinterpret_cast<float*>(destination), a);
  _mm_storeu_ps(reinterpret_cast<float*>(destination + destination_stride), b);
  _mm_storeu_ps(reinterpret_cast<float*>(destination + 2 * destination_stride), c);
  _mm_storeu_ps(reinterpret_cast<float*>(destination + 3 * destination_stride), d);
}

inline void transpose_block_2(const uint8_t* source, int64_t source_stride,
                              uint8_t* destination, int64_t destination_stride) {
  __m128i x[8];
  for (int k = 0; k < 8; ++k)
    x[k] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + k * source_stride));
  // Interleave 16-bit items of line pairs, then 32-bit pairs of those, then 64-bit halves.
  const __m128i a0 = _mm_unpacklo_epi16(x[0], x[1]), a1 = _mm_unpackhi_epi16(x[0], x[1]);
  const __m128i a2 = _mm_unpacklo_epi16(x[2], x[3]), a3 = _mm_unpackhi_epi16(x[2], x[3]);
  const __m128i a4 = _mm_unpacklo_epi16(x[4], x[5]), a5 = _mm_unpackhi_epi16(x[4], x[5]);
  const __m128i a6 = _mm_unpacklo_epi16(x[6], x[7]), a7 = _mm_unpackhi_epi16(x[6], x[7]);
  const __m128i b0 = _mm_unpacklo_epi32(a0, a2), b1 = _mm_unpackhi_epi32(a0, a2);
  const __m128i b2 = _mm_unpacklo_epi32(a1, a3), b3 = _mm_unpackhi_epi32(a1, a3);
  const __m128i b4 = _mm_unpacklo_epi32(a4, a6), b5 = _mm_unpackhi_epi32(a4, a6);
  const __m128i b6 = _mm_unpacklo_epi32(a5, a7), b7 = _mm_unpackhi_epi32(a5, a7);
  const __m128i rows[8] = {
      _mm_unpacklo_epi64(b0, b4), _mm_unpackhi_epi64(b0, b4), _mm_unpacklo_epi64(b1, b5),
      _mm_unpackhi_epi64(b1, b5), _mm_unpacklo_epi64(b2, b6), _mm_unpackhi_epi64(b2, b6),
      _mm_unpacklo_epi64(b3, b7), _mm_unpackhi_epi64(b3, b7)};
  for (int k = 0; k < 8; ++k)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(destination + k * destination_stride), rows[k]);
}

inline void transpose_block_8(const uint8_t* source, int64_t source_stride,
                              uint8_t* destination, int64_t destination_stride) {
  const __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source));
  const __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(source + source_stride));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(destination), _mm_unpacklo_epi64(x0, x1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(destination + destination_stride),
                   _mm_unpackhi_epi64(x0, x1));
}
#endif

#if defined(__x86_64__)
// AVX2 blocks write whole 64-byte destination lines: streamed (non-temporal) stores of a
// large copy then skip reading the destination into cache. The blocks are two transposes
// side by side, lines [0, n) of the source to destination columns [0, n), [n, 2n) to [n, 2n).

template <bool Stream> AOA_AVX2 inline void put(uint8_t* at, __m256i v) {
  if (Stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(at), v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(at), v);
}

AOA_AVX2 inline __m256i load_avx2(const uint8_t* at) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
}

// Four lines of 4 float64 become the four columns.
AOA_AVX2 inline void transpose_4x4_avx2(__m256i x[4]) {
  const __m256d x0 = _mm256_castsi256_pd(x[0]), x1 = _mm256_castsi256_pd(x[1]);
  const __m256d x2 = _mm256_castsi256_pd(x[2]), x3 = _mm256_castsi256_pd(x[3]);
  // Pairs of lines interleaved within 128-bit lanes, then lanes exchanged between pairs.
  const __m256d a0 = _mm256_unpacklo_pd(x0, x1), a1 = _mm256_unpackhi_pd(x0, x1);
  const __m256d a2 = _mm256_unpacklo_pd(x2, x3), a3 = _mm256_unpackhi_pd(x2, x3);
  x[0] = _mm256_castpd_si256(_mm256_permute2f128_pd(a0, a2, 0x20));
  x[1] = _mm256_castpd_si256(_mm256_permute2f128_pd(a1, a3, 0x20));
  x[2] = _mm256_castpd_si256(_mm256_permute2f128_pd(a0, a2, 0x31));
  x[3] = _mm256_castpd_si256(_mm256_permute2f128_pd(a1, a3, 0x31));
}

// Eight lines of 8 float32 become the eight columns.
AOA_AVX2 inline void transpose_8x8_avx2(__m256i x[8]) {
  // Within 128-bit lanes, 4 x 4 transposes of line quads (unpack, then 64-bit shuffles);
  // then lanes exchanged between the quads.
  __m256 a[8], b[8];
  for (int k = 0; k < 8; k += 2) {
    a[k] = _mm256_unpacklo_ps(_mm256_castsi256_ps(x[k]), _mm256_castsi256_ps(x[k + 1]));
    a[k + 1] = _mm256_unpackhi_ps(_mm256_castsi256_ps(x[k]), _mm256_castsi256_ps(x[k + 1]));
  }
  for (int k = 0; k < 8; k += 4) {
    b[k] = _mm256_shuffle_ps(a[k], a[k + 2], 0x44);
    b[k + 1] = _mm256_shuffle_ps(a[k], a[k + 2], 0xee);
    b[k + 2] = _mm256_shuffle_ps(a[k + 1], a[k + 3], 0x44);
    b[k + 3] = _mm256_shuffle_ps(a[k + 1], a[k + 3], 0xee);
  }
  for (int k = 0; k < 4; ++k) {
    x[k] = _mm256_castps_si256(_mm256_permute2f128_ps(b[k], b[k + 4], 0x20));
    x[k + 4] = _mm256_castps_si256(_mm256_permute2f128_ps(b[k], b[k + 4], 0x31));
  }
}

// Eight lines of 16-bit items, each 128-bit lane transposed as an 8 x 8 block.
AOA_AVX2 inline void transpose_lanes_2_avx2(__m256i x[8]) {
  __m256i a[8], b[8];
  for (int k = 0; k < 8; k += 2) {
    a[k] = _mm256_unpacklo_epi16(x[k], x[k + 1]);
    a[k + 1] = _mm256_unpackhi_epi16(x[k], x[k + 1]);
  }
  for (int k = 0; k < 8; k += 4) {
    b[k] = _mm256_unpacklo_epi32(a[k], a[k + 2]);
    b[k + 1] = _mm256_unpackhi_epi32(a[k], a[k + 2]);
    b[k + 2] = _mm256_unpacklo_epi32(a[k + 1], a[k + 3]);
    b[k + 3] = _mm256_unpackhi_epi32(a[k + 1], a[k + 3]);
  }
  for (int k = 0; k < 4; ++k) {
    x[2 * k] = _mm256_unpacklo_epi64(b[k], b[k + 4]);
    x[2 * k + 1] = _mm256_unpackhi_epi64(b[k], b[k + 4]);
  }
}

// Sixteen lines of 16 16-bit items become the sixteen columns: lines 0-7 and 8-15
// transposed lane by lane, then their lanes exchanged.
AOA_AVX2 inline void transpose_16x16_avx2(__m256i x[16]) {
  transpose_lanes_2_avx2(x);
  transpose_lanes_2_avx2(x + 8);
  for (int k = 0; k < 8; ++k) {
    const __m256i top = x[k], bottom = x[k + 8];
    x[k] = _mm256_permute2x128_si256(top, bottom, 0x20);
    x[k + 8] = _mm256_permute2x128_si256(top, bottom, 0x31);
  }
}

// Side x 2 Side items of size Size (Side x 32 bytes halves): a BlockFn.
template <int64_t Size, bool Stream>
AOA_AVX2 inline void transpose_block_avx2(const uint8_t* source, int64_t source_stride,
                                          uint8_t* destination, int64_t destination_stride) {
  constexpr int Side = 32 / Size;
  __m256i left[Side], right[Side];
  for (int k = 0; k < Side; ++k) {
    left[k] = load_avx2(source + k * source_stride);
    right[k] = load_avx2(source + (k + Side) * source_stride);
  }
  if constexpr (Size == 8) {
    transpose_4x4_avx2(left), transpose_4x4_avx2(right);
  } else if constexpr (Size == 4) {
    transpose_8x8_avx2(left), transpose_8x8_avx2(right);
  } else {
    transpose_16x16_avx2(left), transpose_16x16_avx2(right);
  }
  for (int k = 0; k < Side; ++k) {
    put<Stream>(destination + k * destination_stride, left[k]);
    put<Stream>(destination + k * destination_stride + 32, right[k]);
  }
}
#endif

}  // namespace blocks
}  // namespace aoa
