// Helpers of the end-to-end tests: run build/nebula as a user would and read what it leaves.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
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

// Before workers are started by hand (a deployment): a short local run leaves what they need
// in DIR/prep (tokenizer, certificates, job.toml); DIR/run is made for the deployed run.
inline Result prepare_deployment(const std::string& dir) {
  Result r = run("run examples/smoke.toml --set job.steps=1 --set 'job.run_dir=\"" + dir + "/prep\"'", 300);
  fs::create_directories(dir + "/run");
  return r;
}

// Polls (every 50 ms, at most `timeout`) until `metrics` (a metrics.jsonl) has a training line
// of worker `rank` of `site` at step >= `step`; false if that never comes, or if the file `stop`
// (when given) appears first.
inline bool wait_for_step(const std::string& metrics, const std::string& site, int rank, int64_t step,
                          std::chrono::seconds timeout, const std::string& stop = "") {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < deadline && (stop.empty() || !fs::exists(stop))) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    for (const auto& line : lines_of(metrics)) {
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && !j.contains("eval") && j.value("site", "") == site && j.value("rank", -1) == rank &&
          j.value("step", int64_t{0}) >= step)
        return true;
    }
  }
  return false;
}

// A process in the background (bounded by `timeout`), killed by the destructor if still running.
class Background {
 public:
  // `env`: variable assignments for the process ("RANK=1 WORLD_SIZE=2").
  // `program`: another binary than build/nebula (e.g. an example).
  Background(const std::string& args, const std::string& log, int timeout_s, const std::string& env = "",
             const std::string& program = NEBULA_BINARY_DIR "/nebula") {
    const std::string cmd = "cd " NEBULA_SOURCE_DIR " && exec env " + env + " timeout -k 10 " +
                            std::to_string(timeout_s) + " " + program + " " + args + " > " + log + " 2>&1";
    pid_ = ::fork();
    if (pid_ == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
  }
  ~Background() {
    if (pid_ > 0) {
      ::kill(pid_, SIGTERM);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  // The exit code (bounded by the `timeout` wrapper).
  int wait() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

 private:
  pid_t pid_ = -1;
};

// `n` distinct free loopback ports (held until all are chosen, so none repeats), drawn below
// the kernel's ephemeral range as transport::pick_free_port does, so that no outgoing
// connection of a test running beside this one can take one before the workers bind it.
inline std::vector<uint16_t> free_ports(int n) {
  std::vector<int> fds;
  std::vector<uint16_t> ports;
  std::mt19937 rng(std::random_device{}());
  std::uniform_int_distribution<int> draw(10000, 32767);  // below Linux's default ephemeral range
  for (int attempt = 0; static_cast<int>(ports.size()) < n && attempt < 1000; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(draw(rng)));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) ports.push_back(ntohs(a.sin_port));
    fds.push_back(fd);
  }
  for (int fd : fds) ::close(fd);
  return ports;
}

}  // namespace nebula::e2e
