#include "parallel/checkpoint.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <vector>

#include <ATen/ATen.h>

#include "model/safetensors.h"
#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::parallel {
namespace fs = std::filesystem;
namespace {

constexpr const char* kTensors = "tensors.safetensors";
constexpr const char* kManifest = "manifest.json";

std::string step_name(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%012lld", static_cast<long long>(step));
  return buf;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(str_cat(path, ": cannot open"));
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// A file's size and CRC-32, read in pieces (a checkpoint's file can be most of a worker's memory).
std::pair<uint64_t, uint32_t> size_and_crc(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(str_cat(path, ": cannot open"));
  std::vector<uint8_t> piece(size_t{4} << 20);
  uint64_t size = 0;
  uint32_t crc = 0;
  while (in) {
    in.read(reinterpret_cast<char*>(piece.data()), static_cast<std::streamsize>(piece.size()));
    const auto got = static_cast<size_t>(in.gcount());
    crc = wire::crc32(crc, {piece.data(), got});
    size += got;
  }
  return {size, crc};
}

thread_local int64_t range_bytes = 0;

void fsync_path(const std::string& path, bool directory) {
  int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) throw DataError(str_cat(path, ": cannot open to sync: ", std::strerror(errno)));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) throw DataError(str_cat(path, ": fsync failed: ", std::strerror(err)));
}

void write_file(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.flush()) throw DataError(str_cat(path, ": cannot write (disk full?)"));
  out.close();
  fsync_path(path, false);
}

// The checkpoint directories in dir (not *.tmp), newest first.
std::vector<std::pair<int64_t, fs::path>> checkpoints_in(const std::string& dir) {
  std::vector<std::pair<int64_t, fs::path>> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (!e.is_directory() || name.rfind("step-", 0) != 0 || name.size() != 17) continue;
    try {
      out.emplace_back(std::stoll(name.substr(5)), e.path());
    } catch (const std::exception&) {
    }
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  return out;
}

// Reads one checkpoint, checking every file against the manifest. DataError saying what is wrong.
Checkpoint read_checkpoint(const fs::path& dir, const std::string& config_hash,
                           const std::function<bool(const std::string&)>& leave_unread) {
  const std::string manifest_path = (dir / kManifest).string();
  auto m = nlohmann::json::parse(read_all(manifest_path), nullptr, false);
  if (m.is_discarded() || !m.is_object() || m.value("format", "") != "nebula-checkpoint" || !m.contains("files") ||
      !m.contains("step"))
    throw DataError(str_cat(manifest_path, ": not a nebula checkpoint manifest (unreadable or incomplete)"));
  if (m.value("config_hash", "") != config_hash)
    throw ConfigError(str_cat(manifest_path, ": written by a job with config hash ", m.value("config_hash", "?"),
                              ", this job's is ", config_hash, ": resume with the config that wrote it, or start "
                              "without --resume"));
  for (auto& [file, expected] : m["files"].items()) {
    const std::string path = (dir / file).string();
    const auto [size, crc] = size_and_crc(path);
    if (size != expected.value("bytes", uint64_t{0}) || crc != expected.value("crc32", uint32_t{0}))
      throw DataError(str_cat(path, ": ", size, " bytes with CRC-32 ", crc, ", the manifest says ",
                              expected.value("bytes", uint64_t{0}), " bytes with CRC-32 ",
                              expected.value("crc32", uint32_t{0}), ": damaged"));
  }
  Checkpoint c;
  c.step = m["step"].get<int64_t>();
  c.state = m.value("state", nlohmann::json::object());
  auto index = std::make_shared<model::TensorIndex>(model::index_safetensors((dir / kTensors).string()));
  bool unread = false;
  for (const auto& [name, e] : index->tensors) {
    if (leave_unread && leave_unread(name)) {
      unread = true;
      continue;
    }
    c.tensors[name] = model::read_safetensors_range(*index, name, 0, e.numel).view(e.shape);
  }
  if (unread) c.unread = std::move(index);
  return c;
}

}  // namespace

