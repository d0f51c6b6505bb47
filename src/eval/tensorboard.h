// Scalars as TensorBoard event files, so that `tensorboard --logdir DIR` plots what nebula
// measured. TensorBoard reads every file named events.out.tfevents.* under its logdir; one
// directory is one run in its run selector.
//
// A file is a sequence of records in the TFRecord framing (all integers little-endian):
//
//   u64 N | u32 masked_crc32c(the 8 bytes of N) | N bytes of data | u32 masked_crc32c(data)
//   masked_crc32c(x) = ((crc >> 15) | (crc << 17)) + 0xa282ead8   (mod 2^32), crc = CRC-32C(x)
//
// CRC-32C is the Castagnoli CRC (reflected polynomial 0x82F63B78, initial value and final xor
// 0xFFFFFFFF; iSCSI, ext4). Each record's data is one tensorflow.Event protobuf message
// (tensorflow/core/util/event.proto, summary.proto); the fields written here:
//
//   Event         1 wall_time     double   (wire type 1, 8 bytes)   unix seconds
//                 2 step          int64    (wire type 0, varint; a negative step is 10 bytes)
//                 3 file_version  string   (wire type 2)            "brain.Event:2"
//                 5 summary       Summary  (wire type 2)
//   Summary       1 value         repeated Summary.Value (wire type 2)
//   Summary.Value 1 tag           string   (wire type 2)            "train/loss"
//                 2 simple_value  float    (wire type 5, 4 bytes)
//
// A field is written as its key (field number << 3 | wire type, a varint) and then the value;
// length-delimited values (wire type 2) are a varint byte count and the bytes. The first
// record is Event{wall_time, file_version}; every scalar is then one Event{wall_time, step,
// summary{value{tag, simple_value}}}.
//
// Thread safety: a TensorBoardWriter is used by one thread at a time; the free functions are pure.
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace nebula::eval {

// CRC-32C of `bytes`; crc32c("123456789") == 0xE3069283.
uint32_t crc32c(std::string_view bytes);
// The masked CRC-32C the TFRecord framing stores (see above; TensorFlow masks because a CRC
// over bytes that themselves hold CRCs is weak).
uint32_t masked_crc32c(std::string_view bytes);

// Appends scalars to a new event file DIR/events.out.tfevents.<unix seconds>.<hostname>.
// Errors (the directory or the file cannot be created or written) are DataError naming the
// path. Records are buffered by stdio: call flush() after each batch of scalars, so that a
// running TensorBoard sees them and write errors are reported; the destructor closes the
// file without reporting.
class TensorBoardWriter {
 public:
  // Creates `dir` (and its parents) and the file, named after `wall_time` (unix seconds, the
  // current time if negative), and writes the file_version event with that time. A file of
  // that name already there is replaced.
  explicit TensorBoardWriter(const std::string& dir, double wall_time = -1);

  // One Event with one value. `tag` is not empty; '/' groups tags in TensorBoard's UI
  // ("eval/de/accuracy"). `wall_time` in unix seconds.
  void add_scalar(const std::string& tag, int64_t step, float value, double wall_time);
  void flush();
  const std::string& path() const { return path_; }

 private:
  void write_record(const std::string& data);

  struct Close {
    void operator()(std::FILE* f) const { std::fclose(f); }
  };
  std::string path_;
  std::unique_ptr<std::FILE, Close> file_;  // fclose flushes
};

struct TensorBoardScalar {
  std::string tag;
  int64_t step = 0;
  float value = 0;
  double wall_time = 0;
};

// Every simple_value of an event file, in file order. Checks what the writer promises: both
// CRCs of every record, a first event with a file_version "brain.Event:...", and well-formed
// protobuf (unknown fields are skipped). DataError naming the path and the record's byte
// offset otherwise. Meant for tests and tools; TensorBoard itself reads the files in practice.
std::vector<TensorBoardScalar> read_tensorboard_scalars(const std::string& path);

}  // namespace nebula::eval
