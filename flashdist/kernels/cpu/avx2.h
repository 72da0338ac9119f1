// The explicitly vectorised (AVX2) part of step.cpp's fused CPU steps, for CPUs without AVX-512 (AMD Zen 1-3,
// Intel client cores and Xeons before Skylake-SP). Not a standalone header: step.cpp includes it after the
// block code's helpers (Desc, Block, the bf16 and code helpers, the scale bounds), whose semantics it
// reproduces bit for bit, as avx512.h does with 16 lanes.
//
// One block (up to 8 quantization groups of one row) is computed as avx512.h computes it: every group's new moments and
// absmaxes, the per-group values of all groups at once (one lane each, here 8 lanes for 8 groups), then each group's
// update and codes. A group is four 8-lane vectors (with bf16 parameters and int8 rho, in the order of 16-bit unpacks:
// UNPACKED below). The operations and their order are those of the block code: IEEE + - * / sqrt, round to nearest
// even, no FMA (-ffp-contract=off). Parameters that are zero, infinite or NaN, and master weights within a bf16 step of
// the largest finite value, are merged and split by the block code's scalar functions (the group's 32 values); a block
// that ends inside a group (a row's last) runs on a zero-padded copy of its values, which reads as the reference's
// padding, and only the row's values are copied back.
#pragma once

#if !defined(FLASHDIST_AVX512) && defined(__AVX2__)
#define FLASHDIST_AVX2 1

namespace avx2 {

using V = __m256;
using I = __m256i;

inline V vf(float x) { return _mm256_set1_ps(x); }
inline I vi(int32_t x) { return _mm256_set1_epi32(x); }
inline I as_int(V x) { return _mm256_castps_si256(x); }
inline V as_float(I x) { return _mm256_castsi256_ps(x); }
inline V vabs(V x) { return _mm256_and_ps(x, as_float(vi(0x7FFFFFFF))); }
inline __m128i ld128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline __m128i ld64(const void* p) { return _mm_loadl_epi64(static_cast<const __m128i*>(p)); }

// 8 values of each source type as fp32 (bf16: its bits in the upper half) or int32
inline V load_bf16(const uint16_t* p) { return as_float(_mm256_slli_epi32(_mm256_cvtepu16_epi32(ld128(p)), 16)); }
inline I load_i8(const int8_t* p) { return _mm256_cvtepi8_epi32(ld64(p)); }
inline I load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(ld64(p)); }
inline I load_i16(const int16_t* p) { return _mm256_cvtepi16_epi32(ld128(p)); }

enum Param { BF16_RHO8, BF16_RHO16, FP32 };

// The order of a group's 32 values in its four vectors. Natural: vector v holds values 8v..8v+7. Unpacked (bf16
// parameters with int8 rho, whose master weights are built from 16-bit unpacks): vector 2h holds values 16h +
// {0-3, 8-11} and vector 2h+1 values 16h + {4-7, 12-15}, the order _mm256_unpack{lo,hi}_epi16 give. Every value
// of a group is loaded in its order, computed lane by lane, reduced by a maximum (any order) and stored in place.
template <Param P>
constexpr bool UNPACKED = P == BF16_RHO8;

// Vector v of a group's 32 fp32 values at p (or stored to p), in the group's order
template <Param P>
inline V load_ordered(const float* p, int v) {
  if constexpr (!UNPACKED<P>) return _mm256_loadu_ps(p + 8 * v);
  const float* lo = p + 16 * (v / 2) + 4 * (v % 2);
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(lo)), _mm_loadu_ps(lo + 8), 1);
}
template <Param P>
inline void store_ordered(float* p, int v, V x) {
  if constexpr (!UNPACKED<P>) return _mm256_storeu_ps(p + 8 * v, x);
  float* lo = p + 16 * (v / 2) + 4 * (v % 2);
  _mm_storeu_ps(lo, _mm256_castps256_ps128(x));
  _mm_storeu_ps(lo + 8, _mm256_extractf128_ps(x, 1));
}

// Masks of the unpacked order's byte loads: from a group's 16 bytes 16h..16h+15 in both 128-bit halves, vector
// 2h+k takes bytes 4k..4k+3 (low half) and 8+4k..8+4k+3 (high half) into byte `at` of its lanes (-128: zero)
constexpr std::array<std::array<int8_t, 32>, 2> unpacked_byte_masks(int at) {
  std::array<std::array<int8_t, 32>, 2> m{};
  for (int k = 0; k < 2; ++k)
    for (int b = 0; b < 32; ++b) m[k][b] = int8_t(b % 4 == at ? 8 * (b / 16) + 4 * k + b % 16 / 4 : -128);
  return m;
}
alignas(32) inline constexpr std::array<std::array<int8_t, 32>, 2> UNPACKED_BYTES[2] = {unpacked_byte_masks(0),
                                                                                      unpacked_byte_masks(3)};
template <int at>
inline I unpacked_bytes(const void* p, int v) {
  const I b = _mm256_broadcastsi128_si256(ld128(static_cast<const uint8_t*>(p) + 16 * (v / 2)));
  const I mask = _mm256_load_si256(reinterpret_cast<const I*>(UNPACKED_BYTES[at == 3][v % 2].data()));
  return _mm256_shuffle_epi8(b, mask);
}

