// Fused CPU steps of FlashAdam(W), FlashSGD(W) and FlashLion: the arithmetic of flashdist/kernels/reference.py,
// operation for operation, in fp32 (reference.py is the definition; its docstrings and those of quant/codes.py
// and quant/rho.py say why each operation is what it is). Built with -ffp-contract=off and without
// -ffast-math, so every + - * / sqrt below is one IEEE round-to-nearest operation, as in torch's eager ops.
//
// Work is cut into groups of 32 values (a quantization group: 32 values of one row; with fp32 moments simply
// 32 consecutive values), each computed in small fp32 arrays that the compiler vectorises; at::parallel_for
// spreads chunks of groups, from all tensors of one call, over torch's intra-op threads.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#ifdef __F16C__
#include <immintrin.h>
#endif

namespace {

constexpr int G = 32;                  // values per group (codes.GROUP)
constexpr int64_t CHUNK_GROUPS = 64;   // groups per unit of parallel work
constexpr int64_t SERIAL_CHUNKS = 16;  // calls with fewer chunks than this run on the calling thread

enum Dt : int { F32 = 0, BF16 = 1, F16 = 2, I8 = 3, I16 = 4, U8 = 5 };

inline uint32_t f2u(float x) { uint32_t u; std::memcpy(&u, &x, 4); return u; }
inline float u2f(uint32_t u) { float x; std::memcpy(&x, &u, 4); return x; }
inline bool finite(float x) { return (f2u(x) & 0x7F800000u) != 0x7F800000u; }

// fp32 -> bf16 bits, round to nearest even; NaN -> 0xFFFF, what torch's vectorised conversion writes
inline uint16_t f2bf(float x) {
  uint32_t u = f2u(x);
  uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return x != x ? uint16_t(0xFFFF) : uint16_t(r);
}

// fp16 <-> fp32 on 32 values (round to nearest even; F16C where the build machine has it)
inline void h2f32(const uint16_t* in, float* out) {
#ifdef __F16C__
  for (int i = 0; i < G; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i))));
#else
  for (int k = 0; k < G; ++k) out[k] = c10::detail::fp16_ieee_to_fp32_value(in[k]);
