// Internal helpers shared by the codec families: the common payload header, byte-length
// checks, bulk copies, error feedback and the counter-based RNG. Not part of the API.
#pragma once

#include <ATen/core/Tensor.h>

#include <bit>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::codec::detail {

static_assert(std::endian::native == std::endian::little,
              "codec payloads copy float/int arrays as host bytes; add byte swapping for big-endian hosts");

inline constexpr uint8_t kDtypeFloat32 = 1;

[[noreturn]] void fail(CodecError::Kind kind, const std::string& msg);

struct PayloadHeader {
  CodecId id = CodecId::kNone;
  std::vector<int64_t> shape;
  int64_t numel = 0;
};

// Precondition checks on an encoder's input (nebula::Error): float32, CPU, ndim and numel
// within the format's limits. Returns t contiguous.
at::Tensor check_input(const at::Tensor& t, const char* codec);

// Writes the common header: id, version, dtype, ndim, dims.
void write_header(wire::ByteWriter& w, CodecId id, at::IntArrayRef shape);

// Reads and validates the common header. `expect` is the decoding codec: another known id
// is kMismatch unless `any`. Checks expected_numel (kMismatch) when >= 0. A truncated
// header is kTruncated.
PayloadHeader read_header(wire::ByteReader& r, CodecId expect, bool any, int64_t expected_numel);

// Exactly `need` bytes must remain: fewer is kTruncated, more is kMismatch.
void expect_remaining(const wire::ByteReader& r, uint64_t need, const char* codec, const char* what);

// Runs a decoder body, turning a wire::FrameError from ByteReader (a read past the end)
// into CodecError kTruncated.
template <typename F>
auto guarded(F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const FrameError& e) {
    throw CodecError(CodecError::Kind::kTruncated, e.what());
  }
}

// Appends n bytes to buf (zero-filled) and returns a pointer to the first.
inline uint8_t* append(std::vector<uint8_t>& buf, size_t n) {
  size_t off = buf.size();
  buf.resize(off + n);
  return buf.data() + off;
}

// A new contiguous float32 tensor of `shape`, uninitialised.
at::Tensor empty_float(at::IntArrayRef shape);

// Error feedback: state.residual as a contiguous float32 tensor of t's numel (zeros on a
// fresh state), scaled by `decay` (CodecOptions::error_decay) when it is below 1. A residual
// of another numel is a caller bug (nebula::Error).
at::Tensor& residual_for(CodecState& state, const at::Tensor& t, const char* codec, double decay);

// x[i] = a[i] + b[i].
void add(const float* a, const float* b, float* x, int64_t n);
// d, or 0 when d is NaN or +-inf (d - d is NaN exactly then): error feedback never keeps a
// non-finite residual. For codecs that update the residual one element at a time.
inline float finite_or_zero(float d) { return (d - d == 0.0f) ? d : 0.0f; }
// r[i] = finite_or_zero(x[i] - y[i]).
void sub_finite(const float* x, const float* y, float* r, int64_t n);

// Counter-based RNG: a 64-bit key from (seed, counter), then 32 random bits per element
// index. Stateless, so results do not depend on threads or chunking.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}
inline uint64_t rng_key(uint64_t seed, uint64_t counter) { return splitmix64(splitmix64(seed) ^ counter); }
// Chris Wellons' "lowbias32" integer hash (bias ~0.17), applied twice with the key mixed in.
inline uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}
inline uint32_t random_bits(uint64_t key, uint32_t index) {
  return hash32(hash32(index ^ static_cast<uint32_t>(key)) + static_cast<uint32_t>(key >> 32));
}
// Uniform in [0, 1) with 24 random bits.
inline float uniform01(uint64_t key, uint32_t index) {
  return static_cast<float>(static_cast<int32_t>(random_bits(key, index) >> 8)) * 0x1p-24f;
}

inline std::string shape_str(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

}  // namespace nebula::codec::detail
