// Checkpoints on disk. The worker (worker.cc) decides what goes in them and when.
//
// A checkpoint is a directory DIR/step-<12 digits>/ holding
//   tensors.safetensors   every tensor (model weights, optimizer moments, strategy state),
//                         readable by any safetensors reader (model/safetensors.h)
//   manifest.json         {"format": "nebula-checkpoint", "version": 1, "step", "config_hash",
//                          "state": {...} (anything else: outer step, RNG, data position ...),
//                          "files": {"tensors.safetensors": {"bytes", "crc32"}}}
//
// Writing is atomic: everything goes into step-N.tmp/, each file is fsync'ed, the directory is
// renamed to step-N and the parent fsync'ed. A crash leaves either a complete checkpoint or a
// *.tmp directory that readers ignore (and the next save removes). Loading takes the newest
// checkpoint whose files match their manifest (size and CRC-32); a damaged one is reported
// (spdlog::warn naming the file and what is wrong) and the one before it is tried. The check
// reads the files in pieces of a few MiB: it never holds a whole file.
//
// Thread safety: free functions; one writer per directory.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "model/mlm_batch.h"
#include "model/safetensors.h"

namespace nebula::parallel {

struct Checkpoint {
  int64_t step = 0;
  std::map<std::string, at::Tensor> tensors;
  nlohmann::json state = nlohmann::json::object();
  // Tensors left in the file (load_latest_checkpoint's leave_unread): read by range, see read_range.
  std::shared_ptr<const model::TensorIndex> unread;
};

// A tensor of `k`, loaded or left unread: its number of values (-1: no such tensor), and its
// values [begin, begin + len) flattened, as float32 (read from the file when left unread).
int64_t tensor_numel(const Checkpoint& k, const std::string& name);
at::Tensor read_range(const Checkpoint& k, const std::string& name, int64_t begin, int64_t len);
// Bytes this thread has read from checkpoint files by range (resharding's log line; tests).
int64_t range_bytes_read();

// Writes `checkpoint` into dir (created) and keeps only the newest `keep` checkpoints there.
// DataError naming the path when something cannot be written (e.g. a full disk): the
// checkpoints written before are left as they were.
void save_checkpoint(const std::string& dir, const Checkpoint& checkpoint, const std::string& config_hash,
                     int keep = 2);

// The newest intact checkpoint in dir, or nullopt if there is none. A checkpoint written with
// another config_hash is a ConfigError naming both hashes (resuming under a changed config
// would silently train something else).
// With `max_step`, the newest intact one at or before that step. Tensors whose names
// `leave_unread` accepts stay in the file (Checkpoint::unread): a resharding worker reads only
// its part of every old worker's state.
std::optional<Checkpoint> load_latest_checkpoint(const std::string& dir, const std::string& config_hash,
                                                 int64_t max_step = INT64_MAX,
                                                 const std::function<bool(const std::string&)>& leave_unread = {});

// A batcher's position as state["data"][name] (generator, cursor) and tensor "data/NAME/order".
void put_batcher(Checkpoint& c, const std::string& name, const model::BatcherState& s);
// DataError naming the entry if it is missing or malformed.
model::BatcherState get_batcher(const Checkpoint& c, const std::string& name);

}  // namespace nebula::parallel
