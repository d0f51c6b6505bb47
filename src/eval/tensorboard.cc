#include "eval/tensorboard.h"

#include <unistd.h>

#include <array>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>

#include "nebula/error.h"

namespace nebula::eval {
namespace {

static_assert(std::numeric_limits<double>::is_iec559 && std::numeric_limits<float>::is_iec559,
              "protobuf's double and float are IEEE 754");

// Entry b is the CRC register after shifting in the byte b by the bitwise algorithm: eight
// times, shift right and xor the polynomial when the bit shifted out was 1. Reflected
// ("LSB first") like the polynomial. A byte-at-a-time table is plenty for event files of a few
// kilobytes.
constexpr std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> table{};
  for (uint32_t b = 0; b < 256; ++b) {
    uint32_t crc = b;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
    table[b] = crc;
  }
  return table;
}
constexpr std::array<uint32_t, 256> kCrc32cTable = make_crc32c_table();

// Protobuf wire types.
constexpr int kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5;

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out += static_cast<char>((v >> (8 * i)) & 0xFF);
}

void put_varint(std::string& out, uint64_t v) {
  for (; v >= 0x80; v >>= 7) out += static_cast<char>((v & 0x7F) | 0x80);  // low 7 bits first
  out += static_cast<char>(v);
}

void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire_type));
}

void put_length_delimited(std::string& out, int field, std::string_view bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

void put_double(std::string& out, int field, double v) {
  put_key(out, field, kFixed64);
  put_le(out, std::bit_cast<uint64_t>(v), 8);
}

uint64_t get_le(std::string_view s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(s[at + i])) << (8 * i);
  return v;
}

// Reads the fields of one protobuf message; DataError prefixed with `where` if it is malformed.
class ProtoReader {
 public:
  ProtoReader(std::string_view bytes, const std::string& where) : bytes_(bytes), where_(where) {}

  bool done() const { return pos_ == bytes_.size(); }

  // The next field's number and wire type.
  std::pair<uint64_t, int> key() {
    const uint64_t k = varint();
    return {k >> 3, static_cast<int>(k & 7)};
  }

  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ == bytes_.size()) fail("truncated varint");
      const auto b = static_cast<unsigned char>(bytes_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("varint longer than 10 bytes");
  }

  uint64_t fixed(int bytes) {
    if (bytes_.size() - pos_ < static_cast<size_t>(bytes)) fail("truncated fixed-size field");
    pos_ += bytes;
    return get_le(bytes_, pos_ - bytes, bytes);
  }

  std::string_view length_delimited() {
    const uint64_t n = varint();
    if (n > bytes_.size() - pos_) fail("a length-delimited field runs past its message");
    pos_ += n;
    return bytes_.substr(pos_ - n, n);
  }

  void skip(int wire_type) {
    switch (wire_type) {
      case kVarint: varint(); break;
      case kFixed64: fixed(8); break;
      case kLengthDelimited: length_delimited(); break;
      case kFixed32: fixed(4); break;
      default: fail(str_cat("unsupported wire type ", wire_type));
    }
  }

  [[noreturn]] void fail(const std::string& what) const { throw DataError(str_cat(where_, ": ", what)); }

 private:
  std::string_view bytes_;
  size_t pos_ = 0;
  const std::string& where_;
};

struct Event {
  double wall_time = 0;
  int64_t step = 0;
  std::string file_version;
  std::vector<std::pair<std::string, float>> values;  // (tag, simple_value)
};

