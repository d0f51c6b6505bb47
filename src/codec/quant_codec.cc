#include "codec/quant_codec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "codec/payload.h"

namespace nebula::codec {

namespace {

using detail::fail;
using Kind = CodecError::Kind;

constexpr uint32_t kFlagStochastic = 1;
constexpr int64_t kGrainValues = int64_t{1} << 15;  // values per parallel task, at least
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

// Where everything lives in a payload of `numel` values in blocks of `block`.
struct Layout {
  int bits = 8;
  int64_t numel = 0, block = 1, nblocks = 0;
  Layout(int bits_, int64_t numel_, int64_t block_)
      : bits(bits_), numel(numel_), block(block_), nblocks(numel_ == 0 ? 0 : (numel_ - 1) / block_ + 1) {}
  int64_t block_len(int64_t b) const { return std::min(block, numel - b * block); }
  int64_t block_code_bytes(int64_t len) const { return bits == 8 ? len : (len + 1) / 2; }
  int64_t code_offset(int64_t b) const { return b * block_code_bytes(block); }
  int64_t code_bytes() const {
    return nblocks == 0 ? 0 : code_offset(nblocks - 1) + block_code_bytes(block_len(nblocks - 1));
  }
  int64_t data_bytes() const { return 8 * nblocks + code_bytes(); }
};

// The (min, scale) of one block and how to quantise it. finite == false: the block holds a
// NaN or an Inf and is sent as min = scale = NaN (decodes to NaN).
struct BlockParams {
  float mn = 0, mx = 0, scale = 0, inv = 0;
  bool finite = true;
  bool slow = false;  // 1 / scale overflows a float: quantise in double
};

// One pass: min, max and whether a NaN is present. Sixteen independent lanes so that the
// compiler turns the loop into packed min/max/compare (a plain reduction would stay scalar
// without -ffast-math).
BlockParams block_params(const float* __restrict x, int64_t n, float maxq) {
  constexpr int W = 16;
  float lo[W], hi[W];
  int32_t nan[W];
  for (int k = 0; k < W; ++k) {
    lo[k] = std::numeric_limits<float>::infinity();
    hi[k] = -std::numeric_limits<float>::infinity();
    nan[k] = 0;
  }
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    for (int k = 0; k < W; ++k) {
      const float v = x[i + k];
      lo[k] = v < lo[k] ? v : lo[k];
      hi[k] = v > hi[k] ? v : hi[k];
      nan[k] |= (v != v);
    }
  }
  for (int k = 0; i + k < n; ++k) {
    const float v = x[i + k];
    lo[k] = v < lo[k] ? v : lo[k];
    hi[k] = v > hi[k] ? v : hi[k];
    nan[k] |= (v != v);
  }
  BlockParams p;
  int32_t any_nan = 0;
  p.mn = lo[0];
  p.mx = hi[0];
  for (int k = 0; k < W; ++k) {
    p.mn = std::min(p.mn, lo[k]);
    p.mx = std::max(p.mx, hi[k]);
    any_nan |= nan[k];
  }
  if (any_nan || !std::isfinite(p.mn) || !std::isfinite(p.mx)) {
    p.finite = false;
    p.mn = p.scale = kNaN;
    return p;
  }
  // In double: max - min may overflow a float, scale and 1/scale never do here.
  const double range = static_cast<double>(p.mx) - static_cast<double>(p.mn);
  p.scale = static_cast<float>(range / maxq);
  if (p.scale > 0.0f) {
    p.inv = static_cast<float>(maxq / range);
    p.slow = !std::isfinite(p.inv) || !std::isfinite(1.0f / p.scale);
  }
  return p;
}

// (GCC 12 vectorises this form; clamping first and adding 0.5 after does not.)
template <int kBits>
inline uint32_t quant_nearest(float x, float mn, float inv) {
  constexpr float maxq = (1 << kBits) - 1;
  float v = (x - mn) * inv + 0.5f;
  v = v < 0.0f ? 0.0f : v;
  v = v > maxq ? maxq : v;
  return static_cast<uint32_t>(static_cast<int32_t>(v));
}

template <int kBits>
inline uint32_t quant_stochastic(float x, float mn, float inv, float u) {
  constexpr float maxq = (1 << kBits) - 1;
  float v = (x - mn) * inv;
  v = v < 0.0f ? 0.0f : v;
  v += u;  // floor(v + u): rounds up with probability frac(v)
  v = v > maxq ? maxq : v;
  return static_cast<uint32_t>(static_cast<int32_t>(v));
}

// Codes of one block. `index0` is the global index of x[0] (the RNG's counter).
template <int kBits, bool kStochastic>
void quantize_block(const float* __restrict x, int64_t n, const BlockParams& p, uint64_t key, int64_t index0,
                    uint8_t* __restrict codes) {
  const float mn = p.mn, inv = p.inv;
  const uint32_t i0 = static_cast<uint32_t>(index0);
  if constexpr (kBits == 8) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t q;
      if constexpr (kStochastic)
        q = quant_stochastic<8>(x[i], mn, inv, detail::uniform01(key, i0 + static_cast<uint32_t>(i)));
      else
        q = quant_nearest<8>(x[i], mn, inv);
      codes[i] = static_cast<uint8_t>(q);
    }
  } else {
    const int64_t pairs = n / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      uint32_t q0, q1;
      if constexpr (kStochastic) {
        const uint32_t idx = i0 + static_cast<uint32_t>(2 * j);
        q0 = quant_stochastic<4>(x[2 * j], mn, inv, detail::uniform01(key, idx));
        q1 = quant_stochastic<4>(x[2 * j + 1], mn, inv, detail::uniform01(key, idx + 1));
      } else {
        q0 = quant_nearest<4>(x[2 * j], mn, inv);
        q1 = quant_nearest<4>(x[2 * j + 1], mn, inv);
      }
      codes[j] = static_cast<uint8_t>(q0 | (q1 << 4));
    }
    if (n % 2) {
      const int64_t i = n - 1;
      codes[pairs] = static_cast<uint8_t>(
          kStochastic ? quant_stochastic<4>(x[i], mn, inv, detail::uniform01(key, i0 + static_cast<uint32_t>(i)))
                      : quant_nearest<4>(x[i], mn, inv));
    }
  }
}

