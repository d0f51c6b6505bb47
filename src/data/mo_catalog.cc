#include "data/mo_catalog.h"

#include <iconv.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <memory>

#include "data/file_io.h"
#include "nebula/error.h"

namespace nebula::data {
namespace {

constexpr uint32_t kMagic = 0x950412de;
constexpr size_t kHeaderSize = 28;
// Offsets are 32-bit, so no valid catalog exceeds 4 GiB plus its last string.
constexpr size_t kMaxFileSize = (size_t{1} << 32) + (size_t{1} << 32);

uint32_t byteswap32(uint32_t v) {
  return (v >> 24) | ((v >> 8) & 0xff00u) | ((v << 8) & 0xff0000u) | (v << 24);
}

// Bounds-checked view of the catalog bytes in the file's byte order.
class MoReader {
 public:
  MoReader(std::string_view bytes, const std::string& name) : bytes_(bytes), name_(name) {}

  [[noreturn]] void fail(const std::string& reason) const { throw DataError(name_ + ": " + reason); }

  // Reads the 32-bit word at `offset`; the caller has checked offset + 4 <= size.
  uint32_t word(size_t offset) const {
    uint32_t v;
    std::memcpy(&v, bytes_.data() + offset, 4);
    return swap_ ? byteswap32(v) : v;
  }

  void set_swap(bool swap) { swap_ = swap; }
  size_t size() const { return bytes_.size(); }

  // String `index` of the table at `table` (already checked to lie inside the file).
  std::string_view string_at(size_t table, uint32_t index, const char* which) const {
    const uint64_t length = word(table + size_t{index} * 8);
    const uint64_t offset = word(table + size_t{index} * 8 + 4);
    // The string and its terminating NUL must lie inside the file.
    if (offset + length + 1 > bytes_.size()) {
      fail(str_cat(which, " table entry ", index, " points past end of file (offset ", offset, ", length ",
                   length, ", file size ", bytes_.size(), ")"));
    }
    if (bytes_[offset + length] != '\0') {
      fail(str_cat(which, " table entry ", index, " is not NUL-terminated (offset ", offset, ", length ",
                   length, ")"));
    }
    return bytes_.substr(offset, length);
  }

 private:
  std::string_view bytes_;
  const std::string& name_;
  bool swap_ = false;
};

std::vector<std::string> split_nul(std::string_view s) {
  std::vector<std::string> parts;
  for (;;) {
    size_t pos = s.find('\0');
    parts.emplace_back(s.substr(0, pos));
    if (pos == std::string_view::npos) break;
    s.remove_prefix(pos + 1);
  }
  return parts;
}

// The charset named in the header entry's "Content-Type: ...; charset=X" line, or "".
std::string header_charset(std::string_view header) {
  static constexpr std::string_view kKey = "charset=";
  for (size_t pos = 0; pos + kKey.size() <= header.size(); ++pos) {
    bool match = true;
    for (size_t k = 0; k < kKey.size() && match; ++k) {
      char c = header[pos + k];
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
      match = c == kKey[k];
    }
    if (!match) continue;
    size_t start = pos + kKey.size(), end = start;
    while (end < header.size() && header[end] != ';' && header[end] != '\n' && header[end] != ' ' &&
           header[end] != '\r' && header[end] != '\t') {
      ++end;
    }
    return std::string(header.substr(start, end - start));
  }
  return "";
}

bool is_utf8_compatible(std::string charset) {
  for (char& c : charset) {
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 'a' + 'A');
  }
  // "CHARSET" is the placeholder of an unfilled template; msgfmt treats it as ASCII.
  return charset.empty() || charset == "UTF-8" || charset == "UTF8" || charset == "ASCII" ||
         charset == "US-ASCII" || charset == "ANSI_X3.4-1968" || charset == "CHARSET";
}

// Converts the catalog's strings to UTF-8 (one iconv descriptor per catalog).
class ToUtf8 {
 public:
  ToUtf8(const std::string& charset, const MoReader& r) : charset_(charset), reader_(r) {
    cd_ = ::iconv_open("UTF-8", charset.c_str());
    if (cd_ == reinterpret_cast<iconv_t>(-1)) r.fail(str_cat("unsupported charset \"", charset, "\" in header"));
  }
  ~ToUtf8() { ::iconv_close(cd_); }
  ToUtf8(const ToUtf8&) = delete;
  ToUtf8& operator=(const ToUtf8&) = delete;

