// Model files in the safetensors format (https://huggingface.co/docs/safetensors), so that
// other tools (Python's `safetensors`, `torch`, Hugging Face) read what nebula writes:
//
//   u64 little-endian N | N bytes of JSON header | tensor bytes
//   header = {"NAME": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//             "__metadata__": {"key": "string value", ...}}
//
// Offsets are relative to the first byte after the header, tensors are stored little-endian,
// row-major, back to back in name order, and the header is padded with spaces to a multiple
// of 8 bytes (as the reference writer does).
//
// Writing is atomic: a temporary file next to the target, fsync, rename, then fsync of the
// directory. A crash leaves either the old file or the new one, never a torn one.
// Reading validates like wire input: every size, offset and dtype is checked against the
// file before anything is allocated, and errors are DataError naming the file and the tensor.
//
// Thread safety: free functions without shared state.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include <map>
#include <string>
#include <vector>

namespace nebula::model {

struct TensorFile {
  std::map<std::string, at::Tensor> tensors;       // contiguous CPU tensors
  std::map<std::string, std::string> metadata;     // "__metadata__"
};

// Supported dtypes: float32 (F32), float16 (F16), bfloat16 (BF16), int64 (I64), int32 (I32),
// uint8 (U8). Tensors on other devices are copied to the CPU first.
void save_safetensors(const std::string& path, const TensorFile& file);
TensorFile load_safetensors(const std::string& path);

// A file's tensors without their values (checked as load_safetensors checks them): what a reader
// of parts needs (resharding a checkpoint reads of each tensor only the values a worker holds).
struct TensorEntry {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t offset = 0;  // of the first byte in the file
};
struct TensorIndex {
  std::string path;
  std::map<std::string, TensorEntry> tensors;
  std::map<std::string, std::string> metadata;
};
TensorIndex index_safetensors(const std::string& path);
// Values [begin, begin + len) of tensor `name` flattened, in its dtype. DataError naming the
// file and the tensor when it has no such values.
at::Tensor read_safetensors_range(const TensorIndex& index, const std::string& name, int64_t begin, int64_t len);

// Every parameter and buffer of `module`, by its dotted name ("encoder.layers.0.q.weight").
void save_module(const torch::nn::Module& module, const std::string& path,
                 const std::map<std::string, std::string>& metadata = {});
// Copies the file's tensors into `module`'s parameters and buffers of the same names. A name
// the module has and the file lacks, or a shape that differs, is a DataError naming the
// file, the tensor and both shapes. Tensors of the file the module lacks are ignored only if
// `allow_extra` (e.g. loading an encoder out of a bigger model). Returns the metadata.
std::map<std::string, std::string> load_module(torch::nn::Module& module, const std::string& path,
                                               bool allow_extra = false);
// The same from a file already read (e.g. for its metadata first); `path` names it in errors.
void load_module(torch::nn::Module& module, const TensorFile& file, const std::string& path, bool allow_extra = false);

}  // namespace nebula::model