// Vector v of a group's unsigned codes at p, as int32
template <Param P>
inline I load_unsigned_codes(const uint8_t* p, int v) {
  if constexpr (UNPACKED<P>) return unpacked_bytes<0>(p, v);
  else return load_u8(p + 8 * v);
}
// Vector v of a group's signed codes at p, each code c as the int32 c << SIGNED_CODE_SHIFT<P> (the unpacked
// order's byte loads place it in the lane's top byte)
template <Param P>
constexpr int SIGNED_CODE_SHIFT = UNPACKED<P> ? 24 : 0;
template <Param P>
inline I load_signed_codes(const int8_t* p, int v) {
  if constexpr (UNPACKED<P>) return unpacked_bytes<3>(p, v);
  else return load_i8(p + 8 * v);
}

// 32 bytes whose 4-byte quarters hold values {0, 8, 16, 24, 4, 12, 20, 28} + 0..3 (a group's natural order
// narrowed in place) or {0, 4, 16, 20, 8, 12, 24, 28} + 0..3 (its unpacked order), put in order
template <bool unpacked>
inline I quarters_in_order(I y) {
  if constexpr (unpacked) return _mm256_permute4x64_epi64(y, 0xD8);
  else return _mm256_permutevar8x32_epi32(y, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// A narrowing store of two natural-order vectors: the low or high word of each lane (16 words), in order. Each
// vector's words are gathered into its own quadword of every 128-bit half (pshufb), the two are or-ed, and one
// permute puts the quadwords in order.
template <bool high>
__attribute__((always_inline)) inline void st16x2(void* p, I a, I b) {
  constexpr int8_t o = high ? 2 : 0, z = -128;  // the word's first byte; a zero byte
  const I ma = _mm256_setr_epi8(o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13, z, z, z, z, z, z, z, z,
                                o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13, z, z, z, z, z, z, z, z);
  const I mb = _mm256_setr_epi8(z, z, z, z, z, z, z, z, o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13,
                                z, z, z, z, z, z, z, z, o, o + 1, o + 4, o + 5, o + 8, o + 9, o + 12, o + 13);
  const I y = _mm256_or_si256(_mm256_shuffle_epi8(a, ma), _mm256_shuffle_epi8(b, mb));
  _mm256_storeu_si256(static_cast<I*>(p), _mm256_permute4x64_epi64(y, 0xD8));  // quarters a0 b0 a1 b1 -> a0 a1 b0 b1
}
// The codes of a group, rounded (round to nearest even, the default rounding mode): signed codes in
// [-127, 127] or unsigned ones in [0, 255], so the saturating packs keep them as the truncation would
template <bool is_signed, bool unpacked>
__attribute__((always_inline)) inline void store_codes4(void* p, const V x[4]) {
  const I ab = _mm256_packs_epi32(_mm256_cvtps_epi32(x[0]), _mm256_cvtps_epi32(x[1]));
  const I cd = _mm256_packs_epi32(_mm256_cvtps_epi32(x[2]), _mm256_cvtps_epi32(x[3]));
  const I y = is_signed ? _mm256_packs_epi16(ab, cd) : _mm256_packus_epi16(ab, cd);
  _mm256_storeu_si256(static_cast<I*>(p), quarters_in_order<unpacked>(y));
}

// load_theta4 of a group with a zero, infinite or NaN parameter: merge_bf16 itself
template <Param P>
__attribute__((noinline)) void merge_rarely(const Desc& d, int64_t i, V out[4]) {
  const uint16_t* p = static_cast<const uint16_t*>(d.param) + i;
  alignas(32) float t[G];
  if constexpr (P == BF16_RHO8) merge_bf16(p, static_cast<const int8_t*>(d.rho) + i, t, 8, G);
  else merge_bf16(p, static_cast<const int16_t*>(d.rho) + i, t, 0, G);
  for (int v = 0; v < 4; ++v) out[v] = load_ordered<P>(t, v);
}

// theta (the fp32 master weight) of a group's 32 values at i, in the group's order. bf16 + rho: the common case
// of merge_bf16, a finite non-zero parameter's bits t = x << 16 moved by d = rho << shift toward its sign,
// ((t ^ s) + d) ^ s with s the sign spread over the lane: t + d where x is positive, t - d where negative. With
// int8 rho (shift 8) that is computed on 16-bit lanes: the magnitude's bits move by e = rho or -rho
// (_mm256_sign_epi16 by x, which is never zero here), so the low word is e << 8 and the high word x, less one
// where e is negative (x's magnitude is at least 1: the borrow never reaches the sign); the two words are then
// unpacked into the group's (unpacked) order. A group with a zero, infinite or NaN parameter (on the 16 bits
// x, (x << 1) - 1 >= 0xFEFF unsigned) is merged by merge_bf16 itself.
template <Param P>
__attribute__((always_inline)) inline void load_theta4(const Desc& d, int64_t i, V out[4]) {
  if constexpr (P == FP32) {
    for (int v = 0; v < 4; ++v) out[v] = _mm256_loadu_ps(static_cast<const float*>(d.param) + i + 8 * v);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(d.param) + i;
    I x[2], rare = _mm256_setzero_si256();
    for (int h = 0; h < 2; ++h) {  // y >= 0xFEFF where y - 0xFEFE does not saturate to 0
      x[h] = _mm256_loadu_si256(reinterpret_cast<const I*>(p + 16 * h));
      const I y = _mm256_add_epi16(_mm256_slli_epi16(x[h], 1), _mm256_set1_epi16(-1));
      rare = _mm256_or_si256(rare, _mm256_subs_epu16(y, _mm256_set1_epi16(int16_t(0xFEFE))));
    }
    if (!_mm256_testz_si256(rare, rare)) return merge_rarely<P>(d, i, out);
    if constexpr (P == BF16_RHO8) {
      for (int h = 0; h < 2; ++h) {
        const I rho = _mm256_cvtepi8_epi16(ld128(static_cast<const int8_t*>(d.rho) + i + 16 * h));
        const I e = _mm256_sign_epi16(rho, x[h]);
        const I lo = _mm256_slli_epi16(e, 8), hi = _mm256_add_epi16(x[h], _mm256_srai_epi16(e, 15));
        out[2 * h] = as_float(_mm256_unpacklo_epi16(lo, hi));
        out[2 * h + 1] = as_float(_mm256_unpackhi_epi16(lo, hi));
      }
      return;
    }
    for (int v = 0; v < 4; ++v) {
      const I t = as_int(load_bf16(p + 8 * v));
      const I dd = load_i16(static_cast<const int16_t*>(d.rho) + i + 8 * v);
      const I s = _mm256_srai_epi32(t, 31);
      out[v] = as_float(_mm256_xor_si256(_mm256_add_epi32(_mm256_xor_si256(t, s), dd), s));
    }
  }
}

// The high and low 16-bit words of a group's master weights (in the unpacked order), values 16h..16h+15 of each
// in order: each vector's low words to bytes 0-7 of each 128-bit half and its high words to bytes 8-15
// (pshufb), then the two vectors' low (high) quadwords of each half together
inline void words16(const V theta[4], I hw[2], I lw[2]) {
  const I m = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                               0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int h = 0; h < 2; ++h) {
    const I a = _mm256_shuffle_epi8(as_int(theta[2 * h]), m), b = _mm256_shuffle_epi8(as_int(theta[2 * h + 1]), m);
    lw[h] = _mm256_unpacklo_epi64(a, b);
    hw[h] = _mm256_unpackhi_epi64(a, b);
  }
}

// Whether a group's master weights hold one of magnitude >= 0x7F7F0000 (the magnitudes' bits as int32)
inline bool splits_rarely(const V theta[4]) {
  const I a = _mm256_max_epi32(as_int(vabs(theta[0])), as_int(vabs(theta[1])));
  const I b = _mm256_max_epi32(as_int(vabs(theta[2])), as_int(vabs(theta[3])));
  const I big = _mm256_cmpgt_epi32(_mm256_max_epi32(a, b), vi(0x7F7EFFFF));
  return !_mm256_testz_si256(big, big);
}

// store_theta4 of a group that holds a master weight of magnitude >= 0x7F7F0000: split_bf16 itself
template <Param P>
__attribute__((noinline)) void split_rarely(const Desc& d, int64_t i, const V theta[4]) {
  uint16_t* p = static_cast<uint16_t*>(d.param) + i;
  alignas(32) float t[G];
  for (int v = 0; v < 4; ++v) store_ordered<P>(t, v, theta[v]);
  if constexpr (P == BF16_RHO8) split_bf16<int8_t, 8>(t, p, static_cast<int8_t*>(d.rho) + i, G);
  else split_bf16<int16_t, 0>(t, p, static_cast<int16_t*>(d.rho) + i, G);
}

// The new parameter (and rho) of a group's 32 values at i from theta (in the group's order), as avx512.h's
// split_common computes them on 32-bit lanes (its comment derives it): with s the sign spread over the lane, the
// bf16 value is the high word of theta + 0x8080 + (s << 8) (int8 rho) or theta + 0x8000 + s (int16), and rho is
// byte 1 of (theta ^ s) + 128 or the low word of (theta ^ s) - s. With int8 rho that is computed on 16-bit
// lanes, on the high and low words H and L of the master weights (words16): the parameter is H plus the carry
// out of L + (0x8080 or 0x7F80), which comes where L >= 0x7F80 (theta positive) or 0x8080 (negative), and rho
// is ((L ^ s) + 128) >> 8 (no higher bit reaches byte 1). A group with a master weight of magnitude >=
// 0x7F7F0000 (within a bf16 step of the largest finite value, infinite or NaN) is split by split_bf16 itself.
template <Param P>
__attribute__((always_inline)) inline void store_theta4(const Desc& d, int64_t i, const V theta[4]) {
  if constexpr (P == FP32) {
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(static_cast<float*>(d.param) + i + 8 * v, theta[v]);
    return;
  }
  uint16_t* p = static_cast<uint16_t*>(d.param) + i;
  if constexpr (P == BF16_RHO8) {
    I hw[2], lw[2], r[2];
    words16(theta, hw, lw);
    I big = _mm256_setzero_si256();  // |H| >= 0x7F7F: (H << 1) - 0xFEFD does not saturate to 0
    for (int h = 0; h < 2; ++h)
      big = _mm256_or_si256(big, _mm256_subs_epu16(_mm256_slli_epi16(hw[h], 1), _mm256_set1_epi16(int16_t(0xFEFD))));
    if (!_mm256_testz_si256(big, big)) return split_rarely<P>(d, i, theta);
    for (int h = 0; h < 2; ++h) {
      const I s = _mm256_srai_epi16(hw[h], 15);
      r[h] = _mm256_srli_epi16(_mm256_add_epi16(_mm256_xor_si256(lw[h], s), _mm256_set1_epi16(128)), 8);
      const I edge = _mm256_add_epi16(_mm256_set1_epi16(0x7F80), _mm256_and_si256(s, _mm256_set1_epi16(0x100)));
      const I carry = _mm256_cmpeq_epi16(_mm256_max_epu16(lw[h], edge), lw[h]);  // L >= edge: -1
      _mm256_storeu_si256(reinterpret_cast<I*>(p + 16 * h), _mm256_sub_epi16(hw[h], carry));
    }
    // the two halves' bytes, 0-7 16-23 | 8-15 24-31, in order
    const I rho = _mm256_permute4x64_epi64(_mm256_packus_epi16(r[0], r[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<I*>(static_cast<int8_t*>(d.rho) + i), rho);
  } else {
    if (splits_rarely(theta)) return split_rarely<P>(d, i, theta);
    I hi[4], lo[4];
    for (int v = 0; v < 4; ++v) {
      const I x = as_int(theta[v]), s = _mm256_srai_epi32(x, 31);  // s = -1 for a negative theta
      hi[v] = _mm256_add_epi32(_mm256_add_epi32(x, vi(32768)), s);  // t - 1 and -x where negative
      lo[v] = _mm256_sub_epi32(_mm256_xor_si256(x, s), s);
    }
    st16x2<false>(static_cast<int16_t*>(d.rho) + i, lo[0], lo[1]);
    st16x2<false>(static_cast<int16_t*>(d.rho) + i + 16, lo[2], lo[3]);
    st16x2<true>(p, hi[0], hi[1]);
    st16x2<true>(p + 16, hi[2], hi[3]);
  }
}

// The gradient of a group's 32 values at i, in the group's order
template <Param P>
__attribute__((always_inline)) inline void load_grad4(const Desc& d, int64_t i, V out[4]) {
  if (d.gdt == F32) {
    for (int v = 0; v < 4; ++v) out[v] = load_ordered<P>(static_cast<const float*>(d.grad) + i, v);
  } else if constexpr (UNPACKED<P>) {
    for (int h = 0; h < 2; ++h) {
      const I x = _mm256_loadu_si256(reinterpret_cast<const I*>(static_cast<const uint16_t*>(d.grad) + i + 16 * h));
      out[2 * h] = as_float(_mm256_unpacklo_epi16(_mm256_setzero_si256(), x));
      out[2 * h + 1] = as_float(_mm256_unpackhi_epi16(_mm256_setzero_si256(), x));
    }
  } else {
    for (int v = 0; v < 4; ++v) out[v] = load_bf16(static_cast<const uint16_t*>(d.grad) + i + 8 * v);
  }
}

// Vector v of the first moment of a group with codes at p, before its group's scale (dequantize_signed with
// scale and factor 1): y / (2 - |y|) of y = code / 127 where companded, the code where linear. The unpacked
// order's codes c * 2^24 are multiplied by INV127 * 2^-24 (exact powers of two: the same product c * INV127).
template <Param P>
inline V first_moment_value(const int8_t* p, int v, bool companded) {
  const I c = load_signed_codes<P>(p, v);
  if (!companded) return _mm256_cvtepi32_ps(_mm256_srai_epi32(c, SIGNED_CODE_SHIFT<P>));
  const V y = _mm256_mul_ps(_mm256_cvtepi32_ps(c), vf(INV127 / float(1 << SIGNED_CODE_SHIFT<P>)));
  return _mm256_div_ps(y, _mm256_sub_ps(vf(2.0f), vabs(y)));
}

// Lane-wise max of the bits of a group's vectors (unsigned). For values that are at least +0 or NaN (square roots
// of sums of products with non-negative factors) the sign is set on NaNs alone, so the maximum with the sign
// cleared is the maximum magnitude.
inline I max_lanes(const V x[4]) {
  const I a = _mm256_max_epu32(as_int(x[0]), as_int(x[1]));
  return _mm256_max_epu32(a, _mm256_max_epu32(as_int(x[2]), as_int(x[3])));
}
// Lane-wise max of the magnitudes' bits of a group's vectors
inline I absmax_lanes(const V x[4]) {
  const V a[4] = {vabs(x[0]), vabs(x[1]), vabs(x[2]), vabs(x[3])};
  return max_lanes(a);
}

// x[0..7] -> one vector whose lane q is the largest (unsigned) lane of x[q]: a transposing tree
__attribute__((always_inline)) inline I reduce_max8(const I* x) {
  I p[4], q[2];
  for (int i = 0; i < 4; ++i)
    p[i] = _mm256_max_epu32(_mm256_unpacklo_epi32(x[2 * i], x[2 * i + 1]),
                            _mm256_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    q[i] = _mm256_max_epu32(_mm256_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                            _mm256_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
  return _mm256_max_epu32(_mm256_permute2x128_si256(q[0], q[1], 0x20), _mm256_permute2x128_si256(q[0], q[1], 0x31));
}

// Per-group values of a block's up to 8 groups, one lane each (avx512.h's GroupValues, from the same fp32
// operations as quantize_signed, quantize_unsigned and the update's scaling)
struct GroupValues {
  alignas(32) float sn[8], step[8], k254[8], as[8], mlift[8], mrcp[8], vlift[8], vrcp[8];
  uint32_t bad;  // bit q: group q's new moments do not fit their scales (the group is skipped)
};

inline V nonzero_or_one_bits(I bits) {  // absmax bits (no sign): 0 -> 1.0
  return as_float(_mm256_blendv_epi8(bits, vi(0x3F800000), _mm256_cmpeq_epi32(bits, _mm256_setzero_si256())));
}
inline V lift_of(V a) {  // a < TINY ? LIFT : 1 (a NaN: 1)
  return _mm256_blendv_ps(vf(1.0f), vf(LIFT), _mm256_cmp_ps(a, vf(TINY), _CMP_LT_OQ));
}
// Lanes (as bits) whose absmax bits are above bound; magnitudes' bits are below 2^31, so the signed comparison
// is the unsigned one (a NaN's bits are above every bound)
inline uint32_t above(I bits, float bound) {
  return uint32_t(_mm256_movemask_ps(as_float(_mm256_cmpgt_epi32(bits, vi(int32_t(f2u(bound)))))));
}

// The first moment's values (signed_group_values of avx512.h); returns the lanes that overflow the scale, e:
// pow2_normalizer's exponent (1 / sn = 2^(e - 127) exactly)
inline uint32_t signed_group_values(I am, bool companded, GroupValues& out, I& e) {
  const V a = nonzero_or_one_bits(am);
  e = _mm256_min_epi32(_mm256_max_epi32(_mm256_srli_epi32(as_int(a), 23), vi(8)), vi(253));
  const V sn = as_float(_mm256_slli_epi32(_mm256_sub_epi32(vi(254), e), 23));
  _mm256_store_ps(out.sn, sn);
  if (companded) {
    _mm256_store_ps(out.k254, _mm256_mul_ps(vf(254.0f), sn));
    _mm256_store_ps(out.as, _mm256_mul_ps(a, sn));
  } else {
    const V lift = lift_of(a);
    _mm256_store_ps(out.mlift, lift);
    _mm256_store_ps(out.mrcp, _mm256_div_ps(vf(127.0f), _mm256_mul_ps(a, lift)));
  }
  return above(am, SCALE_MAX);
}

// The new scales of the groups kept: bf16 of their absmaxes (finite, so f2bf's rounding on the bits), all
// eight in one store where the block has eight groups and keeps them all
inline void store_scales(uint16_t* scales, int groups, uint32_t bad, I absmax) {
  const I odd = _mm256_and_si256(_mm256_srli_epi32(absmax, 16), vi(1));
  const I b = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(absmax, vi(0x7FFF)), odd), 16);
  const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
  if (groups == B / G && !bad) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), w);
    return;
  }
  alignas(16) uint16_t v[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(v), w);
  for (int q = 0; q < groups; ++q)
    if (!(bad >> q & 1)) scales[q] = v[q];
}

