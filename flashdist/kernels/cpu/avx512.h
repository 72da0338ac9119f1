// The explicitly vectorised (AVX-512) part of step.cpp's fused CPU steps. Not a standalone header: step.cpp
// includes it after the block code's helpers (Desc, Block, the bf16 and code helpers, the scale bounds), whose
// semantics it reproduces bit for bit.
#pragma once

// ---- explicit AVX-512 path for the quantized steps ----
//
// The block code above leaves one pass per stage over small fp32 arrays: the compiler vectorises each loop,
// but every stage stores and reloads its values. Here one quantization group (32 values, two 16-lane vectors)
// goes from the loaded codes to the written codes in registers. The operations and their order are those of
// the block code (so of reference.py): the same IEEE + - * / sqrt and round-to-nearest-even, no FMA (the
// intrinsics are plain vector operators, kept apart by -ffp-contract=off); a row's last, partial group is read
// with zeros past its end and written through a lane mask, as the block code pads and masks it.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FLASHDIST_AVX512 1

namespace simd {

using V = __m512;
using I = __m512i;
using M = __mmask16;

inline V vf(float x) { return _mm512_set1_ps(x); }
inline I vi(int32_t x) { return _mm512_set1_epi32(x); }
inline V vabs(V x) { return _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), vi(0x7FFFFFFF))); }

// Loads and narrowing stores of 16 lanes. Whole vectors (all but a row's last group) use plain loads and
// stores, the last group's lanes masked ones.
constexpr M ALL = 0xFFFF;
inline __m128i ld8(const void* p, M k) {
  return k == ALL ? _mm_loadu_si128(static_cast<const __m128i*>(p)) : _mm_maskz_loadu_epi8(k, p);
}
inline __m256i ld16(const void* p, M k) {
  return k == ALL ? _mm256_loadu_si256(static_cast<const __m256i*>(p)) : _mm256_maskz_loadu_epi16(k, p);
}
inline V ld32(const float* p, M k) { return k == ALL ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(k, p); }
inline void st8(void* p, M k, I x) {
  __m128i b = _mm512_cvtepi32_epi8(x);
  if (k == ALL) _mm_storeu_si128(static_cast<__m128i*>(p), b);
  else _mm_mask_storeu_epi8(p, k, b);
}
inline void st32(float* p, M k, V x) {
  if (k == ALL) _mm512_storeu_ps(p, x);
  else _mm512_mask_storeu_ps(p, k, x);
}

inline I load_i8(const int8_t* p, M k) { return _mm512_cvtepi8_epi32(ld8(p, k)); }
inline I load_u8(const uint8_t* p, M k) { return _mm512_cvtepu8_epi32(ld8(p, k)); }
inline I load_i16(const int16_t* p, M k) { return _mm512_cvtepi16_epi32(ld16(p, k)); }

// merge_bf16 on 16 lanes, any parameter values: t the parameter's fp32 bits, r rho (sign-extended). A non-zero
// finite parameter's bits move by rho << shift toward its sign (the magnitude stays in range: at least 2^16,
// rho << shift below 2^15), so moving is one add of rho negated for negative parameters.
template <int shift>
inline V merge_any(I t, I r) {
  I d = _mm512_slli_epi32(r, shift);
  I out = _mm512_mask_sub_epi32(_mm512_add_epi32(t, d), _mm512_cmplt_epi32_mask(t, _mm512_setzero_si512()), t, d);
  // +-0 + rho * unit: rho's sign and magnitude (where rho is 0 the parameter stays, -0 included)
  M zero = _mm512_testn_epi32_mask(t, vi(0x7FFFFFFF)) & _mm512_test_epi32_mask(d, d);
  out = _mm512_mask_or_epi32(out, zero, _mm512_abs_epi32(d), _mm512_and_si512(d, vi(int32_t(0x80000000u))));
  M special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(t, vi(0x7F800000)), vi(0x7F800000));  // inf, NaN
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(out, special, t));
}

// split_bf16 on 16 lanes, any theta: the new parameter's bf16 bits and rho, both in int32 lanes. Its "next
// value up" is one bf16 value up (pb + 1 for a positive theta, pb - 1 for a negative one: sign and magnitude
// bits) and 2 * steps off rho.
template <int shift>
inline void split_any(V theta, I& pbits, I& rho) {
  constexpr int32_t steps = shift ? 128 : 32768, half = shift ? 128 : 0;
  I x = _mm512_castps_si512(theta);
  const M neg = _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512());
  I mag = _mm512_and_si512(x, vi(0x7FFFFFFF));
  M nan = _mm512_cmpgt_epi32_mask(mag, vi(0x7F800000));
  // f2bf: x + 0x7FFF, + 1 where the kept part is odd, cut to 16 bits (t: that magnitude as fp32 bits)
  I rounded = _mm512_add_epi32(x, vi(0x7FFF));
  rounded = _mm512_mask_add_epi32(rounded, _mm512_test_epi32_mask(x, vi(0x10000)), rounded, vi(1));
  I pb = _mm512_srli_epi32(rounded, 16);
  I t = _mm512_and_si512(rounded, vi(0x7FFF0000));
  I r = _mm512_srai_epi32(_mm512_add_epi32(_mm512_sub_epi32(mag, t), vi(half)), shift);
  r = _mm512_mask_sub_epi32(r, neg, _mm512_setzero_si512(), r);  // toward theta's sign: rho's value
  // a theta that rounds to inf stays inf (rho 0, below), as in the reference: no step up from it
  M up = _mm512_mask_cmpge_epi32_mask(~nan & _mm512_cmplt_epi32_mask(t, vi(0x7F800000)), r, vi(steps));
  r = _mm512_mask_sub_epi32(r, up, r, vi(2 * steps));
  pb = _mm512_mask_add_epi32(pb, up, pb, _mm512_mask_blend_epi32(neg, vi(1), vi(-1)));
  M special = _mm512_cmpge_epi32_mask(_mm512_and_si512(pb, vi(0x7FFF)), vi(0x7F80)) | nan;  // inf, NaN: rho 0
  // split_bf16's clamp to [-steps, steps - 1] is not needed: rounding to nearest leaves |mag - t| <= 2^15,
  // so r is in [-steps, steps] before the step up and in [-steps, steps - 1] after it
  rho = _mm512_mask_mov_epi32(r, special, _mm512_setzero_si512());
  pbits = _mm512_mask_mov_epi32(pb, nan, vi(0xFFFF));
}

