// libFuzzer target for StripedLink's receiving side (transport/striped_link.h): stripe chunks
// on N streams with any header fields, lengths, orders and counts.
//
// The input: [N-1 u8 (N = 1..4)] then chunks, each [stream u8][type u8][index u8][count u8]
// [logical_seq u8][total u16][length u8][data], made with make_chunk_frame (a valid CRC on
// the wire; the logical checksum is that of the claimed whole when the chunk's data could be
// all of it, else fuzzed), and sent on stream `stream % N`. The fuzzer reads what the link
// delivers until it fails. Anything but these outcomes aborts: whole frames with a valid
// checksum and payload_len == their size; then FrameError, PeerLost or Timeout. A sanitizer
// report, a hang or an allocation sized by a claimed length fails too.
//
// Seed mode: NEBULA_FUZZ_WRITE_SEEDS=DIR ./stripe_fuzzer writes a few inputs to DIR.
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
#include "transport/striped_link.h"
#include "wire/frame.h"
#include "fuzz_util.h"
#include "scripted_link.h"

namespace {

using namespace nebula;
using namespace nebula::transport;
using wire::Frame;

void write_seeds(const std::string& dir) {
  // Two streams, one 6-byte frame split 3 + 3, then a frame with an empty chunk.
  std::vector<uint8_t> two = {1};
  auto chunk = [](std::vector<uint8_t>& s, uint8_t stream, uint8_t index, uint8_t count, uint8_t seq, uint16_t total,
                  std::vector<uint8_t> data) {
    s.insert(s.end(), {stream, 2, index, count, seq, static_cast<uint8_t>(total), static_cast<uint8_t>(total >> 8),
                       static_cast<uint8_t>(data.size())});
    s.insert(s.end(), data.begin(), data.end());
  };
  chunk(two, 0, 0, 2, 0, 6, {1, 2, 3});
  chunk(two, 1, 1, 2, 0, 6, {4, 5, 6});
  chunk(two, 0, 0, 2, 1, 1, {7});
  chunk(two, 1, 1, 2, 1, 1, {});
  std::vector<uint8_t> one = {0};
  chunk(one, 0, 0, 1, 0, 4, {9, 9, 9, 9});
  fuzz::write_seed_file(dir + "/two", two);
  fuzz::write_seed_file(dir + "/one", one);
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
  if (size < 1) return 0;
  const size_t n = 1 + data[0] % 4;
  std::vector<fuzz::ScriptedLink*> raw;
  std::vector<std::unique_ptr<Link>> streams;
  for (size_t i = 0; i < n; ++i) {
    auto s = std::make_unique<fuzz::ScriptedLink>();
    raw.push_back(s.get());
    streams.push_back(std::move(s));
  }
  for (size_t at = 1; at + 8 <= size;) {
    const uint8_t* c = data + at;
    ChunkHeader h;
    h.original.type = static_cast<wire::FrameType>(c[1] % 11);
    h.index = c[2];
    h.count = c[3];
    h.logical_seq = c[4];
    h.original.payload_len = uint64_t{c[5]} | uint64_t{c[6]} << 8;
    if (c[6] == 0xFF) h.original.payload_len <<= 24;  // now and then a claim far above what comes
    const size_t len = std::min<size_t>(c[7], size - at - 8);
    std::span<const uint8_t> bytes(c + 8, len);
    // A checksum that can match when the chunk could be the whole frame; otherwise any.
    h.original.checksum = h.original.payload_len == len ? wire::compute_checksum(h.original, bytes)
                                                        : static_cast<uint32_t>(len * 2654435761u);
    raw[c[0] % n]->push(make_chunk_frame(h, bytes));
    at += 8 + len;
  }
  LinkOptions o;
  o.max_payload = 1 << 16;
  try {
    StripedLink link(std::move(streams), o);
    for (;;) {
      Frame f;
      try {
        f = link.recv(Deadline::after(std::chrono::seconds(5)));
      } catch (const FrameError&) {
        break;
      } catch (const PeerLost&) {
        break;
      } catch (const Timeout&) {
        break;
      }
      FUZZ_ASSERT(f.payload.size() == f.header.payload_len);
      FUZZ_ASSERT(f.header.payload_len <= o.max_payload);
      FUZZ_ASSERT(wire::compute_checksum(f.header, f.payload) == f.header.checksum);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception: %s\n", e.what());
    std::abort();
  }
  return 0;
}