// int8 codes (before rounding) of 8 values m of group q of a first moment
inline V signed_code(V m, const GroupValues& gv, int q, bool companded) {
  if (companded)
    return _mm256_div_ps(_mm256_mul_ps(m, vf(gv.k254[q])),
                         _mm256_add_ps(vf(gv.as[q]), _mm256_mul_ps(vabs(m), vf(gv.sn[q]))));
  return _mm256_mul_ps(_mm256_mul_ps(m, vf(gv.mlift[q])), vf(gv.mrcp[q]));
}

// A block that ends inside a group, run by `run` on a zero-padded copy (base 0) of its values; the row's values
// of the parameter, rho and moment codes are copied back. Zero gradients, parameters and codes past the row give
// zero moments there, as the reference's padding does, and their lanes are not written back.
template <class Run>
int64_t on_padded_copy(const Desc& d, const Block& s, Run run) {
  alignas(32) uint8_t param[4 * B], grad[4 * B], rho[2 * B], mom[2][B];
  const size_t psize = d.pdt == F32 ? 4 : 2, gsize = d.gdt == F32 ? 4 : 2, rsize = d.rdt == I8 ? 1 : 2;
  Desc c = d;
  auto copy_in = [&](void* dst, const void* src, size_t size) {
    std::memcpy(dst, static_cast<const uint8_t*>(src) + s.base * size, s.n * size);
    std::memset(static_cast<uint8_t*>(dst) + s.n * size, 0, (s.L - s.n) * size);
  };
  copy_in(param, d.param, psize);
  copy_in(grad, d.grad, gsize);
  c.param = param;
  c.grad = grad;
  if (d.rho) { copy_in(rho, d.rho, rsize); c.rho = rho; }
  for (int k = 0; k < 2; ++k)
    if (d.mom[k]) { copy_in(mom[k], d.mom[k], 1); c.mom[k] = mom[k]; }
  const int64_t skipped = run(c, Block{0, s.L, s.L, s.sidx});
  std::memcpy(static_cast<uint8_t*>(d.param) + s.base * psize, param, s.n * psize);
  if (d.rho) std::memcpy(static_cast<uint8_t*>(d.rho) + s.base * rsize, rho, s.n * rsize);
  for (int k = 0; k < 2; ++k)
    if (d.mom[k]) std::memcpy(static_cast<uint8_t*>(d.mom[k]) + s.base, mom[k], s.n);
  return skipped;
}