// The rare block whose scale is so small (< ~1e-39) that 1/scale overflows a float.
template <int kBits>
void quantize_block_slow(const float* x, int64_t n, const BlockParams& p, bool stochastic, uint64_t key,
                         int64_t index0, uint8_t* codes) {
  constexpr double maxq = (1 << kBits) - 1;
  for (int64_t i = 0; i < n; ++i) {
    double v = std::clamp(static_cast<double>(x[i] - p.mn) / p.scale, 0.0, maxq);
    v = stochastic ? std::min(v + detail::uniform01(key, static_cast<uint32_t>(index0 + i)), maxq) : v + 0.5;
    const auto q = static_cast<uint8_t>(static_cast<int>(v));
    if (kBits == 8)
      codes[i] = q;
    else
      codes[i / 2] = static_cast<uint8_t>(i % 2 ? codes[i / 2] | (q << 4) : q);
  }
}

template <int kBits>
void dequantize_block(const uint8_t* __restrict codes, int64_t n, float mn, float scale, float* __restrict y) {
  if constexpr (kBits == 8) {
    for (int64_t i = 0; i < n; ++i) y[i] = mn + static_cast<float>(codes[i]) * scale;
  } else {
    const int64_t pairs = n / 2;
    for (int64_t j = 0; j < pairs; ++j) {
      const uint32_t b = codes[j];
      y[2 * j] = mn + static_cast<float>(b & 15u) * scale;
      y[2 * j + 1] = mn + static_cast<float>(b >> 4) * scale;
    }
    if (n % 2) y[n - 1] = mn + static_cast<float>(codes[pairs] & 15u) * scale;
  }
}

template <int kBits>
void encode_blocks(const Layout& L, const float* x, float* residual, bool stochastic, uint64_t key, uint8_t* mins,
                   uint8_t* scales, uint8_t* codes) {
  constexpr float maxq = (1 << kBits) - 1;
  const int64_t grain = std::max<int64_t>(1, kGrainValues / L.block);
  at::parallel_for(0, L.nblocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<float> xs, dec;  // error feedback: x + residual, and its decode
    if (residual) {
      xs.resize(static_cast<size_t>(L.block));
      dec.resize(static_cast<size_t>(L.block));
    }
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * L.block, n = L.block_len(b);
      const float* src = x + start;
      if (residual) {
        detail::add(src, residual + start, xs.data(), n);
        src = xs.data();
      }
      const BlockParams p = block_params(src, n, maxq);
      std::memcpy(mins + 4 * b, &p.mn, 4);
      std::memcpy(scales + 4 * b, &p.scale, 4);
      uint8_t* c = codes + L.code_offset(b);
      if (!p.finite) {
        // Codes stay 0 (the buffer is zero-filled); the block decodes to NaN.
      } else if (p.slow) {
        quantize_block_slow<kBits>(src, n, p, stochastic, key, start, c);
      } else if (stochastic) {
        quantize_block<kBits, true>(src, n, p, key, start, c);
      } else {
        quantize_block<kBits, false>(src, n, p, key, start, c);
      }
      if (residual) {
        dequantize_block<kBits>(c, n, p.mn, p.scale, dec.data());
        detail::sub_finite(src, dec.data(), residual + start, n);
      }
    }
  });
}

template <int kBits>
void decode_blocks(const Layout& L, const uint8_t* mins, const uint8_t* scales, const uint8_t* codes, float* y) {
  const int64_t grain = std::max<int64_t>(1, kGrainValues / L.block);
  at::parallel_for(0, L.nblocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      float mn, scale;
      std::memcpy(&mn, mins + 4 * b, 4);
      std::memcpy(&scale, scales + 4 * b, 4);
      dequantize_block<kBits>(codes + L.code_offset(b), L.block_len(b), mn, scale, y + b * L.block);
    }
  });
}

}  // namespace

