#include "data/corpus.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <set>
#include <system_error>
#include <tuple>
#include <utility>

#include "data/file_io.h"
#include "data/mo_catalog.h"
#include "nebula/error.h"

namespace nebula::data {
namespace {

namespace fs = std::filesystem;

// Salts keep the three hash-based choices independent of each other: without them the
// per-language subset (smallest hashes) would all land in the test split.
constexpr uint64_t kSplitSalt = 0x73706c6974ULL;     // "split"
constexpr uint64_t kSliceSalt = 0x736c696365ULL;     // "slice"
constexpr uint64_t kSubsetSalt = 0x737562736574ULL;  // "subset"

// Where a placeholder or tag was removed, the passes leave kGap; the last pass turns a
// run of spaces and gaps into one space, or into nothing before closing punctuation
// ("in %s." -> "in.", "file %s: failed" -> "file: failed"). Control bytes in the input
// become spaces first, so kGap cannot come from the input.
constexpr char kGap = '\x01';

bool is_alnum(unsigned char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_alpha(unsigned char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool is_high(unsigned char c) { return c >= 0x80; }  // part of a multi-byte UTF-8 character
bool starts_with_at(std::string_view s, size_t i, std::string_view what) { return s.substr(i, what.size()) == what; }

// Rule 1.
std::string normalize_spaces(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    char c = s[i];
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      out += ' ';
    } else if (starts_with_at(s, i, "\xc2\xa0")) {  // U+00A0 no-break space
      out += ' ';
      i += 1;
    } else if (starts_with_at(s, i, "\xe2\x80\xaf")) {  // U+202F narrow no-break space
      out += ' ';
      i += 2;
    } else {
      out += c;
    }
  }
  return out;
}

// Rule 2: length of the markup tag starting at s[i] == '<', or 0.
size_t tag_length(std::string_view s, size_t i) {
  const size_t n = s.size();
  size_t j = i + 1;
  if (j < n && s[j] == '/') ++j;
  if (j >= n || !is_alpha(s[j])) return 0;
  ++j;
  while (j < n && (is_alnum(s[j]) || s[j] == '_' || s[j] == ':' || s[j] == '.' || s[j] == '-')) ++j;
  if (j < n && s[j] == '>') return j + 1 - i;
  if (j + 1 < n && s[j] == '/' && s[j + 1] == '>') return j + 2 - i;
  if (j < n && s[j] == ' ') {
    for (size_t k = j; k < n && k - i < 500; ++k) {
      if (s[k] == '<') return 0;
      if (s[k] == '>') return k + 1 - i;
    }
  }
  return 0;
}

std::string remove_tags(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '<') {
      if (size_t len = tag_length(s, i)) {
        out += kGap;
        out += ' ';  // "a<br/>b" -> "a b"
        i += len - 1;
        continue;
      }
    }
    out += s[i];
  }
  return out;
}

// Rule 3: length of the printf/Python/Qt specifier starting at s[i] == '%' (not "%%"), or 0.
size_t format_spec_length(std::string_view s, size_t i) {
  const size_t n = s.size();
  size_t j = i + 1;
  auto skip_digits = [&](size_t k) {
    while (k < n && is_digit(s[k])) ++k;
    return k;
  };
  if (j < n && s[j] == '(') {  // Python %(name)s
    size_t k = j + 1;
    while (k < n && k - j < 40 && (is_alnum(s[k]) || s[k] == '_')) ++k;
    if (k >= n || s[k] != ')' || k == j + 1) return 0;
    j = k + 1;
  } else if (size_t k = skip_digits(j); k > j && k < n && s[k] == '$') {  // positional %1$s
    j = k + 1;
  }
  while (j < n && (s[j] == '-' || s[j] == '+' || s[j] == '#' || s[j] == '0' || s[j] == '\'')) ++j;  // flags
  auto skip_star_or_digits = [&](size_t k) {
    if (k < n && s[k] == '*') {
      size_t d = skip_digits(k + 1);
      return (d > k + 1 && d < n && s[d] == '$') ? d + 1 : k + 1;
    }
    return skip_digits(k);
  };
  j = skip_star_or_digits(j);  // width
  if (j < n && s[j] == '.') j = skip_star_or_digits(j + 1);  // precision
  // length modifiers
  if (starts_with_at(s, j, "hh") || starts_with_at(s, j, "ll")) {
    j += 2;
  } else if (j < n && std::string_view("hlLqjzZt").find(s[j]) != std::string_view::npos) {
    ++j;
  }
  if (j < n && std::string_view("diouxXeEfFgGaAcspnmCS").find(s[j]) != std::string_view::npos) return j + 1 - i;
  // strftime: %B, %-d, %_H, %Ey, %5Y
  j = i + 1;
  while (j < n && (s[j] == '_' || s[j] == '-' || s[j] == '0' || s[j] == '^' || s[j] == '#')) ++j;
  j = skip_digits(j);
  if (j + 1 < n && (s[j] == 'E' || s[j] == 'O') && is_alpha(s[j + 1])) ++j;
  if (j < n && is_alpha(s[j])) return j + 1 - i;
  // Qt: %1 .. %99
  if (i + 1 < n && s[i + 1] >= '1' && s[i + 1] <= '9') {
    size_t k = i + 2;
    if (k < n && is_digit(s[k])) ++k;
    return k - i;
  }
  return 0;
}