// One block of FlashAdam(W) with 8-bit moments whose values are whole groups (s.n == s.L); the number of
// skipped groups.
template <Param P, bool decoupled, bool companded>
int64_t adam_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float eps,
                   float wd, float decay, float step_size, float ibc2) {
  const int8_t* mc = static_cast<const int8_t*>(d.mom[0]);
  const uint8_t* vc = static_cast<const uint8_t*>(d.mom[1]);
  const int groups = s.L / G;
  V m[B / G][4], sec[B / G][4], th[B / G][4];
  I am[B / G], au[B / G];
  for (int q = groups; q < B / G; ++q) am[q] = au[q] = _mm256_setzero_si256();
  for (int q = 0; q < groups; ++q) {
    const float sm = bf16_value(d.scales[0][s.sidx + q]), sv = bf16_value(d.scales[1][s.sidx + q]);
    const V mmult = vf(companded ? sm * beta1 : (sm * INV127) * beta1);
    const float su = sv * INV255;
    const V vmult = vf(companded ? (su * su) * beta2 : su * beta2);
    const int64_t i0 = s.base + int64_t(q) * G;
    V gs[4], t4[4];
    load_grad4<P>(d, i0, gs);
    load_theta4<P>(d, i0, t4);
    for (int v = 0; v < 4; ++v) {
      V g = gs[v];
      th[q][v] = t4[v];
      V mj = _mm256_mul_ps(first_moment_value<P>(mc + i0, v, companded), mmult);
      const V cv = _mm256_cvtepi32_ps(load_unsigned_codes<P>(vc + i0, v));
      V vj = _mm256_mul_ps(companded ? _mm256_mul_ps(cv, cv) : cv, vmult);
      if (decoupled) th[q][v] = _mm256_mul_ps(th[q][v], vf(decay));
      else g = _mm256_add_ps(g, _mm256_mul_ps(th[q][v], vf(wd)));
      m[q][v] = _mm256_add_ps(mj, _mm256_mul_ps(g, vf(omb1)));
      vj = _mm256_add_ps(vj, _mm256_mul_ps(_mm256_mul_ps(g, g), vf(omb2)));
      sec[q][v] = companded ? _mm256_sqrt_ps(vj) : vj;
    }
    am[q] = absmax_lanes(m[q]);
    au[q] = companded ? max_lanes(sec[q]) : absmax_lanes(sec[q]);
  }
  const I amax = reduce_max8(am);
  const I umax = companded ? as_int(vabs(as_float(reduce_max8(au)))) : reduce_max8(au);
  GroupValues gv;
  I e;
  gv.bad = (signed_group_values(amax, companded, gv, e) | above(umax, companded ? SQRT_SCALE_MAX : SCALE_MAX)) &
           ((1u << groups) - 1);
  _mm256_store_ps(gv.step, _mm256_mul_ps(vf(step_size), as_float(_mm256_slli_epi32(e, 23))));
  const V b = nonzero_or_one_bits(umax), lift = lift_of(b);
  _mm256_store_ps(gv.vlift, lift);
  _mm256_store_ps(gv.vrcp, _mm256_div_ps(vf(255.0f), _mm256_mul_ps(b, lift)));
  store_scales(d.scales[0] + s.sidx, groups, gv.bad, amax);
  store_scales(d.scales[1] + s.sidx, groups, gv.bad, umax);
  for (int q = 0; q < groups; ++q) {
    if (gv.bad >> q & 1) continue;  // the group keeps its old state (skip_groups)
    V theta[4], code_m[4], code_u[4];
    const V sn = vf(gv.sn[q]), step = vf(gv.step[q]), vrcp = vf(gv.vrcp[q]);
    for (int v = 0; v < 4; ++v) {
      const V mj = m[q][v];
      V x, den;
      if (companded) {  // |m sn|, which is |m| sn bit for bit, serves the flush and the companding
        const V mx = _mm256_mul_ps(mj, sn), ax = vabs(mx);
        x = _mm256_and_ps(mx, _mm256_cmp_ps(ax, vf(UPDATE_FLUSH), _CMP_NLT_UQ));
        code_m[v] = _mm256_div_ps(_mm256_mul_ps(mj, vf(gv.k254[q])), _mm256_add_ps(vf(gv.as[q]), ax));
        den = _mm256_add_ps(_mm256_mul_ps(sec[q][v], vf(ibc2)), vf(eps));
      } else {
        x = _mm256_mul_ps(mj, sn);
        x = _mm256_and_ps(x, _mm256_cmp_ps(vabs(x), vf(UPDATE_FLUSH), _CMP_NLT_UQ));
        code_m[v] = signed_code(mj, gv, q, false);
        den = _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(sec[q][v]), vf(ibc2)), vf(eps));
      }
      theta[v] = _mm256_sub_ps(th[q][v], _mm256_mul_ps(_mm256_div_ps(x, den), step));
      const V lifted = gv.vlift[q] == 1.0f ? sec[q][v] : _mm256_mul_ps(sec[q][v], vf(gv.vlift[q]));  // x * 1 is x
      code_u[v] = _mm256_mul_ps(lifted, vrcp);
    }
    const int64_t i = s.base + int64_t(q) * G;
    store_codes4<true, UNPACKED<P>>(static_cast<int8_t*>(d.mom[0]) + i, code_m);
    store_codes4<false, UNPACKED<P>>(static_cast<uint8_t*>(d.mom[1]) + i, code_u);
    store_theta4<P>(d, i, theta);
  }
  return __builtin_popcount(gv.bad);
}

