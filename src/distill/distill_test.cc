#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "distill/kd_loss.h"
#include "distill/protocol.h"
#include "distill/teacher_service.h"
#include "distill/topk.h"
#include "nebula/error.h"
#include "transport/emulated_link.h"
#include "transport/link_test_util.h"

namespace nebula::distill {
namespace {

using namespace std::chrono_literals;
using transport::testing::GatedLink;
using transport::testing::make_tcp_pair;

// ---- helpers ---------------------------------------------------------------------------

// Deterministic logits without an RNG: a smooth but irregular [n, v] pattern.
at::Tensor pattern_logits(int64_t n, int64_t v, double phase = 0.0) {
  return at::sin(at::arange(n * v, at::kDouble).reshape({n, v}) * 0.7351 + phase).mul(3.0).to(at::kFloat) +
         at::cos(at::arange(n * v, at::kDouble).reshape({n, v}) * 0.0173).to(at::kFloat);
}

// The largest probability entry in row 0 is the reference scale of the error bound.
void expect_within_bound(const TopK& exact, const TopK& decoded) {
  ASSERT_EQ(exact.index.sizes(), decoded.index.sizes());
  EXPECT_TRUE(at::equal(exact.index.cpu(), decoded.index));
  EXPECT_EQ(decoded.vocab, exact.vocab);
  const at::Tensor p = exact.prob.cpu();
  const at::Tensor q = decoded.prob;
  const int64_t n = p.size(0), k = p.size(1);
  for (int64_t r = 0; r < n; ++r) {
    const double p0_hat = q[r][0].item<double>();
    const double bound = std::max(p0_hat / 510.0, 1.0 / 65535.0) + 1e-7;  // + float rounding
    for (int64_t j = 0; j < k; ++j) {
      EXPECT_LE(std::abs(q[r][j].item<double>() - p[r][j].item<double>()), bound) << "row " << r << " entry " << j;
      if (j > 0) {
        EXPECT_LE(q[r][j].item<float>(), q[r][j - 1].item<float>());
      }
    }
  }
}

template <typename F>
std::string expect_frame_error(F&& f, FrameError::Kind kind) {
  try {
    f();
  } catch (const FrameError& e) {
    EXPECT_EQ(static_cast<int>(e.kind()), static_cast<int>(kind)) << e.what();
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected FrameError, got: " << e.what();
    return {};
  }
  ADD_FAILURE() << "expected FrameError, nothing thrown";
  return {};
}

void put_u32(std::vector<uint8_t>& b, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) b[at + i] = static_cast<uint8_t>(v >> (8 * i));
}

// ---- top-k format ----------------------------------------------------------------------

TEST(TopK, PicksLargestWithSoftmaxProbabilities) {
  const at::Tensor logits = pattern_logits(6, 50);
  for (double t : {1.0, 2.0}) {
    const TopK k5 = top_k(logits, 5, t);
    ASSERT_EQ(k5.index.sizes(), (at::IntArrayRef{6, 5}));
    EXPECT_EQ(k5.vocab, 50);
    auto [sorted, order] = logits.sort(1, /*descending=*/true);
    EXPECT_TRUE(at::equal(k5.index, order.slice(1, 0, 5)));
    const at::Tensor direct = at::softmax(logits.to(at::kDouble) / t, 1).gather(1, k5.index);
    EXPECT_TRUE(at::allclose(k5.prob.to(at::kDouble), direct, 1e-5, 1e-7)) << "T = " << t;
  }
  EXPECT_THROW(top_k(logits, 0, 1.0), Error);
  EXPECT_THROW(top_k(logits, 51, 1.0), Error);
  EXPECT_THROW(top_k(logits, 5, 0.0), Error);
}

TEST(TopK, RoundTripU16Indices) {
  for (int64_t vocab : {1000, 65536}) {
    const TopK exact = top_k(pattern_logits(40, vocab), 8, 1.0);
    const std::vector<uint8_t> bytes = encode_topk(exact);
    EXPECT_EQ(bytes.size(), topk_bytes(40, 8, vocab));
    EXPECT_EQ(bytes.size(), kTopKHeaderBytes + 40 * (8 * 2 + 2 + 7));
    expect_within_bound(exact, decode_topk(bytes, "test"));
  }
}

TEST(TopK, RoundTripU32Indices) {
  const int64_t vocab = 70000;
  at::Tensor logits = pattern_logits(4, vocab);
  logits.index_put_({1, 69999}, 100.0f);  // an index that needs more than 16 bits, p ~ 1
  const TopK exact = top_k(logits, 8, 2.0);
  EXPECT_EQ(exact.index[1][0].item<int64_t>(), 69999);
  const std::vector<uint8_t> bytes = encode_topk(exact);
  EXPECT_EQ(bytes.size(), topk_bytes(4, 8, vocab));
  EXPECT_EQ(bytes.size(), kTopKHeaderBytes + 4 * (8 * 4 + 2 + 7));
  expect_within_bound(exact, decode_topk(bytes, "test"));
}

TEST(TopK, RoundTripEdgeRows) {
  // k = vocab; a one-hot row; a flat row; a row whose p0 is below the u16 step (clamped to 1).
  TopK t;
  t.vocab = 4;
  t.index = at::tensor(std::vector<int64_t>{3, 0, 1, 2, 2, 1, 0, 3, 0, 1, 2, 3}, at::kLong).reshape({3, 4});
  t.prob = at::tensor(std::vector<float>{1, 0, 0, 0, 0.25f, 0.25f, 0.25f, 0.25f, 1e-6f, 5e-7f, 0, 0}).reshape({3, 4});
  expect_within_bound(t, decode_topk(encode_topk(t), "test"));
  // No tokens at all.
  const TopK empty = top_k(at::zeros({0, 10}), 3, 1.0);
  const TopK back = decode_topk(encode_topk(empty), "test");
  EXPECT_EQ(back.index.sizes(), (at::IntArrayRef{0, 3}));
  EXPECT_EQ(encode_topk(empty).size(), kTopKHeaderBytes);
}

TEST(TopK, DecodeRejectsBadPayloads) {
  const int64_t vocab = 1000;
  const std::vector<uint8_t> good = encode_topk(top_k(pattern_logits(3, vocab), 4, 1.0));
  ASSERT_NO_THROW(decode_topk(good, "payload from test"));
  using K = FrameError::Kind;

  for (size_t n : {size_t{0}, size_t{5}, kTopKHeaderBytes, good.size() - 1}) {
    std::string msg = expect_frame_error(
        [&] { decode_topk(std::span<const uint8_t>(good).first(n), "payload from test"); }, K::kTruncated);
    EXPECT_NE(msg.find("payload from test"), std::string::npos) << msg;
    EXPECT_NE(msg.find("truncated"), std::string::npos) << msg;
  }
  {
    std::vector<uint8_t> b = good;
    b.push_back(0);
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("1 trailing bytes"),
              std::string::npos);
  }
  {
    std::vector<uint8_t> b = good;  // first index of row 1 := vocab
    b[kTopKHeaderBytes + 4 * 2] = vocab & 0xff;
    b[kTopKHeaderBytes + 4 * 2 + 1] = vocab >> 8;
    std::string msg = expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload);
    EXPECT_NE(msg.find("row 1 entry 0 index 1000 >= vocab 1000"), std::string::npos) << msg;
  }
  {
    std::vector<uint8_t> b = good;  // row 0 entry 1 := entry 0
    b[kTopKHeaderBytes + 2] = b[kTopKHeaderBytes];
    b[kTopKHeaderBytes + 3] = b[kTopKHeaderBytes + 1];
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("repeats"), std::string::npos);
  }
  {
    std::vector<uint8_t> b = good;
    put_u32(b, 5, vocab + 1);  // k > vocab
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("k = 1001"), std::string::npos);
    put_u32(b, 5, 0);
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("k = 0"), std::string::npos);
  }
  {
    std::vector<uint8_t> b = good;  // N * row bytes overflows u64
    put_u32(b, 1, 0xFFFFFFFFu);
    put_u32(b, 5, 0xFFFFFFFFu);
    put_u32(b, 9, 0xFFFFFFFFu);
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("overflows"), std::string::npos);
    put_u32(b, 1, 1000000);  // no overflow, just far more than is there
    expect_frame_error([&] { decode_topk(b, "t"); }, K::kTruncated);
  }
  {
    std::vector<uint8_t> b = good;
    b[0] = 9;
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("version 9"), std::string::npos);
    b = good;
    put_u32(b, 9, 0);
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("vocab 0"), std::string::npos);
  }
  {
    const size_t p0 = kTopKHeaderBytes + 3 * 4 * 2, codes = p0 + 3 * 2;
    std::vector<uint8_t> b = good;
    b[p0] = b[p0 + 1] = 0;
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("p0 code 0"), std::string::npos);
    b = good;
    b[codes + 1] = static_cast<uint8_t>(b[codes] + 1);  // row 0: entry 2 above entry 1
    EXPECT_NE(expect_frame_error([&] { decode_topk(b, "t"); }, K::kBadPayload).find("non-increasing"),
              std::string::npos);
  }
}

