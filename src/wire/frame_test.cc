#include "wire/frame.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>

namespace nebula::wire {
namespace {

using Kind = FrameError::Kind;

std::vector<uint8_t> pattern(size_t n, uint32_t seed = 1) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed;
  for (auto& b : v) {
    x = x * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

// Runs fn and returns the FrameError kind it threw; fails the test if it threw nothing
// or something else.
template <typename Fn>
Kind kind_of(Fn&& fn) {
  try {
    fn();
  } catch (const FrameError& e) {
    return e.kind();
  }
  ADD_FAILURE() << "expected FrameError";
  return Kind::kBadPayload;
}

constexpr uint64_t kMax = 1 << 20;

TEST(FrameTest, HeaderSizeIs40) { EXPECT_EQ(kHeaderSize, 40u); }

// Parts' CRCs combine into the whole's, at every cut (empty parts included): what diloco's
// sharded global-weight hash rests on.
TEST(FrameTest, Crc32OfPartsCombinesToTheWhole) {
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 131 + 7);
  const uint32_t whole = crc32(0, bytes);
  for (size_t cut : {size_t{0}, size_t{1}, size_t{499}, size_t{999}, size_t{1000}}) {
    const std::span<const uint8_t> all(bytes);
    const uint32_t a = crc32(0, all.first(cut)), b = crc32(0, all.subspan(cut));
    EXPECT_EQ(crc32_combine(a, b, bytes.size() - cut), whole) << "cut at " << cut;
  }
  bytes[500] ^= 1;
  EXPECT_NE(crc32(0, bytes), whole);
}

TEST(FrameTest, HeaderRoundTrip) {
  FrameHeader h;
  h.type = FrameType::kPart;
  h.flags = 0xBEEF;
  h.op_id = 0x0123456789ABCDEFull;
  h.seq = 0xFEDCBA9876543210ull;
  h.codec = 7;
  h.payload_len = 12345;
  h.checksum = 0xDEADBEEF;
  auto bytes = encode_header(h);
  // Little-endian, byte by byte.
  EXPECT_EQ(bytes[0], 0x4C);
  EXPECT_EQ(bytes[3], 0x4E);
  EXPECT_EQ(bytes[kVersionOffset], kProtocolVersion);
  EXPECT_EQ(bytes[kOpIdOffset], 0xEF);
  EXPECT_EQ(bytes[kOpIdOffset + 7], 0x01);
  FrameHeader d = decode_header(bytes, 1 << 20);
  EXPECT_EQ(d.type, h.type);
  EXPECT_EQ(d.flags, h.flags);
  EXPECT_EQ(d.op_id, h.op_id);
  EXPECT_EQ(d.seq, h.seq);
  EXPECT_EQ(d.codec, h.codec);
  EXPECT_EQ(d.payload_len, h.payload_len);
  EXPECT_EQ(d.checksum, h.checksum);
}

class FrameRoundTrip : public ::testing::TestWithParam<size_t> {};

TEST_P(FrameRoundTrip, WholeFrame) {
  size_t n = GetParam();
  Frame f = make_frame(FrameType::kData, 42, 7, pattern(n), 3, 2);
  EXPECT_EQ(f.header.payload_len, n);
  auto bytes = encode_frame(f);
  ASSERT_EQ(bytes.size(), kHeaderSize + n);
  Frame d = decode_frame(bytes, kMax);
  EXPECT_EQ(d.header.type, FrameType::kData);
  EXPECT_EQ(d.header.op_id, 42u);
  EXPECT_EQ(d.header.seq, 7u);
  EXPECT_EQ(d.header.flags, 3u);
  EXPECT_EQ(d.header.codec, 2u);
  EXPECT_EQ(d.header.checksum, f.header.checksum);
  EXPECT_EQ(d.payload, f.payload);
}

INSTANTIATE_TEST_SUITE_P(Sizes, FrameRoundTrip, ::testing::Values(0, 1, 65536));

std::vector<uint8_t> valid_frame(size_t n = 100) { return encode_frame(make_frame(FrameType::kData, 1, 2, pattern(n))); }

TEST(FrameTest, WrongMagic) {
  auto b = valid_frame();
  b[0] ^= 0xFF;
  EXPECT_EQ(kind_of([&] { decode_header(b, kMax); }), Kind::kBadMagic);
  EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadMagic);
}

TEST(FrameTest, WrongVersion) {
  auto b = valid_frame();
  b[kVersionOffset] = 2;
  EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadVersion);
  b[kVersionOffset] = 0;
  EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadVersion);
}