// adam_block with its flags known when compiling, on whole groups (a block that ends inside a group: on a
// padded copy)
template <Param P>
int64_t adam_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float eps,
                   float wd, float decay, float step_size, float ibc2, bool decoupled, bool companded) {
  auto run = [&](const Desc& dd, const Block& ss) {
#define FLASHDIST_ADAM(D, C) adam_block<P, D, C>(dd, ss, beta1, beta2, omb1, omb2, eps, wd, decay, step_size, ibc2)
    if (decoupled) return companded ? FLASHDIST_ADAM(true, true) : FLASHDIST_ADAM(true, false);
    return companded ? FLASHDIST_ADAM(false, true) : FLASHDIST_ADAM(false, false);
#undef FLASHDIST_ADAM
  };
  return s.n == s.L ? run(d, s) : on_padded_copy(d, s, run);
}

// The end of a block of FlashLion or FlashSGD(W) with an 8-bit moment (avx512.h's store_signed_block): the new
// first moments m of its groups quantized, each group's codes, scale and parameter values (``store_param(q)``)
// stored, or the group left as it was (skip_groups) where its moment overflows the bf16 scale or it is in
// ``skip`` (bit q: group q). The number of groups skipped.
template <Param P, bool companded, class StoreParam>
__attribute__((always_inline)) inline int64_t store_signed_block(const Desc& d, const Block& s, int groups,
                                                                 const V (*m)[4], const I* amax, uint32_t skip,
                                                                 StoreParam store_param) {
  I all[B / G];
  for (int q = 0; q < B / G; ++q) all[q] = q < groups ? amax[q] : _mm256_setzero_si256();
  const I am = reduce_max8(all);
  GroupValues gv;
  I e;
  gv.bad = (signed_group_values(am, companded, gv, e) | skip) & ((1u << groups) - 1);
  store_scales(d.scales[0] + s.sidx, groups, gv.bad, am);
  for (int q = 0; q < groups; ++q) {
    if (gv.bad >> q & 1) continue;
    V code[4];
    for (int v = 0; v < 4; ++v) code[v] = signed_code(m[q][v], gv, q, companded);
    store_codes4<true, UNPACKED<P>>(static_cast<int8_t*>(d.mom[0]) + s.base + int64_t(q) * G, code);
    store_param(q);
  }
  return __builtin_popcount(gv.bad);
}

