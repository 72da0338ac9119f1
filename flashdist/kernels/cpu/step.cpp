// Fused CPU steps of FlashAdam(W), FlashSGD(W), FlashLion and FlashMuon's elementwise phases: the arithmetic
// of flashdist/kernels/reference.py, operation for operation, in fp32 (reference.py is the definition; its
// docstrings and those of quant/codes.py and quant/rho.py say why each operation is what it is). Built with
// -ffp-contract=off and without -ffast-math, so every + - * / sqrt below is one IEEE round-to-nearest
// operation, as in torch's eager ops (and std::fma one fused multiply-add, as torch's lerp).
//
// Work is cut into blocks of up to 256 values of one row (8 quantization groups of 32; with fp32 moments simply
// 256 consecutive values), each computed in small fp32 arrays that the compiler vectorises; at::parallel_for
// spreads chunks of blocks, from all tensors of one call, over torch's intra-op threads.
//
// Where the build machine has AVX-512 (F, BW, VL), the quantized steps on bf16 + rho or fp32 parameters run the
// explicitly vectorised path of avx512.h instead (namespace simd): same operations in the same order, fewer
// instructions; where it has AVX2 but not AVX-512, that of avx2.h (namespace avx2, 8-lane vectors). Everything
// else (fp16 parameters, fp32 moments, other CPUs) runs the block code.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Half.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int G = 32;                    // values per quantization group (codes.GROUP)
constexpr int B = 256;                   // values per block: up to 8 groups of one row, computed together
constexpr int64_t CHUNK_BLOCKS = 8;      // blocks per unit of parallel work
constexpr int64_t SERIAL_VALUES = 1 << 16;  // calls on fewer values run on the calling thread

enum Dt : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, I16 = 4, U8 = 5 };

inline uint32_t f2u(float x) { return __builtin_bit_cast(uint32_t, x); }
inline float u2f(uint32_t u) { return __builtin_bit_cast(float, u); }
inline bool finite(float x) { return (f2u(x) & 0x7F800000u) != 0x7F800000u; }

// fp32 -> bf16 bits, round to nearest even; NaN -> 0xFFFF, what torch's vectorised conversion writes
inline uint16_t f2bf(float x) {
  uint32_t u = f2u(x);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t(0xFFFF) : uint16_t(r);
}
inline float bf16_value(uint16_t b) { return u2f(uint32_t(b) << 16); }