TEST(FrameTest, WrongType) {
  for (int t : {0, 10, 255}) {
    auto b = valid_frame();
    b[kTypeOffset] = static_cast<uint8_t>(t);
    EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadType) << t;
  }
}

TEST(FrameTest, SessionProtocolTypesAccepted) {
  for (FrameType t : {FrameType::kAck, FrameType::kResume, FrameType::kPing, FrameType::kPong}) {
    Frame f = make_frame(t, 0, 3, pattern(8));
    EXPECT_EQ(decode_frame(encode_frame(f), kMax).header.type, t);
  }
  EXPECT_EQ(frame_type_name(FrameType::kAck), "ack");
  EXPECT_EQ(frame_type_name(FrameType::kResume), "resume");
  EXPECT_EQ(frame_type_name(FrameType::kPong), "pong");
  EXPECT_EQ(frame_type_name(FrameType::kPart), "part");
  EXPECT_EQ(decode_frame(encode_frame(make_frame(FrameType::kPart, 0, 3, pattern(1000))), kMax).header.type,
            FrameType::kPart);
}

// A header's claimed length is judged by its type before anything is read or allocated: a
// hello or a control frame cannot claim more than a few KiB even on a link that takes
// gigabyte data frames.
TEST(FrameTest, ControlAndHelloFramesHaveTheirOwnSmallLimits) {
  const uint64_t big = 1ull << 30;
  for (FrameType t : {FrameType::kAck, FrameType::kResume, FrameType::kPing, FrameType::kPong, FrameType::kBye,
                      FrameType::kHeartbeat}) {
    FrameHeader h;
    h.type = t;
    h.payload_len = kMaxControlPayload;
    EXPECT_NO_THROW(decode_header(encode_header(h), big)) << frame_type_name(t);
    h.payload_len = kMaxControlPayload + 1;
    EXPECT_EQ(kind_of([&] { decode_header(encode_header(h), big); }), Kind::kTooLarge) << frame_type_name(t);
  }
  FrameHeader h;
  h.type = FrameType::kHello;
  h.payload_len = big - 1;
  try {
    decode_header(encode_header(h), big);
    FAIL() << "expected FrameError";
  } catch (const FrameError& e) {
    EXPECT_EQ(e.kind(), Kind::kTooLarge);
    EXPECT_NE(std::string(e.what()).find("hello frame exceeds that type's maximum 65536"), std::string::npos)
        << e.what();
  }
  h.payload_len = kMaxHelloPayload;
  EXPECT_NO_THROW(decode_header(encode_header(h), big));
  for (FrameType t : {FrameType::kData, FrameType::kPart}) {
    h.type = t;
    h.payload_len = big;
    EXPECT_NO_THROW(decode_header(encode_header(h), big)) << frame_type_name(t);
  }
  // A link limit below a type's own keeps the link's.
  h.type = FrameType::kHello;
  h.payload_len = 100;
  EXPECT_EQ(kind_of([&] { decode_header(encode_header(h), 99); }), Kind::kTooLarge);
}

// A payload's CRC comes out of a verified checksum without a pass over the payload, and goes
// back in for another header; parts join with crc32_combine.
TEST(FrameTest, PayloadCrcIsDerivedFromTheChecksumWithoutReadingThePayload) {
  Frame f = make_frame(FrameType::kData, 7, 9, pattern(100000), 3, 2);
  const uint32_t whole = crc32(0, f.payload);
  EXPECT_EQ(payload_crc(f.header), whole);
  FrameHeader other = f.header;
  other.type = FrameType::kPart;
  other.seq = 12345;
  EXPECT_EQ(checksum_from_payload_crc(other, whole), compute_checksum(other, f.payload));
  const std::span<const uint8_t> all(f.payload);
  const uint32_t a = crc32(0, all.first(30000)), b = crc32(0, all.subspan(30000));
  EXPECT_EQ(crc32_combine(a, b, 70000), whole);
  EXPECT_EQ(crc32_strip_prefix(whole, a, 70000), b);
  f.payload[5] ^= 1;  // the derivation trusts the checksum: verify the frame first
  EXPECT_NE(payload_crc(f.header), crc32(0, f.payload));
}