BlockQuantCodec::BlockQuantCodec(int bits, const CodecOptions& options) : bits_(bits), options_(options) {
  NEBULA_CHECK(bits == 8 || bits == 4, "BlockQuantCodec with ", bits, " bits");
  NEBULA_CHECK(options.block >= 1 && options.block <= (int64_t{1} << 24), "block ", options.block);
}

std::vector<uint8_t> BlockQuantCodec::encode(const at::Tensor& t_in, CodecState& state) const {
  const std::string nm = name();
  at::Tensor t = detail::check_input(t_in, nm.c_str());
  const Layout L(bits_, t.numel(), options_.block);
  float* residual = options_.error_feedback ? detail::residual_for(state, t, nm.c_str(), options_.error_decay).data_ptr<float>() : nullptr;
  const uint64_t key = detail::rng_key(options_.seed, state.rng_counter);

  wire::ByteWriter w;
  detail::write_header(w, id(), t.sizes());
  w.put_u32(static_cast<uint32_t>(options_.block));
  w.put_u32(options_.stochastic ? kFlagStochastic : 0);
  std::vector<uint8_t> out = w.take();
  uint8_t* mins = detail::append(out, static_cast<size_t>(L.data_bytes()));
  uint8_t* scales = mins + 4 * L.nblocks;
  uint8_t* codes = scales + 4 * L.nblocks;
  if (bits_ == 8)
    encode_blocks<8>(L, t.data_ptr<float>(), residual, options_.stochastic, key, mins, scales, codes);
  else
    encode_blocks<4>(L, t.data_ptr<float>(), residual, options_.stochastic, key, mins, scales, codes);
  if (options_.stochastic) ++state.rng_counter;
  ++state.steps;
  return out;
}

at::Tensor BlockQuantCodec::decode(std::span<const uint8_t> payload, int64_t expected_numel) const {
  return detail::guarded([&] {
    const std::string nm = name();
    wire::ByteReader r(payload, nm + " payload");
    detail::PayloadHeader h = detail::read_header(r, id(), false, expected_numel);
    const uint32_t block = r.u32();
    const uint32_t flags = r.u32();
    if (block == 0 || block > (uint32_t{1} << 24))
      fail(Kind::kBadHeader, str_cat(nm, " payload: block ", block, " is not in [1, 16777216]"));
    if (flags & ~kFlagStochastic) fail(Kind::kBadHeader, str_cat(nm, " payload: unknown flags 0x", std::hex, flags));
    const Layout L(bits_, h.numel, block);
    detail::expect_remaining(r, static_cast<uint64_t>(L.data_bytes()), nm.c_str(), "block mins, scales and codes");
    const uint8_t* mins = r.bytes(static_cast<size_t>(L.data_bytes())).data();
    const uint8_t* scales = mins + 4 * L.nblocks;
    const uint8_t* codes = scales + 4 * L.nblocks;
    if (bits_ == 4 && L.nblocks > 0) {
      // A block of odd length ends in a half-used byte whose high nibble must be 0 (one
      // encoding per tensor). With an even block size only the last block can be odd.
      for (int64_t b = block % 2 ? 0 : L.nblocks - 1; b < L.nblocks; ++b) {
        const int64_t len = L.block_len(b);
        if (len % 2 && (codes[L.code_offset(b) + len / 2] >> 4) != 0)
          fail(Kind::kMismatch, str_cat(nm, " payload: block ", b, " has a non-zero padding nibble"));
      }
    }
    at::Tensor y = detail::empty_float(h.shape);
    if (bits_ == 8)
      decode_blocks<8>(L, mins, scales, codes, y.data_ptr<float>());
    else
      decode_blocks<4>(L, mins, scales, codes, y.data_ptr<float>());
    return y;
  });
}

at::Tensor BlockQuantCodec::error_bound(const at::Tensor& t_in) const {
  at::Tensor t = detail::check_input(t_in, name().c_str());
  const Layout L(bits_, t.numel(), options_.block);
  at::Tensor bound = detail::empty_float(t.sizes());
  const float* x = t.data_ptr<float>();
  float* out = bound.data_ptr<float>();
  const float maxq = static_cast<float>((1 << bits_) - 1);
  const float levels = options_.stochastic ? 1.0001f : 0.5001f;
  for (int64_t b = 0; b < L.nblocks; ++b) {
    const int64_t start = b * L.block, n = L.block_len(b);
    const BlockParams p = block_params(x + start, n, maxq);
    const float big = std::max(std::fabs(p.mn), std::fabs(p.mx));
    const float e = (!p.finite || big > 1e38f) ? std::numeric_limits<float>::infinity()
                                               : p.scale * levels + big * 0x1p-21f + 0x1p-140f;
    std::fill(out + start, out + start + n, e);
  }
  return bound;
}

}  // namespace nebula::codec