// fp16 <-> fp32 on L values, L a multiple of 8 (round to nearest even; F16C where the build machine has it)
inline void h2f(const uint16_t* in, float* out, int L) {
#ifdef __F16C__
  for (int i = 0; i < L; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#else
  for (int k = 0; k < L; ++k) out[k] = c10::detail::fp16_ieee_to_fp32_value(in[k]);
#endif
}
inline void f2h(const float* in, uint16_t* out, int L) {
#ifdef __F16C__
  for (int i = 0; i < L; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int k = 0; k < L; ++k) out[k] = c10::detail::fp16_ieee_from_fp32_value(in[k]);
#endif
}

template <typename T, typename Conv>
inline void get(const T* s, int n, int L, float* out, Conv conv) {
  if (n == L) { for (int k = 0; k < L; ++k) out[k] = conv(s[k]); }
  else { for (int k = 0; k < L; ++k) out[k] = k < n ? conv(s[k]) : 0.f; }
}

// Values [base, base + n) of a tensor as fp32, zero from n to L.
void load(const void* p, int dt, int64_t base, int n, int L, float* out) {
  switch (dt) {
    case F32: get(static_cast<const float*>(p) + base, n, L, out, [](float v) { return v; }); break;
    case BF16: get(static_cast<const uint16_t*>(p) + base, n, L, out, [](uint16_t v) { return bf16_value(v); }); break;
    case F16: {
      uint16_t t[B];
      const uint16_t* s = static_cast<const uint16_t*>(p) + base;
      if (n == L) { h2f(s, out, L); break; }
      for (int k = 0; k < L; ++k) t[k] = k < n ? s[k] : uint16_t(0);
      h2f(t, out, L);
      break;
    }
    case I8: get(static_cast<const int8_t*>(p) + base, n, L, out, [](int8_t v) { return float(v); }); break;
    case I16: get(static_cast<const int16_t*>(p) + base, n, L, out, [](int16_t v) { return float(v); }); break;
    case U8: get(static_cast<const uint8_t*>(p) + base, n, L, out, [](uint8_t v) { return float(v); }); break;
  }
}

template <typename T>
inline void put(T* d, int n, const bool* keep, const T* t) {
  if (keep) { for (int k = 0; k < n; ++k) d[k] = keep[k] ? t[k] : d[k]; }
  else { for (int k = 0; k < n; ++k) d[k] = t[k]; }
}

// Write x[k] for k < n where keep is null or keep[k], converting fp32 to the tensor's dtype (integer dtypes:
// truncation through int32, then the low bits, as torch converts; the values written are integers in range).
void store(void* p, int dt, int64_t base, int n, int L, const float* x, const bool* keep) {
  switch (dt) {
    case F32: put(static_cast<float*>(p) + base, n, keep, x); break;
    case BF16: {
      uint16_t t[B];
      for (int k = 0; k < L; ++k) t[k] = f2bf(x[k]);
      put(static_cast<uint16_t*>(p) + base, n, keep, t);
      break;
    }
    case F16: {
      uint16_t t[B];
      f2h(x, t, L);
      put(static_cast<uint16_t*>(p) + base, n, keep, t);
      break;
    }
    case I8: {
      int8_t t[B];
      for (int k = 0; k < L; ++k) t[k] = int8_t(int32_t(x[k]));
      put(static_cast<int8_t*>(p) + base, n, keep, t);
      break;
    }
    case I16: {
      int16_t t[B];
      for (int k = 0; k < L; ++k) t[k] = int16_t(int32_t(x[k]));
      put(static_cast<int16_t*>(p) + base, n, keep, t);
      break;
    }
    case U8: {
      uint8_t t[B];
      for (int k = 0; k < L; ++k) t[k] = uint8_t(int32_t(x[k]));
      put(static_cast<uint8_t*>(p) + base, n, keep, t);
      break;
    }
  }
}

// ---- weight splitting (quant/rho.py) ----

struct Format {
  int min_exp;        // smallest normal biased fp32 exponent of the parameter format
  float half_factor;  // 2^-(mantissa bits + 1)
  float steps;        // 2^(k-1) rho steps per h
};

inline float half_ulp(float x, const Format& f) {
  int32_t e = int32_t((f2u(x) >> 23) & 0xFF);
  e = e < f.min_exp ? f.min_exp : (e > 254 ? 254 : e);
  return u2f(uint32_t(e) << 23) * f.half_factor;
}

inline float rho_unit(float tp, bool toward_zero, const Format& f) {
  uint32_t b = f2u(tp);
  bool pow2 = ((b & 0x7FFFFFu) == 0) & (int32_t((b >> 23) & 0xFF) > f.min_exp);
  float h = half_ulp(tp, f);
  return (pow2 & toward_zero) ? h * 0.5f : h;
}

void merge(const float* tp, const float* r, float* theta, const Format& f, int L) {
  const float unit = 1.0f / f.steps;
  for (int k = 0; k < L; ++k) {
    bool tz = ((r[k] < 0.f) & (tp[k] > 0.f)) | ((r[k] > 0.f) & (tp[k] < 0.f));
    float merged = tp[k] + r[k] * (rho_unit(tp[k], tz, f) * unit);
    theta[k] = r[k] == 0.f ? tp[k] : merged;
  }
}

// err / h for a power of two h (rho.py's ``err / h``): a multiplication by the exact reciprocal, with h
// lifted by 2^24 first where it is subnormal (bf16 parameters below 2^-118); the quotient is exact either way.
inline float div_pow2(float err, float h) {
  float lift = h < 0x1p-126f ? 0x1p24f : 1.0f;
  float hl = h * lift;
  return (err * lift) * u2f((254u << 23) - f2u(hl));
}

// rho.py's _code on L values: r, and the unit h it counts in
inline void rho_code(const float* theta, const float* tp, const Format& f, int L, float* r, float* h) {
  for (int k = 0; k < L; ++k) {
    float err = theta[k] - tp[k];
    h[k] = rho_unit(tp[k], ((err < 0.f) & (tp[k] > 0.f)) | ((err > 0.f) & (tp[k] < 0.f)), f);
    float q = div_pow2(err, h[k]) * f.steps;
    float sign = std::signbit(theta[k]) ? -1.0f : 1.0f;
    r[k] = std::floor(q * sign + 0.5f) * sign;
  }
}

// theta -> (tp: the parameter value, r: rho), both fp32; tp holds theta rounded to the format on entry.
void split(const float* theta, float* tp, float* r, const Format& f, int L) {
  float h[B];
  rho_code(theta, tp, f, L, r, h);
  uint32_t any_up = 0;
  for (int k = 0; k < L; ++k) any_up |= uint32_t(r[k] >= f.steps);
  if (any_up) {  // an error that rounds to +2^(k-1): the next value up, and a negative rho
    float t2[B], r2[B];
    for (int k = 0; k < L; ++k) t2[k] = std::copysign(tp[k] + 2.0f * h[k], theta[k]);
    rho_code(theta, t2, f, L, r2, h);
    for (int k = 0; k < L; ++k) {
      bool up = r[k] >= f.steps;
      tp[k] = up ? t2[k] : tp[k];
      r[k] = up ? r2[k] : r[k];
    }
  }
  for (int k = 0; k < L; ++k) {
    float rr = finite(r[k]) ? r[k] : 0.f;
    r[k] = rr < -f.steps ? -f.steps : (rr > f.steps - 1.0f ? f.steps - 1.0f : rr);
  }
}

// bf16 parameters, on the bits. The reference's fp32 operations above are exact for bf16 (the rebuilt weight
// and the error are representable, h is a power of two), and in the bits of an fp32 magnitude one rho step
// is always 2^shift units (shift 8 for int8, 0 for int16): across a power of two, rho_unit's halving toward
// zero matches the halved spacing below it, and bf16's smallest-exponent clamp matches fp32's subnormal
// spacing. So merging adds rho << shift to the magnitude's bits, and splitting rounds the bits to bf16, takes
// the remainder rounded half away from zero in steps, and moves to the next bf16 value toward theta's side
// when that remainder is +2^(k-1), exactly as rho.py's float code does.
template <typename R>
inline void merge_bf16(const uint16_t* __restrict__ p, const R* __restrict__ rho, float* __restrict__ theta, int shift,
                       int L) {
  for (int k = 0; k < L; ++k) {
    uint32_t t = uint32_t(p[k]) << 16;
    uint32_t sign = t & 0x80000000u, mag = t & 0x7FFFFFFFu;
    int32_t d = int32_t(rho[k]) * (1 << shift);
    int32_t moved = int32_t(mag) + (sign ? -d : d);                      // a non-zero parameter: same sign
    uint32_t from_zero = (d < 0 ? 0x80000000u : 0u) | uint32_t(d < 0 ? -d : d);  // +-0 + rho * unit
    uint32_t out = mag == 0 ? from_zero : (sign | uint32_t(moved));
    out = (rho[k] == 0 || mag >= 0x7F800000u) ? t : out;                // rho 0, inf and NaN: the parameter
    theta[k] = u2f(out);
  }
}

template <typename R, int shift>
inline void split_bf16(const float* __restrict__ theta, uint16_t* __restrict__ p, R* __restrict__ rho, int L) {
  constexpr int32_t steps = shift ? 128 : 32768, half = shift ? 128 : 0;
  int32_t pbits[B], rr[B];
  for (int k = 0; k < L; ++k) {
    int32_t xi = int32_t(f2u(theta[k]));
    uint32_t x = uint32_t(xi);
    uint32_t sign = x & 0x80000000u, mag = x & 0x7FFFFFFFu;
    // f2bf on the bits: round to nearest even, NaN -> 0xFFFF
    uint32_t pb = mag > 0x7F800000u ? 0xFFFFu : (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
    int32_t t = int32_t((pb << 16) & 0x7FFFFFFFu);
    int32_t r = (int32_t(mag) - t + half) >> shift;  // toward |theta|
    // rho (in the value's direction) past its last positive code; a theta that rounds to inf stays inf (rho 0),
    // as in the reference, where the parameter is inf before any step up
    bool up = t < 0x7F800000 && (sign ? -r : r) >= steps;
    int32_t t2 = sign ? t - 0x10000 : t + 0x10000;
    int32_t r2 = (int32_t(mag) - t2 + half) >> shift;
    t = up ? t2 : t;
    r = up ? r2 : r;
    bool special = t >= 0x7F800000;  // inf (overflow) or NaN: rho 0
    r = special ? 0 : (sign ? -r : r);
    rr[k] = r < -steps ? -steps : (r > steps - 1 ? steps - 1 : r);
    pbits[k] = int32_t(mag > 0x7F800000u ? pb : (sign | uint32_t(t)) >> 16);  // NaN: as converted
  }
  for (int k = 0; k < L; ++k) {
    p[k] = uint16_t(pbits[k]);
    rho[k] = R(rr[k]);
  }
}

// ---- 8-bit codes (quant/codes.py), per group of G values ----

constexpr float INV127 = 1.0f / 127.0f;
constexpr float INV255 = 1.0f / 255.0f;
constexpr float TINY = 0x1p-64f;
constexpr float LIFT = 0x1p64f;
constexpr float UPDATE_FLUSH = 0x1p-48f;

// largest magnitude; a NaN anywhere makes it NaN (torch.amax). On the bits: for magnitudes (sign cleared)
// the integer order is the float order, and every NaN is above the infinity's bits.
inline float absmax(const float* x) {
  uint32_t a = 0;
  for (int k = 0; k < G; ++k) {
    uint32_t b = f2u(x[k]) & 0x7FFFFFFFu;
    a = b > a ? b : a;
  }
  return a > 0x7F800000u ? std::numeric_limits<float>::quiet_NaN() : u2f(a);
}

inline bool all_finite(const float* x) {
  uint32_t bad = 0;
  for (int k = 0; k < G; ++k) bad |= uint32_t((f2u(x[k]) & 0x7F800000u) == 0x7F800000u);
  return !bad;
}

inline float nonzero_or_one(float a) { return a > 0.f ? a : 1.0f; }

inline float pow2_normalizer(float a) {
  int32_t e = int32_t(f2u(a)) >> 23;
  e = e < 8 ? 8 : (e > 253 ? 253 : e);
  return u2f(uint32_t(254 - e) << 23);
}

// fp32 codes of one group, rounded to integers (torch.round: to nearest, ties to even)
inline void quantize_signed(const float* m, float a_raw, bool companded, float* code) {
  float a = nonzero_or_one(a_raw);
  if (companded) {
    float s = pow2_normalizer(a);
    float k254 = 254.0f * s, as = a * s;
    for (int k = 0; k < G; ++k) code[k] = std::rint((m[k] * k254) / (as + std::fabs(m[k]) * s));
  } else {
    float lift = a < TINY ? LIFT : 1.0f;
    float rcp = 127.0f / (a * lift);
    for (int k = 0; k < G; ++k) code[k] = std::rint((m[k] * lift) * rcp);
  }
}

inline void quantize_unsigned(const float* u, float a_raw, float* code) {
  float a = nonzero_or_one(a_raw);
  float lift = a < TINY ? LIFT : 1.0f;
  float rcp = 255.0f / (a * lift);
  for (int k = 0; k < G; ++k) code[k] = std::rint((u[k] * lift) * rcp);
}

// factor * first moment from int8 codes: the companded value y / (2 - |y|) of y = code / 127 is computed,
// not looked up: codes.EXP_AVG_TABLE is built with exactly these fp32 operations.
inline void dequantize_signed(const float* c, float scale, bool companded, float factor, float* out) {
  if (companded) {
    float mult = scale * factor;
    for (int k = 0; k < G; ++k) {
      float y = c[k] * INV127;
      out[k] = (y / (2.0f - std::fabs(y))) * mult;
    }
  } else {
    float mult = (scale * INV127) * factor;
    for (int k = 0; k < G; ++k) out[k] = c[k] * mult;
  }
}

inline void dequantize_unsigned(const float* c, float scale, bool companded, float factor, float* out) {
  float s = scale * INV255;
  if (companded) {
    float mult = (s * s) * factor;
    for (int k = 0; k < G; ++k) out[k] = (c[k] * c[k]) * mult;
  } else {
    float mult = s * factor;
    for (int k = 0; k < G; ++k) out[k] = c[k] * mult;
  }
}

// ---- one tensor of a call ----

struct Desc {
  void* param = nullptr;
  int pdt = F32;
  const void* grad = nullptr;
  int gdt = F32;
  void* rho = nullptr;  // int8 / int16, or null
  int rdt = I8;
  void* mom[2] = {nullptr, nullptr};         // codes (int8 / uint8) or fp32 moments
  uint16_t* scales[2] = {nullptr, nullptr};  // bf16 scales of quantized moments
  int64_t numel = 0, cols = 0, gpr = 0, bpr = 0, nblocks = 0;
  Format fmt{};
};

// A block: values [base, base + n) of one row (quantized) or of the flat tensor, computed over L values
// (n rounded up to whole groups; the padding is zeros, like the reference's padding of a row's last group).
struct Block {
  int64_t base;
  int n, L;
  int64_t sidx;  // scale index of the block's first group
};

inline Block block_of(const Desc& d, bool quantized, int64_t b) {
  int64_t base, sidx = 0;
  int64_t left;
  if (quantized) {
    int64_t row = b / d.bpr, col = (b % d.bpr) * B;
    base = row * d.cols + col;
    sidx = row * d.gpr + col / G;
    left = d.cols - col;
  } else {
    base = b * B;
    left = d.numel - base;
  }
  int n = int(std::min<int64_t>(B, left));
  return {base, n, (n + G - 1) / G * G, sidx};
}

// theta (the fp32 master weight) of a block
inline void load_theta(const Desc& d, const Block& s, float* theta) {
  if (d.rho && d.pdt == BF16 && s.n == s.L) {
    const uint16_t* p = static_cast<const uint16_t*>(d.param) + s.base;
    if (d.rdt == I8) merge_bf16(p, static_cast<const int8_t*>(d.rho) + s.base, theta, 8, s.L);
    else merge_bf16(p, static_cast<const int16_t*>(d.rho) + s.base, theta, 0, s.L);
  } else if (d.rho) {
    float tp[B], r[B];
    load(d.param, d.pdt, s.base, s.n, s.L, tp);
    load(d.rho, d.rdt, s.base, s.n, s.L, r);
    merge(tp, r, theta, d.fmt, s.L);
  } else {
    load(d.param, d.pdt, s.base, s.n, s.L, theta);
  }
}

// the new parameter (and rho) of a block from theta; keep: per-value write mask, or null for all
inline void store_theta(const Desc& d, const Block& s, const float* theta, const bool* keep) {
  if (d.rho && d.pdt == BF16) {
    uint16_t p[B];
    uint16_t* dst = static_cast<uint16_t*>(d.param) + s.base;
    if (d.rdt == I8) {
      int8_t r[B];
      split_bf16<int8_t, 8>(theta, p, r, s.L);
      put(static_cast<int8_t*>(d.rho) + s.base, s.n, keep, r);
    } else {
      int16_t r[B];
      split_bf16<int16_t, 0>(theta, p, r, s.L);
      put(static_cast<int16_t*>(d.rho) + s.base, s.n, keep, r);
    }
    put(dst, s.n, keep, p);
  } else if (d.rho) {
    float tp[B], r[B];
    if (d.pdt == BF16) {
      for (int k = 0; k < s.L; ++k) tp[k] = bf16_value(f2bf(theta[k]));
    } else {
      uint16_t t[B];
      f2h(theta, t, s.L);
      h2f(t, tp, s.L);
    }
    split(theta, tp, r, d.fmt, s.L);
    store(d.rho, d.rdt, s.base, s.n, s.L, r, keep);
    store(d.param, d.pdt, s.base, s.n, s.L, tp, keep);
  } else {
    store(d.param, d.pdt, s.base, s.n, s.L, theta, keep);
  }
}

// The reference computes on ungrouped tensors and pads each row's last group with zeros only where it
// groups them again (absmax, finiteness); padding values here are zeroed to match.
inline void zero_tail(float* x, const Block& s) {
  for (int k = s.n; k < s.L; ++k) x[k] = 0.f;
}

// The largest group absmaxes whose bf16 scales the next step can dequantize (codes.SCALE_MAX, SQRT_SCALE_MAX:
// fp32 0x7F7F7FFF and 0x5F7F7FFF); a NaN absmax fits neither.
constexpr float SCALE_MAX = 0x1.fefffep+127f;
constexpr float SQRT_SCALE_MAX = 0x1.fefffep+63f;

// Quantized blocks: a group is skipped where a new moment does not fit its scale (gbad[q] set by the caller),
// or, for SGD, where the new parameter is not finite (low: the parameter values, or null). Returns the number
// skipped and sets mask to a per-value keep mask (null when none is).
inline int64_t skip_groups(const Block& s, bool* gbad, const float* low, bool* keep, const bool*& mask) {
  int64_t bad = 0;
  for (int q = 0; q * G < s.L; ++q) {
    if (low) gbad[q] = gbad[q] || !all_finite(low + q * G);
    bad += gbad[q];
  }
  mask = nullptr;
  if (bad) {
    for (int q = 0; q * G < s.L; ++q)
      for (int k = 0; k < G; ++k) keep[q * G + k] = !gbad[q];
    mask = keep;
  }
  return bad;
}

// codes (int8 signed / uint8) and scales of one moment of a block; amax: each group's absmax
inline void store_codes(const Desc& d, const Block& s, int which, const float* x, const float* amax, bool is_signed,
                        bool companded, const bool* gbad, const bool* keep) {
  float code[B];
  for (int q = 0; q * G < s.L; ++q) {
    if (is_signed) quantize_signed(x + q * G, amax[q], companded, code + q * G);
    else quantize_unsigned(x + q * G, amax[q], code + q * G);
  }
  store(d.mom[which], is_signed ? I8 : U8, s.base, s.n, s.L, code, keep);
  for (int q = 0; q * G < s.L; ++q)
    if (!gbad[q]) d.scales[which][s.sidx + q] = f2bf(amax[q]);
}

// fp32-moment blocks: keep the values where x (the new last moment, or the gradient without moments) and,
// for SGD, the new parameter (low) are finite; the number of the others (padding values are 0: finite)
inline int64_t finite_values(const Block& s, const float* x, const float* low, bool* keep) {
  int64_t bad = 0;
  for (int k = 0; k < s.L; ++k) {
    keep[k] = finite(x[k]) && (!low || finite(low[k]));
    bad += !keep[k];
  }
  return bad;
}

// The new parameter as fp32 values (tp) and rho (r) of a block, before they are written (SGD checks them).
inline void make_low(const Desc& d, const Block& s, const float* theta, float* tp, float* r) {
  if (d.rho && d.pdt == BF16) {
    uint16_t p[B];
    int32_t ri[B];
    if (d.rdt == I8) split_bf16<int32_t, 8>(theta, p, ri, s.L);
    else split_bf16<int32_t, 0>(theta, p, ri, s.L);
    for (int k = 0; k < s.L; ++k) { tp[k] = bf16_value(p[k]); r[k] = float(ri[k]); }
  } else if (d.pdt == BF16) {
    for (int k = 0; k < s.L; ++k) tp[k] = bf16_value(f2bf(theta[k]));
  } else if (d.pdt == F16) {
    uint16_t t[B];
    f2h(theta, t, s.L);
    h2f(t, tp, s.L);
    if (d.rho) split(theta, tp, r, d.fmt, s.L);
  } else {
    for (int k = 0; k < s.L; ++k) tp[k] = theta[k];
  }
}

inline void write_low(const Desc& d, const Block& s, const float* tp, const float* r, const bool* keep) {
  if (d.rho) store(d.rho, d.rdt, s.base, s.n, s.L, r, keep);
  store(d.param, d.pdt, s.base, s.n, s.L, tp, keep);
}

// Load a quantized first moment times factor (int8 codes, per-group scales)
inline void load_signed(const Desc& d, const Block& s, int which, bool companded, float factor, float* out) {
  float c[B];
  load(d.mom[which], I8, s.base, s.n, s.L, c);
  for (int q = 0; q * G < s.L; ++q)
    dequantize_signed(c + q * G, bf16_value(d.scales[which][s.sidx + q]), companded, factor, out + q * G);
}

#include "avx512.h"  // namespace simd: the AVX-512 path, where the build machine has it
#include "avx2.h"    // namespace avx2: the AVX2 path, where it has AVX2 but not AVX-512

// The vectorised path of this build, if any: both namespaces have the same Param layouts and block functions.
#if defined(FLASHDIST_AVX512)
namespace vec = simd;
#define FLASHDIST_VECTOR 1
#elif defined(FLASHDIST_AVX2)
namespace vec = avx2;
#define FLASHDIST_VECTOR 1
#endif

// ---- the steps ----

struct Adam {
  float beta1, beta2, omb1, omb2, eps, wd, decay, step_size, ibc2;
  bool decoupled, companded;

  int64_t block(const Desc& d, bool quantized, int64_t bi) const {
    Block s = block_of(d, quantized, bi);
    const int L = s.L;
#ifdef FLASHDIST_VECTOR
    if (quantized && (d.gdt == BF16 || d.gdt == F32)) {
      if (d.pdt == BF16 && d.rho && d.rdt == I8)
        return vec::adam_block<vec::BF16_RHO8>(d, s, beta1, beta2, omb1, omb2, eps, wd, decay, step_size, ibc2,
                                               decoupled, companded);
      if (d.pdt == BF16 && d.rho && d.rdt == I16)
        return vec::adam_block<vec::BF16_RHO16>(d, s, beta1, beta2, omb1, omb2, eps, wd, decay, step_size, ibc2,
                                                decoupled, companded);
      if (d.pdt == F32)
        return vec::adam_block<vec::FP32>(d, s, beta1, beta2, omb1, omb2, eps, wd, decay, step_size, ibc2,
                                          decoupled, companded);
    }
#endif
    float g[B], theta[B], m[B], v[B], u[B], denom[B];
    load(d.grad, d.gdt, s.base, s.n, L, g);
    if (quantized) {
      load_signed(d, s, 0, companded, beta1, m);
      float c[B];
      load(d.mom[1], U8, s.base, s.n, L, c);
      for (int q = 0; q * G < L; ++q)
        dequantize_unsigned(c + q * G, bf16_value(d.scales[1][s.sidx + q]), companded, beta2, v + q * G);
    } else {
      load(d.mom[0], F32, s.base, s.n, L, m);
      load(d.mom[1], F32, s.base, s.n, L, v);
      for (int k = 0; k < L; ++k) { m[k] = m[k] * beta1; v[k] = v[k] * beta2; }
    }
    load_theta(d, s, theta);
    if (decoupled) { for (int k = 0; k < L; ++k) theta[k] = theta[k] * decay; }
    else { for (int k = 0; k < L; ++k) g[k] = g[k] + theta[k] * wd; }
    for (int k = 0; k < L; ++k) {
      m[k] = m[k] + g[k] * omb1;
      v[k] = v[k] + (g[k] * g[k]) * omb2;
      u[k] = std::sqrt(v[k]);
      denom[k] = u[k] * ibc2 + eps;
    }
    bool keep[B];
    if (!quantized) {
      int64_t bad = finite_values(s, v, nullptr, keep);
      for (int k = 0; k < L; ++k) theta[k] = theta[k] - (m[k] / denom[k]) * step_size;
      const bool* mask = bad ? keep : nullptr;
      store(d.mom[0], F32, s.base, s.n, L, m, mask);
      store(d.mom[1], F32, s.base, s.n, L, v, mask);
      store_theta(d, s, theta, mask);
      return bad;
    }
    if (s.n < L) { zero_tail(m, s); zero_tail(v, s); zero_tail(u, s); }
    // reference._adam_update: (m / denom) * step_size per group, m scaled by a power of two
    float am[B / G], au[B / G];
    bool gbad[B / G];
    const float* second = companded ? u : v;
    const float second_max = companded ? SQRT_SCALE_MAX : SCALE_MAX;
    for (int q = 0; q * G < L; ++q) {
      const float* mq = m + q * G;
      am[q] = absmax(mq);
      au[q] = absmax(second + q * G);
      gbad[q] = !(am[q] <= SCALE_MAX) || !(au[q] <= second_max);
      float sn = pow2_normalizer(nonzero_or_one(am[q]));
      float step = step_size * (1.0f / sn);
      for (int k = 0; k < G; ++k) {
        float x = mq[k] * sn;
        x = std::fabs(x) < UPDATE_FLUSH ? 0.f : x;
        theta[q * G + k] = theta[q * G + k] - (x / denom[q * G + k]) * step;
      }
    }
    const bool* mask;
    int64_t bad = skip_groups(s, gbad, nullptr, keep, mask);
    store_codes(d, s, 0, m, am, true, companded, gbad, mask);
    store_codes(d, s, 1, second, au, false, companded, gbad, mask);
    store_theta(d, s, theta, mask);
    return bad;
  }
};

struct SGD {
  float momentum_decay, momentum_gain, momentum, wd, decay, lr;
  bool decoupled, nesterov, has_momentum, companded;

  int64_t block(const Desc& d, bool quantized, int64_t bi) const {
    Block s = block_of(d, quantized, bi);
    const int L = s.L;
#ifdef FLASHDIST_VECTOR
    if (has_momentum && quantized && (d.gdt == BF16 || d.gdt == F32)) {
      if (d.pdt == BF16 && d.rho && d.rdt == I8)
        return vec::sgd_block<vec::BF16_RHO8>(d, s, momentum_decay, momentum_gain, momentum, wd, decay, lr,
                                              decoupled, nesterov, companded);
      if (d.pdt == BF16 && d.rho && d.rdt == I16)
        return vec::sgd_block<vec::BF16_RHO16>(d, s, momentum_decay, momentum_gain, momentum, wd, decay, lr,
                                               decoupled, nesterov, companded);
      if (d.pdt == F32)
        return vec::sgd_block<vec::FP32>(d, s, momentum_decay, momentum_gain, momentum, wd, decay, lr, decoupled,
                                         nesterov, companded);
    }
#endif
    float g[B], g_in[B], theta[B], m[B], dir[B];
    load(d.grad, d.gdt, s.base, s.n, L, g);
    for (int k = 0; k < L; ++k) g_in[k] = g[k];
    load_theta(d, s, theta);
    if (decoupled) { for (int k = 0; k < L; ++k) theta[k] = theta[k] * decay; }
    else { for (int k = 0; k < L; ++k) g[k] = g[k] + theta[k] * wd; }
    const float* step_dir = g;
    if (has_momentum) {
      if (quantized) {
        load_signed(d, s, 0, companded, momentum_decay, m);
      } else {
        load(d.mom[0], F32, s.base, s.n, L, m);
        for (int k = 0; k < L; ++k) m[k] = m[k] * momentum_decay;
      }
      for (int k = 0; k < L; ++k) m[k] = m[k] + g[k] * momentum_gain;
      if (nesterov) { for (int k = 0; k < L; ++k) dir[k] = g[k] + m[k] * momentum; step_dir = dir; }
      else step_dir = m;
    }
    for (int k = 0; k < L; ++k) theta[k] = theta[k] - step_dir[k] * lr;
    bool keep[B];
    float tp[B], r[B];
    make_low(d, s, theta, tp, r);  // SGD's step has no bound: a non-finite new parameter skips too
    if (s.n < L) zero_tail(tp, s);
    if (!(has_momentum && quantized)) {
      int64_t bad = finite_values(s, has_momentum ? m : g_in, tp, keep);
      const bool* mask = bad ? keep : nullptr;
      if (has_momentum) store(d.mom[0], F32, s.base, s.n, L, m, mask);
      write_low(d, s, tp, r, mask);
      return bad;
    }
    zero_tail(m, s);
    float am[B / G];
    bool gbad[B / G];
    for (int q = 0; q * G < L; ++q) {
      am[q] = absmax(m + q * G);
      gbad[q] = !(am[q] <= SCALE_MAX);
    }
    const bool* mask;
    int64_t bad = skip_groups(s, gbad, tp, keep, mask);
    store_codes(d, s, 0, m, am, true, companded, gbad, mask);
    write_low(d, s, tp, r, mask);
    return bad;
  }
};

struct Lion {
  float beta1, beta2, omb1, omb2, decay, lr;
  bool companded;

  int64_t block(const Desc& d, bool quantized, int64_t bi) const {
    Block s = block_of(d, quantized, bi);
    const int L = s.L;
#ifdef FLASHDIST_VECTOR
    if (quantized && (d.gdt == BF16 || d.gdt == F32)) {
      if (d.pdt == BF16 && d.rho && d.rdt == I8)
        return vec::lion_block<vec::BF16_RHO8>(d, s, beta1, beta2, omb1, omb2, decay, lr, companded);
      if (d.pdt == BF16 && d.rho && d.rdt == I16)
        return vec::lion_block<vec::BF16_RHO16>(d, s, beta1, beta2, omb1, omb2, decay, lr, companded);
      if (d.pdt == F32) return vec::lion_block<vec::FP32>(d, s, beta1, beta2, omb1, omb2, decay, lr, companded);
    }
#endif
    float g[B], theta[B], m[B];
    load(d.grad, d.gdt, s.base, s.n, L, g);
    load_theta(d, s, theta);
    if (quantized) {
      load_signed(d, s, 0, companded, 1.0f, m);
    } else {
      load(d.mom[0], F32, s.base, s.n, L, m);
      for (int k = 0; k < L; ++k) m[k] = m[k] * 1.0f;
    }
    for (int k = 0; k < L; ++k) {
      theta[k] = theta[k] * decay;
      float c = m[k] * beta1 + g[k] * omb1;
      float dir = float(c > 0.f) - float(c < 0.f);
      theta[k] = theta[k] - dir * lr;
      m[k] = m[k] * beta2 + g[k] * omb2;
    }
    bool keep[B];
    if (!quantized) {
      int64_t bad = finite_values(s, m, nullptr, keep);
      const bool* mask = bad ? keep : nullptr;
      store(d.mom[0], F32, s.base, s.n, L, m, mask);
      store_theta(d, s, theta, mask);
      return bad;
    }
    zero_tail(m, s);
    float am[B / G];
    bool gbad[B / G];
    for (int q = 0; q * G < L; ++q) {
      am[q] = absmax(m + q * G);
      gbad[q] = !(am[q] <= SCALE_MAX);
    }
    const bool* mask;
    int64_t bad = skip_groups(s, gbad, nullptr, keep, mask);
    store_codes(d, s, 0, m, am, true, companded, gbad, mask);
    store_theta(d, s, theta, mask);
    return bad;
  }
};

// Muon's elementwise phases (reference.muon_momentum_ and reference.muon_apply_), one tensor per call: the
// matrix is orthogonalized between them. torch's lerp is one fused multiply-add, std::fma here (exact).
struct MuonMomentum {
  float buf_coef, nest_coef;  // lerp coefficients: w where it is below 0.5, else w - 1 (reference.lerp_)
  bool buf_small, nesterov, nest_small, companded;

  // d.param: the update U (bf16, written); d.grad: the gradient; d.mom[0]: the codes or the fp32 buffer
  int64_t block(const Desc& d, bool quantized, int64_t bi) const {
    Block s = block_of(d, quantized, bi);
    const int L = s.L;
    float g[B], buf[B], u[B];
    load(d.grad, d.gdt, s.base, s.n, L, g);
    if (quantized) load_signed(d, s, 0, companded, 1.0f, buf);
    else load(d.mom[0], F32, s.base, s.n, L, buf);
    for (int k = 0; k < L; ++k) buf[k] = std::fma(g[k] - buf[k], buf_coef, buf_small ? buf[k] : g[k]);
    if (nesterov) {
      for (int k = 0; k < L; ++k) u[k] = std::fma(buf[k] - g[k], nest_coef, nest_small ? g[k] : buf[k]);
    } else {
      for (int k = 0; k < L; ++k) u[k] = buf[k];
    }
    store(d.param, BF16, s.base, s.n, L, u, nullptr);
    bool keep[B];
    if (!quantized) {  // a value whose new buffer is not finite keeps the stored one
      int64_t bad = finite_values(s, buf, nullptr, keep);
      store(d.mom[0], F32, s.base, s.n, L, buf, bad ? keep : nullptr);
      return 0;
    }
    zero_tail(buf, s);
    float am[B / G];
    bool gbad[B / G];
    for (int q = 0; q * G < L; ++q) {
      am[q] = absmax(buf + q * G);
      gbad[q] = !(am[q] <= SCALE_MAX);  // a group whose new buffer does not fit a scale keeps the stored one
    }
    const bool* mask;
    skip_groups(s, gbad, nullptr, keep, mask);
    store_codes(d, s, 0, buf, am, true, companded, gbad, mask);
    return 0;
  }
};

struct MuonApply {
  float decay, alpha;  // 1 - lr * weight_decay; -adjusted_lr

  // d.grad: the orthogonalized update O (bf16); values of O that are not finite leave theirs unchanged
  int64_t block(const Desc& d, bool, int64_t bi) const {
    Block s = block_of(d, false, bi);
    const int L = s.L;
    float o[B], theta[B];
    bool keep[B];
    load(d.grad, d.gdt, s.base, s.n, L, o);
    int64_t bad = finite_values(s, o, nullptr, keep);
    for (int k = 0; k < L; ++k) o[k] = keep[k] ? o[k] : 0.f;
    load_theta(d, s, theta);
    for (int k = 0; k < L; ++k) theta[k] = std::fma(o[k], alpha, theta[k] * decay);
    store_theta(d, s, theta, bad ? keep : nullptr);
    return bad;
  }
};

// ---- tensor lists -> descriptors ----

int dtype_code(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return F32;
    case at::kBFloat16: return BF16;
    case at::kHalf: return F16;
    case at::kChar: return I8;
    case at::kShort: return I16;
    case at::kByte: return U8;
    default: return -1;
  }
}

bool usable(const at::Tensor& t, int64_t numel) {
  return t.device().is_cpu() && t.layout() == at::kStrided && t.is_contiguous() && t.numel() == numel &&
         dtype_code(t) >= 0 && !t.is_conj() && !t.is_neg();
}

// Fill descriptors; false (nothing touched) where a tensor is not one the kernel handles: the caller then
// runs the eager reference.
bool describe(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
              const std::vector<std::vector<at::Tensor>>& moments, const std::vector<std::vector<at::Tensor>>& scales,
              const std::vector<at::Tensor>& rhos, const std::vector<int64_t>& cols, bool quantized,
              std::vector<Desc>& out) {
  size_t n = params.size();
  if (grads.size() != n || (!rhos.empty() && rhos.size() != n) || (quantized && cols.size() != n)) return false;
  for (auto& m : moments) if (m.size() != n) return false;
  for (auto& sc : scales) if (quantized && sc.size() != n) return false;
  out.clear();
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& p = params[i];
    Desc d;
    d.numel = p.numel();
    if (d.numel == 0) continue;
    if (!usable(p, d.numel) || !usable(grads[i], d.numel)) return false;
    d.param = p.data_ptr();
    d.pdt = dtype_code(p);
    d.grad = grads[i].data_ptr();
    d.gdt = dtype_code(grads[i]);
    if (d.pdt > F16 || d.gdt > F16) return false;
    if (!rhos.empty()) {
      const at::Tensor& r = rhos[i];
      if (!usable(r, d.numel) || d.pdt == F32) return false;
      d.rho = r.data_ptr();
      d.rdt = dtype_code(r);
      if (d.rdt != I8 && d.rdt != I16) return false;
      d.fmt = Format{d.pdt == BF16 ? 1 : 127 - 14, d.pdt == BF16 ? 0x1p-8f : 0x1p-11f,
                     d.rdt == I8 ? 128.0f : 32768.0f};
    }
    for (size_t k = 0; k < moments.size(); ++k) {
      const at::Tensor& m = moments[k][i];
      if (!usable(m, d.numel)) return false;
      int want = quantized ? (k == 0 ? I8 : U8) : F32;
      if (dtype_code(m) != want) return false;
      d.mom[k] = m.data_ptr();
    }
    if (quantized) {
      d.cols = cols[i];
      if (d.cols <= 0 || d.numel % d.cols) return false;
      d.gpr = (d.cols + G - 1) / G;
      d.bpr = (d.cols + B - 1) / B;
      d.nblocks = (d.numel / d.cols) * d.bpr;
      for (size_t k = 0; k < moments.size(); ++k) {
        const at::Tensor& sc = scales[k][i];
        if (!usable(sc, (d.numel / d.cols) * d.gpr) || sc.scalar_type() != at::kBFloat16) return false;
        d.scales[k] = static_cast<uint16_t*>(sc.data_ptr());
      }
    } else {
      d.nblocks = (d.numel + B - 1) / B;
    }
    out.push_back(d);
  }
  return true;
}