TEST(FrameTest, NonZeroReservedIsBadType) {
  for (size_t i = 0; i < kReservedSize; ++i) {
    auto b = valid_frame();
    b[kReservedOffset + i] = 1;
    EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadType) << i;
  }
}

TEST(FrameTest, LengthOverMaximum) {
  auto b = valid_frame(100);
  EXPECT_EQ(kind_of([&] { decode_frame(b, 99); }), Kind::kTooLarge);
  EXPECT_NO_THROW(decode_frame(b, 100));
}

TEST(FrameTest, HugeClaimedLengthIsRejectedWithoutAllocating) {
  FrameHeader h;
  h.payload_len = 1ull << 63;
  auto b = encode_header(h);
  // decode_frame would need 8 EiB if it allocated first; it must throw kTooLarge instead.
  try {
    decode_frame(b, kMax);
    FAIL() << "expected FrameError";
  } catch (const FrameError& e) {
    EXPECT_EQ(e.kind(), Kind::kTooLarge);
    EXPECT_NE(std::string(e.what()).find("9223372036854775808"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("1048576"), std::string::npos) << e.what();
  }
}

TEST(FrameTest, BadChecksumInHeader) {
  auto b = valid_frame();
  b[kChecksumOffset] ^= 0x01;
  EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadChecksum);
  // A flipped header field that is not otherwise validated is caught by the checksum too.
  b = valid_frame();
  b[kOpIdOffset] ^= 0x80;
  EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadChecksum);
}

TEST(FrameTest, FlippedPayloadByte) {
  auto b = valid_frame(1000);
  for (size_t pos : {size_t{0}, size_t{500}, size_t{999}}) {
    auto c = b;
    c[kHeaderSize + pos] ^= 0x10;
    EXPECT_EQ(kind_of([&] { decode_frame(c, kMax); }), Kind::kBadChecksum) << pos;
  }
}

TEST(FrameTest, TruncatedHeaderAtEveryLength) {
  auto b = valid_frame();
  for (size_t n = 0; n < kHeaderSize; ++n) {
    std::span<const uint8_t> s(b.data(), n);
    EXPECT_EQ(kind_of([&] { decode_header(s, kMax); }), Kind::kTruncated) << n;
    EXPECT_EQ(kind_of([&] { decode_frame(s, kMax); }), Kind::kTruncated) << n;
  }
}

TEST(FrameTest, TruncatedOrOverlongPayload) {
  auto b = valid_frame(100);
  EXPECT_EQ(kind_of([&] { decode_frame(std::span<const uint8_t>(b.data(), b.size() - 1), kMax); }),
            Kind::kTruncated);
  b.push_back(0);
  EXPECT_EQ(kind_of([&] { decode_frame(b, kMax); }), Kind::kBadPayload);
  FrameHeader h = decode_header(b, kMax);
  EXPECT_EQ(kind_of([&] { verify_checksum(h, std::span<const uint8_t>(b.data() + kHeaderSize, 99)); }),
            Kind::kTruncated);
}

TEST(FrameTest, EncodeFrameChecksLength) {
  Frame f = make_frame(FrameType::kData, 1, 1, pattern(10));
  f.payload.pop_back();
  EXPECT_THROW(encode_frame(f), Error);
}

TEST(FrameTest, MessagesNameFieldValueAndLimit) {
  auto b = valid_frame();
  b[kTypeOffset] = 10;
  try {
    decode_frame(b, kMax);
    ADD_FAILURE() << "type 10 accepted";
  } catch (const FrameError& e) {
    EXPECT_NE(std::string(e.what()).find("frame type 10"), std::string::npos) << e.what();
  }
}

// Random mutations of a valid frame: decode_frame either returns a frame or throws
// FrameError; any other exception (or a crash under ASan) fails.
TEST(FrameTest, FuzzMutations) {
  std::mt19937_64 rng(12345);
  const auto base = valid_frame(64);
  int ok = 0, rejected = 0;
  for (int iter = 0; iter < 20000; ++iter) {
    auto b = base;
    int mutations = 1 + static_cast<int>(rng() % 4);
    for (int m = 0; m < mutations; ++m) {
      switch (rng() % 4) {
        case 0: b[rng() % b.size()] ^= static_cast<uint8_t>(1u << (rng() % 8)); break;
        case 1: b[rng() % b.size()] = static_cast<uint8_t>(rng()); break;
        case 2: b.resize(rng() % (b.size() + 1)); break;
        case 3: b.insert(b.begin() + static_cast<long>(rng() % (b.size() + 1)), static_cast<uint8_t>(rng())); break;
      }
      if (b.empty()) break;
    }
    // Occasionally aim at the length field with a huge value.
    if (iter % 97 == 0 && b.size() >= kHeaderSize) {
      for (size_t i = 0; i < 8; ++i) b[kPayloadLenOffset + i] = static_cast<uint8_t>(rng());
    }
    try {
      Frame f = decode_frame(b, kMax);
      EXPECT_EQ(f.payload.size(), f.header.payload_len);
      ++ok;
    } catch (const FrameError&) {
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": unexpected exception " << e.what();
    }
  }
  EXPECT_EQ(ok + rejected, 20000);
  EXPECT_GT(rejected, 19000);  // a CRC-32 lets through almost nothing
}