Event parse_event(std::string_view data, const std::string& where) {
  Event e;
  ProtoReader event(data, where);
  while (!event.done()) {
    const auto [field, wire] = event.key();
    if (field == 1 && wire == kFixed64) {
      e.wall_time = std::bit_cast<double>(event.fixed(8));
    } else if (field == 2 && wire == kVarint) {
      e.step = static_cast<int64_t>(event.varint());  // two's complement, like protobuf's int64
    } else if (field == 3 && wire == kLengthDelimited) {
      e.file_version = event.length_delimited();
    } else if (field == 5 && wire == kLengthDelimited) {
      ProtoReader summary(event.length_delimited(), where);
      while (!summary.done()) {
        const auto [sfield, swire] = summary.key();
        if (sfield != 1 || swire != kLengthDelimited) {
          summary.skip(swire);
          continue;
        }
        ProtoReader value(summary.length_delimited(), where);
        std::string tag;
        bool has_simple_value = false;
        float simple_value = 0;
        while (!value.done()) {
          const auto [vfield, vwire] = value.key();
          if (vfield == 1 && vwire == kLengthDelimited) {
            tag = value.length_delimited();
          } else if (vfield == 2 && vwire == kFixed32) {
            simple_value = std::bit_cast<float>(static_cast<uint32_t>(value.fixed(4)));
            has_simple_value = true;
          } else {
            value.skip(vwire);
          }
        }
        if (has_simple_value) e.values.emplace_back(std::move(tag), simple_value);
      }
    } else {
      event.skip(wire);
    }
  }
  return e;
}

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  uint32_t crc = 0xFFFFFFFF;
  for (unsigned char b : bytes) crc = kCrc32cTable[(crc ^ b) & 0xFF] ^ (crc >> 8);
  return crc ^ 0xFFFFFFFF;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir, double wall_time) {
  if (wall_time < 0)
    wall_time = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec || !std::filesystem::is_directory(dir))
    throw DataError(str_cat(dir, ": cannot create the TensorBoard directory", ec ? ": " + ec.message() : ""));
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || !host[0]) std::strcpy(host, "localhost");
  path_ = str_cat(dir, "/events.out.tfevents.", static_cast<int64_t>(std::floor(wall_time)), ".", host);
  file_.reset(std::fopen(path_.c_str(), "wb"));
  if (!file_) throw DataError(str_cat(path_, ": cannot create: ", std::strerror(errno)));
  std::string event;
  put_double(event, 1, wall_time);
  put_length_delimited(event, 3, "brain.Event:2");
  write_record(event);
}

void TensorBoardWriter::add_scalar(const std::string& tag, int64_t step, float value, double wall_time) {
  NEBULA_CHECK(!tag.empty(), "a TensorBoard scalar needs a tag (", path_, ")");
  std::string v;
  put_length_delimited(v, 1, tag);
  put_key(v, 2, kFixed32);
  put_le(v, std::bit_cast<uint32_t>(value), 4);
  std::string summary;
  put_length_delimited(summary, 1, v);
  std::string event;
  put_double(event, 1, wall_time);
  put_key(event, 2, kVarint);
  put_varint(event, static_cast<uint64_t>(step));  // a negative step: its two's complement, 10 bytes
  put_length_delimited(event, 5, summary);
  write_record(event);
}

void TensorBoardWriter::flush() {
  if (std::fflush(file_.get()) != 0) throw DataError(str_cat(path_, ": write failed: ", std::strerror(errno)));
}

void TensorBoardWriter::write_record(const std::string& data) {
  std::string r;
  put_le(r, data.size(), 8);
  put_le(r, masked_crc32c(r), 4);
  r += data;
  put_le(r, masked_crc32c(data), 4);
  if (std::fwrite(r.data(), 1, r.size(), file_.get()) != r.size())
    throw DataError(str_cat(path_, ": write failed: ", std::strerror(errno)));
}

std::vector<TensorBoardScalar> read_tensorboard_scalars(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(str_cat(path, ": cannot open the event file"));
  const std::string file((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (file.empty()) throw DataError(str_cat(path, ": empty event file (no file_version record)"));
  std::vector<TensorBoardScalar> scalars;
  for (size_t pos = 0; pos < file.size();) {
    const std::string where = str_cat(path, ": record at byte ", pos);
    const size_t left = file.size() - pos;
    if (left < 12) throw DataError(str_cat(where, ": truncated length"));
    const uint64_t n = get_le(file, pos, 8);
    if (get_le(file, pos + 8, 4) != masked_crc32c(std::string_view(file).substr(pos, 8)))
      throw DataError(str_cat(where, ": the length's CRC does not match"));
    if (n > left - 12 || left - 12 - n < 4) throw DataError(str_cat(where, ": truncated data (", n, " bytes)"));
    const std::string_view data = std::string_view(file).substr(pos + 12, n);
    if (get_le(file, pos + 12 + n, 4) != masked_crc32c(data))
      throw DataError(str_cat(where, ": the data's CRC does not match"));
    Event e = parse_event(data, where);
    if (pos == 0 && e.file_version.rfind("brain.Event:", 0) != 0)
      throw DataError(str_cat(where, ": the first event has no file_version \"brain.Event:...\""));
    for (auto& [tag, value] : e.values) scalars.push_back({std::move(tag), e.step, value, e.wall_time});
    pos += 12 + n + 4;
  }
  return scalars;
}

}  // namespace nebula::eval