// A group's 32 values as its two vectors, loaded and stored together: a bf16 group widened by two word permutes
// (each value into the high half of its lane, the low half zeroed) instead of a widening and a shift per vector,
// and a narrowing store of both vectors' low bytes (codes, int8 rho) or low or high words (bf16 bits, int16
// rho) by one byte or word permute and one store instead of a narrowing instruction and a store per vector. The
// permutes keep exactly the bytes and words that _mm512_cvtepi32_epi8 / _epi16 keep (truncation).
using M32 = __mmask32;
constexpr M32 ALL32 = ~M32(0);
inline M32 pair_mask(const M k[2]) { return M32(k[0]) | M32(k[1]) << 16; }

template <class T, int N, class F>
constexpr std::array<T, N> index_table(F f) {
  std::array<T, N> a{};
  for (int i = 0; i < N; ++i) a[i] = T(f(i));
  return a;
}
// word i of the widened vectors: word i / 2 (first vector) or 16 + i / 2 (second), in the odd words only
alignas(64) inline constexpr auto WIDEN_LO = index_table<uint16_t, 32>([](int i) { return i / 2; });
alignas(64) inline constexpr auto WIDEN_HI = index_table<uint16_t, 32>([](int i) { return 16 + i / 2; });
// word i of a narrowed pair: the low (2 i) or high (2 i + 1) word of lane i of a (i < 16) or of b (bit 5 set)
alignas(64) inline constexpr auto LOW_WORDS = index_table<uint16_t, 32>([](int i) { return 2 * i; });
alignas(64) inline constexpr auto HIGH_WORDS = index_table<uint16_t, 32>([](int i) { return 2 * i + 1; });
// byte i (of the low 32): byte 0 or 1 of lane i of a (i < 16) or of b (bit 6 set)
alignas(64) inline constexpr std::array<uint8_t, 64> BYTES[2] = {
    index_table<uint8_t, 64>([](int i) { return 4 * (i % 32); }),
    index_table<uint8_t, 64>([](int i) { return 4 * (i % 32) + 1; })};

inline I table(const void* t) { return _mm512_load_si512(t); }

inline I ld_words(const void* p, M32 k) {
  return k == ALL32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(k, p);
}
inline void widen_bf16(I x, V out[2]) {
  out[0] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, table(WIDEN_LO.data()), x));
  out[1] = _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, table(WIDEN_HI.data()), x));
}
template <int byte = 0>
inline void st8x2(void* p, M32 k, I a, I b) {
#ifdef __AVX512VBMI__
  const __m256i y = _mm512_castsi512_si256(_mm512_permutex2var_epi8(a, table(BYTES[byte].data()), b));
  if (k == ALL32) _mm256_storeu_si256(static_cast<__m256i*>(p), y);
  else _mm256_mask_storeu_epi8(p, k, y);
#else
  st8(p, M(k), _mm512_srli_epi32(a, 8 * byte));
  st8(static_cast<int8_t*>(p) + 16, M(k >> 16), _mm512_srli_epi32(b, 8 * byte));
#endif
}
template <bool high>
inline void st16x2(void* p, M32 k, I a, I b) {
  const I y = _mm512_permutex2var_epi16(a, table(high ? HIGH_WORDS.data() : LOW_WORDS.data()), b);
  if (k == ALL32) _mm512_storeu_si512(p, y);
  else _mm512_mask_storeu_epi16(p, k, y);
}

// The common case of each, in fewer operations. merge: a finite, non-zero parameter's bits move by
// rho << shift toward its sign, which is ((t ^ s) + d) ^ s with s its sign spread over the lane (for s = -1
// that is t - d).
// Lanes with a zero, infinite or NaN parameter take merge_any (``rare``: the caller's test).
template <int shift>
inline V merge(I t, I r, bool rare) {
  if (rare) return merge_any<shift>(t, r);
  const I d = _mm512_slli_epi32(r, shift);
  const M neg = _mm512_cmplt_epi32_mask(t, _mm512_setzero_si512());  // ((t ^ -1) + d) ^ -1 is t - d
  return _mm512_castsi512_ps(_mm512_mask_sub_epi32(_mm512_add_epi32(t, d), neg, t, d));
}