TEST(TopK, BytesPerToken) {
  // k = 8: 8 u16 indices + u16 p0 + 7 u8 codes = 25 bytes/token while V <= 65536.
  EXPECT_EQ(topk_bytes(1000, 8, 1000), kTopKHeaderBytes + 25 * 1000);
  EXPECT_EQ(topk_bytes(1000, 8, 32000), kTopKHeaderBytes + 25 * 1000);
  EXPECT_EQ(topk_bytes(1000, 8, 100000), kTopKHeaderBytes + 41 * 1000);
  EXPECT_THROW(topk_bytes(1, 9, 8), Error);
}

// ---- KD loss ---------------------------------------------------------------------------

// T² · mean_r Σ_{q>0} q (log q − log softmax(s/T)), in double with plain loops.
double reference_kd(const at::Tensor& s_in, const TopK& t, double temp) {
  const at::Tensor s = s_in.detach().to(at::kDouble).contiguous();
  const at::Tensor idx = t.index.contiguous(), pr = t.prob.to(at::kDouble).contiguous();
  const int64_t n = s.size(0), v = s.size(1), k = idx.size(1);
  double total = 0;
  for (int64_t r = 0; r < n; ++r) {
    const double* z = s.data_ptr<double>() + r * v;
    double mx = -INFINITY;
    for (int64_t i = 0; i < v; ++i) mx = std::max(mx, z[i] / temp);
    double se = 0;
    for (int64_t i = 0; i < v; ++i) se += std::exp(z[i] / temp - mx);
    const double lse = mx + std::log(se);
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += pr.data_ptr<double>()[r * k + j];
    double kl = 0;
    for (int64_t j = 0; j < k; ++j) {
      const double q = pr.data_ptr<double>()[r * k + j] / sum;
      if (q == 0) continue;
      const int64_t i = idx.data_ptr<int64_t>()[r * k + j];
      kl += q * (std::log(q) - (z[i] / temp - lse));
    }
    total += kl;
  }
  return temp * temp * total / n;
}

