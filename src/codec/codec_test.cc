#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "codec/codec.h"
#include "codec/powersgd_codec.h"
#include "codec/sparseloco_codec.h"
#include "codec/topk_codec.h"
#include "wire/frame.h"

namespace nebula::codec {
namespace {

using Kind = CodecError::Kind;
using Bytes = std::vector<uint8_t>;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

struct Case {
  std::string label;
  CodecOptions options;
};

CodecOptions opts(std::string kind) {
  CodecOptions o;
  o.kind = std::move(kind);
  return o;
}

CodecOptions sparseloco(int64_t chunk, double density) {
  CodecOptions o = opts("sparseloco");
  o.block = chunk;
  o.density = density;
  return o;
}

constexpr const char* kAllKinds[] = {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd", "sparseloco"};

// Every codec, plus the variants with their own code paths.
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* k : kAllKinds) cases.push_back({k, opts(k)});
  for (const char* k : {"int8", "int4"}) {
    CodecOptions o = opts(k);
    o.stochastic = true;
    cases.push_back({std::string(k) + "_stochastic", o});
    o = opts(k);
    o.block = 7;  // odd, and not dividing the sizes below
    cases.push_back({std::string(k) + "_block7", o});
  }
  // sparseloco: chunks of 7 (3-bit indices, one value kept per chunk), SparseLoCo's chunks
  // of 4096 keeping 1/64, and a density above 1/32 (the per-value selection path).
  cases.push_back({"sparseloco_chunk7", sparseloco(7, 0.01)});
  cases.push_back({"sparseloco_4096", sparseloco(4096, 1.0 / 64)});
  cases.push_back({"sparseloco_dense", sparseloco(256, 0.3)});
  for (CodecOptions o : {sparseloco(7, 0.01), sparseloco(4096, 1.0 / 64), sparseloco(256, 0.3)}) {
    o.indices = "rice";  // the same cases with Rice-coded indices
    cases.push_back({"sparseloco_rice_" + std::to_string(o.block), o});
    o.value_bits = 1;  // and with 1-bit values, Rice-coded and fixed
    cases.push_back({"sparseloco_rice_1bit_" + std::to_string(o.block), o});
    o.indices = "fixed";
    cases.push_back({"sparseloco_1bit_" + std::to_string(o.block), o});
  }
  return cases;
}

at::Tensor randn(at::IntArrayRef shape, uint64_t seed, double scale = 1.0) {
  at::manual_seed(seed);
  return at::randn(shape, at::kFloat) * scale;
}

// max_i (|a_i - b_i| - bound_i); <= 0 means within the bound. NaN-free inputs only.
double excess(const at::Tensor& decoded, const at::Tensor& t, const at::Tensor& bound) {
  if (t.numel() == 0) return 0;
  return ((decoded - t).abs() - bound).max().item<double>();
}

Bytes encode_fresh(const Codec& c, const at::Tensor& t) {
  CodecState s;
  return c.encode(t, s);
}

template <typename F>
Kind codec_error_kind(F&& f) {
  try {
    f();
  } catch (const CodecError& e) {
    return e.kind();
  }
  ADD_FAILURE() << "no CodecError thrown";
  return Kind::kBadHeader;
}

#define EXPECT_CODEC_ERROR(kind, expr) EXPECT_EQ(codec_error_kind([&] { (void)(expr); }), kind) << #expr

Bytes cut(const Bytes& p, size_t len) { return Bytes(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(len)); }

// ---------------------------------------------------------------------------------------
// Round trips

// sparseloco: in each chunk exactly the k largest |x| (ties to lower indices) decode
// non-zero, with x's sign and one of at most two levels; each level is the mean of the |x|
// it stands for, and every |x| of the low level is below every |x| of the high one.
void check_sparseloco(const CodecOptions& o, const float* x, const float* y, int64_t n) {
  std::vector<int64_t> order;
  std::vector<char> keep;
  for (int64_t start = 0; start < n; start += o.block) {
    const int64_t len = std::min(o.block, n - start), k = sparseloco_count(len, o.density);
    order.resize(static_cast<size_t>(len));
    std::iota(order.begin(), order.end(), start);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
    keep.assign(static_cast<size_t>(len), 0);
    for (int64_t j = 0; j < k; ++j) keep[static_cast<size_t>(order[static_cast<size_t>(j)] - start)] = 1;
    std::vector<float> levels;
    for (int64_t i = start; i < start + len; ++i) {
      if (!keep[static_cast<size_t>(i - start)]) {
        ASSERT_EQ(std::bit_cast<uint32_t>(y[i]), 0u) << "element " << i << " is not kept but decodes to " << y[i];
        continue;
      }
      ASSERT_EQ(std::signbit(y[i]), std::signbit(x[i])) << "element " << i;
      if (std::find(levels.begin(), levels.end(), std::fabs(y[i])) == levels.end()) levels.push_back(std::fabs(y[i]));
    }
    ASSERT_GE(levels.size(), 1u);
    ASSERT_LE(levels.size(), 2u) << "chunk at " << start;
    std::sort(levels.begin(), levels.end());
    double sum[2] = {0, 0}, lo_max = 0, hi_min = kInf;
    int64_t count[2] = {0, 0};
    for (int64_t i = start; i < start + len; ++i) {
      if (!keep[static_cast<size_t>(i - start)]) continue;
      const int g = std::fabs(y[i]) == levels.back() ? 1 : 0;
      sum[g] += std::fabs(x[i]);
      ++count[g];
      if (g == 0) lo_max = std::max<double>(lo_max, std::fabs(x[i]));
      if (g == 1) hi_min = std::min<double>(hi_min, std::fabs(x[i]));
    }
    ASSERT_EQ(count[0] + count[1], k);
    if (levels.size() == 2) {
      EXPECT_NEAR(sum[0] / count[0], levels[0], 1e-6 * levels[0]) << "chunk at " << start;
      EXPECT_LT(lo_max, hi_min) << "chunk at " << start;
    }
    EXPECT_NEAR(sum[1] / count[1], levels.back(), 1e-6 * levels.back()) << "chunk at " << start;
  }
}

// The bound each codec promises, checked independently of Codec::error_bound.
void check_promise(const Case& c, const at::Tensor& t, const at::Tensor& d) {
  const std::string& kind = c.options.kind;
  const int64_t n = t.numel();
  const at::Tensor tf = t.contiguous().flatten(), df = d.contiguous().flatten();
  const float* x = tf.data_ptr<float>();
  const float* y = df.data_ptr<float>();
  if (kind == "none") {
    EXPECT_TRUE(at::equal(tf, df));
  } else if (kind == "fp16") {
    for (int64_t i = 0; i < n; ++i) ASSERT_LE(std::fabs(y[i] - x[i]), std::ldexp(std::fabs(x[i]), -11) + 0x1p-25f) << i;
  } else if (kind == "bf16") {
    for (int64_t i = 0; i < n; ++i) ASSERT_LE(std::fabs(y[i] - x[i]), std::ldexp(std::fabs(x[i]), -8) + 0x1p-134f) << i;
  } else if (kind == "int8" || kind == "int4") {
    const float maxq = kind == "int8" ? 255.0f : 15.0f;
    const int64_t block = c.options.block;
    for (int64_t b0 = 0; b0 < n; b0 += block) {
      const int64_t b1 = std::min(n, b0 + block);
      float lo = x[b0], hi = x[b0];
      for (int64_t i = b0; i < b1; ++i) lo = std::min(lo, x[i]), hi = std::max(hi, x[i]);
      const float scale = (hi - lo) / maxq;
      const float allowed =
          (c.options.stochastic ? scale : scale / 2) * 1.001f + 1e-6f * std::max(std::fabs(lo), std::fabs(hi));
      for (int64_t i = b0; i < b1; ++i) ASSERT_LE(std::fabs(y[i] - x[i]), allowed) << "element " << i;
    }
  } else if (kind == "topk") {
    const int64_t k = topk_count(n, c.options.density);
    if (n == 0) return;
    const at::Tensor idx = std::get<1>(at::topk(tf.abs(), k));
    at::Tensor keep = at::zeros({n}, at::kBool);
    keep.index_put_({idx}, true);
    EXPECT_TRUE(at::equal(df.masked_select(keep), tf.masked_select(keep)));
    EXPECT_EQ(df.masked_select(keep.logical_not()).abs().sum().item<float>(), 0.0f);
  } else if (kind == "powersgd") {
    if (!powersgd_low_rank(t.sizes(), c.options.rank)) {
      EXPECT_TRUE(at::equal(tf, df));
    }
  } else if (kind == "sparseloco") {
    check_sparseloco(c.options, x, y, n);
  }
}

TEST(CodecRoundTrip, EverySizeWithinPromisedBound) {
  for (const Case& c : all_cases()) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{1'000'003}}) {
      SCOPED_TRACE(c.label + " numel " + std::to_string(n));
      auto codec = make_codec(c.options);
      const at::Tensor t = randn({n}, 7 + n, 3.0);
      CodecState state;
      const Bytes p = codec->encode(t, state);
      EXPECT_EQ(state.steps, 1u);
      EXPECT_EQ(payload_codec(p), codec->id());
      const at::Tensor d = codec->decode(p, n);
      ASSERT_EQ(d.sizes(), t.sizes());
      ASSERT_EQ(d.scalar_type(), at::kFloat);
      EXPECT_LE(excess(d, t, codec->error_bound(t)), 0.0);
      check_promise(c, t, d);
      EXPECT_TRUE(at::equal(decode_any(p), d));
      // A fresh residual is zero, so error feedback does not change the first payload.
      CodecOptions no_ef = c.options;
      no_ef.error_feedback = false;
      EXPECT_EQ(encode_fresh(*make_codec(no_ef), t), p);
    }
  }
}