// split: theta's magnitude bits rounded half up to 16 + (16 - shift) bits, R = (mag + half) >> shift, are one
// integer of bf16 value and rho: split_any's rounding to bf16, its remainder and its step up leave the one
// pair with pbits * 2^(16 - shift) + rho = R and rho in [-steps, steps - 1] toward theta's sign, that is
// rho in [-steps, steps - 1] for a positive theta and in [-(steps - 1), steps] for a negative one (magnitude
// space). So pbits = (R + steps + s) >> (16 - shift), s the sign spread over the lane (-1 or 0), and rho, in
// the value's direction, is +-R modulo 2^(16 - shift): the low bits that the narrowing store keeps. Theta's
// sign bit rides along at bit 31 - shift of R and lands on the bf16 sign bit. Lanes whose magnitude comes
// within a bf16 step of the largest finite value, infinities and NaNs take split_any (both vectors of the group
// where one of them has such a lane).
//
// Neither is shifted into place: a store takes the bytes that hold them. With x theta's bits (as unsigned) and
// a = x + half, pbits = ((a >> shift) + steps + s) >> (16 - shift) = (a + (steps + s) << shift) >> 16 (the
// floors nest), the high word of x + half + steps << shift + s << shift; rho for shift 8 is +-(a >> 8) modulo
// 2^8: byte 1 of a, and for a negative theta byte 1 of 255 - a = 127 - x, since -floor(a / 256) =
// floor((255 - a) / 256) (2^32 is a multiple of 2^16, so the two's complement keeps both); for shift 0, +-x
// modulo 2^16: the low word of x or of -x. So split returns hi, whose high word is pbits, and lo, whose byte 1
// (shift 8) or low word (shift 0) is rho.
template <int shift>
inline void split_common(V theta, I& hi, I& lo) {
  const I x = _mm512_castps_si512(theta);
  const M neg = _mm512_cmplt_epi32_mask(x, _mm512_setzero_si512());  // s = -1
  if constexpr (shift == 8) {
    const I t = _mm512_add_epi32(x, vi(128 + (128 << 8)));
    hi = _mm512_mask_sub_epi32(t, neg, t, vi(1 << 8));
    lo = _mm512_mask_sub_epi32(_mm512_add_epi32(x, vi(128)), neg, vi(127), x);
  } else {
    const I t = _mm512_add_epi32(x, vi(32768));
    hi = _mm512_mask_sub_epi32(t, neg, t, vi(1));
    lo = _mm512_mask_sub_epi32(x, neg, _mm512_setzero_si512(), x);
  }
}
template <int shift>
inline void split(const V theta[2], I hi[2], I lo[2]) {
  const I twice = _mm512_max_epu32(_mm512_slli_epi32(_mm512_castps_si512(theta[0]), 1),
                                   _mm512_slli_epi32(_mm512_castps_si512(theta[1]), 1));
  const bool rare = _mm512_cmpge_epu32_mask(twice, vi(int32_t(0xFEFE0000u)));  // magnitude >= 0x7F7F0000
  for (int j = 0; j < 2; ++j) {
    if (rare) {  // split_any's pbits and rho moved to where split_common leaves them
      split_any<shift>(theta[j], hi[j], lo[j]);
      hi[j] = _mm512_slli_epi32(hi[j], 16);
      if constexpr (shift == 8) lo[j] = _mm512_slli_epi32(lo[j], 8);
    } else {
      split_common<shift>(theta[j], hi[j], lo[j]);
    }
  }
}

// The parameter layouts of this path: bf16 with int8 or int16 rho, or fp32 (gradients bf16 or fp32).
enum Param { BF16_RHO8, BF16_RHO16, FP32 };

