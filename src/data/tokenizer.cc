#include "data/tokenizer.h"

#include <dlfcn.h>
#include <unistd.h>

#include <filesystem>
#include <mutex>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "data/file_io.h"
#include "nebula/error.h"

namespace nebula::data {
namespace {

constexpr unsigned int kSeed = 20220519;  // any fixed value; the point is that it is fixed
constexpr int kMaxTrainingSentences = 200000;

// Removes the file when the scope ends (training succeeded or threw).
struct TempFile {
  std::string path;
  ~TempFile() {
    if (!path.empty()) ::unlink(path.c_str());
  }
};

// The shim's C functions (sentencepiece_shim.cc), resolved once per process.
struct Shim {
  int (*train)(const char* const*, const char* const*, int, unsigned, char*, int);
  void* (*load)(const char*, size_t, char*, int);
  void (*free)(void*);
  void (*info)(const void*, int*);
  long (*encode)(const void*, const char*, size_t, int*, size_t, char*, int);
  long (*decode)(const void*, const int*, size_t, char*, size_t, char*, int);
};

const Shim& shim() {
  static Shim s;
  static std::once_flag once;
  static std::string failure;
  std::call_once(once, [] {
    std::vector<std::string> candidates;
    if (const char* env = std::getenv("NEBULA_SENTENCEPIECE_SHIM")) candidates.push_back(env);
    std::error_code ec;
    auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
    if (!ec) candidates.push_back((exe.parent_path() / "libnebula_sentencepiece.so").string());
    candidates.push_back(NEBULA_SENTENCEPIECE_SHIM);
    void* handle = nullptr;
    std::string tried;
    for (const auto& path : candidates) {
      // LOCAL: nobody else binds to its symbols; DEEPBIND: it binds to its own first.
      handle = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
      if (handle) break;
      tried += str_cat("\n  ", path, ": ", ::dlerror());
    }
    if (!handle) {
      failure = str_cat("cannot load the SentencePiece shim; tried:", tried,
                        "\nrebuild nebula or set NEBULA_SENTENCEPIECE_SHIM to libnebula_sentencepiece.so");
      return;
    }
    auto sym = [&](const char* name) {
      void* p = ::dlsym(handle, name);
      if (!p && failure.empty()) failure = str_cat("SentencePiece shim lacks ", name, ": rebuild nebula");
      return p;
    };
    s.train = reinterpret_cast<decltype(s.train)>(sym("nebula_spm_train"));
    s.load = reinterpret_cast<decltype(s.load)>(sym("nebula_spm_load"));
    s.free = reinterpret_cast<decltype(s.free)>(sym("nebula_spm_free"));
    s.info = reinterpret_cast<decltype(s.info)>(sym("nebula_spm_info"));
    s.encode = reinterpret_cast<decltype(s.encode)>(sym("nebula_spm_encode"));
    s.decode = reinterpret_cast<decltype(s.decode)>(sym("nebula_spm_decode"));
  });
  if (!failure.empty()) throw DataError(failure);
  return s;
}

constexpr int kErrLen = 1024;

}  // namespace

void Tokenizer::train(const std::vector<std::string>& sentences, const std::string& model_prefix, int vocab_size) {
  NEBULA_CHECK(vocab_size > 5, "vocab_size must exceed the 5 special pieces, got ", vocab_size);
  std::string text;
  size_t count = 0;
  for (const std::string& s : sentences) {
    if (s.find_first_not_of(" \t\r\n") == std::string::npos) continue;
    for (char c : s) text += (c == '\n' || c == '\r') ? ' ' : c;
    text += '\n';
    ++count;
  }
  if (count == 0) throw DataError(str_cat(model_prefix, ": cannot train a tokenizer on zero non-empty sentences"));

  TempFile input;
  input.path = str_cat(model_prefix, ".train-input.", ::getpid(), ".txt");
  write_file_atomic(input.path, text);

  // The map form of Train() needs no quoting, so paths with spaces work.
  const std::unordered_map<std::string, std::string> args = {
      {"input", input.path},
      {"model_prefix", model_prefix},
      {"model_type", "unigram"},
      {"vocab_size", std::to_string(vocab_size)},
      {"character_coverage", "0.9995"},
      {"input_sentence_size", std::to_string(kMaxTrainingSentences)},
      {"shuffle_input_sentence", "true"},
      {"num_threads", "1"},
      {"pad_id", "0"},
      {"unk_id", "1"},
      {"bos_id", "2"},
      {"eos_id", "3"},
      {"user_defined_symbols", "<mask>"},
      {"minloglevel", "2"},
  };
  std::vector<const char*> keys, values;
  for (const auto& [k, v] : args) {
    keys.push_back(k.c_str());
    values.push_back(v.c_str());
  }
  char err[kErrLen] = "";
  const bool ok = shim().train(keys.data(), values.data(), static_cast<int>(keys.size()), kSeed, err, kErrLen) == 0;
  if (!ok) {
    const std::string msg = err;
    if (msg.find("Vocabulary size") != std::string::npos || msg.find("vocab_size") != std::string::npos) {
      throw DataError(str_cat(model_prefix, ": vocab_size ", vocab_size, " is too large for the training data (",
                              count, " sentences); use a smaller vocab_size or more text (SentencePiece: ", msg,
                              ")"));
    }
    throw DataError(str_cat(model_prefix, ": SentencePiece training failed on ", count, " sentences: ", msg));
  }
}

Tokenizer Tokenizer::load(const std::string& model_path) {
  // Read the bytes ourselves: the error then names the path and strerror, and
  // SentencePiece only has to judge the contents.
  const std::string bytes = read_file_bytes(model_path, size_t{1} << 31);
  const Shim& api = shim();
  char err[kErrLen] = "";
  void* raw = api.load(bytes.data(), bytes.size(), err, kErrLen);
  if (!raw) throw DataError(str_cat(model_path, ": not a valid SentencePiece model (", err, ")"));
  std::shared_ptr<void> sp(raw, api.free);
  int info[6];
  api.info(raw, info);
  if (info[0] <= 0) throw DataError(str_cat(model_path, ": SentencePiece model has no pieces"));
  Tokenizer t;
  t.model_path_ = model_path;
  t.vocab_size_ = info[0];
  t.pad_id_ = info[1];
  t.unk_id_ = info[2];
  t.bos_id_ = info[3];
  t.eos_id_ = info[4];
  t.mask_id_ = info[5];
  t.sp_ = std::move(sp);
  return t;
}

std::vector<int> Tokenizer::encode(std::string_view text) const {
  std::vector<int> ids(text.size() + 8);  // pieces never outnumber bytes by much: one retry at most
  char err[kErrLen] = "";
  for (;;) {
    long n = shim().encode(sp_.get(), text.data(), text.size(), ids.data(), ids.size(), err, kErrLen);
    if (n < 0) throw DataError(str_cat(model_path_, ": cannot encode text: ", err));
    bool fits = static_cast<size_t>(n) <= ids.size();
    ids.resize(static_cast<size_t>(n));
    if (fits) return ids;
  }
}

std::string Tokenizer::decode(const std::vector<int>& ids) const {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size_) {
      throw DataError(str_cat(model_path_, ": cannot decode id ", ids[i], " at position ", i, " (vocab size ",
                              vocab_size_, ")"));
    }
  }
  std::string text(ids.size() * 8 + 16, '\0');
  char err[kErrLen] = "";
  for (;;) {
    long n = shim().decode(sp_.get(), ids.data(), ids.size(), text.data(), text.size(), err, kErrLen);
    if (n < 0) throw DataError(str_cat(model_path_, ": cannot decode ids: ", err));
    bool fits = static_cast<size_t>(n) <= text.size();
    text.resize(static_cast<size_t>(n));
    if (fits) return text;
  }
}

}  // namespace nebula::data