// One block of FlashLion with an 8-bit moment whose values are whole groups (s.n == s.L); the number of skipped
// groups.
template <Param P, bool companded>
int64_t lion_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float decay,
                   float lr) {
  const int8_t* mc = static_cast<const int8_t*>(d.mom[0]);
  const int groups = s.L / G;
  V m[B / G][4], th[B / G][4];
  I am[B / G];
  for (int q = 0; q < groups; ++q) {
    const float sm = bf16_value(d.scales[0][s.sidx + q]);
    const V mult = vf(companded ? sm : sm * INV127);  // dequantize_signed's with factor 1 (x * 1 is x)
    const int64_t i0 = s.base + int64_t(q) * G;
    V gs[4];
    load_grad4<P>(d, i0, gs);
    load_theta4<P>(d, i0, th[q]);
    for (int v = 0; v < 4; ++v) {
      const V g = gs[v], mo = _mm256_mul_ps(first_moment_value<P>(mc + i0, v, companded), mult);
      const V t = _mm256_mul_ps(th[q][v], vf(decay));
      const V c = _mm256_add_ps(_mm256_mul_ps(mo, vf(beta1)), _mm256_mul_ps(g, vf(omb1)));
      // float(c > 0) - float(c < 0): +1, -1, or +0 (zero and NaN)
      const V dir = _mm256_sub_ps(_mm256_and_ps(_mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_GT_OQ), vf(1.0f)),
                                  _mm256_and_ps(_mm256_cmp_ps(c, _mm256_setzero_ps(), _CMP_LT_OQ), vf(1.0f)));
      th[q][v] = _mm256_sub_ps(t, _mm256_mul_ps(dir, vf(lr)));
      m[q][v] = _mm256_add_ps(_mm256_mul_ps(mo, vf(beta2)), _mm256_mul_ps(g, vf(omb2)));
    }
    am[q] = absmax_lanes(m[q]);
  }
  return store_signed_block<P, companded>(d, s, groups, m, am, 0, [&](int q) {
    store_theta4<P>(d, s.base + int64_t(q) * G, th[q]);
  });
}