// Run op.block over every block of every tensor; the number of skipped groups (values, with fp32 moments).
template <typename Op>
int64_t run(const std::vector<Desc>& descs, bool quantized, const Op& op) {
  std::vector<std::pair<int32_t, int64_t>> chunks;  // (tensor, first block)
  int64_t values = 0;
  for (size_t i = 0; i < descs.size(); ++i) {
    values += descs[i].numel;
    for (int64_t b = 0; b < descs[i].nblocks; b += CHUNK_BLOCKS) chunks.emplace_back(int32_t(i), b);
  }
  std::atomic<int64_t> skipped{0};
  auto body = [&](int64_t begin, int64_t end) {
    int64_t local = 0;
    for (int64_t c = begin; c < end; ++c) {
      const Desc& d = descs[chunks[c].first];
      int64_t b1 = std::min(d.nblocks, chunks[c].second + CHUNK_BLOCKS);
      for (int64_t b = chunks[c].second; b < b1; ++b) local += op.block(d, quantized, b);
    }
    skipped += local;
  };
  int64_t n = int64_t(chunks.size());
  if (values < SERIAL_VALUES) body(0, n);
  else at::parallel_for(0, n, 1, body);
  return skipped.load();
}

// Written through raw pointers: bump the version counters as torch's in-place ops do, so that autograd still
// notices a tensor saved for backward that a step changed.
void bump(std::initializer_list<const std::vector<at::Tensor>*> lists) {
  for (auto* l : lists)
    for (auto& t : *l) torch::autograd::impl::bump_version(t);
}