std::string remove_format_specs(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%') {
      if (starts_with_at(s, i, "%%0A")) {  // GnuPG/pinentry's percent-encoded newline
        out += ' ';
        i += 3;
        continue;
      }
      if (i + 1 < s.size() && s[i + 1] == '%') {
        // "%%s": a specifier escaped for a second formatting pass (git does this).
        if (size_t len = format_spec_length(s, i + 1)) {
          out += kGap;
          i += len;
          continue;
        }
        out += '%';
        ++i;
        continue;
      }
      if (size_t len = format_spec_length(s, i)) {
        out += kGap;
        i += len - 1;
        continue;
      }
    }
    out += s[i];
  }
  return out;
}

// Rule 4: length of the brace placeholder starting at s[i] == '{', or 0.
size_t brace_length(std::string_view s, size_t i) {
  const size_t n = s.size();
  size_t j = i + 1;
  while (j < n && j - i <= 40 && (is_alnum(s[j]) || s[j] == '_' || s[j] == '.' || s[j] == '-')) ++j;
  if (j < n && (s[j] == ':' || s[j] == '!')) {
    ++j;
    while (j < n && j - i <= 40 && s[j] != '}' && s[j] != '{' && s[j] != ' ') ++j;
  }
  if (j < n && s[j] == '}' && j - i <= 40) return j + 1 - i;
  return 0;
}

std::string remove_braces(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '{') {
      if (size_t len = brace_length(s, i)) {
        if (!out.empty() && out.back() == '$') out.pop_back();  // ${var}
        out += kGap;
        i += len - 1;
        continue;
      }
    }
    out += s[i];
  }
  return out;
}

bool is_entity_at(std::string_view s, size_t i) {
  size_t j = i + 1;
  const size_t n = s.size();
  if (j < n && s[j] == '#') {
    ++j;
    if (j < n && (s[j] == 'x' || s[j] == 'X')) ++j;
  }
  size_t start = j;
  while (j < n && j - i < 12 && is_alnum(s[j])) ++j;
  return j > start && j < n && s[j] == ';';
}

// Rule 5.
std::string remove_mnemonics(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  const size_t n = s.size();
  for (size_t i = 0; i < n; ++i) {
    const char c = s[i];
    // East Asian style "打开(_O)" / "(&O)": drop the whole group.
    if (c == '(' && i + 3 < n && (s[i + 1] == '_' || s[i + 1] == '&') && is_alnum(s[i + 2]) && s[i + 3] == ')') {
      i += 3;
      continue;
    }
    if (c == '_' || c == '&') {
      const bool prev_ok = out.empty() || (!is_alnum(out.back()) && !is_high(out.back()) && out.back() != '_' &&
                                           out.back() != '&');
      const bool next_ok = i + 1 < n && (is_alnum(s[i + 1]) || is_high(s[i + 1]));
      if (prev_ok && next_ok && !(c == '&' && is_entity_at(s, i))) continue;
    }
    out += c;
  }
  return out;
}

// Rule 6.
std::string decode_entities(std::string_view s) {
  static constexpr std::array<std::pair<std::string_view, char>, 6> kEntities{{
      {"&amp;", '&'}, {"&lt;", '<'}, {"&gt;", '>'}, {"&quot;", '"'}, {"&apos;", '\''}, {"&nbsp;", ' '}}};
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    bool replaced = false;
    if (s[i] == '&') {
      for (const auto& [name, ch] : kEntities) {
        if (starts_with_at(s, i, name)) {
          out += ch;
          i += name.size() - 1;
          replaced = true;
          break;
        }
      }
    }
    if (!replaced) out += s[i];
  }
  return out;
}

// Rule 7. Repeats until nothing changes, so "('')" goes too. Spaces inside are allowed
// only for pairs whose closing mark differs from and cannot open the next pair, so that
// the gap in "'a' 'b'" or "»a« »b«" is not taken for an empty pair.
std::string remove_empty_pairs(std::string s) {
  struct Pair {
    std::string_view open, close;
    bool spaces_inside;
  };
  static constexpr std::array<Pair, 14> kPairs{{
      {"'", "'", false}, {"\"", "\"", false}, {"`", "'", true}, {"`", "`", false},
      {"(", ")", true}, {"[", "]", true}, {"<", ">", true},
      {"\xc2\xab", "\xc2\xbb", true},           // « »
      {"\xc2\xbb", "\xc2\xab", false},          // » «
      {"\xe2\x80\x9e", "\xe2\x80\x9c", false},  // „ “
      {"\xe2\x80\x9c", "\xe2\x80\x9d", false},  // “ ”
      {"\xe2\x80\x98", "\xe2\x80\x99", false},  // ‘ ’
      {"\xe2\x80\x9a", "\xe2\x80\x98", false},  // ‚ ‘
      {"\xe3\x80\x8c", "\xe3\x80\x8d", true}}};  // 「 」
  for (bool changed = true; changed;) {
    changed = false;
    std::string out;
    out.reserve(s.size());
    for (size_t i = 0; i < s.size(); ++i) {
      bool removed = false;
      for (const Pair& pair : kPairs) {
        if (!starts_with_at(s, i, pair.open)) continue;
        size_t j = i + pair.open.size();
        while (j < s.size() && (s[j] == kGap || (pair.spaces_inside && s[j] == ' '))) ++j;
        if (starts_with_at(s, j, pair.close)) {
          out += kGap;
          i = j + pair.close.size() - 1;
          removed = changed = true;
          break;
        }
      }
      if (!removed) out += s[i];
    }
    s = std::move(out);
  }
  return s;
}