TEST(CodecRoundTrip, PayloadSizes) {
  const int64_t n = 1'000'003;
  const at::Tensor t = randn({n}, 1);
  const size_t header = 4 + 8;
  EXPECT_EQ(encode_fresh(*make_codec(opts("none")), t).size(), header + 4 * n);
  EXPECT_EQ(encode_fresh(*make_codec(opts("fp16")), t).size(), header + 2 * n);
  EXPECT_EQ(encode_fresh(*make_codec(opts("bf16")), t).size(), header + 2 * n);
  const int64_t nb = (n + 255) / 256;
  EXPECT_EQ(encode_fresh(*make_codec(opts("int8")), t).size(), header + 8 + 8 * nb + n);
  EXPECT_EQ(encode_fresh(*make_codec(opts("int4")), t).size(), header + 8 + 8 * nb + (n + 1) / 2);
  EXPECT_EQ(encode_fresh(*make_codec(opts("topk")), t).size(), header + 8 + 8 * topk_count(n, 0.01));
  EXPECT_EQ(topk_count(n, 0.01), 10001);
  EXPECT_EQ(topk_count(0, 0.01), 0);
  EXPECT_EQ(topk_count(7, 0.01), 1);
  EXPECT_EQ(topk_count(7, 1.0), 7);
  const at::Tensor m = randn({1000, 1000}, 2);
  EXPECT_EQ(encode_fresh(*make_codec(opts("powersgd")), m).size(), 4 + 16 + 8 + 4 * 2000 * 4);
  // sparseloco, chunks of 256 keeping 3 (the last, of 67, keeps 1): 3907 chunks, 11719
  // values of 8 + 2 bits.
  EXPECT_EQ(encode_fresh(*make_codec(opts("sparseloco")), t).size(), header + 12 + 8 * 3907 + 11719 + 2930);
  EXPECT_EQ(sparseloco_count(256, 0.01), 3);
  EXPECT_EQ(sparseloco_count(67, 0.01), 1);
  EXPECT_EQ(sparseloco_count(4096, 0.01), 41);
  EXPECT_EQ(sparseloco_count(4096, 1.0 / 64), 64);
  EXPECT_EQ(sparseloco_count(7, 1.0), 7);
  EXPECT_EQ(sparseloco_count(10, 0.25), 3);  // 2.5 rounds up
  EXPECT_EQ(sparseloco_count(0, 0.5), 0);
}

TEST(CodecRoundTrip, ShapesPreserved) {
  const std::vector<std::vector<int64_t>> shapes = {{}, {2, 3}, {4, 5, 6}, {0, 3}, {3, 0, 2}, {64, 64}, {100, 50},
                                                    {8, 16, 32}, {1000, 1000}};
  for (const Case& c : all_cases()) {
    auto codec = make_codec(c.options);
    for (const auto& shape : shapes) {
      SCOPED_TRACE(c.label + " shape " + std::to_string(shape.size()) + "-d");
      const at::Tensor t = randn(shape, 3);
      const at::Tensor d = decode_any(encode_fresh(*codec, t), t.numel());
      ASSERT_EQ(d.sizes(), t.sizes());
      EXPECT_LE(excess(d, t, codec->error_bound(t)), 0.0);
      check_promise(c, t, d);
    }
    // Non-contiguous input.
    const at::Tensor t = randn({64, 80}, 4).t();
    const at::Tensor d = codec->decode(encode_fresh(*codec, t));
    ASSERT_EQ(d.sizes(), t.sizes());
    EXPECT_LE(excess(d, t, codec->error_bound(t)), 0.0);
  }
}

TEST(CodecRoundTrip, CastsRoundToNearestEvenAndOverflowToInf) {
  auto fp16 = make_codec(opts("fp16"));
  auto bf16 = make_codec(opts("bf16"));
  // 1 + 2^-11 is halfway between fp16's 1 and 1 + 2^-10: ties to even (1).
  const at::Tensor t = at::tensor({1.0f + 0x1p-11f, 1.0f + 3 * 0x1p-11f, 65504.0f, 65519.0f, 65520.0f, -1e6f, 1e-8f,
                                   1.0f + 0x1p-8f, 3e38f},
                                  at::kFloat);
  const at::Tensor h = fp16->decode(encode_fresh(*fp16, t));
  const std::vector<float> want16 = {1.0f, 1.0f + 0x1p-9f, 65504.0f, 65504.0f, kInf, -kInf, 0.0f, 1.0f + 0x1p-8f, kInf};
  for (int i = 0; i < 9; ++i) {
    if (i == 6) {
      EXPECT_NEAR(h[i].item<float>(), 1e-8f, 0x1p-25f);  // subnormal in fp16
      continue;
    }
    EXPECT_EQ(h[i].item<float>(), want16[static_cast<size_t>(i)]) << i;
  }
  const at::Tensor b = bf16->decode(encode_fresh(*bf16, t));
  EXPECT_EQ(b[7].item<float>(), 1.0f);        // 1 + 2^-8 ties to even in bf16
  EXPECT_TRUE(std::isfinite(b[8].item<float>()));  // bf16 has float's range
  EXPECT_NEAR(b[8].item<float>(), 3e38f, 3e38f * 0x1p-8f);
}

// ---------------------------------------------------------------------------------------
// sparseloco

// The size a sparseloco payload must have: header, chunk/k/k_last, two f32 levels per
// chunk, ceil(log2(chunk))-bit indices and 2-bit codes, each stream padded to a byte.
size_t sparseloco_size(int64_t ndim, int64_t n, int64_t chunk, double density) {
  const int64_t nchunks = (n + chunk - 1) / chunk;
  const int64_t kept = n / chunk * sparseloco_count(chunk, density) + sparseloco_count(n % chunk, density);
  const auto bits = static_cast<int64_t>(std::bit_width(static_cast<uint64_t>(chunk - 1)));
  return static_cast<size_t>(4 + 8 * ndim + 12 + 8 * nchunks + (kept * bits + 7) / 8 + (kept * 2 + 7) / 8);
}

