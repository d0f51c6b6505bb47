// Cost of the frame layer and of the TCP link on loopback, per payload size.
//   build/bench/wire_bench
// bytes_per_second is payload bytes; compare MakeFrame (checksum only) with TcpRoundTrip
// (checksum on both ends + two kernel copies) to see what the link adds.
#include <benchmark/benchmark.h>

#include <thread>

#include "transport/tcp_link.h"
#include "wire/frame.h"

namespace {

using namespace nebula;

void MakeFrame(benchmark::State& state) {
  std::vector<uint8_t> payload(static_cast<size_t>(state.range(0)), 7);
  for (auto _ : state) {
    wire::Frame f = wire::make_frame(wire::FrameType::kData, 1, 0, payload);
    benchmark::DoNotOptimize(f.header.checksum);
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
BENCHMARK(MakeFrame)->Arg(1 << 10)->Arg(1 << 20)->Arg(16 << 20);

void DecodeFrame(benchmark::State& state) {
  auto bytes = wire::encode_frame(wire::make_frame(wire::FrameType::kData, 1, 0,
                                                   std::vector<uint8_t>(static_cast<size_t>(state.range(0)), 7)));
  for (auto _ : state) {
    wire::Frame f = wire::decode_frame(bytes, 1ull << 30);
    benchmark::DoNotOptimize(f.payload.data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0));
}
BENCHMARK(DecodeFrame)->Arg(1 << 10)->Arg(1 << 20)->Arg(16 << 20);

// One frame to an echo peer and back over TcpLink on 127.0.0.1.
void TcpRoundTrip(benchmark::State& state) {
  transport::TcpListener listener("127.0.0.1", 0);
  std::thread echo([&] {
    auto link = listener.accept(Deadline::after(std::chrono::seconds(10)));
    try {
      for (;;) link->send(link->recv(Deadline::after(std::chrono::seconds(30))), Deadline::after(std::chrono::seconds(30)));
    } catch (const std::exception&) {
    }
  });
  auto link = transport::TcpLink::connect("127.0.0.1", listener.port(), "echo", Deadline::after(std::chrono::seconds(10)));
  wire::Frame f = wire::make_frame(wire::FrameType::kData, 1, 0, std::vector<uint8_t>(static_cast<size_t>(state.range(0)), 7));
  for (auto _ : state) {
    link->send(f, Deadline::after(std::chrono::seconds(30)));
    auto back = link->recv(Deadline::after(std::chrono::seconds(30)));
    benchmark::DoNotOptimize(back.payload.data());
  }
  state.SetBytesProcessed(state.iterations() * state.range(0) * 2);
  link->close();
  echo.join();
}
BENCHMARK(TcpRoundTrip)->Arg(1 << 10)->Arg(1 << 20)->Arg(16 << 20)->UseRealTime();

}  // namespace