// lion_block with its flag known when compiling, on whole groups (a block that ends inside a group: on a padded
// copy)
template <Param P>
int64_t lion_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float decay,
                   float lr, bool companded) {
  auto run = [&](const Desc& dd, const Block& ss) {
    return companded ? lion_block<P, true>(dd, ss, beta1, beta2, omb1, omb2, decay, lr)
                     : lion_block<P, false>(dd, ss, beta1, beta2, omb1, omb2, decay, lr);
  };
  return s.n == s.L ? run(d, s) : on_padded_copy(d, s, run);
}

// Whether a group's new parameter, as make_low gives it (the value stored), is infinite or NaN somewhere. bf16 +
// rho: only a master weight of magnitude >= 0x7F7F0000 can give one (below it the rounding and the split's step
// up stay at or below the largest finite bf16 value); such a group is split by split_bf16 to see, which also
// catches a finite master weight that rounds or steps up to inf.
template <Param P>
inline bool stored_nonfinite4(const V theta[4]) {
  if constexpr (P == FP32) {
    I special = _mm256_setzero_si256();
    for (int v = 0; v < 4; ++v)
      special = _mm256_or_si256(special, _mm256_cmpeq_epi32(_mm256_and_si256(as_int(theta[v]), vi(0x7F800000)),
                                                            vi(0x7F800000)));
    return _mm256_movemask_epi8(special);
  } else {
    if (!splits_rarely(theta)) return false;
    alignas(32) float t[G];
    uint16_t p[G];
    int32_t r[G];
    for (int v = 0; v < 4; ++v) _mm256_store_ps(t + 8 * v, theta[v]);
    split_bf16<int32_t, P == BF16_RHO8 ? 8 : 0>(t, p, r, G);
    bool bad = false;
    for (int k = 0; k < G; ++k) bad |= (p[k] & 0x7F80) == 0x7F80;
    return bad;
  }
}