TEST(CodecSparseLoco, CompressionRatio) {
  const int64_t n = int64_t{1} << 20;
  const at::Tensor t = randn({n}, 41);
  // SparseLoCo's setting, chunks of 4096 keeping 64: 256 chunks of 64 x (12 + 2) bits plus
  // two f32 levels.
  const Bytes p = encode_fresh(*make_codec(sparseloco(4096, 1.0 / 64)), t);
  EXPECT_EQ(p.size(), 12u + 12 + 256 * 8 + 256 * 64 * 14 / 8);
  EXPECT_GT(4.0 * n / static_cast<double>(p.size()), 136.0);
  // 1% (41 per chunk of 4096).
  const Bytes q = encode_fresh(*make_codec(sparseloco(4096, 0.01)), t);
  EXPECT_EQ(q.size(), 12u + 12 + 256 * 8 + 256 * 41 * 14 / 8);
  EXPECT_GT(4.0 * n / static_cast<double>(q.size()), 205.0);
  // 1-bit values: one level per chunk and 1-bit codes.
  CodecOptions one = sparseloco(4096, 0.01);
  one.value_bits = 1;
  const Bytes r = encode_fresh(*make_codec(one), t);
  EXPECT_EQ(r.size(), 12u + 12 + 256 * 4 + 256 * 41 * 13 / 8);
  EXPECT_GT(4.0 * n / static_cast<double>(r.size()), 230.0);
  one.value_bits = 3;
  EXPECT_THROW(make_codec(one), ConfigError);
}

// Rice-coded indices (codec_indices = "rice"): the same values as fixed-width indices in
// fewer bytes. Bits per kept index measured on random data; the entropy of 64 positions out of
// 4096 is log2(C(4096, 64)) / 64 = 7.4 bits, fixed width takes 12.
TEST(CodecSparseLoco, RiceIndicesSendTheSameValuesInFewerBits) {
  const int64_t n = int64_t{1} << 20;
  const at::Tensor t = randn({n}, 41);
  for (const double density : {1.0 / 64, 0.01, 0.03}) {
    CodecOptions o = sparseloco(4096, density);
    const Bytes fixed = encode_fresh(*make_codec(o), t);
    o.indices = "rice";
    const Bytes rice = encode_fresh(*make_codec(o), t);
    EXPECT_TRUE(at::equal(decode_any(fixed), decode_any(rice))) << density;
    const int64_t kept = 256 * sparseloco_count(4096, density);
    const double header = 24, levels = 256 * 8, codes = kept * 2 / 8.0;
    const double rice_bits = (static_cast<double>(rice.size()) - header - levels - codes) * 8 / kept;
    const double fixed_bits = (static_cast<double>(fixed.size()) - header - levels - codes) * 8 / kept;
    std::printf("sparseloco %.4f of 4096: %.2f bits per kept index Rice-coded, %.2f fixed; payload %.3fx smaller\n",
                density, rice_bits, fixed_bits, static_cast<double>(fixed.size()) / static_cast<double>(rice.size()));
    EXPECT_EQ(fixed_bits, 12.0);
    EXPECT_LT(rice_bits, 9.0) << density;
  }
  // Chunks whose k is 1 (r = 12: a gap of up to 4095), all kept (r = 0), and a short last chunk.
  for (const auto& [chunk, density, numel] : {std::tuple{4096, 1e-6, 10000}, std::tuple{8, 1.0, 100},
                                              std::tuple{65536, 1e-6, 70000}, std::tuple{100, 0.05, 1234}}) {
    CodecOptions o = sparseloco(chunk, density);
    o.indices = "rice";
    const at::Tensor x = randn({numel}, 43);
    auto codec = make_codec(o);
    const Bytes p = encode_fresh(*codec, x);
    o.indices = "fixed";
    EXPECT_TRUE(at::equal(codec->decode(p), decode_any(encode_fresh(*make_codec(o), x)))) << chunk;
  }
}

// A Rice payload is checked like every other: cut anywhere, lengthened, its quotients too long,
// its coding unknown: a CodecError of the kind that says so, never a read past its end.
TEST(CodecSparseLoco, CorruptRicePayloadsAreRefused) {
  CodecOptions o = sparseloco(100, 0.05);
  o.indices = "rice";
  auto codec = make_codec(o);
  const Bytes p = encode_fresh(*codec, randn({10, 100}, 31));
  ASSERT_NO_THROW(codec->decode(p));
  for (size_t len = 0; len < p.size(); ++len) EXPECT_CODEC_ERROR(Kind::kTruncated, codec->decode(cut(p, len)));
  Bytes longer = p;
  longer.push_back(0);
  EXPECT_CODEC_ERROR(Kind::kMismatch, codec->decode(longer));
  // The chunk field (after 4 + 8 * 2 header bytes): coding bit 2 is unknown (0: Rice, 1: 1-bit values).
  Bytes bad = p;
  bad[20 + 3] = 4 | 1;
  EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(bad));
  // Every index stream byte all ones: quotients beyond the chunk, or a read past the end.
  Bytes ones = p;
  const size_t stream = 32 + 10 * 8 + (50 * 2 + 7) / 8;
  std::fill(ones.begin() + static_cast<std::ptrdiff_t>(stream), ones.end(), 0xFF);
  EXPECT_THROW(codec->decode(ones), CodecError);
  // Any single flipped bit: decoded or refused, never anything else.
  for (size_t i = 0; i < p.size(); ++i)
    for (int b = 0; b < 8; ++b) {
      Bytes flipped = p;
      flipped[i] ^= static_cast<uint8_t>(1 << b);
      try {
        codec->decode(flipped);
      } catch (const CodecError&) {
      }
    }
}

TEST(CodecSparseLoco, RoundTripAtChunkBoundaries) {
  // Chunks of 4096 (12-bit indices) and of 100 (7-bit, so the bit streams need padding);
  // work is split in groups of 8 chunks, so 8 and 9 chunks are boundaries too.
  for (const auto& [chunk, density] : {std::pair{int64_t{4096}, 1.0 / 64}, std::pair{int64_t{100}, 0.05}}) {
    const CodecOptions o = sparseloco(chunk, density);
    const Case c{"sparseloco", o};
    auto codec = make_codec(o);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{3}, chunk - 1, chunk, chunk + 1, 2 * chunk - 1,
                      2 * chunk, 8 * chunk, 8 * chunk + 1, 9 * chunk - 1, 17 * chunk + 5, int64_t{1'000'003}}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + " numel " + std::to_string(n));
      const at::Tensor t = randn({n}, 50 + n, 2.0);
      CodecState state;
      const Bytes p = codec->encode(t, state);
      EXPECT_EQ(p.size(), sparseloco_size(1, n, chunk, density));
      const at::Tensor d = codec->decode(p, n);
      ASSERT_EQ(d.sizes(), t.sizes());
      EXPECT_LE(excess(d, t, codec->error_bound(t)), 0.0);
      check_promise(c, t, d);
      EXPECT_TRUE(at::equal(decode_any(p), d));
      // Error feedback keeps exactly what was not sent.
      EXPECT_TRUE(at::equal(state.residual, t - d));
    }
  }
}

TEST(CodecSparseLoco, TiesConstantsAndZeros) {
  auto codec = make_codec(sparseloco(256, 0.01));  // k = 3; a last chunk of 44 keeps 1
  // Equal magnitudes: the lowest indices win, and one level is sent exactly.
  at::Tensor t = at::full({300}, 2.0f, at::kFloat);
  t[1] = -2.0f;
  t[299] = -2.0f;
  at::Tensor want = at::zeros({300}, at::kFloat);
  want[0] = 2.0f;
  want[1] = -2.0f;
  want[2] = 2.0f;
  want[256] = 2.0f;
  CodecState state;
  const at::Tensor d = codec->decode(codec->encode(t, state));
  EXPECT_TRUE(at::equal(d, want));
  EXPECT_TRUE(at::equal(codec->error_bound(t) > 0, want == 0));
  EXPECT_TRUE(at::equal(state.residual, t - want));
  // All zeros: zeros are kept (as +-0), nothing else changes.
  const at::Tensor z = at::zeros({512}, at::kFloat);
  EXPECT_TRUE(at::equal(codec->decode(encode_fresh(*codec, z)), z));
  EXPECT_TRUE(at::equal(codec->error_bound(z), z));
  // One value kept per chunk: sent exactly.
  auto one = make_codec(sparseloco(8, 0.05));
  const at::Tensor u = randn({64}, 3);
  const at::Tensor du = one->decode(encode_fresh(*one, u));
  EXPECT_TRUE(at::equal(du.abs().view({8, 8}).amax(1), u.abs().view({8, 8}).amax(1)));
  EXPECT_EQ(at::count_nonzero(du).item<int64_t>(), 8);
  EXPECT_TRUE(at::equal(du.masked_select(du != 0), u.masked_select(du != 0)));
}

