// The inter-site frame format (DESIGN.md, "Wire protocol").
//
// Every frame is a fixed 40-byte little-endian header followed by `payload_len` payload
// bytes. Header layout (byte offsets):
//
//    0  magic        u32  0x4E42554C ("NBUL" as a number; the bytes on the wire are 4C 55 42 4E)
//    4  version      u8   kProtocolVersion
//    5  type         u8   FrameType
//    6  flags        u16  meaning defined by the layer that sends the frame type
//    8  op_id        u64  operation id (makes retries idempotent)
//   16  seq          u64  sequence number within the operation
//   24  codec        u8   codec id of the payload (0 = raw); the wire never interprets it
//   25  reserved     3 B  must be zero
//   28  payload_len  u64  payload bytes that follow the header
//   36  checksum     u32  CRC-32 (zlib's polynomial and values) over header bytes [0, 36)
//                          and then the payload
//
// Every field is encoded byte by byte (never a struct memcpy), so the format does not
// depend on the compiler's layout or the host's endianness.
//
// Validation order: decode_header() checks length, magic, version, type, reserved bytes
// and payload_len against the caller's maximum -- all before anyone allocates the
// payload. The checksum covers the payload too, so it is checked by verify_checksum()
// once the payload has been read. Every failure throws nebula::FrameError with a kind
// saying which check failed and a message naming the field, the value seen and the limit.
//
// This layer knows nothing about sockets or tensors; it is pure functions on bytes.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "nebula/error.h"