// Rule 1, second part: GnuPG's option help names the argument between bars first.
std::string remove_argument_name(std::string s) {
  if (s.size() < 3 || s[0] != '|') return s;
  const size_t end = s.find('|', 1);
  // "||Text" (no name) too; but "|| is or" is text: the message starts right after the bar.
  if (end == std::string::npos || end > 40 || s.find(' ', 1) < end || end + 1 >= s.size() || s[end + 1] == ' ')
    return s;
  s[end] = kGap;
  return s.substr(end);
}

// Quote characters, ASCII and typographic. Whether one opens or closes depends on where it
// stands (German uses »...« and „...“, French «...», English '...' and “...”).
constexpr std::array<std::string_view, 13> kQuotes = {
    "'", "\"", "`",
    "\xc2\xab", "\xc2\xbb",                          // « »
    "\xe2\x80\x9e", "\xe2\x80\x9c", "\xe2\x80\x9d",  // „ “ ”
    "\xe2\x80\x98", "\xe2\x80\x99", "\xe2\x80\x9a",  // ‘ ’ ‚
    "\xe3\x80\x8c", "\xe3\x80\x8d"};               // 「 」

bool is_closing_punct(char c) { return std::string_view(",.:;!?)]").find(c) != std::string_view::npos; }

// A quote ends `out` and opens (it follows the start, a space or '(').
bool ends_with_opening_quote(std::string_view out) {
  for (std::string_view q : kQuotes) {
    if (!out.ends_with(q)) continue;
    const size_t p = out.size() - q.size();
    return p == 0 || out[p - 1] == ' ' || out[p - 1] == '(';
  }
  return false;
}

// A quote starts at s[i] and closes (the end, a space, a gap or punctuation follows it).
bool closing_quote_at(std::string_view s, size_t i) {
  for (std::string_view q : kQuotes) {
    if (!starts_with_at(s, i, q)) continue;
    const size_t k = i + q.size();
    return k == s.size() || s[k] == ' ' || s[k] == kGap || is_closing_punct(s[k]);
  }
  return false;
}

// Rule 8.
std::string collapse_and_trim(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    if (s[i] != ' ' && s[i] != kGap) {
      out += s[i++];
      continue;
    }
    bool space = false, gap = false;
    for (; i < s.size() && (s[i] == ' ' || s[i] == kGap); ++i) (s[i] == ' ' ? space : gap) = true;
    // Where something was removed, no space before closing punctuation or a closing quote,
    // nor after an opening quote: "in %s." -> "in.", "'PROT %s'" -> "'PROT'".
    const bool tight =
        i < s.size() && (is_closing_punct(s[i]) || closing_quote_at(s, i) || ends_with_opening_quote(out));
    if (out.empty() || i == s.size() || (gap && tight)) continue;
    if (space) out += ' ';
  }
  for (bool changed = true; changed;) {
    changed = false;
    while (!out.empty() && out.back() == ' ') out.pop_back();
    if (out.ends_with("...")) {
      out.resize(out.size() - 3);
      changed = true;
    } else if (out.ends_with("\xe2\x80\xa6")) {  // …
      out.resize(out.size() - 3);
      changed = true;
    } else if (out.ends_with(":")) {
      out.pop_back();
      changed = true;
    }
    size_t lead = 0;
    while (lead < out.size() && (out[lead] == ' ' || out[lead] == ':' || out[lead] == ',' || out[lead] == ';')) ++lead;
    if (lead > 0) {
      out.erase(0, lead);
      changed = true;
    }
  }
  return out;
}

uint64_t fnv1a(uint64_t h, std::string_view bytes) {
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

std::vector<std::string> split_lines(const std::string& bytes) {
  std::vector<std::string> lines;
  size_t start = 0;
  while (start < bytes.size()) {
    size_t end = bytes.find('\n', start);
    if (end == std::string::npos) end = bytes.size();
    std::string line = bytes.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    start = end + 1;
  }
  return lines;
}

bool is_blank(std::string_view line) { return line.find_first_not_of(' ') == std::string_view::npos; }

// Byte offset of the first byte of `s` that does not start or continue a well-formed UTF-8
// sequence (RFC 3629: no overlong forms, no surrogates, nothing above U+10FFFF), or of a NUL
// (text files hold none; a binary file usually does); npos if there is none.
size_t first_bad_utf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<unsigned char>(s[i]);
    if (b == 0) return i;
    if (b < 0x80) {
      ++i;
      continue;
    }
    size_t n;
    unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (b >= 0xC2 && b <= 0xDF) n = 1;
    else if (b == 0xE0) n = 2, lo = 0xA0;
    else if (b == 0xED) n = 2, hi = 0x9F;
    else if (b >= 0xE1 && b <= 0xEF) n = 2;
    else if (b == 0xF0) n = 3, lo = 0x90;
    else if (b == 0xF4) n = 3, hi = 0x8F;
    else if (b >= 0xF1 && b <= 0xF3) n = 3;
    else return i;
    if (i + n >= s.size()) return i;  // the sequence is cut off by the end of the line
    for (size_t k = 1; k <= n; ++k) {
      const auto c = static_cast<unsigned char>(s[i + k]);
      if (k == 1 ? (c < lo || c > hi) : (c < 0x80 || c > 0xBF)) return i;
    }
    i += n + 1;
  }
  return std::string_view::npos;
}