TEST(CodecSparseLoco, SameBytesOnAnyThreadCount) {
  // Chunks are coded in parallel groups of 8 whose bit streams start on byte boundaries;
  // the payload and the residual must not depend on how the groups are spread.
  const int threads = at::get_num_threads();
  for (int64_t chunk : {int64_t{7}, int64_t{100}, int64_t{256}, int64_t{4096}}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    auto codec = make_codec(sparseloco(chunk, 0.02));
    const at::Tensor t1 = randn({1'000'003}, 60), t2 = randn({1'000'003}, 61);
    Bytes p[2];
    at::Tensor r[2];
    for (int run = 0; run < 2; ++run) {
      at::set_num_threads(run == 0 ? 1 : 4);
      CodecState s;
      codec->encode(t1, s);
      p[run] = codec->encode(t2, s);  // with a non-zero residual
      r[run] = s.residual;
    }
    at::set_num_threads(threads);
    EXPECT_EQ(p[0], p[1]);
    EXPECT_TRUE(at::equal(r[0], r[1]));
  }
}

TEST(CodecSparseLoco, NonFiniteChunksDecodeToNaNWhereKept) {
  CodecOptions o = sparseloco(8, 0.25);  // k = 2 per chunk of 8
  auto codec = make_codec(o);
  at::Tensor t = randn({32}, 70);
  float* x = t.data_ptr<float>();
  x[1] = kNaN;  // chunk 0 holds three non-finite values: NaN, then the lower-index inf
  x[2] = kInf;
  x[5] = -kInf;
  x[9] = kInf;  // chunk 1: inf and the largest finite value
  CodecState state;
  const at::Tensor d = codec->decode(codec->encode(t, state));
  const float* y = d.data_ptr<float>();
  EXPECT_TRUE(std::isnan(y[1]));
  EXPECT_TRUE(std::isnan(y[2]));
  EXPECT_EQ(y[5], 0.0f);  // beyond k: not sent
  EXPECT_TRUE(std::isnan(y[9]));
  const at::Tensor nan = at::isnan(d).view({4, 8});
  EXPECT_EQ(nan.sum(1)[0].item<int64_t>(), 2);
  EXPECT_EQ(nan.sum(1)[1].item<int64_t>(), 2);
  EXPECT_EQ(nan.slice(0, 2).sum().item<int64_t>(), 0);
  EXPECT_TRUE(at::isfinite(d.slice(0, 16)).all().item<bool>());
  // Chunks 2 and 3 are coded as if the others did not exist.
  const at::Tensor tail = t.slice(0, 16).clone();
  EXPECT_TRUE(at::equal(d.slice(0, 16), codec->decode(encode_fresh(*codec, tail))));
  // The residual stays finite: 0 where the decode is non-finite or the value was, x where a
  // finite value was not sent.
  const at::Tensor want_residual = at::where(at::isfinite(d) & at::isfinite(t), t - d, at::zeros_like(t));
  EXPECT_TRUE(at::equal(state.residual, want_residual));
  // The bound: no promise where the decode is NaN or x is not finite, |x| elsewhere in those
  // chunks.
  const at::Tensor b = codec->error_bound(t);
  EXPECT_TRUE(at::equal(at::isinf(b).slice(0, 0, 16), (at::isnan(d) | at::isfinite(t).logical_not()).slice(0, 0, 16)));
  EXPECT_TRUE(at::isfinite(b.slice(0, 16)).all().item<bool>());
}

// ---------------------------------------------------------------------------------------
// NaN / Inf

TEST(CodecNonFinite, BehavesAsDocumented) {
  at::Tensor t = randn({64, 64}, 5);
  float* x = t.data_ptr<float>();
  x[3] = kNaN;
  x[500] = kInf;
  x[777] = -kInf;
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.label);
    for (bool two_d : {true, false}) {
      const at::Tensor in = two_d ? t : t.flatten();
      auto codec = make_codec(c.options);
      CodecState state;
      const at::Tensor d = codec->decode(codec->encode(in, state)).flatten();
      const float* y = d.data_ptr<float>();
      // Every codec: a NaN input never decodes to a finite value, nor does an infinity.
      EXPECT_FALSE(std::isfinite(y[3]));
      EXPECT_FALSE(std::isfinite(y[500]));
      EXPECT_FALSE(std::isfinite(y[777]));
      // Error feedback never keeps a non-finite residual.
      if (state.residual.defined()) {
        EXPECT_TRUE(at::isfinite(state.residual).all().item<bool>());
      }
      const std::string& k = c.options.kind;
      if (k == "none" || k == "fp16" || k == "bf16" || k == "topk" ||
          (k == "powersgd" && !powersgd_low_rank(in.sizes(), c.options.rank))) {
        EXPECT_TRUE(std::isnan(y[3]));
        EXPECT_EQ(y[500], kInf);
        EXPECT_EQ(y[777], -kInf);
      }
      if (k == "int8" || k == "int4") {
        // The blocks holding a non-finite value decode to NaN; all others are finite.
        const int64_t B = c.options.block;
        for (int64_t i = 0; i < d.numel(); ++i) {
          const int64_t b = i / B;
          const bool bad_block = b == 3 / B || b == 500 / B || b == 777 / B;
          ASSERT_EQ(std::isnan(y[i]), bad_block) << i;
        }
      }
      if (k == "powersgd" && two_d) {
        EXPECT_TRUE(at::isnan(d).all().item<bool>());
      }
      if (k == "topk") {
        EXPECT_EQ(at::isfinite(d).logical_not().sum().item<int64_t>(), 3);
      }
      if (k == "sparseloco") {
        // The k kept positions of each chunk holding a non-finite value decode to NaN; the
        // rest of the tensor is finite.
        const int64_t C = c.options.block, n = d.numel();
        for (int64_t start = 0; start < n; start += C) {
          const int64_t len = std::min(C, n - start);
          const bool bad_chunk = (start <= 3 && 3 < start + len) || (start <= 500 && 500 < start + len) ||
                                 (start <= 777 && 777 < start + len);
          const at::Tensor chunk = d.slice(0, start, start + len);
          EXPECT_EQ(at::isnan(chunk).sum().item<int64_t>(), bad_chunk ? sparseloco_count(len, c.options.density) : 0)
              << "chunk at " << start;
          EXPECT_EQ(at::isinf(chunk).sum().item<int64_t>(), 0);
        }
      }
    }
  }
  // PowerSGD keeps its warm start through a non-finite step.
  auto psgd = make_codec(opts("powersgd"));
  CodecState s;
  psgd->encode(randn({64, 64}, 6), s);
  const at::Tensor q = s.q.clone();
  psgd->encode(t, s);
  EXPECT_TRUE(at::equal(s.q, q));
  EXPECT_EQ(s.steps, 2u);
}