// Loads and stores of a group's 32 values (lanes k32 of the pair, km of each vector): gradients, theta (the fp32
// master weight) and its write-back (load_theta and store_theta above), and the codes.
// Whether a group of bf16 parameters holds a value merge leaves to merge_any (+-0, inf, NaN): on each value's
// 16 bits x, ((x << 1) - 1) >= 0xFEFF (unsigned), which is ((t << 1) - 1) >= 0xFEFFFFFF on its fp32 bits t.
inline bool rare_bf16x2(I x) {
  return _mm512_cmpge_epu16_mask(_mm512_add_epi16(_mm512_slli_epi16(x, 1), _mm512_set1_epi16(-1)),
                                 _mm512_set1_epi16(int16_t(0xFEFF)));
}
inline void load_grad2(const Desc& d, int64_t i, M32 k, const M km[2], V out[2]) {
  if (d.gdt == BF16) return widen_bf16(ld_words(static_cast<const uint16_t*>(d.grad) + i, k), out);
  for (int j = 0; j < 2; ++j) out[j] = ld32(static_cast<const float*>(d.grad) + i + 16 * j, km[j]);
}
template <Param P>
inline void load_theta2(const Desc& d, int64_t i, M32 k, const M km[2], V out[2]) {
  if constexpr (P == FP32) {
    for (int j = 0; j < 2; ++j) out[j] = ld32(static_cast<const float*>(d.param) + i + 16 * j, km[j]);
  } else {
    const I x = ld_words(static_cast<const uint16_t*>(d.param) + i, k);
    const bool rare = rare_bf16x2(x);
    V t[2];
    widen_bf16(x, t);
    for (int j = 0; j < 2; ++j) {
      const I bits = _mm512_castps_si512(t[j]);
      if constexpr (P == BF16_RHO8) out[j] = merge<8>(bits, load_i8(static_cast<const int8_t*>(d.rho) + i + 16 * j, km[j]), rare);
      else out[j] = merge<0>(bits, load_i16(static_cast<const int16_t*>(d.rho) + i + 16 * j, km[j]), rare);
    }
  }
}
template <Param P>
inline void store_theta2(const Desc& d, int64_t i, M32 k, const M km[2], const V theta[2]) {
  if constexpr (P == FP32) {
    for (int j = 0; j < 2; ++j) st32(static_cast<float*>(d.param) + i + 16 * j, km[j], theta[j]);
  } else {
    I hi[2], lo[2];
    split<P == BF16_RHO8 ? 8 : 0>(theta, hi, lo);
    if constexpr (P == BF16_RHO8) st8x2<1>(static_cast<int8_t*>(d.rho) + i, k, lo[0], lo[1]);
    else st16x2<false>(static_cast<int16_t*>(d.rho) + i, k, lo[0], lo[1]);
    st16x2<true>(static_cast<uint16_t*>(d.param) + i, k, hi[0], hi[1]);
  }
}
// rint and the conversion to an integer in one instruction (round to nearest even): the codes of a group that is
// written are integers in [-127, 255], so rounding first and truncating after changes nothing
inline I code_bits(V x) { return _mm512_cvt_roundps_epi32(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline void store_codes2(void* p, int64_t i, M32 k, V a, V b) {
  st8x2(static_cast<int8_t*>(p) + i, k, code_bits(a), code_bits(b));
}

// The companded first moment's values y / (2 - |y|), y = code / 127, of a block's codes, before their groups'
// scales: looked up rather than divided where the build has AVX-512 VBMI (byte permutes), which takes one of
// the divisions per value off the divider (FlashLion and FlashSGD(W) measured faster, FlashAdam(W) the same).
// The table holds the values of the codes 0..127, computed by dequantize_signed (the fp32 operations of
// codes.EXP_AVG_TABLE); the value is odd in the code bit for bit (-c: the same product and quotient with the
// sign flipped), so the sign bit comes from the code. The table is kept as four
// byte planes of 128 bytes (two registers each), looked up 64 codes at a time (vpermi2b) and put together by
// interleaving the planes; the codes are permuted first so that the interleaving's order within 128-bit lanes
// comes out as the codes' order.
#ifdef __AVX512VBMI__
struct CompandedTable {
  I plane[4][2];
  I order;  // position 16 l + 4 k + e of the permuted codes holds code 16 k + 4 l + e
  CompandedTable() {
    alignas(64) uint8_t bytes[4][128], perm[64];
    float codes[128], values[128];
    for (int c = 0; c < 128; ++c) codes[c] = float(c);
    for (int q = 0; q < 128 / G; ++q)  // scale and factor 1: the values themselves (x * 1 is x)
      dequantize_signed(codes + q * G, 1.0f, true, 1.0f, values + q * G);
    for (int c = 0; c < 128; ++c)
      for (int b = 0; b < 4; ++b) bytes[b][c] = uint8_t(f2u(values[c]) >> (8 * b));
    for (int l = 0; l < 4; ++l)
      for (int k = 0; k < 4; ++k)
        for (int e = 0; e < 4; ++e) perm[16 * l + 4 * k + e] = uint8_t(16 * k + 4 * l + e);
    for (int b = 0; b < 4; ++b)
      for (int h = 0; h < 2; ++h) plane[b][h] = _mm512_load_si512(bytes[b] + 64 * h);
    order = _mm512_load_si512(perm);
  }
};

inline const CompandedTable& companded_table() {
  static const CompandedTable table;
  return table;
}
#endif

// y / (2 - |y|) of 64 codes from p, of which n (at most 64) are the row's (the others read as code 0), in four
// vectors of 16 in order. Inlined, as first_moment_values: g++ otherwise calls it once per 64 codes, with a
// frame and a vzeroupper around a lookup of about the same size.
__attribute__((always_inline)) inline void companded_values(const int8_t* p, int n, V out[4]) {
  const I c = n >= 64 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8((__mmask64(1) << n) - 1, p);
#ifdef __AVX512VBMI__
  // -128, never written by quantization but possible in a state loaded from elsewhere, is outside the table
  if (!_mm512_cmpeq_epi8_mask(c, _mm512_set1_epi8(-128))) {
    const CompandedTable& t = companded_table();
    const I idx = _mm512_permutexvar_epi8(t.order, c), a = _mm512_abs_epi8(idx);
    I b[4];
    for (int k = 0; k < 4; ++k) b[k] = _mm512_permutex2var_epi8(t.plane[k][0], a, t.plane[k][1]);
    b[3] = _mm512_ternarylogic_epi32(b[3], idx, _mm512_set1_epi8(char(0x80)), 0xF8);  // | the code's sign
    const I lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const I lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
    out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
    out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
    out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
    return;
  }
#endif
  for (int v = 0; v < 4; ++v) {
    V y = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm512_extracti32x4_epi32(c, v))), vf(INV127));
    out[v] = _mm512_div_ps(y, _mm512_sub_ps(vf(2.0f), vabs(y)));
  }
}

// The first moments of a block (d.mom[0]'s codes) before their scales, 16 values a vector: companded_values
// where the moments are companded, the codes as floats where they are linear
__attribute__((always_inline)) inline void first_moment_values(const Desc& d, const Block& s, bool companded, V out[B / 16]) {
  const int8_t* codes = static_cast<const int8_t*>(d.mom[0]) + s.base;
  for (int q = 0; q * G < s.n; q += 2) {
    if (companded) {
      companded_values(codes + q * G, s.n - q * G, out + 2 * q);
    } else {
      for (int v = 0; v < 4 && q * G + 16 * v < s.n; ++v) {
        const int left = s.n - q * G - 16 * v;
        out[2 * q + v] = _mm512_cvtepi32_ps(load_i8(codes + q * G + 16 * v, left >= 16 ? ALL : M((1u << left) - 1)));
      }
    }
  }
}

// factor * first moment of the 16 values of vector v of a block (dequantize_signed above), from
// first_moment_values; scale: their group's
inline V exp_avg(const V* values, int v, float scale, bool companded, float factor) {
  if (companded) return _mm512_mul_ps(values[v], vf(scale * factor));
  return _mm512_mul_ps(values[v], vf((scale * INV127) * factor));
}