// The lines of a user's text file (TSV or one sentence per line), checked to be UTF-8: a file
// in another encoding would otherwise train on <unk>s without a word. A leading byte-order
// mark is dropped.
std::vector<std::string> read_utf8_lines(const std::string& path) {
  std::string bytes = read_file_bytes(path);
  if (bytes.starts_with("\xEF\xBB\xBF")) bytes.erase(0, 3);
  std::vector<std::string> lines = split_lines(bytes);
  for (size_t ln = 0; ln < lines.size(); ++ln) {
    const size_t bad = first_bad_utf8(lines[ln]);
    if (bad == std::string_view::npos) continue;
    const auto b = static_cast<unsigned char>(lines[ln][bad]);
    if (b == 0)
      throw DataError(str_cat(path, ":", ln + 1, ":", bad + 1, ": a NUL byte: this is not a text file (data.path "
                              "must name a UTF-8 text file, not a compressed or binary one)"));
    char hex[8];
    std::snprintf(hex, sizeof hex, "0x%02X", b);
    throw DataError(str_cat(path, ":", ln + 1, ":", bad + 1, ": not valid UTF-8 (byte ", hex,
                            "): convert the file to UTF-8, e.g. iconv -f ISO-8859-1 -t UTF-8"));
  }
  return lines;
}

// Sorted paths of the *.mo regular files in `dir`; empty if there is no such directory.
std::vector<std::string> mo_files_in(const fs::path& dir) {
  std::vector<std::string> files;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return files;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) break;
    const fs::path& p = it->path();
    std::error_code ec2;
    if (p.extension() == ".mo" && fs::is_regular_file(p, ec2)) files.push_back(p.string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string sanitize_field(std::string s) {
  for (char& c : s) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

// Keeps the `max` pairs (of one language) with the smallest subset hash, in their original
// order: a fixed pseudo-random subset that does not favour the start of the alphabet.
// 0 = keep all. Returns how many were left out.
size_t keep_hash_subset(std::vector<SentencePair>& pairs, size_t max) {
  if (max == 0 || pairs.size() <= max) return 0;
  std::vector<std::pair<uint64_t, size_t>> keyed;
  keyed.reserve(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) keyed.emplace_back(pair_hash(pairs[i], kSubsetSalt), i);
  std::nth_element(keyed.begin(), keyed.begin() + static_cast<std::ptrdiff_t>(max), keyed.end());
  keyed.resize(max);
  std::vector<size_t> indices;
  indices.reserve(keyed.size());
  for (const auto& [h, i] : keyed) indices.push_back(i);
  std::sort(indices.begin(), indices.end());  // back to the original order
  std::vector<SentencePair> subset;
  subset.reserve(indices.size());
  for (size_t i : indices) subset.push_back(std::move(pairs[i]));
  const size_t dropped = pairs.size() - subset.size();
  pairs = std::move(subset);
  return dropped;
}

// Unicode code points in UTF-8 text: bytes that are not continuation bytes (10xxxxxx).
size_t count_chars(std::string_view s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xc0) != 0x80;
  return n;
}

constexpr std::array<const char*, 3> kSplitNames = {"train", "valid", "test"};

}  // namespace

std::string clean_message(std::string_view s) {
  std::string t = remove_argument_name(normalize_spaces(s));
  t = remove_tags(t);
  t = remove_format_specs(t);
  t = remove_braces(t);
  t = remove_mnemonics(t);
  t = decode_entities(t);
  t = remove_empty_pairs(std::move(t));
  return collapse_and_trim(t);
}

namespace {

// The salt's bytes, then MurmurHash3's fmix64: FNV-1a alone mixes its high bits poorly for
// similar inputs.
uint64_t salt_and_mix(uint64_t h, uint64_t salt) {
  char salt_bytes[8];
  for (int i = 0; i < 8; ++i) salt_bytes[i] = static_cast<char>((salt >> (8 * i)) & 0xff);
  h = fnv1a(h, std::string_view(salt_bytes, 8));
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdULL;
  h ^= h >> 33;
  h *= 0xc4ceb9fe1a85ec53ULL;
  h ^= h >> 33;
  return h;
}

constexpr uint64_t kFnvOffset = 14695981039346656037ULL;

}  // namespace

uint64_t pair_hash(const SentencePair& p, uint64_t salt) {
  uint64_t h = kFnvOffset;
  const char zero = '\0';
  h = fnv1a(h, p.lang);
  h = fnv1a(h, std::string_view(&zero, 1));
  h = fnv1a(h, p.en);
  h = fnv1a(h, std::string_view(&zero, 1));
  h = fnv1a(h, p.other);
  h = fnv1a(h, std::string_view(&zero, 1));
  return salt_and_mix(h, salt);
}

uint64_t sentence_hash(std::string_view text, uint64_t salt) {
  const char zero = '\0';
  return salt_and_mix(fnv1a(fnv1a(kFnvOffset, text), std::string_view(&zero, 1)), salt);
}

std::vector<std::string> list_gettext_languages(const std::string& locale_dir) {
  std::error_code ec;
  fs::directory_iterator it(locale_dir, ec);
  if (ec) throw DataError(str_cat(locale_dir, ": cannot list locale directory: ", ec.message()));
  std::vector<std::string> langs;
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    if (ec) throw DataError(str_cat(locale_dir, ": cannot list locale directory: ", ec.message()));
    std::error_code ec2;
    if (!it->is_directory(ec2)) continue;
    if (!mo_files_in(it->path() / "LC_MESSAGES").empty()) langs.push_back(it->path().filename().string());
  }
  std::sort(langs.begin(), langs.end());
  return langs;
}