TEST(KdLoss, MatchesDirectComputation) {
  const at::Tensor teacher_logits = pattern_logits(7, 30, 0.3);
  for (double temp : {1.0, 2.0}) {
    TopK t = top_k(teacher_logits, 5, temp);
    t.prob[2][4] = 0.0f;  // a zero entry contributes nothing and must not make NaNs
    at::Tensor s = pattern_logits(7, 30, 1.1).set_requires_grad(true);
    const at::Tensor loss = kd_loss(s, t, temp);
    EXPECT_NEAR(loss.item<double>(), reference_kd(s, t, temp), 1e-5) << "T = " << temp;
    loss.backward();
    ASSERT_TRUE(s.grad().defined());
    EXPECT_TRUE(at::isfinite(s.grad()).all().item<bool>());
    EXPECT_GT(s.grad().abs().sum().item<double>(), 1e-6);
    // Also through the wire format (quantised probabilities).
    const TopK wire = decode_topk(encode_topk(t), "test");
    EXPECT_NEAR(kd_loss(s, wire, temp).item<double>(), reference_kd(s, wire, temp), 1e-5);
  }
}

TEST(KdLoss, OneHotTeacherIsCrossEntropy) {
  const at::Tensor s = pattern_logits(5, 12, 0.5);
  const at::Tensor target = at::tensor(std::vector<int64_t>{3, 0, 11, 7, 7}, at::kLong);
  TopK t;
  t.vocab = 12;
  t.index = at::stack({target, (target + 1) % 12, (target + 2) % 12}, 1);
  t.prob = at::zeros({5, 3});
  t.prob.select(1, 0).fill_(1.0f);
  const double ce = at::nll_loss(at::log_softmax(s, 1), target).item<double>();
  EXPECT_NEAR(kd_loss(s, t, 1.0).item<double>(), ce, 1e-5);
  // Through the wire format too: a one-hot row is exact there.
  EXPECT_NEAR(kd_loss(s, decode_topk(encode_topk(t), "t"), 1.0).item<double>(), ce, 1e-5);
  EXPECT_EQ(kd_loss(at::zeros({0, 12}), TopK{at::zeros({0, 3}, at::kLong), at::zeros({0, 3}), 12}, 1.0).item<double>(),
            0.0);
  EXPECT_THROW(kd_loss(at::zeros({5, 13}), t, 1.0), Error);
}