// The three entry points: -1 when the tensors are not ones this kernel handles (nothing was changed), else
// the number of skipped groups.
int64_t adam_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                  std::vector<at::Tensor> exp_avg_sqs, std::vector<at::Tensor> exp_avg_scales,
                  std::vector<at::Tensor> exp_avg_sq_scales, std::vector<at::Tensor> rhos, std::vector<int64_t> cols,
                  bool quantized, double beta1, double beta2, double omb1, double omb2, double eps, double wd,
                  double decay, double step_size, double ibc2, bool decoupled, bool companded) {
  std::vector<Desc> descs;
  if (!describe(params, grads, {exp_avgs, exp_avg_sqs}, {exp_avg_scales, exp_avg_sq_scales}, rhos, cols, quantized,
                descs))
    return -1;
  Adam op{float(beta1), float(beta2), float(omb1), float(omb2), float(eps), float(wd), float(decay),
          float(step_size), float(ibc2), decoupled, companded};
  int64_t skipped = run(descs, quantized, op);
  bump({&params, &exp_avgs, &exp_avg_sqs, &exp_avg_scales, &exp_avg_sq_scales, &rhos});
  return skipped;
}

int64_t sgd_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> buffers,
                 std::vector<at::Tensor> buffer_scales, std::vector<at::Tensor> rhos, std::vector<int64_t> cols,
                 bool has_momentum, bool quantized, double momentum_decay, double momentum_gain, double momentum,
                 double wd, double decay, double lr, bool decoupled, bool nesterov, bool companded) {
  std::vector<Desc> descs;
  std::vector<std::vector<at::Tensor>> moments, scales;
  if (has_momentum) { moments.push_back(buffers); scales.push_back(buffer_scales); }
  if (!describe(params, grads, moments, scales, rhos, cols, has_momentum && quantized, descs)) return -1;
  SGD op{float(momentum_decay), float(momentum_gain), float(momentum), float(wd), float(decay), float(lr),
         decoupled, nesterov, has_momentum, companded};
  int64_t skipped = run(descs, has_momentum && quantized, op);
  bump({&params, &buffers, &buffer_scales, &rhos});
  return skipped;
}