// One block of FlashSGD(W) with an 8-bit momentum whose values are whole groups (s.n == s.L); the number of
// skipped groups. A group is also skipped where its new parameter is not finite (SGD's step has no bound).
template <Param P, bool decoupled, bool nesterov, bool companded>
int64_t sgd_block(const Desc& d, const Block& s, float momentum_decay, float momentum_gain, float momentum,
                  float wd, float decay, float lr) {
  const int8_t* mc = static_cast<const int8_t*>(d.mom[0]);
  const int groups = s.L / G;
  V m[B / G][4], th[B / G][4];
  I am[B / G];
  uint32_t nonfinite = 0;  // bit q: group q has a new parameter that is inf or NaN
  for (int q = 0; q < groups; ++q) {
    const float sm = bf16_value(d.scales[0][s.sidx + q]);
    const V mult = vf(companded ? sm * momentum_decay : (sm * INV127) * momentum_decay);
    const int64_t i0 = s.base + int64_t(q) * G;
    V gs[4];
    load_grad4<P>(d, i0, gs);
    load_theta4<P>(d, i0, th[q]);
    for (int v = 0; v < 4; ++v) {
      V g = gs[v], t = th[q][v];
      if (decoupled) t = _mm256_mul_ps(t, vf(decay));
      else g = _mm256_add_ps(g, _mm256_mul_ps(t, vf(wd)));
      const V mo = _mm256_mul_ps(first_moment_value<P>(mc + i0, v, companded), mult);
      m[q][v] = _mm256_add_ps(mo, _mm256_mul_ps(g, vf(momentum_gain)));
      const V dir = nesterov ? _mm256_add_ps(g, _mm256_mul_ps(m[q][v], vf(momentum))) : m[q][v];
      th[q][v] = _mm256_sub_ps(t, _mm256_mul_ps(dir, vf(lr)));
    }
    nonfinite |= uint32_t(stored_nonfinite4<P>(th[q])) << q;
    am[q] = absmax_lanes(m[q]);
  }
  return store_signed_block<P, companded>(d, s, groups, m, am, nonfinite, [&](int q) {
    store_theta4<P>(d, s.base + int64_t(q) * G, th[q]);
  });
}

// sgd_block with its flags known when compiling, on whole groups (a block that ends inside a group: on a padded
// copy)
template <Param P>
int64_t sgd_block(const Desc& d, const Block& s, float momentum_decay, float momentum_gain, float momentum,
                  float wd, float decay, float lr, bool decoupled, bool nesterov, bool companded) {
  auto run = [&](const Desc& dd, const Block& ss) {
#define FLASHDIST_SGD(D, N, C) sgd_block<P, D, N, C>(dd, ss, momentum_decay, momentum_gain, momentum, wd, decay, lr)
    if (decoupled) {
      if (nesterov) return companded ? FLASHDIST_SGD(true, true, true) : FLASHDIST_SGD(true, true, false);
      return companded ? FLASHDIST_SGD(true, false, true) : FLASHDIST_SGD(true, false, false);
    }
    if (nesterov) return companded ? FLASHDIST_SGD(false, true, true) : FLASHDIST_SGD(false, true, false);
    return companded ? FLASHDIST_SGD(false, false, true) : FLASHDIST_SGD(false, false, false);
#undef FLASHDIST_SGD
  };
  return s.n == s.L ? run(d, s) : on_padded_copy(d, s, run);
}

}  // namespace avx2
#endif
