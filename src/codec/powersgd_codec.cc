#include "codec/powersgd_codec.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/linalg_qr.h>
#include <ATen/ops/mm.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>

#include "codec/payload.h"

namespace nebula::codec {

namespace {

using detail::fail;
using Kind = CodecError::Kind;

constexpr int64_t kMinLowRankNumel = 4096;

bool all_finite(const at::Tensor& t) {
  const float* p = t.data_ptr<float>();
  int32_t bad = 0;
  for (int64_t i = 0; i < t.numel(); ++i) bad |= (p[i] - p[i] != 0.0f);
  return !bad;
}

// Standard normal from the counter-based generator (Box-Muller on two 24-bit uniforms).
float normal(uint64_t key, uint32_t index) {
  const float u1 = (static_cast<float>(detail::random_bits(key, 2 * index) >> 8) + 1.0f) * 0x1p-24f;  // (0, 1]
  const float u2 = detail::uniform01(key, 2 * index + 1);
  return std::sqrt(-2.0f * std::log(u1)) * std::cos(2.0f * std::numbers::pi_v<float> * u2);
}

void fill_normal(float* p, int64_t n, int64_t stride, uint64_t key, uint32_t index0) {
  for (int64_t i = 0; i < n; ++i) p[i * stride] = normal(key, index0 + static_cast<uint32_t>(i));
}

// Copies a float tensor's data (contiguous) into the payload.
void put_floats(std::vector<uint8_t>& out, const at::Tensor& t) {
  uint8_t* dst = detail::append(out, static_cast<size_t>(t.numel()) * 4);
  if (t.numel()) std::memcpy(dst, t.data_ptr<float>(), static_cast<size_t>(t.numel()) * 4);
}

at::Tensor get_floats(wire::ByteReader& r, at::IntArrayRef shape, int64_t numel) {
  at::Tensor t = detail::empty_float(shape);
  const auto bytes = r.bytes(static_cast<size_t>(numel) * 4);
  if (numel) std::memcpy(t.data_ptr<float>(), bytes.data(), bytes.size());
  return t;
}

}  // namespace

bool powersgd_low_rank(at::IntArrayRef shape, int64_t rank) {
  if (shape.size() < 2) return false;
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  if (numel < kMinLowRankNumel) return false;
  const int64_t n = shape[0], m = numel / n;
  return (n + m) * rank < n * m;
}

PowerSgdCodec::PowerSgdCodec(const CodecOptions& options) : options_(options) {
  NEBULA_CHECK(options.rank >= 1 && options.rank <= 65536, "powersgd rank ", options.rank);
}

std::vector<uint8_t> PowerSgdCodec::encode(const at::Tensor& t_in, CodecState& state) const {
  at::Tensor t = detail::check_input(t_in, "powersgd");
  const at::NoGradGuard no_grad;  // a gradient that requires grad must not grow a graph here
  const int64_t numel = t.numel();
  at::Tensor x = t;
  if (options_.error_feedback) {
    at::Tensor& residual = detail::residual_for(state, t, "powersgd", options_.error_decay);
    detail::add(t.data_ptr<float>(), residual.data_ptr<float>(), residual.data_ptr<float>(), numel);
    x = residual;  // holds t + residual until the new residual is written below
  }
  const int64_t r = options_.rank;
  const bool low_rank = powersgd_low_rank(t.sizes(), r);

  wire::ByteWriter w;
  detail::write_header(w, CodecId::kPowerSgd, t.sizes());
  w.put_u32(low_rank ? static_cast<uint32_t>(r) : 0);
  w.put_u32(0);
  std::vector<uint8_t> out = w.take();
  ++state.steps;
  if (!low_rank) {
    put_floats(out, x);  // exact, so the residual is 0
    if (options_.error_feedback) state.residual.zero_();
    return out;
  }

  const int64_t n = t.size(0), m = numel / n;
  const at::Tensor M = x.view({n, m});
  at::Tensor q = state.q;
  if (!q.defined()) {
    q = detail::empty_float({m, r});
    fill_normal(q.data_ptr<float>(), m * r, 1, detail::rng_key(options_.seed, 0), 0);
  } else {
    NEBULA_CHECK(q.dim() == 2 && q.size(0) == m && q.size(1) == r, "powersgd: state.q has shape ",
                 detail::shape_str(q.sizes()), ", the tensor needs [", m, ", ", r, "] (one CodecState per tensor)");
    q = q.to(at::kCPU, at::kFloat).contiguous();
  }
  at::Tensor P = at::mm(M, q);
  at::Tensor Q;
  bool ok = all_finite(P);
  if (ok) {
    P = std::get<0>(at::linalg_qr(P, "reduced")).contiguous();
    Q = at::mm(M.t(), P).contiguous();
    ok = all_finite(Q);
  }
  if (!ok) {
    // Non-finite input (or an overflow): everything decodes to NaN; the warm start survives.
    P = detail::empty_float({n, r}).fill_(std::numeric_limits<float>::quiet_NaN());
    Q = detail::empty_float({m, r}).fill_(std::numeric_limits<float>::quiet_NaN());
  }
  put_floats(out, P);
  put_floats(out, Q);
  if (ok) {
    // Warm start for the next step. A column of Q that is exactly zero (M has lower rank
    // than r, or is 0) would stay zero forever; redraw it.
    at::Tensor next = Q.clone();
    float* qd = next.data_ptr<float>();
    for (int64_t c = 0; c < r; ++c) {
      bool zero = true;
      for (int64_t i = 0; i < m && zero; ++i) zero = qd[i * r + c] == 0.0f;
      if (zero)
        fill_normal(qd + c, m, r, detail::rng_key(options_.seed, state.steps),
                    static_cast<uint32_t>(c * m));
    }
    state.q = next;
  }
  if (options_.error_feedback) {
    const at::Tensor decoded = at::mm(P, Q.t());
    float* res = state.residual.data_ptr<float>();
    detail::sub_finite(res, decoded.data_ptr<float>(), res, numel);
  }
  return out;
}

at::Tensor PowerSgdCodec::decode(std::span<const uint8_t> payload, int64_t expected_numel) const {
  return detail::guarded([&] {
    wire::ByteReader r(payload, "powersgd payload");
    detail::PayloadHeader h = detail::read_header(r, CodecId::kPowerSgd, false, expected_numel);
    const uint32_t rank = r.u32();
    const uint32_t reserved = r.u32();
    if (reserved != 0) fail(Kind::kBadHeader, str_cat("powersgd payload: reserved field is ", reserved, ", not 0"));
    if (rank == 0) {
      detail::expect_remaining(r, static_cast<uint64_t>(h.numel) * 4, "powersgd", "raw values");
      return get_floats(r, h.shape, h.numel);
    }
    if (h.shape.empty() || h.numel == 0)
      fail(Kind::kBadHeader, str_cat("powersgd payload: rank ", rank, " for a tensor of shape ",
                                     detail::shape_str(h.shape), " (low rank needs a non-empty matrix)"));
    const int64_t n = h.shape[0], m = h.numel / n;
    if (rank > std::min(n, m))
      fail(Kind::kBadHeader, str_cat("powersgd payload: rank ", rank, " is above min(n, m) = ", std::min(n, m),
                                     " of the ", n, " x ", m, " matrix"));
    detail::expect_remaining(r, static_cast<uint64_t>(n + m) * rank * 4, "powersgd", "P and Q");
    const at::Tensor P = get_floats(r, {n, int64_t{rank}}, n * rank);
    const at::Tensor Q = get_floats(r, {m, int64_t{rank}}, m * rank);
    return at::mm(P, Q.t()).view(h.shape);
  });
}

at::Tensor PowerSgdCodec::error_bound(const at::Tensor& t_in) const {
  at::Tensor t = detail::check_input(t_in, "powersgd");
  at::Tensor bound = detail::empty_float(t.sizes());
  if (!powersgd_low_rank(t.sizes(), options_.rank)) {
    // Raw: exact, but NaN/Inf carry no promise (as for every codec).
    const float* x = t.data_ptr<float>();
    float* b = bound.data_ptr<float>();
    for (int64_t i = 0; i < t.numel(); ++i) b[i] = std::isfinite(x[i]) ? 0.0f : std::numeric_limits<float>::infinity();
    return bound;
  }
  // ||M - P P^T M||_F <= ||M||_F bounds every element; plus float rounding.
  double sum = 0;
  const float* x = t.data_ptr<float>();
  for (int64_t i = 0; i < t.numel(); ++i) sum += static_cast<double>(x[i]) * x[i];
  const double norm = std::sqrt(sum);
  return bound.fill_(std::isfinite(norm) ? static_cast<float>(norm * 1.001) : std::numeric_limits<float>::infinity());
}

}  // namespace nebula::codec