std::vector<SentencePair> build_gettext_corpus(const CorpusOptions& options, CorpusStats* stats) {
  CorpusStats local;
  CorpusStats& st = stats ? *stats : local;
  st = CorpusStats{};

  std::vector<std::string> langs = options.languages;
  if (langs.empty()) {
    langs = list_gettext_languages(options.locale_dir);
    if (langs.empty()) throw DataError(str_cat(options.locale_dir, ": no gettext catalogs (*/LC_MESSAGES/*.mo) found"));
  }
  std::sort(langs.begin(), langs.end());
  langs.erase(std::unique(langs.begin(), langs.end()), langs.end());

  // Check every requested language before the (slow) reading starts.
  std::vector<std::vector<std::string>> files_per_lang;
  for (const std::string& lang : langs) {
    fs::path dir = fs::path(options.locale_dir) / lang / "LC_MESSAGES";
    files_per_lang.push_back(mo_files_in(dir));
    if (files_per_lang.back().empty()) {
      throw DataError(str_cat("language '", lang, "': no gettext catalogs (*.mo) in ", dir.string()));
    }
  }

  std::vector<SentencePair> result;
  for (size_t li = 0; li < langs.size(); ++li) {
    const std::string& lang = langs[li];
    std::vector<SentencePair> pairs;
    for (const std::string& file : files_per_lang[li]) {
      std::vector<MoEntry> entries;
      try {
        entries = read_mo_file(file);
      } catch (const DataError& e) {
        spdlog::warn("skipping gettext catalog: {}", e.what());
        ++st.files_skipped;
        st.skipped_files.push_back(file);
        continue;
      }
      ++st.files_read;
      st.entries_seen += entries.size();
      for (const MoEntry& e : entries) {
        if (e.translations.empty() || e.translations[0].empty()) {  // untranslated
          ++st.entries_dropped;
          continue;
        }
        std::string en = clean_message(e.msgid);
        std::string other = clean_message(e.translations[0]);
        auto size_ok = [&](const std::string& x) {
          return !x.empty() && x.size() >= options.min_chars && x.size() <= options.max_chars;
        };
        if (!size_ok(en) || !size_ok(other) || en == other) {
          ++st.entries_dropped;
          continue;
        }
        pairs.push_back(SentencePair{lang, std::move(en), std::move(other)});
      }
    }
    std::sort(pairs.begin(), pairs.end());
    const size_t before = pairs.size();
    pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
    st.duplicates_dropped += before - pairs.size();

    st.pairs_over_cap += keep_hash_subset(pairs, options.max_pairs_per_language);
    if (!pairs.empty()) st.pairs_per_language[lang] = pairs.size();
    st.pairs_kept += pairs.size();
    result.insert(result.end(), std::make_move_iterator(pairs.begin()), std::make_move_iterator(pairs.end()));
  }
  return result;
}

size_t cap_per_language(std::vector<SentencePair>& pairs, size_t max) {
  if (max == 0) return 0;
  std::map<std::string, std::vector<std::pair<uint64_t, size_t>>> by_lang;  // (subset hash, index)
  for (size_t i = 0; i < pairs.size(); ++i) by_lang[pairs[i].lang].emplace_back(pair_hash(pairs[i], kSubsetSalt), i);
  std::vector<bool> keep(pairs.size(), true);
  for (auto& [lang, keyed] : by_lang) {
    if (keyed.size() <= max) continue;
    std::nth_element(keyed.begin(), keyed.begin() + static_cast<std::ptrdiff_t>(max), keyed.end());
    for (size_t j = max; j < keyed.size(); ++j) keep[keyed[j].second] = false;
  }
  std::vector<SentencePair> out;
  for (size_t i = 0; i < pairs.size(); ++i)
    if (keep[i]) out.push_back(std::move(pairs[i]));
  const size_t dropped = pairs.size() - out.size();
  pairs = std::move(out);
  return dropped;
}

std::vector<std::string> read_lines(const std::string& path) { return split_lines(read_file_bytes(path)); }

std::vector<std::string> read_text_file(const std::string& path) {
  std::vector<std::string> out;
  for (std::string& line : read_utf8_lines(path)) {
    if (!is_blank(line)) out.push_back(std::move(line));
  }
  return out;
}

std::vector<SentencePair> read_tsv_file(const std::string& path, const std::string& default_lang) {
  std::vector<SentencePair> out;
  std::vector<std::string> lines = read_utf8_lines(path);
  for (size_t ln = 0; ln < lines.size(); ++ln) {
    const std::string& line = lines[ln];
    if (is_blank(line) || line[0] == '#') continue;
    std::vector<std::string_view> cols;
    std::string_view rest = line;
    for (;;) {
      size_t tab = rest.find('\t');
      cols.push_back(rest.substr(0, tab));
      if (tab == std::string_view::npos) break;
      rest.remove_prefix(tab + 1);
    }
    if (cols.size() == 2) {
      out.push_back(SentencePair{default_lang, std::string(cols[0]), std::string(cols[1])});
    } else if (cols.size() == 3) {
      out.push_back(SentencePair{std::string(cols[0]), std::string(cols[1]), std::string(cols[2])});
    } else {
      throw DataError(str_cat(path, ":", ln + 1, ": expected 2 or 3 tab-separated columns, got ", cols.size(),
                              " (lines are en<TAB>other or lang<TAB>en<TAB>other; '#' starts a comment)"));
    }
  }
  return out;
}

