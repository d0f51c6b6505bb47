// Small file helpers for the data layer: whole-file reads and atomic writes that turn
// every failure into a nebula::DataError naming the path and strerror(errno).
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace nebula::data {

// Reads the regular file at `path` into memory. Refuses files above `max_bytes`
// (the message says so) so a wrong path cannot exhaust memory.
std::string read_file_bytes(const std::string& path, size_t max_bytes = size_t{1} << 34);

// Writes `bytes` to `path` atomically: a temporary file in the same directory is
// written, flushed with fsync, then renamed over `path`. On failure `path` is untouched.
void write_file_atomic(const std::string& path, std::string_view bytes);

}  // namespace nebula::data
