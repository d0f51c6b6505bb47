#include "distill/topk.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "nebula/error.h"

namespace nebula::distill {

namespace {

using Kind = FrameError::Kind;

[[noreturn]] void fail(Kind kind, const std::string& what, const std::string& msg) {
  throw FrameError(kind, str_cat(what, ": ", msg));
}

void put_le(uint8_t* p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

uint64_t get_le(const uint8_t* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(p[i]) << (8 * i);
  return v;
}

// Bytes per row after the header: k indices, the u16 p0 code, k-1 u8 codes.
uint64_t row_bytes(uint64_t k, int width) { return k * static_cast<uint64_t>(width) + 2 + (k - 1); }

// Whether row[0..k) holds a repeated value; `scratch` is reused between rows.
bool has_duplicate(const int64_t* row, int64_t k, std::vector<int64_t>& scratch) {
  if (k <= 32) {
    for (int64_t i = 1; i < k; ++i)
      for (int64_t j = 0; j < i; ++j)
        if (row[i] == row[j]) return true;
    return false;
  }
  scratch.assign(row, row + k);
  std::sort(scratch.begin(), scratch.end());
  return std::adjacent_find(scratch.begin(), scratch.end()) != scratch.end();
}

}  // namespace

TopK top_k(const at::Tensor& logits, int64_t k, double temperature) {
  NEBULA_CHECK(logits.dim() == 2, "top_k: logits must be [N, V], got ", logits.sizes());
  NEBULA_CHECK(at::isFloatingType(logits.scalar_type()), "top_k: logits must be floating point, got ",
               logits.scalar_type());
  const int64_t vocab = logits.size(1);
  NEBULA_CHECK(k >= 1 && k <= vocab, "top_k: k = ", k, " must be in [1, vocab = ", vocab, "]");
  NEBULA_CHECK(temperature > 0 && std::isfinite(temperature), "top_k: temperature ", temperature);
  at::NoGradGuard no_grad;
  const at::Tensor z = logits.to(at::kFloat) / temperature;
  // p_i = exp(z_i - logsumexp(z)): the same values as softmax(z) without a second [N, V] tensor.
  auto [values, index] = at::topk(z, k, /*dim=*/1, /*largest=*/true, /*sorted=*/true);
  at::Tensor prob = at::exp(values - at::logsumexp(z, {1}, /*keepdim=*/true));
  return TopK{index.contiguous(), prob.contiguous(), vocab};
}

size_t topk_bytes(int64_t tokens, int64_t k, int64_t vocab) {
  NEBULA_CHECK(tokens >= 0 && tokens <= UINT32_MAX, "topk_bytes: tokens ", tokens);
  NEBULA_CHECK(vocab >= 1 && vocab <= UINT32_MAX, "topk_bytes: vocab ", vocab);
  NEBULA_CHECK(k >= 1 && k <= vocab, "topk_bytes: k = ", k, " must be in [1, vocab = ", vocab, "]");
  return kTopKHeaderBytes + static_cast<size_t>(tokens) * row_bytes(static_cast<uint64_t>(k), topk_index_width(vocab));
}

std::vector<uint8_t> encode_topk(const TopK& t) {
  NEBULA_CHECK(t.index.defined() && t.prob.defined(), "encode_topk: undefined tensor");
  NEBULA_CHECK(t.index.dim() == 2 && t.prob.sizes() == t.index.sizes(), "encode_topk: index ", t.index.sizes(),
               " and prob ", t.prob.sizes(), " must both be [N, k]");
  const int64_t n = t.index.size(0), k = t.index.size(1), vocab = t.vocab;
  const size_t total = topk_bytes(n, k, vocab);  // checks n, k, vocab
  const at::Tensor index = t.index.to(at::kCPU, at::kLong).contiguous();
  const at::Tensor prob = t.prob.to(at::kCPU, at::kFloat).contiguous();
  const int64_t* ix = index.data_ptr<int64_t>();
  const float* px = prob.data_ptr<float>();
  const int width = topk_index_width(vocab);

  std::vector<uint8_t> out(total);
  uint8_t* p = out.data();
  p[0] = kTopKVersion;
  put_le(p + 1, static_cast<uint64_t>(n), 4);
  put_le(p + 5, static_cast<uint64_t>(k), 4);
  put_le(p + 9, static_cast<uint64_t>(vocab), 4);
  uint8_t* idx_out = p + kTopKHeaderBytes;
  uint8_t* p0_out = idx_out + static_cast<size_t>(n * k) * width;
  uint8_t* code_out = p0_out + 2 * static_cast<size_t>(n);
  std::vector<int64_t> scratch;
  for (int64_t r = 0; r < n; ++r) {
    const int64_t* row = ix + r * k;
    const float* pr = px + r * k;
    for (int64_t j = 0; j < k; ++j) {
      NEBULA_CHECK(row[j] >= 0 && row[j] < vocab, "encode_topk: row ", r, " index ", row[j], " outside [0, ", vocab,
                   ")");
      NEBULA_CHECK(std::isfinite(pr[j]) && pr[j] >= 0.0f && pr[j] <= 1.0f + 1e-5f, "encode_topk: row ", r,
                   " probability ", pr[j], " outside [0, 1]");
      NEBULA_CHECK(j == 0 || pr[j] <= pr[j - 1], "encode_topk: row ", r, " probabilities not descending at entry ",
                   j, " (", pr[j - 1], " then ", pr[j], ")");
      put_le(idx_out + (r * k + j) * width, static_cast<uint64_t>(row[j]), width);
    }
    NEBULA_CHECK(!has_duplicate(row, k, scratch), "encode_topk: row ", r, " repeats an index");
    const double c0 = std::clamp(std::nearbyint(static_cast<double>(pr[0]) * 65535.0), 1.0, 65535.0);
    put_le(p0_out + 2 * r, static_cast<uint64_t>(c0), 2);
    const double p0_hat = c0 / 65535.0;
    for (int64_t j = 1; j < k; ++j)
      code_out[r * (k - 1) + j - 1] =
          static_cast<uint8_t>(std::min(255.0, std::nearbyint(static_cast<double>(pr[j]) / p0_hat * 255.0)));
  }
  return out;
}

TopK decode_topk(std::span<const uint8_t> bytes, const std::string& what) {
  if (bytes.size() < kTopKHeaderBytes)
    fail(Kind::kTruncated, what, str_cat("top-k payload truncated: ", bytes.size(), " bytes, the header needs ",
                                         kTopKHeaderBytes));
  const uint8_t* p = bytes.data();
  if (p[0] != kTopKVersion)
    fail(Kind::kBadPayload, what, str_cat("top-k payload version ", int(p[0]), " (expected ", int(kTopKVersion), ")"));
  const uint64_t n = get_le(p + 1, 4), k = get_le(p + 5, 4), vocab = get_le(p + 9, 4);
  if (vocab == 0) fail(Kind::kBadPayload, what, "top-k payload: vocab 0");
  if (k == 0 || k > vocab) fail(Kind::kBadPayload, what, str_cat("top-k payload: k = ", k, " outside [1, vocab = ", vocab, "]"));
  const int width = topk_index_width(static_cast<int64_t>(vocab));
  const uint64_t per_row = row_bytes(k, width);
  if (n > std::numeric_limits<uint64_t>::max() / per_row)
    fail(Kind::kBadPayload, what, str_cat("top-k payload: ", n, " tokens x k = ", k, " overflows"));
  const uint64_t need = n * per_row, have = bytes.size() - kTopKHeaderBytes;
  if (have < need)
    fail(Kind::kTruncated, what, str_cat("top-k payload truncated: ", n, " tokens x k = ", k, " need ", need,
                                         " bytes after the header, ", have, " present"));
  if (have > need)
    fail(Kind::kBadPayload, what, str_cat("top-k payload: ", have - need, " trailing bytes after ", n,
                                          " tokens x k = ", k));

  const auto N = static_cast<int64_t>(n), K = static_cast<int64_t>(k);
  at::Tensor index = at::empty({N, K}, at::kLong);
  at::Tensor prob = at::empty({N, K}, at::kFloat);
  int64_t* ix = index.data_ptr<int64_t>();
  float* px = prob.data_ptr<float>();
  const uint8_t* idx_in = p + kTopKHeaderBytes;
  const uint8_t* p0_in = idx_in + n * k * width;
  const uint8_t* code_in = p0_in + 2 * n;
  std::vector<int64_t> scratch;
  for (int64_t r = 0; r < N; ++r) {
    int64_t* row = ix + r * K;
    for (int64_t j = 0; j < K; ++j) {
      const uint64_t v = get_le(idx_in + (r * K + j) * width, width);
      if (v >= vocab)
        fail(Kind::kBadPayload, what, str_cat("top-k payload: row ", r, " entry ", j, " index ", v, " >= vocab ", vocab));
      row[j] = static_cast<int64_t>(v);
    }
    if (has_duplicate(row, K, scratch))
      fail(Kind::kBadPayload, what, str_cat("top-k payload: row ", r, " repeats an index"));
    const uint64_t c0 = get_le(p0_in + 2 * r, 2);
    if (c0 == 0) fail(Kind::kBadPayload, what, str_cat("top-k payload: row ", r, " has p0 code 0"));
    const double p0_hat = static_cast<double>(c0) / 65535.0;
    float* pr = px + r * K;
    pr[0] = static_cast<float>(p0_hat);
    unsigned prev = 255;
    for (int64_t j = 1; j < K; ++j) {
      const unsigned c = code_in[r * (K - 1) + j - 1];
      if (c > prev)
        fail(Kind::kBadPayload, what, str_cat("top-k payload: row ", r, " code ", c, " at entry ", j,
                                              " exceeds the previous ", prev, " (must be non-increasing)"));
      prev = c;
      pr[j] = static_cast<float>(p0_hat * c / 255.0);
    }
  }
  return TopK{index, prob, static_cast<int64_t>(vocab)};
}

}  // namespace nebula::distill