TEST(CodecNonFinite, HugeFiniteValuesStayFiniteOrBecomeInf) {
  // fp16 overflows to inf (documented); int8 of a block within float range stays within bound.
  const at::Tensor t = at::tensor({-1e30f, 1e30f, 0.0f, 5.0f}, at::kFloat);
  for (const char* k : {"int8", "int4", "bf16", "topk", "none", "sparseloco"}) {
    auto c = make_codec(opts(k));
    const at::Tensor d = c->decode(encode_fresh(*c, t));
    EXPECT_TRUE(at::isfinite(d).all().item<bool>()) << k;
    EXPECT_LE(excess(d, t, c->error_bound(t)), 0.0) << k;
  }
  // Tiny ranges (1/scale overflows a float) take the slow path and still meet the bound.
  const at::Tensor tiny = at::tensor({1e-44f, 2e-44f, 0.0f, 3e-45f}, at::kFloat);
  for (const char* k : {"int8", "int4"}) {
    for (bool stochastic : {false, true}) {
      CodecOptions o = opts(k);
      o.stochastic = stochastic;
      auto c = make_codec(o);
      const at::Tensor d = c->decode(encode_fresh(*c, tiny));
      EXPECT_LE(excess(d, tiny, c->error_bound(tiny)), 0.0) << k;
    }
  }
}

// ---------------------------------------------------------------------------------------
// Stochastic rounding

TEST(CodecStochastic, UnbiasedAndReproducible) {
  for (const char* kind : {"int8", "int4"}) {
    SCOPED_TRACE(kind);
    CodecOptions o = opts(kind);
    o.stochastic = true;
    o.error_feedback = false;
    o.seed = 1234;
    auto codec = make_codec(o);
    const float maxq = std::string(kind) == "int8" ? 255.0f : 15.0f;
    const float scale = 1.0f / maxq;
    // One block: its min (0) and max (1) fix the levels j / maxq; the rest sits at
    // 0.3 of the way from level 7 to level 8.
    const int64_t n = 256;
    const float v = (7.0f + 0.3f) * scale;
    at::Tensor t = at::full({n}, v, at::kFloat);
    t[0] = 0.0f;
    t[1] = 1.0f;
    CodecState state;
    const int steps = 10000;
    at::Tensor sum = at::zeros({n}, at::kDouble);
    for (int s = 0; s < steps; ++s) {
      const at::Tensor d = codec->decode(codec->encode(t, state));
      // Only the two neighbouring levels ever come out.
      const at::Tensor mid = d.slice(0, 2);
      ASSERT_TRUE((((mid - 7 * scale).abs() < 1e-6) | ((mid - 8 * scale).abs() < 1e-6)).all().item<bool>());
      sum += d.to(at::kDouble);
    }
    EXPECT_EQ(state.rng_counter, static_cast<uint64_t>(steps));
    const at::Tensor mean = (sum / steps).slice(0, 2);
    // One decode is v + scale * (Bernoulli(0.3) - 0.3): sd = scale * sqrt(0.21).
    const double se_one = scale * std::sqrt(0.21) / std::sqrt(double{steps});
    const double se_all = se_one / std::sqrt(double(n - 2));
    EXPECT_NEAR(mean.mean().item<double>(), v, 4 * se_all);
    EXPECT_LT((mean - v).abs().max().item<double>(), 5 * se_one);
    // Nearest rounding would be biased by 0.3 scale: far outside.
    EXPECT_GT(0.3 * scale, 50 * se_all);

    // Same (seed, counter) -> same payload; the next counter -> another one.
    CodecState a, b;
    const Bytes p1 = codec->encode(t, a);
    const Bytes p2 = codec->encode(t, b);
    EXPECT_EQ(p1, p2);
    EXPECT_NE(codec->encode(t, a), p1);
  }
}

// ---------------------------------------------------------------------------------------
// Error feedback

struct FeedbackResult {
  double err = 0;       // ||sum decoded - sum g||
  double identity = 0;  // ||sum decoded - (sum g - residual_T)||
  double residual = 0;  // ||residual_T||
  double total = 0;     // ||sum g||
};

FeedbackResult run_feedback(CodecOptions o, bool error_feedback, int steps) {
  o.error_feedback = error_feedback;
  auto codec = make_codec(o);
  const at::Tensor mu = randn({64, 96}, 100, 1.0);  // a consistent direction, as gradients have
  CodecState state;
  at::Tensor sum_g = at::zeros({64, 96}, at::kDouble), sum_d = at::zeros({64, 96}, at::kDouble);
  for (int s = 0; s < steps; ++s) {
    const at::Tensor g = mu + randn({64, 96}, 1000 + s);
    sum_g += g.to(at::kDouble);
    sum_d += codec->decode(codec->encode(g, state)).to(at::kDouble);
  }
  FeedbackResult r;
  r.err = (sum_d - sum_g).norm().item<double>();
  r.total = sum_g.norm().item<double>();
  if (error_feedback) {
    r.residual = state.residual.norm().item<double>();
    r.identity = (sum_d - (sum_g - state.residual.to(at::kDouble))).norm().item<double>();
  }
  return r;
}

TEST(CodecErrorFeedback, CumulativeSumConverges) {
  CodecOptions topk = opts("topk");
  topk.density = 0.01;
  CodecOptions psgd = opts("powersgd");
  psgd.rank = 2;
  CodecOptions int4 = opts("int4");
  for (const CodecOptions& o : {topk, psgd, int4, opts("sparseloco"), sparseloco(4096, 1.0 / 64)}) {
    SCOPED_TRACE(o.kind);
    const FeedbackResult ef = run_feedback(o, true, 200);
    const FeedbackResult plain = run_feedback(o, false, 200);
    // Error feedback's identity: sum decoded = sum g - residual_T (float rounding only).
    EXPECT_LT(ef.identity, 1e-5 * ef.total + 1e-4);
    EXPECT_NEAR(ef.err, ef.residual, 1e-5 * ef.total + 1e-4);
    // Much smaller than without error feedback (topk, sending 1% a step, is the slowest)...
    EXPECT_LT(ef.err, 0.3 * plain.err) << "with " << ef.err << " without " << plain.err << " total " << ef.total;
    // ...and bounded: twice the steps leave about the same error, where without error
    // feedback it grows with the number of steps.
    const FeedbackResult ef2 = run_feedback(o, true, 400);
    const FeedbackResult plain2 = run_feedback(o, false, 400);
    EXPECT_LT(ef2.identity, 1e-5 * ef2.total + 1e-4);
    EXPECT_LT(ef2.err, 1.3 * ef.err);
    EXPECT_GT(plain2.err, 1.3 * plain.err);
    EXPECT_LT(ef2.err, 0.15 * plain2.err);
  }
}

// SparseLoCo as published, written out plainly: e <- beta e + t; per chunk keep the k largest
// |e| (ties to lower indices), send each as its sign and the mean of its magnitude group (the
// kept magnitudes cut in two where the squared error is least; with 1-bit values one group),
// e <- e - sent. Returns what is sent; `e` is the residual.
std::vector<float> sparseloco_reference(const std::vector<float>& t, std::vector<float>& e, int64_t chunk,
                                        double density, double beta, int value_bits) {
  const auto n = static_cast<int64_t>(t.size());
  std::vector<float> sent(t.size(), 0.0f);
  for (int64_t i = 0; i < n; ++i) e[i] = static_cast<float>(beta) * e[i] + t[i];
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start), k = sparseloco_count(len, density);
    std::vector<int64_t> order(static_cast<size_t>(len));
    for (int64_t i = 0; i < len; ++i) order[i] = start + i;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return std::fabs(e[a]) > std::fabs(e[b]); });
    std::vector<int64_t> kept(order.begin(), order.begin() + k);  // largest first
    std::vector<double> mags;
    for (auto i : kept) mags.push_back(std::fabs(e[i]));
    std::sort(mags.begin(), mags.end());
    // The cut with the least squared error (j values low, k - j high); none: one level.
    auto sse = [&](int64_t j) {
      double err = 0;
      for (auto [lo, hi] : {std::pair<int64_t, int64_t>{0, j}, {j, k}}) {
        if (lo == hi) continue;
        double mean = 0;
        for (int64_t q = lo; q < hi; ++q) mean += mags[q] / static_cast<double>(hi - lo);
        for (int64_t q = lo; q < hi; ++q) err += (mags[q] - mean) * (mags[q] - mean);
      }
      return err;
    };
    int64_t cut = 0;  // 1-bit values: one level, no cut
    for (int64_t j = 1; value_bits == 2 && j < k; ++j)
      if (mags[j - 1] != mags[j] && sse(j) < sse(cut) - 1e-12) cut = j;
    auto mean_of = [&](int64_t lo, int64_t hi) {
      double m = 0;
      for (int64_t q = lo; q < hi; ++q) m += mags[q];
      return static_cast<float>(m / static_cast<double>(hi - lo));
    };
    const float lo = mean_of(0, cut == 0 ? k : cut), hi = cut == 0 ? lo : mean_of(cut, k);
    const double split = cut == 0 ? INFINITY : mags[cut];
    for (auto i : kept) {
      const float level = std::fabs(e[i]) >= split ? hi : lo;
      sent[i] = std::signbit(e[i]) ? -level : level;
      e[i] -= sent[i];
    }
  }
  return sent;
}