int64_t lion_step(std::vector<at::Tensor> params, std::vector<at::Tensor> grads, std::vector<at::Tensor> exp_avgs,
                  std::vector<at::Tensor> exp_avg_scales, std::vector<at::Tensor> rhos, std::vector<int64_t> cols,
                  bool quantized, double beta1, double beta2, double omb1, double omb2, double decay, double lr,
                  bool companded) {
  std::vector<Desc> descs;
  if (!describe(params, grads, {exp_avgs}, {exp_avg_scales}, rhos, cols, quantized, descs)) return -1;
  Lion op{float(beta1), float(beta2), float(omb1), float(omb2), float(decay), float(lr), companded};
  int64_t skipped = run(descs, quantized, op);
  bump({&params, &exp_avgs, &exp_avg_scales, &rhos});
  return skipped;
}

// Muon's phase 1 on one tensor: false when the tensors are not ones this kernel handles (nothing changed)
bool muon_momentum(at::Tensor update, at::Tensor grad, at::Tensor buffer, at::Tensor scales, int64_t cols,
                   bool quantized, double buf_coef, double nest_coef, bool buf_small, bool nesterov, bool nest_small,
                   bool companded) {
  std::vector<Desc> descs;
  std::vector<at::Tensor> updates{update}, grads{grad}, buffers{buffer}, buffer_scales;
  std::vector<std::vector<at::Tensor>> scale_lists;
  std::vector<int64_t> col_list;
  if (quantized) {
    buffer_scales.push_back(scales);
    scale_lists.push_back(buffer_scales);
    col_list.push_back(cols);
  }
  if (!describe(updates, grads, {buffers}, scale_lists, {}, col_list, quantized, descs)) return false;
  if (!descs.empty() && descs[0].pdt != BF16) return false;
  MuonMomentum op{float(buf_coef), float(nest_coef), buf_small, nesterov, nest_small, companded};
  run(descs, quantized, op);
  bump({&updates, &buffers, &buffer_scales});
  return true;
}

