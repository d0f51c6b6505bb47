// Test helpers: serialize entries into .mo bytes (either byte order), and small file
// utilities. Header-only, used by the data layer's tests only.
#pragma once

#include "util/temp_dir.h"

#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "data/mo_catalog.h"

namespace nebula::data::testing {

// The original string of an entry as stored in a .mo file.
inline std::string mo_original(const MoEntry& e) {
  std::string s;
  if (!e.context.empty()) s += e.context + '\x04';
  s += e.msgid;
  if (!e.msgid_plural.empty()) s += std::string(1, '\0') + e.msgid_plural;
  return s;
}

inline std::string mo_translation(const MoEntry& e) {
  std::string s;
  for (size_t i = 0; i < e.translations.size(); ++i) {
    if (i) s += '\0';
    s += e.translations[i];
  }
  return s;
}

// Serializes a catalog as msgfmt would (header entry first, originals sorted, no hash
// table), in little- or big-endian byte order.
inline std::string write_mo(std::vector<MoEntry> entries, bool big_endian,
                            const std::string& header = "Content-Type: text/plain; charset=UTF-8\n") {
  std::vector<std::pair<std::string, std::string>> strings;
  strings.emplace_back("", header);
  for (const MoEntry& e : entries) strings.emplace_back(mo_original(e), mo_translation(e));
  std::sort(strings.begin(), strings.end());
  const uint32_t n = static_cast<uint32_t>(strings.size());
  const uint32_t orig_table = 28, trans_table = 28 + 8 * n, data = 28 + 16 * n;
  std::string out;
  auto put = [&](uint32_t v) {
    for (int i = 0; i < 4; ++i) {
      int shift = big_endian ? 8 * (3 - i) : 8 * i;
      out += static_cast<char>((v >> shift) & 0xff);
    }
  };
  put(0x950412de);
  put(0);  // revision
  put(n);
  put(orig_table);
  put(trans_table);
  put(0);  // hash table size
  put(data);
  // Strings: all originals, then all translations, each NUL-terminated.
  std::string blob;
  std::vector<uint32_t> orig_off, trans_off;
  for (const auto& [o, t] : strings) {
    orig_off.push_back(data + static_cast<uint32_t>(blob.size()));
    blob += o;
    blob += '\0';
  }
  for (const auto& [o, t] : strings) {
    trans_off.push_back(data + static_cast<uint32_t>(blob.size()));
    blob += t;
    blob += '\0';
  }
  for (uint32_t i = 0; i < n; ++i) {
    put(static_cast<uint32_t>(strings[i].first.size()));
    put(orig_off[i]);
  }
  for (uint32_t i = 0; i < n; ++i) {
    put(static_cast<uint32_t>(strings[i].second.size()));
    put(trans_off[i]);
  }
  return out + blob;
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!f) throw std::runtime_error("cannot write " + path);
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

using nebula::testing::TempDir;  // (util/temp_dir.h)


// First *.mo file (sorted) in /usr/share/locale/<lang>/LC_MESSAGES larger than
// `min_bytes`, or "" if there is none.
inline std::string find_system_catalog(const std::string& lang, size_t min_bytes = 4096) {
  std::vector<std::string> files;
  std::error_code ec;
  for (std::filesystem::directory_iterator it("/usr/share/locale/" + lang + "/LC_MESSAGES", ec), end;
       !ec && it != end; it.increment(ec)) {
    if (it->path().extension() == ".mo" && it->is_regular_file() && it->file_size() > min_bytes) {
      files.push_back(it->path().string());
    }
  }
  std::sort(files.begin(), files.end());
  return files.empty() ? "" : files.front();
}

}  // namespace nebula::data::testing