// ---- protocol and teacher service ------------------------------------------------------

// A deterministic "teacher": row = table[tgt token] + 0.5 table[last src token].
struct FakeTeacher {
  int64_t vocab;
  at::Tensor table;
  explicit FakeTeacher(int64_t v) : vocab(v), table(pattern_logits(v, v, 0.9)) {}
  at::Tensor operator()(const Sequences& src, const Sequences& tgt) const {
    std::vector<int64_t> a, b;
    for (size_t s = 0; s < tgt.size(); ++s)
      for (int id : tgt[s]) {
        if (id == 299) throw std::runtime_error("boom: token 299");
        if (id == 298) return at::zeros({1, vocab + 1});  // a teacher bug: wrong shape
        a.push_back(id);
        b.push_back(src[s].empty() ? 0 : src[s].back());
      }
    return table.index_select(0, at::tensor(a, at::kLong)) + 0.5 * table.index_select(0, at::tensor(b, at::kLong));
  }
};

Sequences seqs(std::initializer_list<std::vector<int>> l) { return Sequences(l); }

// Deterministic (src, tgt_in) batch number i.
std::pair<Sequences, Sequences> batch(int i, int64_t vocab) {
  Sequences src, tgt;
  for (int s = 0; s < 3 + i % 3; ++s) {
    std::vector<int> a, b;
    for (int j = 0; j < 4 + (i + s) % 5; ++j) a.push_back(static_cast<int>((i * 37 + s * 11 + j * 7) % 290));
    for (int j = 0; j < 2 + (i * s) % 6; ++j) b.push_back(static_cast<int>((i * 13 + s * 5 + j * 3) % 290));
    src.push_back(a);
    tgt.push_back(b);
  }
  return {src, tgt};
}

std::string text(const wire::Frame& f) { return std::string(f.payload.begin(), f.payload.end()); }

TEST(Protocol, RequestRoundTripAndLimits) {
  const auto [src, tgt] = batch(4, 300);
  const RequestLimits limits{300, 16, 16};
  const Request r = decode_request(encode_request(src, tgt), limits, "req");
  EXPECT_EQ(r.src, src);
  EXPECT_EQ(r.tgt_in, tgt);
  int64_t n = 0;
  for (const auto& t : tgt) n += static_cast<int64_t>(t.size());
  EXPECT_EQ(target_tokens(tgt), n);
  EXPECT_THROW(encode_request(seqs({{1}}), seqs({})), Error);
  EXPECT_THROW(encode_request(seqs({{-1}}), seqs({{1}})), Error);
  std::vector<uint8_t> p = encode_request(src, tgt);
  p.push_back(0);
  EXPECT_THROW(decode_request(p, limits, "req"), FrameError);
  EXPECT_EQ(message_kind_name(2), "response");
  EXPECT_EQ(message_kind_name(9), "kind(9)");
}