TEST(CodecSparseLoco, MatchesAPlainReferenceWithDecayedErrorFeedback) {
  // 3000 values in chunks of 512 (the last of 440), 1 % and 3 % kept, with and without decay,
  // over three rounds so that the residual's decay shows; inputs fixed by their seeds.
  for (double density : {0.01, 0.03})
    for (double beta : {1.0, 0.95, 0.0})
    for (const char* indices : {"fixed", "rice"})
    for (int value_bits : {2, 1}) {
      SCOPED_TRACE(testing::Message() << "density " << density << " beta " << beta << " indices " << indices << " bits "
                                      << value_bits);
      CodecOptions o = sparseloco(512, density);
      o.error_decay = beta;
      o.indices = indices;
      o.value_bits = value_bits;
      auto codec = make_codec(o);
      CodecState state;
      std::vector<float> e(3000, 0.0f);
      for (int round = 0; round < 3; ++round) {
        const at::Tensor t = randn({3000}, 40 + round);
        const std::vector<float> tv(t.data_ptr<float>(), t.data_ptr<float>() + 3000);
        const std::vector<float> want = sparseloco_reference(tv, e, 512, density, beta, value_bits);
        const at::Tensor got = codec->decode(codec->encode(t, state));
        const float* g = got.data_ptr<float>();
        const float* r = state.residual.data_ptr<float>();
        int64_t kept = 0;
        for (int64_t i = 0; i < 3000; ++i) {
          ASSERT_EQ(g[i] != 0.0f, want[i] != 0.0f) << "round " << round << " index " << i;  // the kept set
          ASSERT_NEAR(g[i], want[i], 1e-6f * (1 + std::fabs(want[i]))) << "round " << round << " index " << i;
          ASSERT_NEAR(r[i], e[i], 1e-5f * (1 + std::fabs(e[i]))) << "round " << round << " index " << i;
          kept += want[i] != 0.0f;
        }
        EXPECT_EQ(kept, 5 * sparseloco_count(512, density) + sparseloco_count(440, density));
      }
    }
  // The decay is the residual's share kept: beta = 0 keeps nothing of the last round's.
  CodecOptions o = sparseloco(512, 0.01);
  o.error_decay = 0.0;
  CodecState a, b;
  make_codec(o)->encode(randn({3000}, 7), a);
  const Bytes after = make_codec(o)->encode(randn({3000}, 8), a);
  EXPECT_EQ(after, make_codec(o)->encode(randn({3000}, 8), b));
  o.error_decay = 1.5;
  EXPECT_THROW(make_codec(o), ConfigError);
}

TEST(CodecErrorFeedback, ResidualMisuseIsACallerError) {
  auto codec = make_codec(opts("topk"));
  CodecState state;
  codec->encode(randn({100}, 1), state);
  EXPECT_THROW(codec->encode(randn({101}, 1), state), Error);
  EXPECT_THROW(codec->encode(at::zeros({10}, at::kDouble), state), Error);
  // Same numel, another shape: fine (the residual follows the tensor).
  EXPECT_NO_THROW(codec->encode(randn({10, 10}, 1), state));
  EXPECT_EQ(state.residual.sizes(), (std::vector<int64_t>{10, 10}));
}

// ---------------------------------------------------------------------------------------
// PowerSGD

TEST(CodecPowerSgd, RecoversExactLowRankMatrix) {
  const at::Tensor M = at::mm(randn({256, 2}, 11), randn({2, 128}, 12));
  for (bool ef : {false, true}) {
    CodecOptions o = opts("powersgd");
    o.rank = 4;
    o.error_feedback = ef;
    auto codec = make_codec(o);
    CodecState state;
    double rel = 1;
    for (int step = 1; step <= 5 && rel >= 1e-4; ++step) {
      const at::Tensor d = codec->decode(codec->encode(M, state));
      rel = ((d - M).norm() / M.norm()).item<double>();
    }
    EXPECT_LT(rel, 1e-4) << "error feedback " << ef;
    EXPECT_EQ(state.q.sizes(), (std::vector<int64_t>{128, 4}));
  }
}

TEST(CodecPowerSgd, WarmStartApproachesBestRankR) {
  // A matrix with a decaying spectrum: repeated encodes approach the best rank-r error.
  const at::Tensor U = std::get<0>(at::linalg_qr(randn({200, 50}, 21)));
  const at::Tensor V = std::get<0>(at::linalg_qr(randn({100, 50}, 22)));
  const at::Tensor s = at::pow(0.5, at::arange(50, at::kFloat));
  const at::Tensor M = at::mm(U * s, V.t());
  CodecOptions o = opts("powersgd");
  o.error_feedback = false;
  auto codec = make_codec(o);
  CodecState state;
  double err = 0;
  for (int step = 0; step < 10; ++step) err = (codec->decode(codec->encode(M, state)) - M).norm().item<double>();
  const double best = s.slice(0, 4).pow(2).sum().sqrt().item<double>();
  EXPECT_LT(err, 1.01 * best);
}

TEST(CodecPowerSgd, FallsBackToRawForSmallOrOneDimensional) {
  EXPECT_FALSE(powersgd_low_rank({100000}, 4));
  EXPECT_FALSE(powersgd_low_rank({32, 32}, 4));  // numel < 4096
  EXPECT_TRUE(powersgd_low_rank({64, 64}, 4));
  EXPECT_FALSE(powersgd_low_rank({64, 64}, 32));  // (n + m) r >= n m: no gain
  EXPECT_FALSE(powersgd_low_rank({2, 4096}, 4));
  EXPECT_TRUE(powersgd_low_rank({8, 16, 32}, 4));  // 8 x 512
}

// ---------------------------------------------------------------------------------------
// Corrupt payloads

Bytes sample_payload(const std::string& kind) {
  CodecOptions o = opts(kind);
  if (kind == "topk") o.density = 0.05;
  if (kind == "sparseloco") o = sparseloco(100, 0.05);  // 7-bit indices, 5 per chunk
  const at::Tensor t = kind == "powersgd" ? randn({64, 96}, 31) : randn({10, 100}, 31);
  return encode_fresh(*make_codec(o), t);
}

TEST(CodecCorrupt, TruncatedAtEveryLength) {
  for (const char* kind : kAllKinds) {
    SCOPED_TRACE(kind);
    const Bytes p = sample_payload(kind);
    auto codec = make_codec(opts(kind));
    for (size_t len = 0; len < std::min<size_t>(p.size(), 64); ++len) {
      EXPECT_CODEC_ERROR(Kind::kTruncated, codec->decode(cut(p, len)));
      EXPECT_CODEC_ERROR(Kind::kTruncated, decode_any(cut(p, len)));
    }
    for (size_t len = p.size() - 40; len < p.size(); ++len) EXPECT_CODEC_ERROR(Kind::kTruncated, codec->decode(cut(p, len)));
    EXPECT_CODEC_ERROR(Kind::kTruncated, payload_codec(cut(p, 0)));
    EXPECT_CODEC_ERROR(Kind::kTruncated, payload_codec(cut(p, 3)));
    Bytes longer = p;
    longer.push_back(0);
    EXPECT_CODEC_ERROR(Kind::kMismatch, codec->decode(longer));
    EXPECT_NO_THROW(codec->decode(p));
  }
}

