#include "codec/cast_codec.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>

#include "codec/payload.h"

namespace nebula::codec {

namespace {

constexpr int64_t kGrain = int64_t{1} << 16;

// float32 <-> IEEE binary16, round to nearest even, branch-free so that the loops below
// vectorise (the algorithm of Maratyszcza's FP16 library, as in c10/util/Half.h).
inline uint16_t f32_to_f16(float f) {
  const float scale_to_inf = 0x1.0p+112f;
  const float scale_to_zero = 0x1.0p-110f;
  float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
  const uint32_t w = std::bit_cast<uint32_t>(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  base = std::bit_cast<float>((bias >> 1) + 0x07800000u) + base;
  const uint32_t bits = std::bit_cast<uint32_t>(base);
  const uint32_t nonsign = ((bits >> 13) & 0x00007C00u) + (bits & 0x00000FFFu);
  // Masks rather than ?: so that GCC 12 if-converts and vectorises the loops.
  const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);
  return static_cast<uint16_t>((sign >> 16) | (nan & 0x7E00u) | (~nan & nonsign));
}

inline float f16_to_f32(uint16_t h) {
  const uint32_t w = uint32_t{h} << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normalized = std::bit_cast<float>((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float denormalized = std::bit_cast<float>((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t denormal = 0u - static_cast<uint32_t>(two_w < (1u << 27));
  return std::bit_cast<float>(sign | (denormal & std::bit_cast<uint32_t>(denormalized)) |
                              (~denormal & std::bit_cast<uint32_t>(normalized)));
}

// float32 -> bfloat16, round to nearest even; NaN stays a (quiet) NaN.
inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = std::bit_cast<uint32_t>(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const uint32_t nan = (u >> 16) | 0x0040u;
  return static_cast<uint16_t>((u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded);
}

inline float bf16_to_f32(uint16_t h) { return std::bit_cast<float>(uint32_t{h} << 16); }

void encode_f16(const float* __restrict x, uint8_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h = f32_to_f16(x[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

void decode_f16(const uint8_t* __restrict in, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    y[i] = f16_to_f32(h);
  }
}

void encode_bf16(const float* __restrict x, uint8_t* __restrict out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h = f32_to_bf16(x[i]);
    std::memcpy(out + 2 * i, &h, 2);
  }
}

void decode_bf16(const uint8_t* __restrict in, float* __restrict y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint16_t h;
    std::memcpy(&h, in + 2 * i, 2);
    y[i] = bf16_to_f32(h);
  }
}

size_t value_bytes(CodecId id) { return id == CodecId::kNone ? 4 : 2; }

}  // namespace

CastCodec::CastCodec(CodecId id) : id_(id) {
  NEBULA_CHECK(id == CodecId::kNone || id == CodecId::kFp16 || id == CodecId::kBf16, "CastCodec for ",
               codec_name(id));
}

std::vector<uint8_t> CastCodec::encode(const at::Tensor& t_in, CodecState& state) const {
  const std::string nm = name();
  at::Tensor t = detail::check_input(t_in, nm.c_str());
  const int64_t n = t.numel();
  wire::ByteWriter w;
  detail::write_header(w, id_, t.sizes());
  std::vector<uint8_t> out = w.take();
  uint8_t* dst = detail::append(out, static_cast<size_t>(n) * value_bytes(id_));
  const float* x = t.data_ptr<float>();
  at::parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    switch (id_) {
      case CodecId::kNone: std::memcpy(dst + 4 * b, x + b, static_cast<size_t>(e - b) * 4); break;
      case CodecId::kFp16: encode_f16(x + b, dst + 2 * b, e - b); break;
      default: encode_bf16(x + b, dst + 2 * b, e - b); break;
    }
  });
  ++state.steps;
  return out;
}

at::Tensor CastCodec::decode(std::span<const uint8_t> payload, int64_t expected_numel) const {
  return detail::guarded([&] {
    const std::string nm = name();
    wire::ByteReader r(payload, nm + " payload");
    detail::PayloadHeader h = detail::read_header(r, id_, false, expected_numel);
    const uint64_t bytes = static_cast<uint64_t>(h.numel) * value_bytes(id_);
    detail::expect_remaining(r, bytes, nm.c_str(), "values");
    const uint8_t* src = r.bytes(bytes).data();
    at::Tensor y = detail::empty_float(h.shape);
    float* out = y.data_ptr<float>();
    at::parallel_for(0, h.numel, kGrain, [&](int64_t b, int64_t e) {
      switch (id_) {
        case CodecId::kNone: std::memcpy(out + b, src + 4 * b, static_cast<size_t>(e - b) * 4); break;
        case CodecId::kFp16: decode_f16(src + 2 * b, out + b, e - b); break;
        default: decode_bf16(src + 2 * b, out + b, e - b); break;
      }
    });
    return y;
  });
}

at::Tensor CastCodec::error_bound(const at::Tensor& t_in) const {
  at::Tensor t = detail::check_input(t_in, name().c_str());
  at::Tensor bound = detail::empty_float(t.sizes());
  const float* x = t.data_ptr<float>();
  float* b = bound.data_ptr<float>();
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < t.numel(); ++i) {
    const float a = std::fabs(x[i]);
    if (!std::isfinite(a)) {
      b[i] = inf;
    } else if (id_ == CodecId::kNone) {
      b[i] = 0.0f;
    } else if (id_ == CodecId::kFp16) {
      b[i] = a >= 65520.0f ? inf : a * 0x1p-11f + 0x1p-25f;
    } else {
      // Above the midpoint between bfloat16's largest value and 2^128, RNE gives inf.
      b[i] = a >= std::bit_cast<float>(0x7F7F8000u) ? inf : a * 0x1p-8f + 0x1p-134f;
    }
  }
  return bound;
}

}  // namespace nebula::codec