void write_tsv_file(const std::string& path, const std::vector<SentencePair>& pairs) {
  std::string text;
  for (const SentencePair& p : pairs) {
    text += sanitize_field(p.lang);
    text += '\t';
    text += sanitize_field(p.en);
    text += '\t';
    text += sanitize_field(p.other);
    text += '\n';
  }
  write_file_atomic(path, text);
}

namespace {

void check_fractions(double valid_fraction, double test_fraction) {
  NEBULA_CHECK(valid_fraction >= 0 && valid_fraction <= 1 && test_fraction >= 0 && test_fraction <= 1 &&
                   valid_fraction + test_fraction <= 1,
               "split fractions must lie in [0, 1] with a sum <= 1, got valid=", valid_fraction,
               " test=", test_fraction);
}

Split split_of_unchecked(std::string_view en, double valid_fraction, double test_fraction) {
  const double u = static_cast<double>(sentence_hash(en, kSplitSalt) >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  if (u < test_fraction) return Split::kTest;
  if (u < test_fraction + valid_fraction) return Split::kValid;
  return Split::kTrain;
}

}  // namespace

Split split_of_sentence(std::string_view en, double valid_fraction, double test_fraction) {
  check_fractions(valid_fraction, test_fraction);
  return split_of_unchecked(en, valid_fraction, test_fraction);
}

std::vector<std::optional<Split>> assign_splits(const std::vector<SentencePair>& pairs, double valid_fraction,
                                                double test_fraction) {
  check_fractions(valid_fraction, test_fraction);
  std::vector<Split> by_en(pairs.size());
  // (lang, other) -> the split that translation takes: the first of train, valid, test that one
  // of its pairs' English sentences is in (Split's order).
  std::map<std::pair<std::string_view, std::string_view>, Split> by_other;
  for (size_t i = 0; i < pairs.size(); ++i) {
    const SentencePair& p = pairs[i];
    by_en[i] = split_of_unchecked(p.en, valid_fraction, test_fraction);
    if (p.other.empty()) continue;  // monolingual text: only the English side is keyed
    auto [it, fresh] = by_other.try_emplace({p.lang, p.other}, by_en[i]);
    if (!fresh) it->second = std::min(it->second, by_en[i]);
  }
  std::vector<std::optional<Split>> out(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    const SentencePair& p = pairs[i];
    if (p.other.empty() || by_other.at({p.lang, p.other}) == by_en[i]) out[i] = by_en[i];
  }
  return out;
}

std::vector<SentencePair> filter_split(const std::vector<SentencePair>& pairs, Split which, double valid_fraction,
                                       double test_fraction) {
  const auto splits = assign_splits(pairs, valid_fraction, test_fraction);
  std::vector<SentencePair> out;
  for (size_t i = 0; i < pairs.size(); ++i) {
    if (splits[i] == which) out.push_back(pairs[i]);
  }
  return out;
}

SplitOverlap measure_split_overlap(const std::vector<SentencePair>& train, const std::vector<SentencePair>& valid,
                                   const std::vector<SentencePair>& test) {
  // For each sentence, the set of splits it occurs in (bit i = split i).
  std::map<std::string_view, unsigned> en, text;
  std::map<std::pair<std::string_view, std::string_view>, unsigned> other;
  const std::array<const std::vector<SentencePair>*, 3> splits = {&train, &valid, &test};
  for (unsigned i = 0; i < 3; ++i) {
    for (const SentencePair& p : *splits[i]) {
      en[p.en] |= 1u << i;
      text[p.en] |= 1u << i;
      if (p.other.empty()) continue;
      other[{p.lang, p.other}] |= 1u << i;
      text[p.other] |= 1u << i;
    }
  }
  auto in_several = [](const auto& m) {
    size_t n = 0;
    for (const auto& [key, bits] : m) n += (bits & (bits - 1)) != 0;
    return n;
  };
  SplitOverlap o;
  o.en_sentences = in_several(en);
  o.other_sentences = in_several(other);
  o.texts = in_several(text);
  return o;
}

std::vector<SentencePair> select_languages(const std::vector<SentencePair>& pairs,
                                           const std::vector<std::string>& langs) {
  if (langs.empty()) return pairs;
  std::set<std::string, std::less<>> wanted(langs.begin(), langs.end());
  std::vector<SentencePair> out;
  for (const SentencePair& p : pairs) {
    if (wanted.count(p.lang)) out.push_back(p);
  }
  return out;
}

std::vector<PackageMessage> read_package_messages(const std::string& locale_dir, const std::vector<std::string>& packages,
                                                  const std::vector<std::string>& languages, size_t min_chars,
                                                  size_t max_chars) {
  NEBULA_CHECK(!packages.empty() && !languages.empty(), "read_package_messages: ", packages.size(), " packages, ",
               languages.size(), " languages");
  auto usable = [&](const std::string& x) { return x.size() >= min_chars && x.size() <= max_chars; };
  // English message -> (label, translations); labels of messages seen in several packages.
  std::map<std::string, PackageMessage> by_en;
  std::map<std::string, std::set<int>> labels_of;
  for (size_t k = 0; k < packages.size(); ++k) {
    const int label = static_cast<int>(k);
    for (const std::string& lang : languages) {
      const std::string file = (fs::path(locale_dir) / lang / "LC_MESSAGES" / (packages[k] + ".mo")).string();
      if (!fs::exists(file))
        throw DataError(str_cat(file, ": no catalog of package '", packages[k], "' in language '", lang,
                                "'; choose packages that every language of data.languages has"));
      for (const MoEntry& e : read_mo_file(file)) {
        if (e.translations.empty() || e.translations[0].empty()) continue;
        std::string en = clean_message(e.msgid), other = clean_message(e.translations[0]);
        if (!usable(en) || !usable(other) || en == other) continue;
        labels_of[en].insert(label);
        PackageMessage& m = by_en[en];
        m.en = en;
        m.label = label;
        m.translations.emplace(lang, std::move(other));  // the first entry of a message wins
      }
    }
  }
  std::vector<PackageMessage> out;
  std::vector<size_t> per_package(packages.size(), 0);
  for (auto& [en, m] : by_en) {
    if (labels_of[en].size() > 1) continue;
    ++per_package[static_cast<size_t>(m.label)];
    out.push_back(std::move(m));
  }
  for (size_t k = 0; k < packages.size(); ++k)
    if (per_package[k] == 0)
      throw DataError(str_cat("package '", packages[k], "' (", locale_dir, "/*/LC_MESSAGES/", packages[k],
                              ".mo): no message of its own with a usable translation"));
  std::sort(out.begin(), out.end(),
            [](const PackageMessage& a, const PackageMessage& b) { return std::tie(a.label, a.en) < std::tie(b.label, b.en); });
  return out;
}

std::vector<SentencePair> take_slice(const std::vector<SentencePair>& pairs, size_t index, size_t count) {
  NEBULA_CHECK(count > 0 && index < count, "slice index ", index, " of ", count, " slices");
  std::vector<SentencePair> out;
  for (const SentencePair& p : pairs) {
    if (pair_hash(p, kSliceSalt) % count == index) out.push_back(p);
  }
  return out;
}

Corpus build_corpus(const CorpusBuildOptions& o) {
  NEBULA_CHECK(o.valid_fraction >= 0 && o.valid_fraction <= 1 && o.test_fraction >= 0 && o.test_fraction <= 1 &&
                   o.valid_fraction + o.test_fraction < 1,
               "valid_fraction = ", o.valid_fraction, ", test_fraction = ", o.test_fraction,
               ": each must lie in [0, 1] and their sum below 1 (the rest is train)");
  Corpus c;
  CorpusStats& st = c.stats;
  std::vector<SentencePair> pairs;
  if (o.source == "gettext") {
    CorpusOptions g;
    if (!o.path.empty()) g.locale_dir = o.path;
    g.languages = o.languages;
    g.max_pairs_per_language = o.max_pairs_per_language;
    pairs = build_gettext_corpus(g, &st);
  } else if (o.source == "tsv" || o.source == "text") {
    NEBULA_CHECK(!o.path.empty(), "source '", o.source, "' needs the path of a file");
    if (o.source == "tsv") {
      pairs = read_tsv_file(o.path, "xx");
      st.entries_seen = pairs.size();
      pairs = select_languages(pairs, o.languages);
    } else {
      NEBULA_CHECK(o.languages.empty(), "source 'text' has no languages (each line is one monolingual "
                                        "sentence); leave the languages out");
      for (std::string& line : read_text_file(o.path)) pairs.push_back({"text", std::move(line), ""});
      st.entries_seen = pairs.size();
    }
    st.files_read = 1;
    st.entries_dropped = st.entries_seen - pairs.size();  // lines of languages not selected
    std::sort(pairs.begin(), pairs.end());
    const size_t before = pairs.size();
    pairs.erase(std::unique(pairs.begin(), pairs.end()), pairs.end());
    st.duplicates_dropped = before - pairs.size();
    // Cap each language's run of the sorted pairs.
    std::vector<SentencePair> kept;
    for (size_t begin = 0; begin < pairs.size();) {
      size_t end = begin;
      while (end < pairs.size() && pairs[end].lang == pairs[begin].lang) ++end;
      std::vector<SentencePair> lang(std::make_move_iterator(pairs.begin() + static_cast<std::ptrdiff_t>(begin)),
                                     std::make_move_iterator(pairs.begin() + static_cast<std::ptrdiff_t>(end)));
      st.pairs_over_cap += keep_hash_subset(lang, o.max_pairs_per_language);
      st.pairs_per_language[lang.front().lang] = lang.size();
      kept.insert(kept.end(), std::make_move_iterator(lang.begin()), std::make_move_iterator(lang.end()));
      begin = end;
    }
    pairs = std::move(kept);
    st.pairs_kept = pairs.size();
    for (const std::string& lang : o.languages) {
      if (!st.pairs_per_language.count(lang))
        throw DataError(str_cat(o.path, ": no pairs of language '", lang, "' (its first column)"));
    }
  } else {
    NEBULA_CHECK(false, "corpus source '", o.source, "' is not one of gettext, tsv, text");
  }

  const auto splits = assign_splits(pairs, o.valid_fraction, o.test_fraction);
  for (size_t i = 0; i < pairs.size(); ++i) {
    SentencePair& p = pairs[i];
    if (!splits[i]) {
      ++st.split_conflicts_dropped;
      continue;
    }
    const auto split = static_cast<size_t>(*splits[i]);
    SplitStats& s = c.split_stats[p.lang][split];
    ++s.pairs;
    s.en_chars += count_chars(p.en);
    s.other_chars += count_chars(p.other);
    (split == 0 ? c.train : split == 1 ? c.valid : c.test).push_back(std::move(p));
  }
  c.overlap = measure_split_overlap(c.train, c.valid, c.test);
  return c;
}

std::string corpus_stats_json(const Corpus& c, const CorpusBuildOptions& o) {
  using nlohmann::json;
  const CorpusStats& st = c.stats;
  json j;
  j["source"] = o.source;
  j["path"] = o.path.empty() && o.source == "gettext" ? CorpusOptions{}.locale_dir : o.path;
  j["languages_requested"] = o.languages;
  j["max_pairs_per_language"] = o.max_pairs_per_language;
  j["valid_fraction"] = o.valid_fraction;
  j["test_fraction"] = o.test_fraction;
  j["files_read"] = st.files_read;
  j["files_skipped"] = st.files_skipped;
  j["skipped_files"] = st.skipped_files;
  j["entries_seen"] = st.entries_seen;
  j["entries_dropped"] = st.entries_dropped;
  j["duplicates_removed"] = st.duplicates_dropped;
  j["pairs_over_cap"] = st.pairs_over_cap;
  j["pairs"] = st.pairs_kept;
  j["split_conflicts_dropped"] = st.split_conflicts_dropped;
  // Measured on the written splits, not assumed from the rule (assign_splits): must be 0.
  j["overlap"] = {{"en_sentences", c.overlap.en_sentences},
                  {"other_sentences", c.overlap.other_sentences},
                  {"texts_any_side", c.overlap.texts}};
  json langs = json::object();
  std::array<SplitStats, 3> total{};
  for (const auto& [lang, splits] : c.split_stats) {
    for (size_t i = 0; i < 3; ++i) {
      langs[lang][kSplitNames[i]] = {
          {"pairs", splits[i].pairs}, {"en_chars", splits[i].en_chars}, {"other_chars", splits[i].other_chars}};
      total[i].pairs += splits[i].pairs;
      total[i].en_chars += splits[i].en_chars;
      total[i].other_chars += splits[i].other_chars;
    }
  }
  j["languages"] = langs;
  for (size_t i = 0; i < 3; ++i) {
    j["splits"][kSplitNames[i]] = {
        {"pairs", total[i].pairs}, {"en_chars", total[i].en_chars}, {"other_chars", total[i].other_chars}};
  }
  return j.dump(1) + "\n";
}

void write_corpus(const std::string& dir, const Corpus& c, const CorpusBuildOptions& o) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw DataError(str_cat(dir, ": cannot create the output directory: ", ec.message()));
  write_tsv_file((fs::path(dir) / "train.tsv").string(), c.train);
  write_tsv_file((fs::path(dir) / "valid.tsv").string(), c.valid);
  write_tsv_file((fs::path(dir) / "test.tsv").string(), c.test);
  write_file_atomic((fs::path(dir) / "stats.json").string(), corpus_stats_json(c, o));
}

