#include "model/safetensors.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fcntl.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>

#include "nebula/error.h"

namespace nebula::model {
namespace {

static_assert(std::endian::native == std::endian::little, "safetensors stores little-endian bytes");

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
  size_t bytes;
};
constexpr DtypeInfo kDtypes[] = {{"F32", at::kFloat, 4}, {"F16", at::kHalf, 2}, {"BF16", at::kBFloat16, 2},
                                 {"I64", at::kLong, 8},  {"I32", at::kInt, 4},  {"U8", at::kByte, 1}};

const DtypeInfo* by_type(at::ScalarType t) {
  for (const auto& d : kDtypes)
    if (d.type == t) return &d;
  return nullptr;
}
const DtypeInfo* by_name(const std::string& n) {
  for (const auto& d : kDtypes)
    if (n == d.name) return &d;
  return nullptr;
}

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) throw DataError(str_cat(path, ": write failed: ", std::strerror(errno)));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

std::string shape_text(at::IntArrayRef s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += str_cat(i ? ", " : "", s[i]);
  return out + "]";
}

}  // namespace

void save_safetensors(const std::string& path, const TensorFile& file) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!file.metadata.empty()) header["__metadata__"] = file.metadata;
  std::vector<at::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, t] : file.tensors) {
    const DtypeInfo* d = by_type(t.scalar_type());
    NEBULA_CHECK(d, path, ": tensor '", name, "' has dtype ", t.scalar_type(), ", which safetensors files here do not hold");
    at::Tensor c = t.detach().to(at::kCPU).contiguous();
    const uint64_t bytes = static_cast<uint64_t>(c.numel()) * d->bytes;
    header[name] = {{"dtype", d->name}, {"shape", c.sizes().vec()}, {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
    data.push_back(c);
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw DataError(str_cat(tmp, ": cannot create: ", std::strerror(errno)));
  try {
    uint8_t len[8];
    for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    write_all(fd, len, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const auto& c : data) write_all(fd, c.data_ptr(), static_cast<size_t>(c.nbytes()), tmp);
    if (::fsync(fd) != 0) throw DataError(str_cat(tmp, ": fsync failed: ", std::strerror(errno)));
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    throw DataError(str_cat(path, ": cannot replace with ", tmp, ": ", std::strerror(err)));
  }
  const std::string dir = std::filesystem::path(path).parent_path().string();
  int dfd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);  // the rename itself is durable
    ::close(dfd);
  }
}

TensorIndex index_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw DataError(str_cat(path, ": cannot open model file"));
  in.seekg(0, std::ios::end);
  const uint64_t size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  auto bad = [&](const std::string& what) -> DataError {
    return DataError(str_cat(path, ": not a valid safetensors file: ", what));
  };
  if (size < 8) throw bad(str_cat("only ", size, " bytes"));
  uint8_t len[8];
  in.read(reinterpret_cast<char*>(len), 8);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(len[i]) << (8 * i);
  if (n > size - 8 || n > (100u << 20)) throw bad(str_cat("header of ", n, " bytes in a file of ", size));
  std::string text(n, '\0');
  in.read(text.data(), static_cast<std::streamsize>(n));
  nlohmann::json header = nlohmann::json::parse(text, nullptr, false);
  if (header.is_discarded() || !header.is_object()) throw bad("the header is not a JSON object");
  const uint64_t data_size = size - 8 - n;

  TensorIndex out;
  out.path = path;
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw bad("__metadata__ is not an object");
      for (auto& [k, val] : v.items()) {
        if (!val.is_string()) throw bad(str_cat("__metadata__ value '", k, "' is not a string"));
        out.metadata[k] = val.get<std::string>();
      }
      continue;
    }
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      throw bad(str_cat("tensor '", name, "' needs dtype, shape and data_offsets [begin, end]"));
    const DtypeInfo* d = by_name(v["dtype"].get<std::string>());
    if (!d) throw bad(str_cat("tensor '", name, "' has dtype ", v["dtype"].dump(), " (supported: F32 F16 BF16 I64 I32 U8)"));
    std::vector<int64_t> shape;
    uint64_t count = 1;
    for (const auto& s : v["shape"]) {
      if (!s.is_number_unsigned() || s.get<uint64_t>() > (1ull << 40)) throw bad(str_cat("tensor '", name, "' has shape ", v["shape"].dump()));
      shape.push_back(s.get<int64_t>());
      count *= s.get<uint64_t>();
      if (count > (1ull << 40)) throw bad(str_cat("tensor '", name, "' is too large: shape ", v["shape"].dump()));
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned()) throw bad(str_cat("tensor '", name, "': bad data_offsets"));
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_size || end - begin != count * d->bytes)
      throw bad(str_cat("tensor '", name, "': data_offsets [", begin, ", ", end, "] do not hold ", count, " ", d->name,
                        " values within the ", data_size, " data bytes"));
    out.tensors[name] = {d->type, shape, static_cast<int64_t>(count), 8 + n + begin};
  }
  return out;
}

