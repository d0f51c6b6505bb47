// libFuzzer target for the frame decoder (wire/frame.h): decode_frame, decode_header +
// verify_checksum, and ByteReader.
//
// Contract under test: any input either decodes or throws nebula::FrameError of the kind
// frame.h documents. Anything else is a bug and aborts: another exception type, an
// ASan/UBSan report, an allocation sized by a claimed length (run with -malloc_limit_mb;
// inputs are at most 64 KiB, so a large allocation can only come from a length field),
// a wrong error kind, a checksum that differs from zlib's CRC-32 (the reference frame.h
// names), or an accepted frame that does not re-encode to the same bytes.
//
// Seed mode: NEBULA_FUZZ_WRITE_SEEDS=DIR ./frame_fuzzer writes a few valid frames to DIR
// and exits (run_fuzzers.sh does this; fuzz/corpus/frame holds the same files).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <typeinfo>
#include <vector>

#include <zlib.h>

#include "nebula/error.h"
#include "transport/hello.h"
#include "wire/frame.h"
#include "fuzz_util.h"

namespace {

using nebula::FrameError;
using namespace nebula::wire;
using Kind = FrameError::Kind;

constexpr uint64_t kMaxPayload = 1 << 20;  // 1 MiB, the limit a link would pass
constexpr uint64_t kUnbounded = std::numeric_limits<uint64_t>::max();

bool same(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

uint64_t load_le(std::span<const uint8_t> b, size_t off, size_t n) {
  uint64_t v = 0;
  for (size_t i = 0; i < n; ++i) v |= uint64_t{b[off + i]} << (8 * i);
  return v;
}

// What compute_checksum must return, computed with zlib: CRC-32 over the encoded header
// without its checksum field, then the payload.
uint32_t reference_checksum(const FrameHeader& h, std::span<const uint8_t> payload) {
  auto header = encode_header(h);
  uLong crc = ::crc32_z(0, Z_NULL, 0);
  crc = ::crc32_z(crc, header.data(), kChecksumOffset);
  if (!payload.empty()) crc = ::crc32_z(crc, payload.data(), payload.size());
  return static_cast<uint32_t>(crc);
}

// The header checks in the order frame.h documents them, written independently of
// frame.cc: the kind decode_header must throw, or nullopt if it must accept.
std::optional<Kind> expected_header_error(std::span<const uint8_t> b, uint64_t max_payload) {
  if (b.size() < kHeaderSize) return Kind::kTruncated;
  if (load_le(b, kMagicOffset, 4) != kMagic) return Kind::kBadMagic;
  if (b[kVersionOffset] != kProtocolVersion) return Kind::kBadVersion;
  const uint8_t type = b[kTypeOffset];
  if (type < 1 || type > 9) return Kind::kBadType;  // kHello .. kPart
  for (size_t i = 0; i < kReservedSize; ++i)
    if (b[kReservedOffset + i] != 0) return Kind::kBadType;
  // Data and parts may use the link's whole limit; a hello 64 KiB of it, the session's
  // control frames 64 bytes.
  const uint64_t limit = type == 2 || type == 9 ? max_payload
                         : type == 1            ? std::min<uint64_t>(max_payload, 64 * 1024)
                                                : std::min<uint64_t>(max_payload, 64);
  if (load_le(b, kPayloadLenOffset, 8) > limit) return Kind::kTooLarge;
  return std::nullopt;
}

std::optional<Frame> check_decode_frame(std::span<const uint8_t> in, uint64_t max_payload) {
  Frame f;
  try {
    f = decode_frame(in, max_payload);
  } catch (const FrameError& e) {
    FUZZ_ASSERT(*e.what() != '\0');
    if (auto k = expected_header_error(in, max_payload)) FUZZ_ASSERT(e.kind() == *k);
    return std::nullopt;
  }
  FUZZ_ASSERT(!expected_header_error(in, max_payload));
  FUZZ_ASSERT(f.header.payload_len <= max_payload);
  FUZZ_ASSERT(f.payload.size() == f.header.payload_len);
  FUZZ_ASSERT(compute_checksum(f.header, f.payload) == f.header.checksum);
  FUZZ_ASSERT(reference_checksum(f.header, f.payload) == f.header.checksum);
  FUZZ_ASSERT(same(encode_frame(f), in));  // exactly one frame, nothing ignored
  return f;
}

// decode_header on the input as a prefix of a stream, then verify_checksum on whatever
// part of the claimed payload the input holds.
void check_header_then_checksum(std::span<const uint8_t> in, uint64_t max_payload) {
  FrameHeader h;
  std::optional<Kind> expected = expected_header_error(in, max_payload);
  try {
    h = decode_header(in, max_payload);
  } catch (const FrameError& e) {
    FUZZ_ASSERT(expected && e.kind() == *expected);
    return;
  }
  FUZZ_ASSERT(!expected);
  auto header_bytes = encode_header(h);
  FUZZ_ASSERT(same(header_bytes, in.first(kHeaderSize)));
  auto rest = in.subspan(kHeaderSize);
  auto payload = rest.first(static_cast<size_t>(std::min<uint64_t>(rest.size(), h.payload_len)));
  FUZZ_ASSERT(compute_checksum(h, payload) == reference_checksum(h, payload));
  try {
    verify_checksum(h, payload);
  } catch (const FrameError& e) {
    if (payload.size() != h.payload_len)
      FUZZ_ASSERT(e.kind() == Kind::kTruncated);
    else
      FUZZ_ASSERT(e.kind() == Kind::kBadChecksum && compute_checksum(h, payload) != h.checksum);
    return;
  }
  FUZZ_ASSERT(payload.size() == h.payload_len && compute_checksum(h, payload) == h.checksum);
}

// Drives a ByteReader with a sequence of reads chosen by the bytes themselves (each
// step reads an opcode byte, then does what it says). Whatever a successful read
// consumed must be reproduced exactly by the matching ByteWriter call; a failed read
// must throw kBadPayload and leave the offset where it was.
void check_reader(std::span<const uint8_t> bytes) {
  ByteReader r(bytes, "fuzz payload");
  for (int step = 0; step < 256; ++step) {
    FUZZ_ASSERT(r.offset() + r.remaining() == bytes.size());
    FUZZ_ASSERT(r.done() == (r.remaining() == 0));
    if (r.done()) {
      r.expect_done();
      return;
    }
    uint8_t op = r.u8();
    size_t arg = op >> 3;  // 0..31
    size_t start = r.offset();
    ByteWriter w;
    try {
      switch (op & 7) {
        case 0: w.put_u8(r.u8()); break;
        case 1: w.put_u16(r.u16()); break;
        case 2: w.put_u32(r.u32()); break;
        case 3: w.put_u64(r.u64()); break;
        case 4: w.put_f64(r.f64()); break;
        case 5: {
          // 31 means no limit but the buffer: a huge length prefix must then fail on the
          // bounds check, not allocate.
          size_t max_len = arg == 31 ? std::numeric_limits<size_t>::max() : arg * 16;
          std::string s = r.string(max_len);
          FUZZ_ASSERT(s.size() <= max_len);
          w.put_string(s);
          break;
        }
        case 6: {
          size_t n = arg == 31 ? std::numeric_limits<size_t>::max() : arg * 3;
          auto b = r.bytes(n);
          FUZZ_ASSERT(b.size() == n && b.data() == bytes.data() + start);
          w.put_bytes(b);
          break;
        }
        case 7:
          try {
            r.expect_done();
            FUZZ_ASSERT(r.done());
          } catch (const FrameError& e) {
            FUZZ_ASSERT(e.kind() == Kind::kBadPayload && !r.done());
          }
          continue;
      }
    } catch (const FrameError& e) {
      FUZZ_ASSERT(e.kind() == Kind::kBadPayload);
      FUZZ_ASSERT(r.offset() == start);
      continue;  // the reader must still be usable
    }
    auto out = w.take();
    FUZZ_ASSERT(r.offset() >= start);
    FUZZ_ASSERT(same(out, bytes.subspan(start, r.offset() - start)));
  }
}

std::vector<uint8_t> u64s(std::initializer_list<uint64_t> vs) {
  ByteWriter w;
  for (uint64_t v : vs) w.put_u64(v);
  return w.take();
}

void write_seeds(const std::string& dir) {
  nebula::transport::Hello hello{nebula::transport::kHelloProtocol, "job-1", "site-a", "site-b", 0, 2, 1};
  std::vector<std::pair<std::string, Frame>> seeds = {
      {"hello", nebula::transport::hello_frame(hello)},
      {"data", make_frame(FrameType::kData, 7, 3, {1, 2, 3, 4, 5, 6, 7, 8}, /*flags=*/1, /*codec=*/2)},
      {"bye", make_frame(FrameType::kBye, 0, 0, {})},
      {"heartbeat", make_frame(FrameType::kHeartbeat, 0, 9, {})},
      {"ack", make_frame(FrameType::kAck, 0, 0, u64s({41}))},
      {"resume", make_frame(FrameType::kResume, 0, 0, u64s({0x1234, 40, 41}))},
      {"part", make_frame(FrameType::kPart, 1000, 3, {9, 8, 7, 6})},
  };
  for (auto& [name, f] : seeds) nebula::fuzz::write_seed_file(dir + "/" + name, encode_frame(f));
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  if (const char* dir = std::getenv("NEBULA_FUZZ_WRITE_SEEDS")) {
    write_seeds(dir);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::span<const uint8_t> in(data, size);
  try {
    auto bounded = check_decode_frame(in, kMaxPayload);
    // No maximum at all: a huge payload_len must fail on the length check, not allocate.
    auto unbounded = check_decode_frame(in, kUnbounded);
    if (size <= kHeaderSize + kMaxPayload) FUZZ_ASSERT(bounded.has_value() == unbounded.has_value());
    check_header_then_checksum(in, kMaxPayload);
    check_header_then_checksum(in, kUnbounded);
    // The checksum over arbitrary bytes, at every length and alignment the fuzzer tries.
    FrameHeader any;
    any.payload_len = size;
    FUZZ_ASSERT(compute_checksum(any, in) == reference_checksum(any, in));
    if (size > 0) FUZZ_ASSERT(compute_checksum(any, in.subspan(1)) == reference_checksum(any, in.subspan(1)));
    check_reader(size >= kHeaderSize ? in.subspan(kHeaderSize) : in);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "unexpected exception %s: %s\n", typeid(e).name(), e.what());
    std::abort();
  }
  return 0;
}