TEST(CodecCorrupt, HeaderFields) {
  for (const char* kind : kAllKinds) {
    SCOPED_TRACE(kind);
    const Bytes p = sample_payload(kind);
    auto codec = make_codec(opts(kind));
    Bytes q = p;
    q[0] = 99;  // unknown codec id
    EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(q));
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    EXPECT_CODEC_ERROR(Kind::kBadHeader, payload_codec(q));
    q = p;
    q[0] = static_cast<uint8_t>((p[0] + 1) % 8);  // another codec's id
    EXPECT_CODEC_ERROR(Kind::kMismatch, codec->decode(q));
    q = p;
    q[1] = 2;  // format version
    EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(q));
    q = p;
    q[2] = 0;  // dtype
    EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(q));
    q = p;
    q[3] = 200;  // ndim
    EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(q));
    // numel against the caller's expectation
    EXPECT_CODEC_ERROR(Kind::kMismatch, codec->decode(p, 999));
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(p, 0));
    EXPECT_NO_THROW(codec->decode(p, kind == std::string("powersgd") ? 64 * 96 : 1000));
    // A shape with more than kMaxNumel elements, and one dim above it.
    q = p;
    q[4 + 7] = 0x10;  // dims[0] = 2^60 + ...
    EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(q));
    q = p;
    std::memset(q.data() + 4, 0, 16);
    q[4 + 2] = 0x10;  // 2^20
    q[12 + 2] = 0x10;  // 2^20: product 2^40
    EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(q));
  }
}

void put_u32(Bytes& p, size_t off, uint32_t v) { std::memcpy(p.data() + off, &v, 4); }
void put_u64(Bytes& p, size_t off, uint64_t v) { std::memcpy(p.data() + off, &v, 8); }
void put_f32(Bytes& p, size_t off, float v) { std::memcpy(p.data() + off, &v, 4); }
float get_f32(const Bytes& p, size_t off) {
  float v;
  std::memcpy(&v, p.data() + off, 4);
  return v;
}
// n bits at bit offset `bit` (LSB-first), as sparseloco's bit streams hold them.
uint32_t get_bits(const Bytes& p, size_t bit, int n) {
  uint32_t v = 0;
  for (int j = 0; j < n; ++j) v |= static_cast<uint32_t>((p[(bit + j) / 8] >> ((bit + j) % 8)) & 1) << j;
  return v;
}
void put_bits(Bytes& p, size_t bit, int n, uint32_t v) {
  for (int j = 0; j < n; ++j) {
    uint8_t& b = p[(bit + j) / 8];
    const auto mask = static_cast<uint8_t>(1u << ((bit + j) % 8));
    b = static_cast<uint8_t>(((v >> j) & 1) ? (b | mask) : (b & ~mask));
  }
}

TEST(CodecCorrupt, CodecParameters) {
  const size_t params = 4 + 16;  // every sample payload is 2-D
  // int8/int4: block 0, unknown flags, a block that no longer matches the byte count.
  for (const char* kind : {"int8", "int4"}) {
    const Bytes p = sample_payload(kind);
    Bytes q = p;
    put_u32(q, params, 0);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    q = p;
    put_u32(q, params + 4, 2);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    q = p;
    put_u32(q, params, 1000);  // fewer blocks than the data holds
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    put_u32(q, params, 16);  // more
    EXPECT_CODEC_ERROR(Kind::kTruncated, decode_any(q));
  }
  {
    // int4 blocks of odd length: the padding nibble must be 0.
    for (int64_t block : {7, 256}) {
      CodecOptions o = opts("int4");
      o.block = block;
      Bytes p = encode_fresh(*make_codec(o), randn({21}, 1));
      EXPECT_NO_THROW(decode_any(p));
      p.back() |= 0x10;
      EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(p));
      if (block == 7) {
        p = encode_fresh(*make_codec(o), randn({21}, 1));
        p[p.size() - 5] |= 0x10;  // the second block's last byte (3 blocks of 4 bytes)
        EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(p));
      }
    }
  }
  {
    // topk: k > numel, an index out of range, indices out of order, numel >> k.
    const Bytes p = sample_payload("topk");  // 1000 values, k = 50
    const size_t idx = params + 8;
    Bytes q = p;
    put_u64(q, params, 1001);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    q = p;
    put_u32(q, idx + 4 * 49, 1000);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    put_u32(q, idx + 4 * 49, 0xFFFFFFFFu);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    std::memcpy(q.data() + idx + 4 * 10, p.data() + idx + 4 * 11, 4);  // a duplicate
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    put_u64(q, 4, uint64_t{1} << 15);
    put_u64(q, 12, uint64_t{1} << 15);  // 2^30 elements from 50 values
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    q = p;
    put_u64(q, params, 0);  // k = 0 for a non-empty tensor
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
  }
  {
    // powersgd: rank above min(n, m), a reserved field, a rank that does not fit the bytes.
    const Bytes p = sample_payload("powersgd");  // 64 x 96, rank 4
    Bytes q = p;
    put_u32(q, params, 65);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    q = p;
    put_u32(q, params + 4, 1);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    q = p;
    put_u32(q, params, 5);
    EXPECT_CODEC_ERROR(Kind::kTruncated, decode_any(q));
    q = p;
    put_u32(q, params, 3);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    put_u32(q, params, 0);  // raw, but the bytes hold P and Q
    EXPECT_CODEC_ERROR(Kind::kTruncated, decode_any(q));
    // rank > 0 for a 1-D or empty tensor.
    wire::ByteWriter w;
    for (uint8_t b : {uint8_t{6}, uint8_t{1}, uint8_t{1}, uint8_t{1}}) w.put_u8(b);
    w.put_u64(5000);
    w.put_u32(2);  // above min(5000, 1)
    w.put_u32(0);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(w.take()));
  }
  {
    // sparseloco: 1000 values in 10 chunks of 100 keeping 5: levels at 32 (lo) and 72 (hi),
    // 50 7-bit indices at byte 112 (350 bits: 44 bytes), 50 2-bit codes at 156 (13 bytes).
    const Bytes p = sample_payload("sparseloco");
    ASSERT_EQ(p.size(), 169u);
    const size_t lo = params + 12, hi = lo + 40, idx = 8 * (hi + 40), codes = 8 * 156;
    auto index_bit = [&](int chunk, int j) { return idx + 7 * static_cast<size_t>(5 * chunk + j); };
    EXPECT_NO_THROW(decode_any(p));
    for (uint32_t chunk : {0u, 1u, 65537u, 0xFFFFFFFFu}) {
      Bytes q = p;
      put_u32(q, params, chunk);
      EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q)) << chunk;
    }
    Bytes q = p;
    put_u32(q, params, 128);  // 7 full chunks and one of 104, which must keep k_last >= 1
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    q = p;
    put_u32(q, params, 200);  // 5 chunks: fewer bytes than the data holds
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    for (uint32_t k : {0u, 101u}) {  // k outside [1, chunk]
      q = p;
      put_u32(q, params + 4, k);
      EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q)) << k;
    }
    q = p;
    put_u32(q, params + 4, 4);  // fewer indices and codes than the data holds
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    put_u32(q, params + 4, 6);  // more
    EXPECT_CODEC_ERROR(Kind::kTruncated, decode_any(q));
    q = p;
    put_u32(q, params + 8, 1);  // k_last, but 100 divides 1000
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    // Levels: both NaN is a non-finite chunk; anything else must be 0 <= lo <= hi < inf.
    q = p;
    put_f32(q, lo + 12, kNaN);
    put_f32(q, hi + 12, kNaN);
    const at::Tensor nan_chunk = decode_any(q).flatten();
    EXPECT_EQ(at::isnan(nan_chunk).sum().item<int64_t>(), 5);
    EXPECT_EQ(at::isnan(nan_chunk.slice(0, 300, 400)).sum().item<int64_t>(), 5);
    const float lo3 = get_f32(p, lo + 12), hi3 = get_f32(p, hi + 12);
    for (const auto& [l, h] : {std::pair{hi3 * 2, hi3}, std::pair{-lo3, hi3}, std::pair{-0.5f, 0.5f},
                               std::pair{lo3, kInf}, std::pair{kInf, kInf}, std::pair{kNaN, hi3},
                               std::pair{lo3, kNaN}}) {
      q = p;
      put_f32(q, lo + 12, l);
      put_f32(q, hi + 12, h);
      EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q)) << l << " " << h;
    }
    // Indices: equal, decreasing, past the chunk (7 bits reach 127).
    q = p;
    put_bits(q, index_bit(2, 1), 7, get_bits(p, index_bit(2, 0), 7));
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    put_bits(q, index_bit(2, 0), 7, get_bits(p, index_bit(2, 1), 7) + 1);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    for (uint32_t i : {100u, 127u}) {
      q = p;
      put_bits(q, index_bit(9, 4), 7, i);
      EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q)) << i;
    }
    q = p;
    put_bits(q, index_bit(9, 4), 7, 99);  // still after index 3 (almost surely) and in range
    if (get_bits(p, index_bit(9, 3), 7) < 99) {
      EXPECT_NO_THROW(decode_any(q));
    }
    // Padding bits after the last index and the last code.
    q = p;
    put_bits(q, idx + 350, 1, 1);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    q = p;
    put_bits(q, codes + 103, 1, 1);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    // Codes are never wrong: flipping a sign flips a sign.
    q = p;
    put_bits(q, codes, 1, get_bits(p, codes, 1) ^ 1);
    EXPECT_TRUE(at::equal(decode_any(q).abs(), decode_any(p).abs()));
    // A shape of ~2^30 elements (a multiple of the chunk) from a 169-byte payload: the byte
    // count gives it away before anything is allocated.
    q = p;
    put_u64(q, 4, uint64_t{100} << 20);
    put_u64(q, 12, 10);
    EXPECT_CODEC_ERROR(Kind::kTruncated, decode_any(q));
    q = p;
    put_u64(q, 4, uint64_t{1} << 15);  // 2^30: not a multiple of 100, and k_last is 0
    put_u64(q, 12, uint64_t{1} << 15);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));

    // A partial last chunk of 50 keeps 3 (2.5 rounds up); its indices must stay below 50.
    const Bytes r = encode_fresh(*make_codec(sparseloco(100, 0.05)), randn({1050}, 32));
    const size_t rp = 4 + 8;  // 1-D
    EXPECT_EQ(r.size(), sparseloco_size(1, 1050, 100, 0.05));
    for (uint32_t k_last : {0u, 51u}) {
      q = r;
      put_u32(q, rp + 8, k_last);
      EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q)) << k_last;
    }
    const size_t r_last_index = 8 * (rp + 12 + 8 * 11) + 7 * (53 - 1);
    q = r;
    put_bits(q, r_last_index, 7, 50);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(q));
    // An empty tensor: no chunks, k_last must be 0.
    auto empty = [](uint32_t chunk, uint32_t k, uint32_t k_last) {
      wire::ByteWriter w;
      for (uint8_t b : {uint8_t{7}, uint8_t{1}, uint8_t{1}, uint8_t{1}}) w.put_u8(b);
      w.put_u64(0);
      w.put_u32(chunk);
      w.put_u32(k);
      w.put_u32(k_last);
      return w.take();
    };
    EXPECT_EQ(decode_any(empty(2, 1, 0)).numel(), 0);
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(empty(2, 1, 1)));
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(empty(2, 3, 0)));
    Bytes longer = empty(2, 1, 0);
    longer.push_back(0);
    EXPECT_CODEC_ERROR(Kind::kMismatch, decode_any(longer));
  }
}

