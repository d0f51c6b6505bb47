#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "codec/codec.h"
#include "codec/powersgd_codec.h"
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

// Every codec, plus the variants with their own code paths.
std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (const char* k : {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"}) cases.push_back({k, opts(k)});
  for (const char* k : {"int8", "int4"}) {
    CodecOptions o = opts(k);
    o.stochastic = true;
    cases.push_back({std::string(k) + "_stochastic", o});
    o = opts(k);
    o.block = 7;  // odd, and not dividing the sizes below
    cases.push_back({std::string(k) + "_block7", o});
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

// ---------------------------------------------------------------------------------------
// Round trips

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
  for (const char* k : {"int8", "int4", "bf16", "topk", "none"}) {
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
  for (const CodecOptions& o : {topk, psgd, int4}) {
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
  const at::Tensor t = kind == "powersgd" ? randn({64, 96}, 31) : randn({10, 100}, 31);
  return encode_fresh(*make_codec(o), t);
}

Bytes cut(const Bytes& p, size_t len) { return Bytes(p.begin(), p.begin() + static_cast<std::ptrdiff_t>(len)); }

TEST(CodecCorrupt, TruncatedAtEveryLength) {
  for (const char* kind : {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"}) {
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
  for (const char* kind : {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"}) {
    SCOPED_TRACE(kind);
    const Bytes p = sample_payload(kind);
    auto codec = make_codec(opts(kind));
    Bytes q = p;
    q[0] = 99;  // unknown codec id
    EXPECT_CODEC_ERROR(Kind::kBadHeader, codec->decode(q));
    EXPECT_CODEC_ERROR(Kind::kBadHeader, decode_any(q));
    EXPECT_CODEC_ERROR(Kind::kBadHeader, payload_codec(q));
    q = p;
    q[0] = static_cast<uint8_t>((p[0] + 1) % 7);  // another codec's id
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
}

TEST(CodecCorrupt, RandomMutationsNeverCrash) {
  std::mt19937_64 rng(20240601);
  int errors = 0, ok = 0;
  for (const char* kind : {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"}) {
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
  // Parameters of other codecs are not checked.
  o = opts("fp16");
  o.rank = 0;
  o.block = 0;
  EXPECT_EQ(config_error(o), "");
  const char* kinds[] = {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"};
  for (int i = 0; i < 7; ++i) {
    auto c = make_codec(opts(kinds[i]));
    EXPECT_EQ(c->name(), kinds[i]);
    EXPECT_EQ(static_cast<int>(c->id()), i);
    EXPECT_EQ(codec_name(c->id()), kinds[i]);
  }
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