// Lanes of a group's two vectors that hold values of its row (a row's last group may be partial); every lane
// in a full block (B values), known when compiling, so that its loads, stores and masking are plain ones
template <bool full = false>
inline void group_masks(const Block& s, int q, M k[2]) {
  if constexpr (full) {
    k[0] = k[1] = ALL;
    return;
  }
  const int left = s.n - q * G;
  k[0] = M(left >= 16 ? 0xFFFF : (1u << left) - 1);
  k[1] = M(left >= 32 ? 0xFFFF : (left <= 16 ? 0 : (1u << (left - 16)) - 1));
}

// Per-group values of the second half of a quantized step, for the up to B / G groups of a block, computed
// on all of them at once (one lane each) from the groups' absmaxes (their bits): quantize_signed,
// quantize_unsigned and _adam_update's values, in the same fp32 operations as the scalar code.
struct GroupValues {
  alignas(64) float sn[16], step[16], k254[16], as[16], mlift[16], mrcp[16], vlift[16], vrcp[16];
  uint32_t bad;  // bit q: group q's new moments do not fit their scales (the group is skipped)
};

inline V nonzero_or_one_bits(I bits) {  // absmax bits (no sign): 0 -> 1.0
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(bits, _mm512_testn_epi32_mask(bits, bits), vi(0x3F800000)));
}

// bf16 bits of fp32 bits (f2bf: round to nearest even), one per lane
inline I bf16_bits(I x) {
  const I odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), vi(1));
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, vi(0x7FFF)), odd), 16);
}

// The new scales of the groups kept (lanes of keep): bf16 of their absmaxes' bits
inline void store_scales(uint16_t* scales, M keep, I absmax) {
  _mm256_mask_storeu_epi16(scales, keep, _mm512_cvtepi32_epi16(bf16_bits(absmax)));
}

// The first moment's per-group values (quantize_signed's; FlashAdam(W), FlashLion and FlashSGD(W) alike) from
// am, lane q the absmax bits of group q: sn, and k254 and as (companded) or mlift and mrcp (linear), into
// out. Returns the groups (lanes) whose moment does not fit its scale: !(am <= SCALE_MAX), on the magnitudes'
// bits (a NaN's are above the bound); e: the exponent of pow2_normalizer (1 / sn = 2^(e - 127) exactly).
inline M signed_group_values(I am, bool companded, GroupValues& out, I& e) {
  V a = nonzero_or_one_bits(am);
  // pow2_normalizer(a) = 2^(127 - e), e the exponent clamped to [8, 253]
  e = _mm512_min_epi32(_mm512_max_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 23), vi(8)), vi(253));
  V sn = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_sub_epi32(vi(254), e), 23));
  _mm512_store_ps(out.sn, sn);
  if (companded) {
    _mm512_store_ps(out.k254, _mm512_mul_ps(vf(254.0f), sn));
    _mm512_store_ps(out.as, _mm512_mul_ps(a, sn));
  } else {
    V lift = _mm512_mask_mov_ps(vf(1.0f), _mm512_cmp_ps_mask(a, vf(TINY), _CMP_LT_OQ), vf(LIFT));
    _mm512_store_ps(out.mlift, lift);
    _mm512_store_ps(out.mrcp, _mm512_div_ps(vf(127.0f), _mm512_mul_ps(a, lift)));
  }
  return _mm512_cmpgt_epu32_mask(am, vi(int32_t(f2u(SCALE_MAX))));
}

// int8 codes (before rounding) of 16 values m of group q of a first moment, from its signed_group_values
inline V signed_code(V m, const GroupValues& gv, int q, bool companded) {
  if (companded)
    return _mm512_div_ps(_mm512_mul_ps(m, vf(gv.k254[q])),
                         _mm512_add_ps(vf(gv.as[q]), _mm512_mul_ps(vabs(m), vf(gv.sn[q]))));
  return _mm512_mul_ps(_mm512_mul_ps(m, vf(gv.mlift[q])), vf(gv.mrcp[q]));
}

// am, au: lane q the absmax bits of group q's first and second moment
inline void group_values(I am, I au, int groups, float step_size, bool companded, uint16_t* scale_m,
                         uint16_t* scale_u, GroupValues& out) {
  const M lanes = M((1u << groups) - 1);
  I e;
  // !(am <= SCALE_MAX) || !(au <= max): on the magnitudes' bits (a NaN's are above both bounds)
  M bad = signed_group_values(am, companded, out, e) |
          _mm512_cmpgt_epu32_mask(au, vi(int32_t(f2u(companded ? SQRT_SCALE_MAX : SCALE_MAX))));
  out.bad = bad & lanes;
  _mm512_store_ps(out.step, _mm512_mul_ps(vf(step_size), _mm512_castsi512_ps(_mm512_slli_epi32(e, 23))));
  V b = nonzero_or_one_bits(au);
  V lift = _mm512_mask_mov_ps(vf(1.0f), _mm512_cmp_ps_mask(b, vf(TINY), _CMP_LT_OQ), vf(LIFT));
  _mm512_store_ps(out.vlift, lift);
  _mm512_store_ps(out.vrcp, _mm512_div_ps(vf(255.0f), _mm512_mul_ps(b, lift)));
  const M keep = lanes & ~bad;
  store_scales(scale_m, keep, am);
  store_scales(scale_u, keep, au);
}

// Lane-wise max of the magnitudes' bits of a group's two vectors; its largest lane is the group's absmax bits
// (above 0x7F800000: a NaN)
inline I absmax_lanes(V a, V b) {
  return _mm512_max_epu32(_mm512_castps_si512(vabs(a)), _mm512_castps_si512(vabs(b)));
}