// Sends one raw message and returns the answer.
wire::Frame ask(transport::Link& link, uint16_t kind, uint64_t id, std::vector<uint8_t> payload) {
  link.send(wire::make_frame(wire::FrameType::kData, id, 0, std::move(payload), kind), Deadline::after(10s));
  return link.recv(Deadline::after(30s));
}

void expect_error(const wire::Frame& f, uint64_t id, const std::string& needle) {
  EXPECT_EQ(f.header.flags, static_cast<uint16_t>(MessageKind::kError)) << text(f);
  EXPECT_EQ(f.header.op_id, id);
  const std::string msg = text(f);
  EXPECT_NE(msg.find(str_cat("request ", id)), std::string::npos) << msg;
  EXPECT_NE(msg.find(needle), std::string::npos) << msg;
}

TEST(TeacherService, AnswersAndSurvivesMalformedRequests) {
  const FakeTeacher teacher(300);
  ServeOptions opt;
  opt.vocab = 300;
  opt.max_sequences = 5;
  opt.max_len = 16;
  opt.k = 8;
  opt.temperature = 2.0;
  opt.idle_timeout = 30s;
  auto pair = make_tcp_pair();
  auto served = std::async(std::launch::async, [&] { return serve_teacher(*pair.server, std::ref(teacher), opt); });
  transport::Link& c = *pair.client;
  constexpr uint16_t kReq = 1;

  auto expect_answer = [&](uint64_t id, const Sequences& src, const Sequences& tgt) {
    const wire::Frame f = ask(c, kReq, id, encode_request(src, tgt));
    ASSERT_EQ(f.header.flags, static_cast<uint16_t>(MessageKind::kResponse)) << text(f);
    EXPECT_EQ(f.header.op_id, id);
    EXPECT_EQ(f.payload, encode_topk(top_k(teacher(src, tgt), opt.k, opt.temperature)));
    EXPECT_EQ(f.payload.size(), topk_bytes(target_tokens(tgt), opt.k, opt.vocab));
  };
  const auto [src1, tgt1] = batch(1, 300);
  expect_answer(1, src1, tgt1);

  expect_error(ask(c, kReq, 2, {1, 2, 3}), 2, "truncated");
  expect_error(ask(c, 2, 3, encode_request(src1, tgt1)), 3, "unexpected message kind response");
  expect_error(ask(c, kReq, 4, encode_request(seqs({{1, 2}}), seqs({{5, 300}}))), 4,
               "sequence 0: tgt_in position 1: id 300 outside [0, 300)");
  expect_error(ask(c, kReq, 5, encode_request(seqs({std::vector<int>(17, 1)}), seqs({{5}}))), 5,
               "src length 17 > max_len 16");
  expect_error(ask(c, kReq, 6, encode_request(seqs({}), seqs({}))), 6, "no sequences");
  expect_error(ask(c, kReq, 7, encode_request(Sequences(6, {1}), Sequences(6, {2}))), 7, "6 sequences > max_sequences 5");
  expect_error(ask(c, kReq, 8, encode_request(seqs({{1}}), seqs({{3, 299}}))), 8, "teacher failed: boom: token 299");
  expect_error(ask(c, kReq, 9, {}), 9, "empty request");
  expect_error(ask(c, kReq, 13, encode_request(seqs({{1}}), seqs({{298, 3}}))), 13,
               "teacher returned logits [1, 301], expected [2, 300]");
  c.send(wire::make_frame(wire::FrameType::kHeartbeat, 12, 0, {}), Deadline::after(10s));
  expect_error(c.recv(Deadline::after(30s)), 12, "unexpected frame type heartbeat");

  const auto [src2, tgt2] = batch(2, 300);
  expect_answer(10, src2, tgt2);
  expect_answer(11, seqs({{}, {4}}), seqs({{}, {}}));  // no target tokens: N = 0

  const wire::Frame bye = ask(c, static_cast<uint16_t>(MessageKind::kBye), 0, {});
  EXPECT_EQ(bye.header.flags, static_cast<uint16_t>(MessageKind::kBye));
  ASSERT_EQ(served.wait_for(30s), std::future_status::ready);
  const ServeStats st = served.get();
  EXPECT_EQ(st.requests, 13u);
  EXPECT_EQ(st.errors, 10u);
  EXPECT_EQ(st.tokens, static_cast<uint64_t>(target_tokens(tgt1) + target_tokens(tgt2)));
}