namespace nebula::wire {

inline constexpr uint32_t kMagic = 0x4E42554C;
inline constexpr uint8_t kProtocolVersion = 1;

inline constexpr size_t kMagicOffset = 0;
inline constexpr size_t kVersionOffset = 4;
inline constexpr size_t kTypeOffset = 5;
inline constexpr size_t kFlagsOffset = 6;
inline constexpr size_t kOpIdOffset = 8;
inline constexpr size_t kSeqOffset = 16;
inline constexpr size_t kCodecOffset = 24;
inline constexpr size_t kReservedOffset = 25;
inline constexpr size_t kReservedSize = 3;
inline constexpr size_t kPayloadLenOffset = 28;
inline constexpr size_t kChecksumOffset = 36;
inline constexpr size_t kHeaderSize = kChecksumOffset + 4;
static_assert(kHeaderSize == 4 + 1 + 1 + 2 + 8 + 8 + 1 + kReservedSize + 8 + 4);
static_assert(kHeaderSize == 40);

// Any other value on the wire is rejected with FrameError::Kind::kBadType.
//   kAck     session acknowledgement (transport/resilient_link.h): payload u64, the highest
//            session seq delivered, cumulatively;
//   kResume  session resume exchange, the first frame on every connection of a session
//            (payload: session id, highest seq delivered, highest seq received; all u64);
//   kPing    round-trip probe (payload u64 id), answered by
//   kPong    (payload u64 id, u64 ns the ping was held before the answer was written);
//   kPart    a piece of a larger session frame, not its last (transport/resilient_link.h).
//
// Per-type payload limits (decode_header): control frames (bye, heartbeat, ack, resume, ping,
// pong) carry at most kMaxControlPayload bytes and hellos at most kMaxHelloPayload, whatever
// the caller's max_payload; only kData and kPart may use the rest of it. So a header that
// claims a 1 GiB hello or ack is refused before anything is allocated, even on a link whose
// data frames may be that large.
inline constexpr uint64_t kMaxControlPayload = 64;
inline constexpr uint64_t kMaxHelloPayload = 64 * 1024;

enum class FrameType : uint8_t {
  kHello = 1,
  kData = 2,
  kBye = 3,
  kHeartbeat = 4,
  kAck = 5,
  kResume = 6,
  kPing = 7,
  kPong = 8,
  kPart = 9,
};

// The largest payload decode_header() accepts for `type` on a link whose limit is max_payload.
uint64_t max_payload_of(FrameType type, uint64_t max_payload);

// "hello", "data", "bye", "heartbeat", "ack", "resume", "ping", "pong", "part", or "type(N)" for a value outside
// the enum.
std::string frame_type_name(FrameType type);

struct FrameHeader {
  FrameType type = FrameType::kData;
  uint16_t flags = 0;
  uint64_t op_id = 0;
  uint64_t seq = 0;
  uint8_t codec = 0;
  uint64_t payload_len = 0;  // bytes of payload that follow the header
  uint32_t checksum = 0;     // see compute_checksum()
};

struct Frame {
  FrameHeader header;
  std::vector<uint8_t> payload;  // payload.size() == header.payload_len for a valid frame
};

// CRC-32 (the same values as zlib's crc32(crc, ...)) of `bytes`, continuing from `crc`
// (0 to start). Every checksum on the wire is this one.
uint32_t crc32(uint32_t crc, std::span<const uint8_t> bytes);
// The CRC-32 of bytes A then B from crc32(0, A), crc32(0, B) and B's length (zlib's
// crc32_combine): a checksum of parts held in different places, as of one whole.
uint32_t crc32_combine(uint32_t crc_a, uint32_t crc_b, uint64_t length_b);

// The CRC-32 of B from that of A then B and that of A (the inverse of crc32_combine; CRC-32
// is linear, so this costs O(log length_b) and reads no data).
uint32_t crc32_strip_prefix(uint32_t crc_ab, uint32_t crc_a, uint64_t length_b);

// CRC-32 over the first kChecksumOffset bytes of the encoded `header` (its own checksum
// field excluded), then over `payload`. Payloads above 4 GiB are fine.
uint32_t compute_checksum(const FrameHeader& header, std::span<const uint8_t> payload);
// The CRC-32 of a frame's payload alone, derived from header.checksum without reading the
// payload; and the inverse: the checksum of `header` over a payload whose CRC-32 is
// `payload_crc`. With crc32_combine they let a layer that cuts frames up or joins them
// (StripedLink, ResilientLink) carry checksums over without a second pass over the bytes.
uint32_t payload_crc(const FrameHeader& header);
uint32_t checksum_from_payload_crc(const FrameHeader& header, uint32_t payload_crc);

// Encodes all fields as given (including header.checksum; nothing is recomputed).
std::array<uint8_t, kHeaderSize> encode_header(const FrameHeader& header);

// Decodes and validates the first kHeaderSize bytes of `bytes` (extra bytes are ignored).
// Throws FrameError with kind
//   kTruncated  fewer than kHeaderSize bytes;
//   kBadMagic   magic != kMagic (the peer does not speak this protocol);
//   kBadVersion version != kProtocolVersion;
//   kBadType    type is not a FrameType, or a reserved byte is non-zero (reserved bytes are
//               where a later protocol revision would put new header fields, so a frame
//               using them is a kind of frame this decoder does not understand);
//   kTooLarge   payload_len > max_payload_of(type, max_payload).
// It never allocates anything proportional to payload_len.
FrameHeader decode_header(std::span<const uint8_t> bytes, uint64_t max_payload);

// Throws FrameError kTruncated if payload.size() != header.payload_len, and kBadChecksum
// if compute_checksum(header, payload) != header.checksum.
void verify_checksum(const FrameHeader& header, std::span<const uint8_t> payload);

// A frame with payload_len and checksum filled in.
Frame make_frame(FrameType type, uint64_t op_id, uint64_t seq, std::vector<uint8_t> payload,
                 uint16_t flags = 0, uint8_t codec = 0);

// Header followed by payload in one buffer. Precondition (NEBULA_CHECK):
// frame.payload.size() == frame.header.payload_len. The checksum is written as stored.
std::vector<uint8_t> encode_frame(const Frame& frame);

// Decodes a whole frame held in one buffer (tests, fuzzing, datagram-like uses): exactly
// one header plus payload_len bytes. Throws FrameError as decode_header() and
// verify_checksum() do; kTruncated if the buffer is shorter than the header says,
// kBadPayload if it holds bytes after the payload.
Frame decode_frame(std::span<const uint8_t> bytes, uint64_t max_payload);

// ---------------------------------------------------------------------------------------
// Payload (de)serialisation helpers for the layers above. Little-endian, byte by byte;
// f64 is the IEEE-754 bit pattern; strings are a u32 byte length followed by the bytes.

class ByteWriter {
 public:
  ByteWriter() = default;
  void reserve(size_t n) { buf_.reserve(n); }
  void put_u8(uint8_t v);
  void put_u16(uint16_t v);
  void put_u32(uint32_t v);
  void put_u64(uint64_t v);
  void put_f64(double v);
  // u32 length prefix, then the bytes. Precondition: s.size() <= UINT32_MAX.
  void put_string(std::string_view s);
  // Raw bytes, no length prefix (the reader must know the count).
  void put_bytes(std::span<const uint8_t> bytes);
  size_t size() const { return buf_.size(); }
  // Moves the buffer out; the writer is empty afterwards.
  std::vector<uint8_t> take();

 private:
  std::vector<uint8_t> buf_;
};

// Reads from a borrowed span (which must outlive the reader and any span bytes() returns).
// Every read that would go past the end throws
//   FrameError(kBadPayload, "<what>: truncated at offset X reading Y (needs N bytes, M left)")
// and leaves the offset unchanged. `what` names the thing being parsed, e.g.
// "allreduce payload from site-b".
class ByteReader {
 public:
  ByteReader(std::span<const uint8_t> bytes, std::string what);
  uint8_t u8();
  uint16_t u16();
  uint32_t u32();
  uint64_t u64();
  double f64();
  // A u32-length-prefixed string; a length above max_len throws kBadPayload before
  // anything is allocated.
  std::string string(size_t max_len);
  // The next n bytes, as a view into the underlying buffer.
  std::span<const uint8_t> bytes(size_t n);
  size_t offset() const { return pos_; }
  size_t remaining() const { return data_.size() - pos_; }
  bool done() const { return pos_ == data_.size(); }
  // Throws kBadPayload naming the count of trailing bytes unless done().
  void expect_done() const;

 private:
  const uint8_t* take(size_t n, const char* reading);
  std::span<const uint8_t> data_;
  size_t pos_ = 0;
  std::string what_;
};

}  // namespace nebula::wire