TEST(ByteIoTest, RoundTrip) {
  ByteWriter w;
  w.put_u8(0xAB);
  w.put_u16(0xBEEF);
  w.put_u32(0xDEADBEEF);
  w.put_u64(0x0123456789ABCDEFull);
  w.put_f64(-3.25);
  w.put_f64(std::numeric_limits<double>::infinity());
  w.put_string("site-b");
  w.put_string("");
  std::vector<uint8_t> raw = {1, 2, 3};
  w.put_bytes(raw);
  auto buf = w.take();
  EXPECT_EQ(w.size(), 0u);
  ByteReader r(buf, "test payload");
  EXPECT_EQ(r.u8(), 0xAB);
  EXPECT_EQ(r.u16(), 0xBEEF);
  EXPECT_EQ(r.u32(), 0xDEADBEEFu);
  EXPECT_EQ(r.u64(), 0x0123456789ABCDEFull);
  EXPECT_EQ(r.f64(), -3.25);
  EXPECT_EQ(r.f64(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(r.string(64), "site-b");
  EXPECT_EQ(r.string(64), "");
  auto s = r.bytes(3);
  EXPECT_EQ(std::vector<uint8_t>(s.begin(), s.end()), raw);
  EXPECT_TRUE(r.done());
  EXPECT_NO_THROW(r.expect_done());
}

TEST(ByteIoTest, ReadsPastTheEndThrowBadPayload) {
  std::vector<uint8_t> buf = {1, 2, 3};
  ByteReader r(buf, "hello payload from site-b");
  try {
    r.u32();
    FAIL();
  } catch (const FrameError& e) {
    EXPECT_EQ(e.kind(), Kind::kBadPayload);
    EXPECT_EQ(std::string(e.what()),
              "hello payload from site-b: truncated at offset 0 reading u32 (needs 4 bytes, 3 left)");
  }
  EXPECT_EQ(r.offset(), 0u);  // a failed read consumes nothing
  EXPECT_EQ(r.u16(), 0x0201);
  EXPECT_EQ(kind_of([&] { r.u64(); }), Kind::kBadPayload);
  EXPECT_EQ(kind_of([&] { r.f64(); }), Kind::kBadPayload);
  EXPECT_EQ(kind_of([&] { r.u16(); }), Kind::kBadPayload);
  EXPECT_EQ(kind_of([&] { r.bytes(2); }), Kind::kBadPayload);
  EXPECT_FALSE(r.done());
  EXPECT_EQ(kind_of([&] { r.expect_done(); }), Kind::kBadPayload);
  EXPECT_EQ(r.u8(), 3);
  EXPECT_EQ(kind_of([&] { r.u8(); }), Kind::kBadPayload);
  EXPECT_TRUE(r.done());
}

TEST(ByteIoTest, StringLengthChecks) {
  ByteWriter w;
  w.put_u32(1000);  // claims 1000 bytes, has 2
  w.put_u8('a');
  w.put_u8('b');
  auto buf = w.take();
  ByteReader r(buf, "p");
  EXPECT_EQ(kind_of([&] { r.string(10); }), Kind::kBadPayload);    // over the limit
  EXPECT_EQ(kind_of([&] { r.string(5000); }), Kind::kBadPayload);  // past the end
  EXPECT_EQ(r.offset(), 0u);
  ByteWriter w2;
  w2.put_u32(0xFFFFFFFFu);
  auto buf2 = w2.take();
  ByteReader r2(buf2, "p");
  EXPECT_EQ(kind_of([&] { r2.string(std::numeric_limits<size_t>::max()); }), Kind::kBadPayload);
}

}  // namespace
}  // namespace nebula::wire