void save_checkpoint(const std::string& dir, const Checkpoint& c, const std::string& config_hash, int keep) {
  std::error_code made;
  fs::create_directories(dir, made);
  if (made || !fs::is_directory(dir))
    throw DataError(str_cat(dir, ": cannot create the checkpoint directory: ",
                            made ? made.message() : std::string("a file is in the way")));
  const fs::path final_dir = fs::path(dir) / step_name(c.step);
  const fs::path tmp = fs::path(dir) / (step_name(c.step) + ".tmp");
  std::error_code ec;
  const bool leftover = fs::exists(tmp, ec);
  fs::remove_all(tmp, ec);  // a crash's leftover
  if (!fs::create_directory(tmp, ec)) throw DataError(str_cat(tmp.string(), ": cannot create: ", ec.message()));
  try {
    model::TensorFile f;
    f.tensors = c.tensors;
    model::save_safetensors((tmp / kTensors).string(), f);  // fsync'ed and renamed into place inside tmp
    const auto [tensor_bytes, tensor_crc] = size_and_crc((tmp / kTensors).string());
    // Tests: NEBULA_TEST_CRASH_IN_CHECKPOINT=N (or =TEXT:N, for checkpoint directories whose
    // path contains TEXT, e.g. a site's name) crashes in the middle of writing checkpoint N:
    // tensors written, no manifest yet. Once: not where a crash already left step-N.tmp.
    if (const char* crash = std::getenv("NEBULA_TEST_CRASH_IN_CHECKPOINT"); crash && !leftover) {
      const std::string spec = crash;
      const size_t colon = spec.rfind(':');
      const std::string where = colon == std::string::npos ? "" : spec.substr(0, colon);
      if (std::atoll(spec.c_str() + (colon == std::string::npos ? 0 : colon + 1)) == c.step &&
          dir.find(where) != std::string::npos)
        ::_exit(137);
    }
    nlohmann::json manifest = {{"format", "nebula-checkpoint"},
                               {"version", 1},
                               {"step", c.step},
                               {"config_hash", config_hash},
                               {"state", c.state},
                               {"files", {{kTensors, {{"bytes", tensor_bytes}, {"crc32", tensor_crc}}}}}};
    write_file((tmp / kManifest).string(), manifest.dump(2));
    fsync_path(tmp.string(), true);
    fs::remove_all(final_dir, ec);  // the same step written again (e.g. after a resume)
    fs::rename(tmp, final_dir);
    fsync_path(dir, true);
  } catch (const fs::filesystem_error& e) {
    fs::remove_all(tmp, ec);
    throw DataError(str_cat(final_dir.string(), ": cannot write the checkpoint: ", e.what(),
                            " (free space there or set [checkpoint] dir; the checkpoints before it are kept)"));
  } catch (const DataError& e) {
    fs::remove_all(tmp, ec);
    throw DataError(str_cat(e.what(), " (free space in ", dir,
                            " or set [checkpoint] dir; the checkpoints before it are kept)"));
  } catch (...) {
    fs::remove_all(tmp, ec);
    throw;
  }
  const auto all = checkpoints_in(dir);
  for (size_t i = static_cast<size_t>(std::max(keep, 1)); i < all.size(); ++i) fs::remove_all(all[i].second, ec);
}

std::optional<Checkpoint> load_latest_checkpoint(const std::string& dir, const std::string& config_hash,
                                                 int64_t max_step,
                                                 const std::function<bool(const std::string&)>& leave_unread) {
  for (const auto& [step, path] : checkpoints_in(dir)) {
    if (step > max_step) continue;
    try {
      return read_checkpoint(path, config_hash, leave_unread);
    } catch (const DataError& e) {
      spdlog::warn("checkpoint {} is damaged, trying the one before it: {}", path.string(), e.what());
    } catch (const nlohmann::json::exception& e) {  // a manifest with fields of the wrong type
      spdlog::warn("checkpoint {} has a malformed manifest, trying the one before it: {}", path.string(), e.what());
    }
  }
  return std::nullopt;
}

int64_t tensor_numel(const Checkpoint& k, const std::string& name) {
  if (auto it = k.tensors.find(name); it != k.tensors.end()) return it->second.numel();
  if (k.unread)
    if (auto it = k.unread->tensors.find(name); it != k.unread->tensors.end()) return it->second.numel;
  return -1;
}

at::Tensor read_range(const Checkpoint& k, const std::string& name, int64_t begin, int64_t len) {
  if (auto it = k.tensors.find(name); it != k.tensors.end()) {
    if (begin < 0 || len < 0 || begin + len > it->second.numel())
      throw DataError(str_cat("checkpoint of step ", k.step, ": tensor '", name, "' has ", it->second.numel(),
                              " values, not [", begin, ", ", begin + len, ")"));
    return it->second.reshape({-1}).narrow(0, begin, len).to(at::kFloat);
  }
  if (!k.unread || !k.unread->tensors.count(name))
    throw DataError(str_cat("checkpoint of step ", k.step, ": has no tensor '", name, "'"));
  at::Tensor values = model::read_safetensors_range(*k.unread, name, begin, len);
  range_bytes += static_cast<int64_t>(values.nbytes());
  return values.to(at::kFloat);
}

int64_t range_bytes_read() { return range_bytes; }

void put_batcher(Checkpoint& c, const std::string& name, const model::BatcherState& s) {
  c.state["data"][name] = {{"rng", s.rng}, {"cursor", s.cursor}};
  c.tensors["data/" + name + "/order"] =
      at::tensor(at::ArrayRef<int64_t>(s.order), at::TensorOptions().dtype(at::kLong)).clone();
}

model::BatcherState get_batcher(const Checkpoint& c, const std::string& name) {
  const auto order = c.tensors.find("data/" + name + "/order");
  const nlohmann::json* entry = nullptr;
  if (c.state.contains("data") && c.state["data"].is_object() && c.state["data"].contains(name))
    entry = &c.state["data"][name];
  if (order == c.tensors.end() || !entry || !entry->is_object() || !(*entry)["rng"].is_string() ||
      !(*entry)["cursor"].is_number_integer() || order->second.scalar_type() != at::kLong || order->second.dim() != 1)
    throw DataError(str_cat("checkpoint of step ", c.step, ": the data position '", name,
                            "' is missing or malformed"));
  model::BatcherState s;
  s.rng = (*entry)["rng"].get<std::string>();
  s.cursor = (*entry)["cursor"].get<int64_t>();
  const at::Tensor o = order->second.contiguous();
  s.order.assign(o.data_ptr<int64_t>(), o.data_ptr<int64_t>() + o.numel());
  return s;
}

}  // namespace nebula::parallel