// x[0..15] -> one vector whose lane i is the largest (unsigned) lane of x[i]: a transposing tree of
// unpacks and 128-bit block shuffles, 45 operations where sixteen separate reductions take about 110
inline I reduce_max16(const I* x) {
  I p[8], q[4], r[2];
  for (int i = 0; i < 8; ++i)
    p[i] = _mm512_max_epu32(_mm512_unpacklo_epi32(x[2 * i], x[2 * i + 1]),
                            _mm512_unpackhi_epi32(x[2 * i], x[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    q[i] = _mm512_max_epu32(_mm512_unpacklo_epi64(p[2 * i], p[2 * i + 1]),
                            _mm512_unpackhi_epi64(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 2; ++i)
    r[i] = _mm512_max_epu32(_mm512_shuffle_i32x4(q[2 * i], q[2 * i + 1], 0x88),
                            _mm512_shuffle_i32x4(q[2 * i], q[2 * i + 1], 0xDD));
  return _mm512_max_epu32(_mm512_shuffle_i32x4(r[0], r[1], 0x88), _mm512_shuffle_i32x4(r[0], r[1], 0xDD));
}

// One block of FlashAdam(W) with 8-bit moments (Adam::block's quantized branch); the number of skipped groups.
// First every group's new moments and absmaxes, then the per-group values on all groups at once, then the
// groups' updates and codes.
template <Param P, bool decoupled, bool companded, bool full>
int64_t adam_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float eps,
                   float wd, float decay, float step_size, float ibc2) {
  const uint8_t* vc = static_cast<const uint8_t*>(d.mom[1]);
  const int groups = full ? B / G : (s.n + G - 1) / G;
  V m[B / G][2], sec[B / G][2], den[B / G][2], th[B / G][2];
  static_assert(B / G == 8, "reduce_max16 takes two moments of 8 groups");
  I amax[16];  // 0..7: the groups' first moments, 8..15: their second moments (or square roots)
  for (int q = groups; q < B / G; ++q) amax[q] = amax[8 + q] = _mm512_setzero_si512();
  V fm[B / 16];
  first_moment_values(d, s, companded, fm);
  for (int q = 0; q < groups; ++q) {
    M k[2];
    group_masks<full>(s, q, k);
    const float sm = bf16_value(d.scales[0][s.sidx + q]), sv = bf16_value(d.scales[1][s.sidx + q]);
    const int64_t i0 = s.base + int64_t(q) * G;
    const M32 k32 = full ? ALL32 : pair_mask(k);
    V gs[2], ts[2];
    load_grad2(d, i0, k32, k, gs);
    load_theta2<P>(d, i0, k32, k, ts);
    for (int j = 0; j < 2; ++j) {
      const int64_t i = i0 + 16 * j;
      V g = gs[j];
      V mj = exp_avg(fm, 2 * q + j, sm, companded, beta1);
      V cv = _mm512_cvtepi32_ps(load_u8(vc + i, k[j]));
      V vj;
      if (companded) {
        float su = sv * INV255;
        vj = _mm512_mul_ps(_mm512_mul_ps(cv, cv), vf((su * su) * beta2));
      } else {
        vj = _mm512_mul_ps(cv, vf((sv * INV255) * beta2));
      }
      V t = ts[j];
      if (decoupled) t = _mm512_mul_ps(t, vf(decay));
      else g = _mm512_add_ps(g, _mm512_mul_ps(t, vf(wd)));
      mj = _mm512_add_ps(mj, _mm512_mul_ps(g, vf(omb1)));
      vj = _mm512_add_ps(vj, _mm512_mul_ps(_mm512_mul_ps(g, g), vf(omb2)));
      if (!full) {  // a partial group's lanes past the row: zero, as the reference pads
        mj = _mm512_maskz_mov_ps(k[j], mj);
        vj = _mm512_maskz_mov_ps(k[j], vj);
      }
      V u = _mm512_sqrt_ps(vj);
      if (!companded) den[q][j] = _mm512_add_ps(_mm512_mul_ps(u, vf(ibc2)), vf(eps));
      m[q][j] = mj;
      sec[q][j] = companded ? u : vj;
      th[q][j] = t;
    }
    amax[q] = absmax_lanes(m[q][0], m[q][1]);
    amax[8 + q] = absmax_lanes(sec[q][0], sec[q][1]);
  }
  const I both = reduce_max16(amax);
  GroupValues gv;
  group_values(both, _mm512_shuffle_i32x4(both, both, 0xEE), groups, step_size, companded, d.scales[0] + s.sidx,
               d.scales[1] + s.sidx, gv);
  for (int q = 0; q < groups; ++q) {
    if (gv.bad >> q & 1) continue;  // the group keeps its old state (skip_groups)
    M k[2];
    group_masks<full>(s, q, k);
    V theta[2], code_m[2], code_u[2];
    for (int j = 0; j < 2; ++j) {
      const V mj = m[q][j];
      V x;
      if (companded) {  // |m| s, which is |m s| bit for bit, serves the flush and the companding
        const V ax = _mm512_mul_ps(vabs(mj), vf(gv.sn[q]));
        x = _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(ax, vf(UPDATE_FLUSH), _CMP_NLT_UQ), mj, vf(gv.sn[q]));
        code_m[j] = _mm512_div_ps(_mm512_mul_ps(mj, vf(gv.k254[q])), _mm512_add_ps(vf(gv.as[q]), ax));
      } else {
        x = _mm512_mul_ps(mj, vf(gv.sn[q]));
        x = _mm512_mask_mov_ps(x, _mm512_cmp_ps_mask(vabs(x), vf(UPDATE_FLUSH), _CMP_LT_OQ), vf(0.f));
        code_m[j] = signed_code(mj, gv, q, false);
      }
      const V dj = companded ? _mm512_add_ps(_mm512_mul_ps(sec[q][j], vf(ibc2)), vf(eps)) : den[q][j];
      theta[j] = _mm512_sub_ps(th[q][j], _mm512_mul_ps(_mm512_div_ps(x, dj), vf(gv.step[q])));
      V lifted = gv.vlift[q] == 1.0f ? sec[q][j] : _mm512_mul_ps(sec[q][j], vf(gv.vlift[q]));  // x * 1 is x
      code_u[j] = _mm512_mul_ps(lifted, vf(gv.vrcp[q]));
    }
    const int64_t i = s.base + int64_t(q) * G;
    const M32 k32 = full ? ALL32 : pair_mask(k);
    store_codes2(d.mom[0], i, k32, code_m[0], code_m[1]);
    store_codes2(d.mom[1], i, k32, code_u[0], code_u[1]);
    store_theta2<P>(d, i, k32, k, theta);
  }
  return __builtin_popcount(gv.bad);
}

// adam_block with its flags known when compiling
template <Param P>
int64_t adam_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float eps,
                   float wd, float decay, float step_size, float ibc2, bool decoupled, bool companded) {
  const bool full = s.n == B;
#define FLASHDIST_ADAM(D, C, F) adam_block<P, D, C, F>(d, s, beta1, beta2, omb1, omb2, eps, wd, decay, step_size, ibc2)
  if (decoupled && companded) return full ? FLASHDIST_ADAM(true, true, true) : FLASHDIST_ADAM(true, true, false);
  if (decoupled) return full ? FLASHDIST_ADAM(true, false, true) : FLASHDIST_ADAM(true, false, false);
  if (companded) return full ? FLASHDIST_ADAM(false, true, true) : FLASHDIST_ADAM(false, true, false);
  return full ? FLASHDIST_ADAM(false, false, true) : FLASHDIST_ADAM(false, false, false);
#undef FLASHDIST_ADAM
}

// The end of a block of FlashLion or FlashSGD(W) with an 8-bit moment: the new first moments m of its groups
// quantized, each group's codes, scale and parameter values (``store_param(q, k32, k)``: group q, the lanes of
// its pair and of each vector) stored, or the group left as it was (skip_groups) where its moment overflows the bf16 scale or it is in
// ``skip`` (bit q: group q). The per-group values are computed on all groups at once, as adam_block's. The
// number of groups skipped.
template <bool full, class StoreParam>
inline int64_t store_signed_block(const Desc& d, const Block& s, int groups, const V (*m)[2], const I* amax,
                                  uint32_t skip, bool companded, StoreParam store_param) {
  I all[16];
  for (int q = 0; q < 8; ++q) all[q] = q < groups ? amax[q] : _mm512_setzero_si512();
  for (int q = 8; q < 16; ++q) all[q] = _mm512_setzero_si512();
  const I am = reduce_max16(all);
  GroupValues gv;
  I e;
  const M lanes = M((1u << groups) - 1);
  const M bad = (signed_group_values(am, companded, gv, e) | M(skip)) & lanes;
  store_scales(d.scales[0] + s.sidx, lanes & ~bad, am);
  for (int q = 0; q < groups; ++q) {
    if (bad >> q & 1) continue;
    M k[2];
    group_masks<full>(s, q, k);
    const M32 k32 = full ? ALL32 : pair_mask(k);
    store_codes2(d.mom[0], s.base + int64_t(q) * G, k32, signed_code(m[q][0], gv, q, companded),
                 signed_code(m[q][1], gv, q, companded));
    store_param(q, k32, k);
  }
  return __builtin_popcount(bad);
}

// One block of FlashLion with an 8-bit moment (Lion::block's quantized branch); the number of skipped groups.
template <Param P, bool full>
int64_t lion_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float decay,
                   float lr, bool companded) {
  const int groups = full ? B / G : (s.n + G - 1) / G;
  V fm[B / 16];
  first_moment_values(d, s, companded, fm);
  V m[B / G][2], th[B / G][2];
  I amax[B / G];
  for (int q = 0; q < groups; ++q) {
    M k[2];
    group_masks<full>(s, q, k);
    const float sm = bf16_value(d.scales[0][s.sidx + q]);
    const int64_t i0 = s.base + int64_t(q) * G;
    const M32 k32 = full ? ALL32 : pair_mask(k);
    V gs[2], ts[2];
    load_grad2(d, i0, k32, k, gs);
    load_theta2<P>(d, i0, k32, k, ts);
    for (int j = 0; j < 2; ++j) {
      V g = gs[j];
      V mo = exp_avg(fm, 2 * q + j, sm, companded, 1.0f);
      V t = _mm512_mul_ps(ts[j], vf(decay));
      V c = _mm512_add_ps(_mm512_mul_ps(mo, vf(beta1)), _mm512_mul_ps(g, vf(omb1)));
      // float(c > 0) - float(c < 0): +1, -1, or +0 (zero and NaN)
      V dir = _mm512_mask_mov_ps(_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(c, vf(0.f), _CMP_GT_OQ), vf(1.0f)),
                                 _mm512_cmp_ps_mask(c, vf(0.f), _CMP_LT_OQ), vf(-1.0f));
      th[q][j] = _mm512_sub_ps(t, _mm512_mul_ps(dir, vf(lr)));
      m[q][j] = _mm512_add_ps(_mm512_mul_ps(mo, vf(beta2)), _mm512_mul_ps(g, vf(omb2)));
      if (!full) m[q][j] = _mm512_maskz_mov_ps(k[j], m[q][j]);
    }
    amax[q] = absmax_lanes(m[q][0], m[q][1]);
  }
  return store_signed_block<full>(d, s, groups, m, amax, 0, companded, [&](int q, M32 k32, const M* k) {
    store_theta2<P>(d, s.base + int64_t(q) * G, k32, k, th[q]);
  });
}