#endif
}
inline void f2h32(const float* in, uint16_t* out) {
#ifdef __F16C__
  for (int i = 0; i < G; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  for (int k = 0; k < G; ++k) out[k] = c10::detail::fp16_ieee_from_fp32_value(in[k]);
#endif
}

// Values [base, base + n) of a tensor as fp32, zero past n.
void load(const void* p, int dt, int64_t base, int n, float* out) {
  switch (dt) {
    case F32: {
      const float* s = static_cast<const float*>(p) + base;
      if (n == G) { for (int k = 0; k < G; ++k) out[k] = s[k]; }
      else { for (int k = 0; k < G; ++k) out[k] = k < n ? s[k] : 0.f; }
      break;
    }
    case BF16: {
      const uint16_t* s = static_cast<const uint16_t*>(p) + base;
      if (n == G) { for (int k = 0; k < G; ++k) out[k] = u2f(uint32_t(s[k]) << 16); }
      else { for (int k = 0; k < G; ++k) out[k] = k < n ? u2f(uint32_t(s[k]) << 16) : 0.f; }
      break;
    }
    case F16: {
      const uint16_t* s = static_cast<const uint16_t*>(p) + base;
      uint16_t t[G] = {};
      std::memcpy(t, s, sizeof(uint16_t) * n);
      h2f32(t, out);
      break;
    }
    case I8: {
      const int8_t* s = static_cast<const int8_t*>(p) + base;
      if (n == G) { for (int k = 0; k < G; ++k) out[k] = float(s[k]); }
      else { for (int k = 0; k < G; ++k) out[k] = k < n ? float(s[k]) : 0.f; }
      break;
    }
    case I16: {
      const int16_t* s = static_cast<const int16_t*>(p) + base;
      if (n == G) { for (int k = 0; k < G; ++k) out[k] = float(s[k]); }
      else { for (int k = 0; k < G; ++k) out[k] = k < n ? float(s[k]) : 0.f; }
      break;
    }
    case U8: {
      const uint8_t* s = static_cast<const uint8_t*>(p) + base;
      if (n == G) { for (int k = 0; k < G; ++k) out[k] = float(s[k]); }
      else { for (int k = 0; k < G; ++k) out[k] = k < n ? float(s[k]) : 0.f; }
      break;
    }
  }
}

// Write x[k] for k < n where keep is null or keep[k], converting fp32 to the tensor's dtype (integer dtypes:
// truncation through int32, then the low bits, as torch converts; the values written are integers in range).
void store(void* p, int dt, int64_t base, int n, const float* x, const bool* keep) {
  auto put = [&](auto* d, auto conv) {
    d += base;
    if (!keep && n == G) { for (int k = 0; k < G; ++k) d[k] = conv(k); }
    else { for (int k = 0; k < n; ++k) if (!keep || keep[k]) d[k] = conv(k); }
  };
  switch (dt) {
    case F32: put(static_cast<float*>(p), [&](int k) { return x[k]; }); break;
    case BF16: put(static_cast<uint16_t*>(p), [&](int k) { return f2bf(x[k]); }); break;
    case F16: {
      uint16_t t[G];
      f2h32(x, t);
      put(static_cast<uint16_t*>(p), [&](int k) { return t[k]; });
      break;
    }
    case I8: put(static_cast<int8_t*>(p), [&](int k) { return int8_t(int32_t(x[k])); }); break;
    case I16: put(static_cast<int16_t*>(p), [&](int k) { return int16_t(int32_t(x[k])); }); break;
    case U8: put(static_cast<uint8_t*>(p), [&](int k) { return uint8_t(int32_t(x[k])); }); break;
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

void merge(const float* tp, const float* r, float* theta, const Format& f) {
  const float unit = 1.0f / f.steps;
  for (int k = 0; k < G; ++k) {
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

inline float rho_code(float theta, float tp, const Format& f, float& h) {
  float err = theta - tp;
  h = rho_unit(tp, ((err < 0.f) & (tp > 0.f)) | ((err > 0.f) & (tp < 0.f)), f);
  float q = div_pow2(err, h) * f.steps;
  float sign = std::signbit(theta) ? -1.0f : 1.0f;
  return std::floor(q * sign + 0.5f) * sign;
}

// theta -> (tp: the parameter value, r: rho), both fp32; tp holds theta rounded to the format on entry.
void split(const float* theta, float* tp, float* r, const Format& f) {
  for (int k = 0; k < G; ++k) {
    float h, h2;
    float rr = rho_code(theta[k], tp[k], f, h);
    bool up = rr >= f.steps;
    float t2 = std::copysign(tp[k] + 2.0f * h, theta[k]);
    float r2 = rho_code(theta[k], t2, f, h2);
    rr = up ? r2 : rr;
    tp[k] = up ? t2 : tp[k];
    rr = finite(rr) ? rr : 0.f;
    r[k] = rr < -f.steps ? -f.steps : (rr > f.steps - 1.0f ? f.steps - 1.0f : rr);
  }
}

// ---- 8-bit codes (quant/codes.py) ----

constexpr float INV127 = 1.0f / 127.0f;
constexpr float INV255 = 1.0f / 255.0f;
constexpr float TINY = 0x1p-64f;
constexpr float LIFT = 0x1p64f;
constexpr float UPDATE_FLUSH = 0x1p-48f;

inline float bf16_value(uint16_t b) { return u2f(uint32_t(b) << 16); }

// largest magnitude; a NaN anywhere makes it NaN (torch.amax)
inline float absmax(const float* x) {
  float a = 0.f;
  bool nan = false;
  for (int k = 0; k < G; ++k) {
    float v = std::fabs(x[k]);
    nan |= v != v;
    a = v > a ? v : a;
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : a;
}

inline float nonzero_or_one(float a) { return a > 0.f ? a : 1.0f; }

inline float pow2_normalizer(float a) {
  int32_t e = int32_t(f2u(a)) >> 23;
  e = e < 8 ? 8 : (e > 253 ? 253 : e);
  return u2f(uint32_t(254 - e) << 23);
}

// fp32 codes, already rounded to integers (torch.round: to nearest, ties to even)
void quantize_signed(const float* m, float a_raw, bool companded, float* code) {
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

void quantize_unsigned(const float* u, float a_raw, float* code) {
  float a = nonzero_or_one(a_raw);
  float lift = a < TINY ? LIFT : 1.0f;
  float rcp = 255.0f / (a * lift);
  for (int k = 0; k < G; ++k) code[k] = std::rint((u[k] * lift) * rcp);
}

// factor * first moment from int8 codes: the companded value y / (2 - |y|) of y = code / 127 is computed,
// not looked up: codes.EXP_AVG_TABLE is built with exactly these fp32 operations.
void dequantize_signed(const float* c, float scale, bool companded, float factor, float* out) {
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

void dequantize_unsigned(const float* c, float scale, bool companded, float factor, float* out) {
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
  void* mom[2] = {nullptr, nullptr};            // codes (int8 / uint8) or fp32 moments
  uint16_t* scales[2] = {nullptr, nullptr};     // bf16 scales of quantized moments
  int64_t numel = 0, cols = 0, gpr = 0, ngroups = 0;
  Format fmt{};
};

struct Span {  // values [base, base + n) of one group; scale index sidx
  int64_t base;
  int n;
  int64_t sidx;
};

inline Span span_of(const Desc& d, bool quantized, int64_t g) {
  if (quantized) {
    int64_t row = g / d.gpr, j = g % d.gpr;
    int64_t col = j * G;
    return {row * d.cols + col, int(std::min<int64_t>(G, d.cols - col)), g};
  }
  int64_t base = g * G;
  return {base, int(std::min<int64_t>(G, d.numel - base)), g};
}

// theta (the fp32 master weight) of a group
inline void load_theta(const Desc& d, const Span& s, float* theta) {
  if (d.rho) {
    float tp[G], r[G];
    load(d.param, d.pdt, s.base, s.n, tp);
    load(d.rho, d.rdt, s.base, s.n, r);
    merge(tp, r, theta, d.fmt);
  } else {
    load(d.param, d.pdt, s.base, s.n, theta);
  }
}

// the new parameter (and rho) of a group from theta; keep: per-value write mask, or null for all
inline void store_theta(const Desc& d, const Span& s, const float* theta, const bool* keep) {
  if (d.rho) {
    float tp[G], r[G];
    if (d.pdt == BF16) {
      for (int k = 0; k < G; ++k) tp[k] = bf16_value(f2bf(theta[k]));
    } else {
      uint16_t t[G];
      f2h32(theta, t);
      h2f32(t, tp);
    }
    split(theta, tp, r, d.fmt);
    store(d.rho, d.rdt, s.base, s.n, r, keep);
    store(d.param, d.pdt, s.base, s.n, tp, keep);
  } else {
    store(d.param, d.pdt, s.base, s.n, theta, keep);
  }
}

// The reference computes on ungrouped tensors and pads each row's last group with zeros only where it
// groups them again (absmax, finiteness); padding lanes here are zeroed to match.
inline void zero_tail(float* x, int n) {
  for (int k = n; k < G; ++k) x[k] = 0.f;
}

inline bool all_finite(const float* x) {
  bool ok = true;
  for (int k = 0; k < G; ++k) ok &= finite(x[k]);
  return ok;
}

// Store a quantized group: codes of the first moment m (int8) and, when u is given, of the second (uint8;
// u is the value to encode: sqrt(v) when companded, v otherwise), with their scales.
inline void store_codes(const Desc& d, const Span& s, int which, const float* x, float amax, bool is_signed,
                        bool companded) {
  float code[G];
  if (is_signed) quantize_signed(x, amax, companded, code);
  else quantize_unsigned(x, amax, code);
  store(d.mom[which], is_signed ? I8 : U8, s.base, s.n, code, nullptr);
  d.scales[which][s.sidx] = f2bf(amax);
}

// ---- the steps ----

struct Adam {
  float beta1, beta2, omb1, omb2, eps, wd, decay, step_size, ibc2;
  bool decoupled, companded;

  int64_t group(const Desc& d, bool quantized, int64_t gi) const {
    Span s = span_of(d, quantized, gi);
    float g[G], theta[G], m[G], v[G], u[G], denom[G];
    load(d.grad, d.gdt, s.base, s.n, g);
    if (quantized) {
      float c[G];
      load(d.mom[0], I8, s.base, s.n, c);
      dequantize_signed(c, bf16_value(d.scales[0][s.sidx]), companded, beta1, m);
      load(d.mom[1], U8, s.base, s.n, c);
      dequantize_unsigned(c, bf16_value(d.scales[1][s.sidx]), companded, beta2, v);
    } else {
      load(d.mom[0], F32, s.base, s.n, m);
      load(d.mom[1], F32, s.base, s.n, v);
      for (int k = 0; k < G; ++k) { m[k] = m[k] * beta1; v[k] = v[k] * beta2; }
    }
    load_theta(d, s, theta);
    if (decoupled) { for (int k = 0; k < G; ++k) theta[k] = theta[k] * decay; }
    else { for (int k = 0; k < G; ++k) g[k] = g[k] + theta[k] * wd; }
    for (int k = 0; k < G; ++k) {
      m[k] = m[k] + g[k] * omb1;
      v[k] = v[k] + (g[k] * g[k]) * omb2;
      u[k] = std::sqrt(v[k]);
      denom[k] = u[k] * ibc2 + eps;
    }
    if (!quantized) {
      float graw[G];
      bool keep[G];
      load(d.grad, d.gdt, s.base, s.n, graw);
      int64_t bad = 0;
      for (int k = 0; k < G; ++k) {
        keep[k] = finite(graw[k]);
        bad += (k < s.n) & !keep[k];
        theta[k] = theta[k] - (m[k] / denom[k]) * step_size;
      }
      store(d.mom[0], F32, s.base, s.n, m, keep);
      store(d.mom[1], F32, s.base, s.n, v, keep);
      store_theta(d, s, theta, keep);
      return bad;
    }
    if (s.n < G) { zero_tail(m, s.n); zero_tail(v, s.n); zero_tail(u, s.n); }
    if (!all_finite(m)) return 1;
    float am = absmax(m);
    // reference._adam_update: (m / denom) * step_size per group, m scaled by a power of two
    float sn = pow2_normalizer(nonzero_or_one(am));
    float step = step_size * (1.0f / sn);
    for (int k = 0; k < G; ++k) {
      float x = m[k] * sn;
      x = std::fabs(x) < UPDATE_FLUSH ? 0.f : x;
      theta[k] = theta[k] - (x / denom[k]) * step;
    }
    store_codes(d, s, 0, m, am, true, companded);
    const float* second = companded ? u : v;
    store_codes(d, s, 1, second, absmax(second), false, companded);
    store_theta(d, s, theta, nullptr);
    return 0;
  }
};

struct SGD {
  float momentum_decay, momentum_gain, momentum, wd, decay, lr;
  bool decoupled, nesterov, has_momentum, companded;

  int64_t group(const Desc& d, bool quantized, int64_t gi) const {
    Span s = span_of(d, quantized, gi);
    float g[G], theta[G], m[G], dir[G];
    load(d.grad, d.gdt, s.base, s.n, g);
    load_theta(d, s, theta);
    if (decoupled) { for (int k = 0; k < G; ++k) theta[k] = theta[k] * decay; }
    else { for (int k = 0; k < G; ++k) g[k] = g[k] + theta[k] * wd; }
    if (has_momentum) {
      if (quantized) {
        float c[G];
        load(d.mom[0], I8, s.base, s.n, c);
        dequantize_signed(c, bf16_value(d.scales[0][s.sidx]), companded, momentum_decay, m);
      } else {
        load(d.mom[0], F32, s.base, s.n, m);
        for (int k = 0; k < G; ++k) m[k] = m[k] * momentum_decay;
      }
      for (int k = 0; k < G; ++k) m[k] = m[k] + g[k] * momentum_gain;
      if (nesterov) { for (int k = 0; k < G; ++k) dir[k] = g[k] + m[k] * momentum; }
      else { for (int k = 0; k < G; ++k) dir[k] = m[k]; }
    } else {
      for (int k = 0; k < G; ++k) dir[k] = g[k];
    }
    for (int k = 0; k < G; ++k) theta[k] = theta[k] - dir[k] * lr;
    if (!(has_momentum && quantized)) {
      float graw[G];
      bool keep[G];
      load(d.grad, d.gdt, s.base, s.n, graw);
      int64_t bad = 0;
      for (int k = 0; k < G; ++k) { keep[k] = finite(graw[k]); bad += (k < s.n) & !keep[k]; }
      if (has_momentum) store(d.mom[0], F32, s.base, s.n, m, keep);
      store_theta(d, s, theta, keep);
      return bad;
    }
    zero_tail(m, s.n);
    if (!all_finite(m)) return 1;
    store_codes(d, s, 0, m, absmax(m), true, companded);
    store_theta(d, s, theta, nullptr);
    return 0;
  }
};

struct Lion {
  float beta1, beta2, omb1, omb2, decay, lr;
  bool companded;

  int64_t group(const Desc& d, bool quantized, int64_t gi) const {
    Span s = span_of(d, quantized, gi);
    float g[G], theta[G], m[G];
    load(d.grad, d.gdt, s.base, s.n, g);
    load_theta(d, s, theta);
    if (quantized) {
      float c[G];
      load(d.mom[0], I8, s.base, s.n, c);
      dequantize_signed(c, bf16_value(d.scales[0][s.sidx]), companded, 1.0f, m);
    } else {
      load(d.mom[0], F32, s.base, s.n, m);
      for (int k = 0; k < G; ++k) m[k] = m[k] * 1.0f;
    }
    for (int k = 0; k < G; ++k) {
      theta[k] = theta[k] * decay;
      float c = m[k] * beta1 + g[k] * omb1;
      float dir = float(c > 0.f) - float(c < 0.f);
      theta[k] = theta[k] - dir * lr;
      m[k] = m[k] * beta2 + g[k] * omb2;
    }
    if (!quantized) {
      float graw[G];
      bool keep[G];
      load(d.grad, d.gdt, s.base, s.n, graw);
      int64_t bad = 0;
      for (int k = 0; k < G; ++k) { keep[k] = finite(graw[k]); bad += (k < s.n) & !keep[k]; }
      store(d.mom[0], F32, s.base, s.n, m, keep);
      store_theta(d, s, theta, keep);
      return bad;
    }
    zero_tail(m, s.n);
    if (!all_finite(m)) return 1;
    store_codes(d, s, 0, m, absmax(m), true, companded);
    store_theta(d, s, theta, nullptr);
    return 0;
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
      d.ngroups = (d.numel / d.cols) * d.gpr;
      for (size_t k = 0; k < moments.size(); ++k) {
        const at::Tensor& sc = scales[k][i];
        if (!usable(sc, d.ngroups) || sc.scalar_type() != at::kBFloat16) return false;
        d.scales[k] = static_cast<uint16_t*>(sc.data_ptr());
      }
    } else {
      d.ngroups = (d.numel + G - 1) / G;
    }
    out.push_back(d);
  }
  return true;
}

// Run op.group over every group of every tensor; the number of skipped groups (values, with fp32 moments).
template <typename Op>
int64_t run(const std::vector<Desc>& descs, bool quantized, const Op& op) {
  std::vector<std::pair<int32_t, int64_t>> chunks;  // (tensor, first group)
  for (size_t i = 0; i < descs.size(); ++i)
    for (int64_t g = 0; g < descs[i].ngroups; g += CHUNK_GROUPS) chunks.emplace_back(int32_t(i), g);
  std::atomic<int64_t> skipped{0};
  auto body = [&](int64_t begin, int64_t end) {
    int64_t local = 0;
    for (int64_t c = begin; c < end; ++c) {
      const Desc& d = descs[chunks[c].first];
      int64_t g1 = std::min(d.ngroups, chunks[c].second + CHUNK_GROUPS);
      for (int64_t g = chunks[c].second; g < g1; ++g) local += op.group(d, quantized, g);
    }
    skipped += local;
  };
  int64_t n = int64_t(chunks.size());
  if (n < SERIAL_CHUNKS) body(0, n);
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

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("adam_step", &adam_step, "fused FlashAdam(W) step (see flashdist.kernels.cpu)");
  m.def("sgd_step", &sgd_step, "fused FlashSGD(W) step (see flashdist.kernels.cpu)");
  m.def("lion_step", &lion_step, "fused FlashLion step (see flashdist.kernels.cpu)");
}