TEST(TeacherService, ReturnsWhenTheStudentCloses) {
  const FakeTeacher teacher(300);
  ServeOptions opt;
  opt.vocab = 300;
  auto pair = make_tcp_pair();
  auto served = std::async(std::launch::async, [&] { return serve_teacher(*pair.server, std::ref(teacher), opt); });
  const auto [src, tgt] = batch(0, 300);
  EXPECT_EQ(ask(*pair.client, 1, 1, encode_request(src, tgt)).header.flags,
            static_cast<uint16_t>(MessageKind::kResponse));
  pair.client->close();
  ASSERT_EQ(served.wait_for(30s), std::future_status::ready);
  EXPECT_EQ(served.get().requests, 1u);
}

TEST(TeacherService, IdleTimeout) {
  const FakeTeacher teacher(300);
  ServeOptions opt;
  opt.vocab = 300;
  opt.idle_timeout = 50ms;
  auto pair = make_tcp_pair();  // the student never speaks
  EXPECT_THROW(serve_teacher(*pair.server, std::ref(teacher), opt), Timeout);
  opt.k = 301;
  EXPECT_THROW(serve_teacher(*pair.server, std::ref(teacher), opt), Error);
}

// ---- client ----------------------------------------------------------------------------

TEST(TeacherClient, PipelinesOverAnEmulatedWan) {
  const FakeTeacher teacher(300);
  ServeOptions opt;
  opt.vocab = 300;
  opt.idle_timeout = 30s;
  auto pair = make_tcp_pair();
  // 25 ms each way: 50 ms RTT. Both directions are emulated (EmulatedLink shapes sends).
  // Under each EmulatedLink a GatedLink: the student's holds every answer back until the
  // test lets it through; the teacher's counts the requests that reached it.
  transport::WanEmulation wan;
  wan.one_way_delay = 25ms;
  auto student_gate = std::make_unique<GatedLink>(std::move(pair.client));
  auto teacher_gate = std::make_unique<GatedLink>(std::move(pair.server));
  GatedLink& answers = *student_gate;
  GatedLink& requests = *teacher_gate;
  answers.open_recv(false);
  transport::EmulatedLink student_link(std::move(student_gate), wan);
  transport::EmulatedLink teacher_link(std::move(teacher_gate), wan);
  auto served = std::async(std::launch::async, [&] { return serve_teacher(teacher_link, std::ref(teacher), opt); });

  TeacherClient client(student_link);
  constexpr int kBatches = 8;
  uint64_t request_bytes = 0, response_bytes = 0;
  int64_t tokens = 0;
  for (int i = 0; i < kBatches; ++i) {
    auto [src, tgt] = batch(i, 300);
    request_bytes += encode_request(src, tgt).size();
    response_bytes += topk_bytes(target_tokens(tgt), opt.k, opt.vocab);
    tokens += target_tokens(tgt);
    client.submit(100 + i, std::move(src), std::move(tgt));
  }
  client.submit(200, seqs({{1}}), seqs({{2, 999}}));  // id >= vocab: an error reply
  request_bytes += encode_request(seqs({{1}}), seqs({{2, 999}})).size();
  tokens += 2;
  // Pipelined: all nine requests are outstanding at once. While no answer can reach the
  // client, every one of them still reaches the teacher; a client that waited for each answer
  // before the next request (one per round trip, >= 9 x 50 ms) would stop at the first. An
  // order of events, not a timing: the bound only keeps a broken client from hanging the test.
  ASSERT_TRUE(requests.wait_received(kBatches + 1, Deadline::after(30s)))
      << requests.received() << " of " << kBatches + 1 << " requests reached the teacher before any answer came back";
  EXPECT_EQ(answers.received(), 0u);
  answers.open_recv(true);

  for (int i = 0; i < kBatches; ++i) {
    const auto [src, tgt] = batch(i, 300);
    const TopK got = client.wait(100 + i, Deadline::after(30s));
    const TopK want = decode_topk(encode_topk(top_k(teacher(src, tgt), opt.k, opt.temperature)), "want");
    EXPECT_TRUE(at::equal(got.index, want.index)) << "batch " << i;
    EXPECT_TRUE(at::equal(got.prob, want.prob)) << "batch " << i;
    EXPECT_EQ(got.vocab, 300);
  }
  try {
    client.wait(200, Deadline::after(30s));
    ADD_FAILURE() << "no error";
  } catch (const NetworkError& e) {
    ADD_FAILURE() << "network error instead of the teacher's: " << e.what();
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("teacher error for request 200"), std::string::npos) << msg;
    EXPECT_NE(msg.find("id 999 outside [0, 300)"), std::string::npos) << msg;
  }
  EXPECT_THROW(client.wait(200, Deadline::after(1s)), Error);  // no longer outstanding

  const ClientStats cs = client.stats();
  EXPECT_EQ(cs.requests, kBatches + 1u);
  EXPECT_EQ(cs.tokens, static_cast<uint64_t>(tokens));
  EXPECT_EQ(cs.errors, 1u);
  EXPECT_EQ(cs.bytes_sent, request_bytes);
  EXPECT_GT(cs.bytes_received, response_bytes);  // + the error message
  client.close();
  ASSERT_EQ(served.wait_for(30s), std::future_status::ready);
  const ServeStats ss = served.get();
  EXPECT_EQ(ss.requests, kBatches + 1u);
  EXPECT_EQ(ss.errors, 1u);
  EXPECT_EQ(ss.bytes_received, cs.bytes_sent);
  EXPECT_EQ(ss.bytes_sent, cs.bytes_received);
  EXPECT_THROW(client.submit(300, seqs({{1}}), seqs({{1}})), Error);  // closed
}