template <Param P>
int64_t lion_block(const Desc& d, const Block& s, float beta1, float beta2, float omb1, float omb2, float decay,
                   float lr, bool companded) {
  return s.n == B ? lion_block<P, true>(d, s, beta1, beta2, omb1, omb2, decay, lr, companded)
                  : lion_block<P, false>(d, s, beta1, beta2, omb1, omb2, decay, lr, companded);
}

// One block of FlashSGD(W) with an 8-bit momentum (SGD::block's quantized branch); the number of skipped
// groups. A group is also skipped where its new parameter is not finite (SGD's step has no bound).
template <Param P, bool full>
int64_t sgd_block(const Desc& d, const Block& s, float momentum_decay, float momentum_gain, float momentum,
                  float wd, float decay, float lr, bool decoupled, bool nesterov, bool companded) {
  const int groups = full ? B / G : (s.n + G - 1) / G;
  V fm[B / 16];
  first_moment_values(d, s, companded, fm);
  V m[B / G][2], theta[B / G][2];  // theta: the new parameter (fp32), or its bf16 bits and rho (as int32 lanes)
  I amax[B / G];
  uint32_t nonfinite = 0;  // bit q: group q has a new parameter that is inf or NaN
  for (int q = 0; q < groups; ++q) {
    M k[2];
    group_masks<full>(s, q, k);
    const float sm = bf16_value(d.scales[0][s.sidx + q]);
    M bad_lanes = 0;
    const int64_t i0 = s.base + int64_t(q) * G;
    const M32 k32 = full ? ALL32 : pair_mask(k);
    V gs[2], ts[2];
    load_grad2(d, i0, k32, k, gs);
    load_theta2<P>(d, i0, k32, k, ts);
    for (int j = 0; j < 2; ++j) {
      V g = gs[j];
      V t = ts[j];
      if (decoupled) t = _mm512_mul_ps(t, vf(decay));
      else g = _mm512_add_ps(g, _mm512_mul_ps(t, vf(wd)));
      V mj = _mm512_add_ps(exp_avg(fm, 2 * q + j, sm, companded, momentum_decay), _mm512_mul_ps(g, vf(momentum_gain)));
      V dir = nesterov ? _mm512_add_ps(g, _mm512_mul_ps(mj, vf(momentum))) : mj;
      ts[j] = _mm512_sub_ps(t, _mm512_mul_ps(dir, vf(lr)));
      m[q][j] = full ? mj : _mm512_maskz_mov_ps(k[j], mj);
    }
    I hi[2], lo[2];
    if constexpr (P == BF16_RHO8) split<8>(ts, hi, lo);
    else if constexpr (P == BF16_RHO16) split<0>(ts, hi, lo);
    for (int j = 0; j < 2; ++j) {
      I low;  // the new parameter's bits as stored (bf16 in the upper half of the fp32 bits)
      if constexpr (P == FP32) {
        theta[q][j] = ts[j];
        low = _mm512_castps_si512(ts[j]);
      } else {  // bf16 bits in the upper half, rho in the lower: one vector to keep per 16 values
        low = hi[j];
        const I r = P == BF16_RHO8 ? _mm512_srli_epi32(lo[j], 8) : lo[j];
        theta[q][j] = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(vi(int32_t(0xFFFF0000u)), hi[j], r, 0xCA));
      }
      bad_lanes |= _mm512_mask_cmpeq_epi32_mask(k[j], _mm512_and_si512(low, vi(0x7F800000)), vi(0x7F800000));
    }
    nonfinite |= uint32_t(bad_lanes != 0) << q;
    amax[q] = absmax_lanes(m[q][0], m[q][1]);
  }
  return store_signed_block<full>(d, s, groups, m, amax, nonfinite, companded, [&](int q, M32 k32, const M* k) {
    const int64_t i = s.base + int64_t(q) * G;
    if constexpr (P == FP32) {
      for (int j = 0; j < 2; ++j) st32(static_cast<float*>(d.param) + i + 16 * j, k[j], theta[q][j]);
    } else {
      const I x = _mm512_castps_si512(theta[q][0]), y = _mm512_castps_si512(theta[q][1]);
      if constexpr (P == BF16_RHO8) st8x2(static_cast<int8_t*>(d.rho) + i, k32, x, y);
      else st16x2<false>(static_cast<int16_t*>(d.rho) + i, k32, x, y);
      st16x2<true>(static_cast<uint16_t*>(d.param) + i, k32, x, y);  // the bf16 bits: each lane's high word
    }
  });
}

template <Param P>
int64_t sgd_block(const Desc& d, const Block& s, float momentum_decay, float momentum_gain, float momentum,
                  float wd, float decay, float lr, bool decoupled, bool nesterov, bool companded) {
  return s.n == B ? sgd_block<P, true>(d, s, momentum_decay, momentum_gain, momentum, wd, decay, lr, decoupled,
                                       nesterov, companded)
                  : sgd_block<P, false>(d, s, momentum_decay, momentum_gain, momentum, wd, decay, lr, decoupled,
                                        nesterov, companded);
}

}  // namespace simd
#endif
