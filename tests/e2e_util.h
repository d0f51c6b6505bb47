// Helpers of the end-to-end tests: run build/nebula as a user would and read what it leaves.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace nebula::e2e {

namespace fs = std::filesystem;

struct Result {
  int exit_code;
  std::string output;
};

// Runs a shell command line in the source directory, bounded by `timeout` (so a hang fails
// the test instead of CI). `env`: assignments for the command, e.g. "NEBULA_TEST_STOP_AT_STEP=25".
inline Result shell(const std::string& command, int timeout_s = 600, const std::string& env = "") {
  std::string cmd = "cd " NEBULA_SOURCE_DIR " && " + env + " timeout -k 10 " + std::to_string(timeout_s) + " " +
                    command + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  std::string out;
  std::array<char, 4096> buf;
  while (size_t n = std::fread(buf.data(), 1, buf.size(), p)) out.append(buf.data(), n);
  int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// Runs build/nebula with `args`.
inline Result run(const std::string& args, int timeout_s = 600, const std::string& env = "") {
  return shell(NEBULA_BINARY_DIR "/nebula " + args, timeout_s, env);
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline std::vector<std::string> lines_of(const std::string& path) {
  std::vector<std::string> lines;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The tensors of a safetensors file by name, as raw bytes (the metadata, which names paths, left out).
inline std::map<std::string, std::string> tensor_bytes(const std::string& path) {
  const std::string b = read_file(path);
  if (b.size() < 8) return {};
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(b[static_cast<size_t>(i)]);
  if (8 + n > b.size()) return {};
  auto header = nlohmann::json::parse(b.substr(8, n));
  std::map<std::string, std::string> out;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const auto begin = v["data_offsets"][0].get<size_t>(), end = v["data_offsets"][1].get<size_t>();
    out[name] = b.substr(8 + n + begin, end - begin);
  }
  return out;
}

inline std::string temp_run_dir(const std::string& name) {
  fs::path dir = fs::temp_directory_path() / ("nebula-e2e-" + name + "-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  return dir.string();
}

}  // namespace nebula::e2e
