// libFuzzer target for ResilientLink's session protocol (transport/resilient_link.h): the
// frames a peer sends on a connection -- resume, acks, pings, pongs, heartbeats, pieces of
// split frames, data, bye -- in any order, with any fields.
//
// The input is a script of frames, each made with a valid CRC (so the fuzzer explores the
// protocol, not checksum failures): [type u8][seq u8][op_id u8][payload length u8][payload].
// Every frame type the wire decoder lets through is used. A ResilientLink takes the script as its one
// connection (no reconnection), and the fuzzer reads everything the link delivers. Anything
// but these outcomes aborts: frames delivered in order with seqs 1, 2, 3, ..., each whole and
// with a valid checksum, never a session type; then PeerLost (the script ended, the peer broke
// the protocol or said goodbye) or Timeout. A sanitizer report, a hang (-timeout), or an
// allocation sized by a claimed length (-malloc_limit_mb) fails too.
//
// Seed mode: NEBULA_FUZZ_WRITE_SEEDS=DIR ./session_fuzzer writes a few scripts to DIR.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "nebula/error.h"
#include "transport/resilient_link.h"
#include "wire/frame.h"
#include "fuzz_util.h"
#include "scripted_link.h"

namespace {

using namespace nebula;
using namespace nebula::transport;
using wire::Frame;
using wire::FrameType;

uint64_t u64_at(const uint8_t* p, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n && i < 8; ++i) v |= uint64_t{p[i]} << (8 * i);
  return v;
}

std::deque<Frame> parse_script(const uint8_t* data, size_t size) {
  std::deque<Frame> out;
  size_t at = 0;
  while (at + 4 <= size && out.size() < 256) {
    // 1..9: every type a connection can deliver (the wire decoder refuses any other)
    const auto type = static_cast<FrameType>(1 + data[at] % 9);
    const uint64_t seq = data[at + 1], op = data[at + 2];
    const size_t len = std::min<size_t>(data[at + 3], size - at - 4);
    std::vector<uint8_t> payload(data + at + 4, data + at + 4 + len);
    at += 4 + len;
    // An op_id of a part frame is the whole's length: let the fuzzer also claim huge ones.
    const uint64_t op_id = type == FrameType::kPart && len >= 8 ? u64_at(payload.data(), 8) : op;
    Frame f;
    f.header.type = type;
    f.header.seq = seq;
    f.header.op_id = op_id;
    f.header.payload_len = payload.size();
    f.header.checksum = wire::compute_checksum(f.header, payload);
    f.payload = std::move(payload);
    out.push_back(std::move(f));
  }
  return out;
}

void put_frame(std::vector<uint8_t>& s, uint8_t type, uint8_t seq, uint8_t op, std::vector<uint8_t> payload) {
  s.push_back(static_cast<uint8_t>(type - 1));
  s.push_back(seq);
  s.push_back(op);
  s.push_back(static_cast<uint8_t>(payload.size()));
  s.insert(s.end(), payload.begin(), payload.end());
}

std::vector<uint8_t> u64s(std::initializer_list<uint64_t> vs) {
  wire::ByteWriter w;
  for (uint64_t v : vs) w.put_u64(v);
  return w.take();
}

void write_seeds(const std::string& dir) {
  std::vector<std::pair<std::string, std::vector<uint8_t>>> seeds(4);
  auto& [n0, s0] = seeds[0];  // resume, two data frames, an ack, a ping
  n0 = "plain";
  put_frame(s0, 6, 0, 0, u64s({42, 0, 0}));
  put_frame(s0, 2, 1, 7, {1, 2, 3});
  put_frame(s0, 2, 2, 8, {});
  put_frame(s0, 5, 0, 0, u64s({0, 0}));
  put_frame(s0, 7, 0, 0, u64s({5}));
  auto& [n1, s1] = seeds[1];  // a frame in three pieces
  n1 = "pieces";
  put_frame(s1, 6, 0, 0, u64s({42, 0, 0}));
  put_frame(s1, 9, 1, 10, {1, 2, 3, 4});
  put_frame(s1, 9, 1, 10, {5, 6, 7});
  put_frame(s1, 2, 1, 3, {8, 9, 10});
  auto& [n2, s2] = seeds[2];  // heartbeats, a pong, a goodbye
  n2 = "control";
  put_frame(s2, 6, 0, 0, u64s({42, 0, 0}));
  put_frame(s2, 4, 0, 0, {});
  put_frame(s2, 8, 0, 0, u64s({1, 100}));
  put_frame(s2, 3, 0, 0, {});
  auto& [n3, s3] = seeds[3];  // a replay and a gap
  n3 = "replay";
  put_frame(s3, 6, 0, 0, u64s({42, 0, 0}));
  put_frame(s3, 2, 1, 1, {1});
  put_frame(s3, 2, 1, 1, {1});
  put_frame(s3, 2, 3, 1, {3});
  for (auto& [name, bytes] : seeds) fuzz::write_seed_file(dir + "/" + name, bytes);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("NEBULA_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  spdlog::set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  ResilientOptions o;
  o.reconnect_timeout = std::chrono::milliseconds(1);
  o.backoff_initial = o.backoff_max = std::chrono::milliseconds(0);
  o.liveness_timeout = std::chrono::milliseconds(0);
  o.fragment_bytes = 16;
  o.max_pending_bytes = 1 << 16;  // a claimed whole above it grows only as pieces arrive
  Reconnect none = [](Deadline) -> std::unique_ptr<Link> { throw PeerLost("peer", "no reconnection"); };
  try {
    auto script = std::make_unique<fuzz::ScriptedLink>();
    for (Frame& f : parse_script(data, size)) script->push(std::move(f));
    ResilientLink link(std::move(script), none, o);
    uint64_t expected_seq = 1;
    for (;;) {
      Frame f;
      try {
        f = link.recv(Deadline::after(std::chrono::seconds(5)));
      } catch (const PeerLost&) {
        break;
      } catch (const Timeout&) {
        break;
      }
      FUZZ_ASSERT(f.header.seq == expected_seq);
      ++expected_seq;
      FUZZ_ASSERT(f.header.type == FrameType::kData || f.header.type == FrameType::kHello);
      FUZZ_ASSERT(f.payload.size() == f.header.payload_len);
      FUZZ_ASSERT(wire::compute_checksum(f.header, f.payload) == f.header.checksum);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    std::abort();
  }
  return 0;
}
