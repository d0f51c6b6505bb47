// Parsing of human units used in configs: sizes ("1GiB"), rates ("50Mbit"), durations ("80ms").
// Each throws nebula::ConfigError with the offending text and the accepted forms.
#pragma once

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

namespace nebula {

// Bytes. Accepts B, KB/MB/GB/TB (powers of 1000), KiB/MiB/GiB/TiB (powers of 1024); "0" alone.
uint64_t parse_size(std::string_view text);
// Bits per second. Accepts bit/Kbit/Mbit/Gbit/Tbit (per second implied, "/s" optional),
// also "bps"/"Kbps"/"Mbps"/"Gbps" and byte rates "B/s", "KB/s", "MB/s", "GB/s", "MiB/s".
double parse_rate_bits(std::string_view text);
// Durations: ns, us, ms, s, min, h; "0" alone.
std::chrono::nanoseconds parse_duration(std::string_view text);

// A plain count with an optional SI prefix (K, M, G or B = 1e9, T, P, E) and optionally one
// of `units` after it: "70e9", "70B", "1.5M", "400T", "400TFLOP/s". `forms` names the accepted
// forms in errors.
double parse_si(std::string_view text, std::initializer_list<const char*> units, const char* forms);

// Human output, for logs and summaries: "1.5 MiB", "50.0 Mbit/s", "80.0 ms".
std::string format_bytes(double bytes);
std::string format_rate_bits(double bits_per_second);
std::string format_duration(std::chrono::nanoseconds d);

}  // namespace nebula