std::string format_corpus_stats(const Corpus& c, const CorpusBuildOptions& o) {
  const CorpusStats& st = c.stats;
  std::string out;
  char line[256];
  const bool gettext = o.source == "gettext";
  std::snprintf(line, sizeof line, "%zu %s read, %zu skipped as corrupt or unreadable; %zu entries, %zu dropped %s, "
                "%zu duplicates removed, %zu left out by the per-language cap\n",
                st.files_read, gettext ? "catalogs" : "file", st.files_skipped, st.entries_seen, st.entries_dropped,
                gettext ? "(untranslated, empty, too short/long, or unchanged)" : "(other languages)",
                st.duplicates_dropped, st.pairs_over_cap);
  out += line;
  std::snprintf(line, sizeof line, "%zu pairs left out whose translation is in another split; sentences in two "
                "splits: %zu English, %zu other (%zu texts of either side)\n",
                st.split_conflicts_dropped, c.overlap.en_sentences, c.overlap.other_sentences, c.overlap.texts);
  out += line;
  std::snprintf(line, sizeof line, "%-10s %8s %8s %8s %8s   %s\n", "lang", "train", "valid", "test", "total",
                "avg chars en / other");
  out += line;
  auto row = [&](const std::string& name, const std::array<SplitStats, 3>& s) {
    size_t pairs = 0, en = 0, other = 0;
    for (const SplitStats& x : s) {
      pairs += x.pairs;
      en += x.en_chars;
      other += x.other_chars;
    }
    const double n = pairs ? static_cast<double>(pairs) : 1.0;
    std::snprintf(line, sizeof line, "%-10s %8zu %8zu %8zu %8zu   %.1f / %.1f\n", name.c_str(), s[0].pairs,
                  s[1].pairs, s[2].pairs, pairs, static_cast<double>(en) / n, static_cast<double>(other) / n);
    out += line;
  };
  std::array<SplitStats, 3> total{};
  for (const auto& [lang, splits] : c.split_stats) {
    row(lang, splits);
    for (size_t i = 0; i < 3; ++i) {
      total[i].pairs += splits[i].pairs;
      total[i].en_chars += splits[i].en_chars;
      total[i].other_chars += splits[i].other_chars;
    }
  }
  row("total", total);
  size_t en = 0, other = 0;
  for (const SplitStats& x : total) {
    en += x.en_chars;
    other += x.other_chars;
  }
  std::snprintf(line, sizeof line, "characters: %zu English, %zu other\n", en, other);
  out += line;
  return out;
}

}  // namespace nebula::data
