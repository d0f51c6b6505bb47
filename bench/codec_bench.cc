// Tensor codecs, one thread: encode + decode throughput (bytes_per_second counts the input
// float32 bytes), the two halves separately (enc_GB/s, dec_GB/s, 1e9 bytes), and the
// compression ratio (input bytes / payload bytes). Error feedback is off for the casts and
// quantizers (their fast path; *_ef variants show its cost) and on for topk, powersgd and
// sparseloco, as they are used. powersgd gets a square matrix (1024^2 or 4096^2) so it
// takes the low-rank path. sparseloco keeps 1% of each chunk of 4096 (SparseLoCo's chunk)
// or of 256 (the [strategy] default block). at_topk is ATen's top-k selection alone, for
// comparison with topk's radix select (which is inside the whole topk encode + decode).
// memcpy copies the same float32 bytes twice (there and back, into reused buffers): what the
// memory system allows a pass of encode + decode, the ceiling for `none` at each size.
#include <ATen/Parallel.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/topk.h>
#include <benchmark/benchmark.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <vector>

#include "codec/codec.h"
#include "codec/topk_codec.h"
#include "util/allocator.h"

namespace {

// As in the nebula binary (util/allocator.h), before the first allocation of a benchmark.
[[maybe_unused]] const bool kTuned = nebula::tune_allocator();

using nebula::codec::CodecOptions;
using nebula::codec::CodecState;
using Clock = std::chrono::steady_clock;

CodecOptions opts(const char* kind, bool error_feedback = false, bool stochastic = false) {
  CodecOptions o;
  o.kind = kind;
  o.error_feedback = error_feedback;
  o.stochastic = stochastic;
  return o;
}

CodecOptions sparseloco(int64_t chunk, double density) {
  CodecOptions o = opts("sparseloco", true);
  o.block = chunk;
  o.density = density;
  return o;
}

at::Tensor input(int64_t n) {
  at::manual_seed(1);
  const auto side = int64_t{1} << (static_cast<int>(std::log2(static_cast<double>(n))) / 2);
  return at::randn({side, n / side}, at::kFloat);
}

void BM_Codec(benchmark::State& st, CodecOptions o) {
  at::set_num_threads(1);
  const int64_t n = st.range(0);
  const at::Tensor t = input(n);
  const auto codec = nebula::codec::make_codec(o);
  CodecState state;
  size_t payload = 0;
  double enc_s = 0, dec_s = 0;
  for (auto _ : st) {
    const auto t0 = Clock::now();
    const std::vector<uint8_t> p = codec->encode(t, state);
    const auto t1 = Clock::now();
    const at::Tensor d = codec->decode(p);
    const auto t2 = Clock::now();
    benchmark::DoNotOptimize(d.data_ptr<float>());
    payload = p.size();
    enc_s += std::chrono::duration<double>(t1 - t0).count();
    dec_s += std::chrono::duration<double>(t2 - t1).count();
  }
  const double bytes = 4.0 * static_cast<double>(n) * static_cast<double>(st.iterations());
  st.SetBytesProcessed(static_cast<int64_t>(bytes));
  st.counters["ratio"] = 4.0 * static_cast<double>(n) / static_cast<double>(payload);
  st.counters["enc_GB/s"] = bytes / enc_s / 1e9;
  st.counters["dec_GB/s"] = bytes / dec_s / 1e9;
}

void BM_Memcpy(benchmark::State& st) {
  const int64_t n = st.range(0);
  const at::Tensor t = input(n);
  std::vector<float> there(static_cast<size_t>(n)), back(static_cast<size_t>(n));
  for (auto _ : st) {
    std::memcpy(there.data(), t.data_ptr<float>(), there.size() * sizeof(float));
    std::memcpy(back.data(), there.data(), back.size() * sizeof(float));
    benchmark::DoNotOptimize(back.data());
  }
  st.SetBytesProcessed(st.iterations() * n * 4);
}

void BM_AtTopk(benchmark::State& st) {
  at::set_num_threads(1);
  const int64_t n = st.range(0);
  const at::Tensor t = input(n).flatten();
  const int64_t k = nebula::codec::topk_count(n, 0.01);
  for (auto _ : st) benchmark::DoNotOptimize(at::topk(at::abs(t), k));
  st.SetBytesProcessed(st.iterations() * n * 4);
}

}  // namespace

#define CODEC_BENCH(label, options) \
  BENCHMARK_CAPTURE(BM_Codec, label, options)->Arg(1 << 20)->Arg(1 << 24)->Unit(benchmark::kMillisecond)

CODEC_BENCH(none, opts("none"));
CODEC_BENCH(fp16, opts("fp16"));
CODEC_BENCH(bf16, opts("bf16"));
CODEC_BENCH(int8, opts("int8"));
CODEC_BENCH(int4, opts("int4"));
CODEC_BENCH(int8_stochastic, opts("int8", false, true));
CODEC_BENCH(int4_stochastic, opts("int4", false, true));
CODEC_BENCH(int8_ef, opts("int8", true));
CODEC_BENCH(int4_ef, opts("int4", true));
CODEC_BENCH(topk, opts("topk", true));
CODEC_BENCH(powersgd, opts("powersgd", true));
CODEC_BENCH(sparseloco, sparseloco(4096, 0.01));
CODEC_BENCH(sparseloco_256, sparseloco(256, 0.01));
BENCHMARK(BM_Memcpy)->Arg(1 << 20)->Arg(1 << 24)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_AtTopk)->Arg(1 << 20)->Arg(1 << 24)->Unit(benchmark::kMillisecond);
