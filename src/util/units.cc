#include "nebula/units.h"

#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <stdexcept>
#include <utility>
#include <vector>

#include "nebula/error.h"

namespace nebula {
namespace {

// Splits "12.5 MiB" into (12.5, "MiB"). Throws on a missing or negative number.
std::pair<double, std::string> split_number(std::string_view text, const char* what, const char* forms) {
  std::string s(text);
  size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  size_t start = i;
  // Digits, a point, and an exponent ("70e9", "1.5E-3") when one follows.
  auto digit = [&](size_t k) { return k < s.size() && std::isdigit(static_cast<unsigned char>(s[k])); };
  while (i < s.size()) {
    if (digit(i) || s[i] == '.') {
      ++i;
    } else if ((s[i] == 'e' || s[i] == 'E') && i > start &&
               (digit(i + 1) || ((s[i + 1] == '+' || s[i + 1] == '-') && digit(i + 2)))) {
      i += digit(i + 1) ? 1 : 2;
    } else {
      break;
    }
  }
  std::string number = s.substr(start, i - start);
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  std::string unit = s.substr(i);
  while (!unit.empty() && std::isspace(static_cast<unsigned char>(unit.back()))) unit.pop_back();
  double value = 0;
  try {
    size_t used = 0;
    value = std::stod(number, &used);
    if (used != number.size()) throw std::invalid_argument("trailing");
  } catch (const std::exception&) {
    throw ConfigError(str_cat("bad ", what, " \"", text, "\": expected a non-negative number and a unit, one of ", forms));
  }
  if (!std::isfinite(value)) throw ConfigError(str_cat("bad ", what, " \"", text, "\": not finite"));
  return {value, unit};
}

struct Unit {
  const char* name;
  double factor;
};

double lookup(std::string_view text, const std::string& unit, double value, const std::vector<Unit>& units,
              const char* what, const char* forms) {
  if (unit.empty() && value == 0) return 0;
  for (const auto& u : units)
    if (unit == u.name) return value * u.factor;
  throw ConfigError(str_cat("bad ", what, " \"", text, "\": unknown unit \"", unit, "\"; use one of ", forms));
}

}  // namespace

uint64_t parse_size(std::string_view text) {
  static const char* forms = "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. \"1GiB\")";
  static const std::vector<Unit> units = {
      {"B", 1},           {"KB", 1e3},           {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12},       {"KiB", 1024.0},       {"MiB", 1048576.0},    {"GiB", 1073741824.0},
      {"TiB", 1099511627776.0}};
  auto [value, unit] = split_number(text, "size", forms);
  double bytes = lookup(text, unit, value, units, "size", forms);
  if (bytes > 1.8e19) throw ConfigError(str_cat("bad size \"", text, "\": too large"));
  return static_cast<uint64_t>(std::llround(bytes));
}

double parse_rate_bits(std::string_view text) {
  static const char* forms = "bit, Kbit, Mbit, Gbit, Tbit (optionally \"/s\"), bps, Kbps, Mbps, Gbps, "
                             "B/s, KB/s, MB/s, GB/s, KiB/s, MiB/s, GiB/s (e.g. \"50Mbit\")";
  static const std::vector<Unit> units = {
      {"bit", 1},         {"Kbit", 1e3},          {"Mbit", 1e6},          {"Gbit", 1e9},
      {"Tbit", 1e12},     {"bit/s", 1},           {"Kbit/s", 1e3},        {"Mbit/s", 1e6},
      {"Gbit/s", 1e9},    {"Tbit/s", 1e12},       {"bps", 1},             {"Kbps", 1e3},
      {"Mbps", 1e6},      {"Gbps", 1e9},          {"B/s", 8},             {"KB/s", 8e3},
      {"MB/s", 8e6},      {"GB/s", 8e9},          {"KiB/s", 8 * 1024.0},  {"MiB/s", 8 * 1048576.0},
      {"GiB/s", 8 * 1073741824.0}};
  auto [value, unit] = split_number(text, "rate", forms);
  return lookup(text, unit, value, units, "rate", forms);
}

std::chrono::nanoseconds parse_duration(std::string_view text) {
  static const char* forms = "ns, us, ms, s, min, h (e.g. \"80ms\")";
  static const std::vector<Unit> units = {{"ns", 1},      {"us", 1e3},     {"ms", 1e6},
                                          {"s", 1e9},     {"min", 60e9},   {"h", 3600e9}};
  auto [value, unit] = split_number(text, "duration", forms);
  double ns = lookup(text, unit, value, units, "duration", forms);
  if (ns > 9.0e18) throw ConfigError(str_cat("bad duration \"", text, "\": too large"));
  return std::chrono::nanoseconds(static_cast<int64_t>(std::llround(ns)));
}

double parse_si(std::string_view text, std::initializer_list<const char*> units, const char* forms) {
  auto [value, rest] = split_number(text, "number", forms);
  static const std::map<char, double> prefix = {{'K', 1e3}, {'M', 1e6}, {'G', 1e9}, {'B', 1e9},
                                                {'T', 1e12}, {'P', 1e15}, {'E', 1e18}};
  if (rest.empty()) return value;
  if (auto p = prefix.find(rest[0]); p != prefix.end()) {
    const std::string unit = rest.substr(1);
    bool ok = unit.empty();
    for (const char* u : units) ok |= unit == u;
    if (ok) return value * p->second;
  }
  for (const char* u : units)
    if (rest == u) return value;
  throw ConfigError(str_cat("bad number \"", text, "\": unknown suffix \"", rest, "\"; ", forms));
}

std::string format_bytes(double bytes) {
  const char* names[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int i = 0;
  while (std::fabs(bytes) >= 1024 && i < 4) {
    bytes /= 1024;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, i == 0 ? "%.0f %s" : "%.2f %s", bytes, names[i]);
  return buf;
}

std::string format_rate_bits(double bps) {
  const char* names[] = {"bit/s", "Kbit/s", "Mbit/s", "Gbit/s", "Tbit/s"};
  int i = 0;
  while (std::fabs(bps) >= 1000 && i < 4) {
    bps /= 1000;
    ++i;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.1f %s", bps, names[i]);
  return buf;
}

std::string format_duration(std::chrono::nanoseconds d) {
  double ns = static_cast<double>(d.count());
  char buf[64];
  if (ns < 1e3) std::snprintf(buf, sizeof buf, "%.0f ns", ns);
  else if (ns < 1e6) std::snprintf(buf, sizeof buf, "%.1f us", ns / 1e3);
  else if (ns < 1e9) std::snprintf(buf, sizeof buf, "%.1f ms", ns / 1e6);
  else std::snprintf(buf, sizeof buf, "%.2f s", ns / 1e9);
  return buf;
}

}  // namespace nebula
