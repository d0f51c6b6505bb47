// What nebula's libFuzzer targets share: the invariant check and the seed writer.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <span>
#include <string>

// Aborts (so libFuzzer records the input) when a documented invariant does not hold.
#define FUZZ_ASSERT(cond)                                                                  \
  do {                                                                                     \
    if (!(cond)) {                                                                         \
      std::fprintf(stderr, "%s:%d: fuzz invariant `%s` violated\n", __FILE__, __LINE__, #cond); \
      std::abort();                                                                        \
    }                                                                                      \
  } while (0)

namespace nebula::fuzz {

// Seed mode (NEBULA_FUZZ_WRITE_SEEDS=DIR): one seed input; exits non-zero if it cannot be written.
inline void write_seed_file(const std::string& path, std::span<const uint8_t> bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  if (!f) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
}

}  // namespace nebula::fuzz