  std::string operator()(const std::string& in, uint32_t index) const {
    ::iconv(cd_, nullptr, nullptr, nullptr, nullptr);  // reset shift state
    std::string out(in.size() * 2 + 16, '\0');
    char* src = const_cast<char*>(in.data());
    size_t src_left = in.size();
    size_t done = 0;
    for (;;) {
      char* dst = out.data() + done;
      size_t dst_left = out.size() - done;
      size_t rc = ::iconv(cd_, &src, &src_left, &dst, &dst_left);
      done = out.size() - dst_left;
      if (rc != static_cast<size_t>(-1)) break;
      if (errno == E2BIG) {
        out.resize(out.size() * 2);
        continue;
      }
      reader_.fail(str_cat("entry ", index, " is not valid ", charset_, " (byte offset ", in.size() - src_left,
                           " of its string)"));
    }
    out.resize(done);
    return out;
  }

 private:
  std::string charset_;
  const MoReader& reader_;
  iconv_t cd_;
};

}  // namespace

std::vector<MoEntry> parse_mo(std::string_view bytes, const std::string& name) {
  MoReader r(bytes, name);
  if (bytes.size() < kHeaderSize) {
    r.fail(str_cat("file too short for a .mo header (", bytes.size(), " bytes, need ", kHeaderSize, ")"));
  }
  if (bytes.size() > kMaxFileSize) r.fail(str_cat("file too large for a .mo catalog (", bytes.size(), " bytes)"));
  const uint32_t magic = r.word(0);
  if (magic == kMagic) {
    r.set_swap(false);
  } else if (byteswap32(magic) == kMagic) {
    r.set_swap(true);
  } else {
    r.fail(str_cat("bad magic 0x", std::hex, magic, " (not a .mo catalog)"));
  }
  const uint32_t revision = r.word(4);
  const uint32_t major = revision >> 16;
  if (major > 1) r.fail(str_cat("unsupported revision ", major, ".", (revision & 0xffff), " (major must be 0 or 1)"));

  const uint64_t n = r.word(8);
  const uint64_t orig_table = r.word(12);
  const uint64_t trans_table = r.word(16);
  const uint64_t hash_size = r.word(20);
  const uint64_t hash_offset = r.word(24);
  const uint64_t size = bytes.size();
  // Each entry costs at least 16 bytes of tables; this bounds N before anything is sized by it.
  if (n * 16 > size) r.fail(str_cat("entry count ", n, " is impossible for a file of ", size, " bytes"));
  if (orig_table + n * 8 > size) {
    r.fail(str_cat("original string table (offset ", orig_table, ", ", n, " entries) extends past end of file (file size ",
                   size, ")"));
  }
  if (trans_table + n * 8 > size) {
    r.fail(str_cat("translation table (offset ", trans_table, ", ", n,
                   " entries) extends past end of file (file size ", size, ")"));
  }
  if (hash_size != 0 && hash_offset + hash_size * 4 > size) {
    r.fail(str_cat("hash table (offset ", hash_offset, ", ", hash_size, " slots) extends past end of file (file size ",
                   size, ")"));
  }

  // Validate every string first; the header entry (empty original) names the charset.
  std::string charset;
  for (uint32_t i = 0; i < n; ++i) {
    std::string_view orig = r.string_at(orig_table, i, "original string");
    std::string_view trans = r.string_at(trans_table, i, "translation");
    if (orig.empty() && charset.empty()) charset = header_charset(trans);
  }
  std::unique_ptr<ToUtf8> to_utf8;
  if (!is_utf8_compatible(charset)) to_utf8 = std::make_unique<ToUtf8>(charset, r);

  std::vector<MoEntry> entries;
  entries.reserve(n);
  for (uint32_t i = 0; i < n; ++i) {
    std::string_view orig = r.string_at(orig_table, i, "original string");
    std::string_view trans = r.string_at(trans_table, i, "translation");
    MoEntry e;
    std::string_view id = orig;
    if (size_t nul = id.find('\0'); nul != std::string_view::npos) {
      e.msgid_plural = std::string(id.substr(nul + 1));
      id = id.substr(0, nul);
    }
    if (size_t eot = id.find('\x04'); eot != std::string_view::npos) {
      e.context = std::string(id.substr(0, eot));
      id = id.substr(eot + 1);
    }
    // Empty msgid: the header entry (metadata), or nothing a corpus could use.
    if (id.empty()) continue;
    e.msgid = std::string(id);
    e.translations = split_nul(trans);
    if (to_utf8) {
      e.context = (*to_utf8)(e.context, i);
      e.msgid = (*to_utf8)(e.msgid, i);
      e.msgid_plural = (*to_utf8)(e.msgid_plural, i);
      for (std::string& t : e.translations) t = (*to_utf8)(t, i);
    }
    entries.push_back(std::move(e));
  }
  return entries;
}

std::vector<MoEntry> read_mo_file(const std::string& path) {
  return parse_mo(read_file_bytes(path, kMaxFileSize), path);
}

}  // namespace nebula::data