// Muon's phase 3 on one tensor: -1 when the tensors are not ones this kernel handles (nothing changed), else
// the number of values left unchanged (not finite in O)
int64_t muon_apply(at::Tensor param, at::Tensor ortho, std::vector<at::Tensor> rhos, double decay, double alpha) {
  std::vector<Desc> descs;
  std::vector<at::Tensor> params{param}, orthos{ortho};
  if (!describe(params, orthos, {}, {}, rhos, {}, false, descs)) return -1;
  MuonApply op{float(decay), float(alpha)};
  int64_t skipped = run(descs, false, op);
  bump({&params, &rhos});
  return skipped;
}

// The instruction set of the explicitly vectorised paths this build has ("" where the block code runs alone).
std::string vector_isa() {
#if defined(FLASHDIST_AVX512)
  return "avx512";
#elif defined(FLASHDIST_AVX2)
  return "avx2";
#else
  return "";
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("vector_isa", &vector_isa, "instruction set of the explicitly vectorised paths, or an empty string");
  m.def("adam_step", &adam_step, "fused FlashAdam(W) step (see flashdist.kernels.cpu)");
  m.def("sgd_step", &sgd_step, "fused FlashSGD(W) step (see flashdist.kernels.cpu)");
  m.def("lion_step", &lion_step, "fused FlashLion step (see flashdist.kernels.cpu)");
  m.def("muon_momentum", &muon_momentum, "FlashMuon's momentum phase on one tensor (see flashdist.kernels.cpu)");
  m.def("muon_apply", &muon_apply, "FlashMuon's weight update on one tensor (see flashdist.kernels.cpu)");
}