TEST(CodecCorrupt, RandomMutationsNeverCrash) {
  std::mt19937_64 rng(20240601);
  int errors = 0, ok = 0;
  for (const char* kind : kAllKinds) {
    const Bytes p = sample_payload(kind);
    for (int iter = 0; iter < 300; ++iter) {
      Bytes q = p;
      const int edits = 1 + static_cast<int>(rng() % 4);
      for (int e = 0; e < edits; ++e) {
        // Mostly the header and parameters, where a change matters most.
        const size_t span = rng() % 3 ? std::min<size_t>(q.size(), 48) : q.size();
        const size_t at = rng() % span;
        switch (rng() % 4) {
          case 0: q[at] = static_cast<uint8_t>(rng()); break;
          case 1: q[at] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
          case 2: q.resize(rng() % (q.size() + 1)); break;
          default: q.push_back(static_cast<uint8_t>(rng())); break;
        }
        if (q.empty()) break;
      }
      try {
        const at::Tensor d = decode_any(q);
        EXPECT_LE(d.numel(), kMaxNumel);
        ++ok;
      } catch (const CodecError&) {
        ++errors;
      }
    }
  }
  EXPECT_GT(errors, 1000);
  EXPECT_GT(ok, 10);  // mutations of values only decode fine
}

// ---------------------------------------------------------------------------------------
// Options

std::string config_error(const CodecOptions& o) {
  try {
    make_codec(o);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

TEST(CodecOptionsTest, BadOptionsNameTheKey) {
  EXPECT_NE(config_error(opts("int9")).find("strategy.codec = \"int9\" is not one of none, fp16"), std::string::npos)
      << config_error(opts("int9"));
  CodecOptions o = opts("int8");
  o.block = 0;
  EXPECT_NE(config_error(o).find("strategy.codec_block = 0"), std::string::npos);
  o.kind = "int4";
  o.block = -5;
  EXPECT_NE(config_error(o).find("strategy.codec_block = -5"), std::string::npos);
  for (double d : {0.0, -0.1, 1.5, std::nan("")}) {
    o = opts("topk");
    o.density = d;
    EXPECT_NE(config_error(o).find("strategy.codec_density"), std::string::npos) << d;
  }
  o = opts("powersgd");
  o.rank = 0;
  EXPECT_NE(config_error(o).find("strategy.codec_rank = 0"), std::string::npos);
  // sparseloco: the block is the chunk, and in-chunk indices must fit in 16 bits.
  for (int64_t block : {int64_t{-1}, int64_t{0}, int64_t{1}, int64_t{65537}, int64_t{1} << 24}) {
    const std::string e = config_error(sparseloco(block, 0.01));
    EXPECT_NE(e.find("strategy.codec_block = " + std::to_string(block) + " is not in [2, 65536]"), std::string::npos)
        << e;
  }
  EXPECT_EQ(config_error(sparseloco(2, 0.01)), "");
  EXPECT_EQ(config_error(sparseloco(65536, 1.0)), "");
  for (double d : {0.0, -0.1, 1.5, std::nan("")}) {
    EXPECT_NE(config_error(sparseloco(4096, d)).find("strategy.codec_density"), std::string::npos) << d;
  }
  // Parameters of other codecs are not checked.
  o = opts("fp16");
  o.rank = 0;
  o.block = 0;
  EXPECT_EQ(config_error(o), "");
  for (int i = 0; i < 8; ++i) {
    auto c = make_codec(opts(kAllKinds[i]));
    EXPECT_EQ(c->name(), kAllKinds[i]);
    EXPECT_EQ(static_cast<int>(c->id()), i);
    EXPECT_EQ(codec_name(c->id()), kAllKinds[i]);
  }
  EXPECT_EQ(CodecId::kSparseLoco, static_cast<CodecId>(7));
  EXPECT_EQ(codec_name(static_cast<CodecId>(42)), "codec(42)");
}

TEST(CodecOptionsTest, EncodeRejectsWrongInput) {
  auto c = make_codec(opts("int8"));
  CodecState s;
  EXPECT_THROW(c->encode(at::zeros({3}, at::kDouble), s), Error);
  EXPECT_THROW(c->encode(at::Tensor(), s), Error);
}

}  // namespace
}  // namespace nebula::codec