at::Tensor read_safetensors_range(const TensorIndex& index, const std::string& name, int64_t begin, int64_t len) {
  auto it = index.tensors.find(name);
  if (it == index.tensors.end()) throw DataError(str_cat(index.path, ": has no tensor '", name, "'"));
  const TensorEntry& e = it->second;
  if (begin < 0 || len < 0 || begin + len > e.numel)
    throw DataError(str_cat(index.path, ": tensor '", name, "' has ", e.numel, " values, not [", begin, ", ",
                            begin + len, ")"));
  const size_t bytes = by_type(e.dtype)->bytes;
  at::Tensor t = at::empty({len}, at::TensorOptions().dtype(e.dtype));
  std::ifstream in(index.path, std::ios::binary);
  in.seekg(static_cast<std::streamoff>(e.offset + static_cast<uint64_t>(begin) * bytes));
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(static_cast<size_t>(len) * bytes));
  if (!in) throw DataError(str_cat(index.path, ": tensor '", name, "': short read (the file changed?)"));
  return t;
}

TensorFile load_safetensors(const std::string& path) {
  TensorIndex index = index_safetensors(path);
  TensorFile out;
  out.metadata = std::move(index.metadata);
  for (const auto& [name, e] : index.tensors)
    out.tensors[name] = read_safetensors_range(index, name, 0, e.numel).view(e.shape);
  return out;
}

void save_module(const torch::nn::Module& module, const std::string& path,
                 const std::map<std::string, std::string>& metadata) {
  TensorFile f;
  f.metadata = metadata;
  for (const auto& p : module.named_parameters()) f.tensors[p.key()] = p.value();
  for (const auto& b : module.named_buffers()) f.tensors[b.key()] = b.value();
  save_safetensors(path, f);
}

std::map<std::string, std::string> load_module(torch::nn::Module& module, const std::string& path, bool allow_extra) {
  TensorFile f = load_safetensors(path);
  load_module(module, f, path, allow_extra);
  return f.metadata;
}

void load_module(torch::nn::Module& module, const TensorFile& f, const std::string& path, bool allow_extra) {
  at::NoGradGuard no_grad;
  std::set<std::string> used;
  auto fill = [&](const std::string& name, at::Tensor& target) {
    auto it = f.tensors.find(name);
    if (it == f.tensors.end())
      throw DataError(str_cat(path, ": has no tensor '", name, "' (shape ", shape_text(target.sizes()),
                              ") that the model needs: is it a model of this kind and size?"));
    if (it->second.sizes() != target.sizes())
      throw DataError(str_cat(path, ": tensor '", name, "' has shape ", shape_text(it->second.sizes()),
                              " but the model's is ", shape_text(target.sizes()), ": the [model] sizes differ"));
    target.copy_(it->second);
    used.insert(name);
  };
  for (auto& p : module.named_parameters()) fill(p.key(), p.value());
  for (auto& b : module.named_buffers()) fill(b.key(), b.value());
  if (!allow_extra)
    for (const auto& [name, t] : f.tensors)
      if (!used.count(name))
        throw DataError(str_cat(path, ": tensor '", name, "' has no place in the model: is it a model of this kind?"));
}

}  // namespace nebula::model