TEST(TeacherClient, DeadlinesAndLostPeers) {
  auto pair = make_tcp_pair();
  ClientOptions co;
  co.close_timeout = 200ms;
  {
    TeacherClient client(*pair.client, co);  // nobody serves
    client.submit(1, seqs({{1}}), seqs({{2}}));
    EXPECT_THROW(client.wait(1, Deadline::after(0ms)), Timeout);
    EXPECT_THROW(client.wait(7, Deadline::after(0ms)), Error);  // never submitted
    EXPECT_THROW(client.submit(1, seqs({{1}}), seqs({{2}})), Error);  // still outstanding
    client.close();  // no bye comes back: the link is closed after close_timeout
    EXPECT_THROW(client.wait(1, Deadline::after(10s)), PeerLost);
  }
  {
    // The sender fails (a request above the link's max_payload): every wait reports it.
    auto small = make_tcp_pair(transport::LinkOptions{.max_payload = 64});
    TeacherClient client(*small.client, co);
    client.submit(1, seqs({std::vector<int>(100, 1)}), seqs({{2}}));
    try {
      client.wait(1, Deadline::after(30s));
      ADD_FAILURE() << "no error";
    } catch (const PeerLost& e) {
      EXPECT_NE(std::string(e.what()).find("max_payload"), std::string::npos) << e.what();
    }
    client.submit(2, seqs({{1}}), seqs({{2}}));
    EXPECT_THROW(client.wait(2, Deadline::after(30s)), PeerLost);
  }
  auto pair2 = make_tcp_pair();
  TeacherClient client(*pair2.client, co);
  client.submit(1, seqs({{1}}), seqs({{2}}));
  pair2.server->close();  // the teacher's site goes away
  try {
    client.wait(1, Deadline::after(30s));
    ADD_FAILURE() << "no error";
  } catch (const PeerLost& e) {
    EXPECT_NE(std::string(e.what()).find("teacher request 1"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace nebula::distill
