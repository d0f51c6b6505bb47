#include "model/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cstdlib>
#include <fstream>

#include "model/mlm_encoder.h"
#include "model/testing.h"
#include "nebula/error.h"
#include "util/temp_dir.h"

namespace nebula::model {
namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary) << bytes;
}

using testing::error_of;

TEST(Safetensors, RoundTripsEveryDtypeAndMetadata) {
  nebula::testing::TempDir dir("st");
  TensorFile f;
  f.tensors["a.weight"] = at::randn({3, 5});
  f.tensors["b"] = at::arange(7, at::kLong);
  f.tensors["c"] = at::randn({4}).to(at::kHalf);
  f.tensors["d"] = at::randn({2, 2}).to(at::kBFloat16);
  f.tensors["e"] = at::arange(6, at::kInt).reshape({2, 3});
  f.tensors["f"] = at::arange(5, at::kByte);
  f.tensors["scalar"] = at::scalar_tensor(2.5);  // shape []
  f.metadata = {{"kind", "mlm_encoder"}, {"dim", "16"}};
  save_safetensors(dir.file("m.safetensors"), f);
  TensorFile g = load_safetensors(dir.file("m.safetensors"));
  EXPECT_EQ(g.metadata, f.metadata);
  ASSERT_EQ(g.tensors.size(), f.tensors.size());
  for (const auto& [name, t] : f.tensors) {
    ASSERT_TRUE(g.tensors.count(name)) << name;
    EXPECT_EQ(g.tensors[name].scalar_type(), t.scalar_type()) << name;
    EXPECT_TRUE(at::equal(g.tensors[name], t)) << name;
  }
  EXPECT_FALSE(std::filesystem::exists(dir.file("m.safetensors.tmp")));
}

// The layout other tools read: u64 LE header length, JSON header padded to 8 bytes, offsets
// relative to the data section, float32 bytes little-endian.
TEST(Safetensors, FollowsThePublishedLayout) {
  nebula::testing::TempDir dir("st");
  TensorFile f;
  f.tensors["x"] = at::tensor({1.0f, -2.0f, 0.5f});
  f.tensors["y"] = at::tensor({int64_t{7}});
  save_safetensors(dir.file("m.safetensors"), f);
  const std::string bytes = read_bytes(dir.file("m.safetensors"));
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<uint64_t>(static_cast<uint8_t>(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  auto header = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(header["x"]["dtype"], "F32");
  EXPECT_EQ(header["x"]["shape"], nlohmann::json::array({3}));
  const uint64_t begin = header["x"]["data_offsets"][0], end = header["x"]["data_offsets"][1];
  ASSERT_EQ(end - begin, 12u);
  float values[3];
  std::memcpy(values, bytes.data() + 8 + n + begin, 12);
  EXPECT_EQ(values[0], 1.0f);
  EXPECT_EQ(values[1], -2.0f);
  EXPECT_EQ(values[2], 0.5f);
  EXPECT_EQ(header["y"]["dtype"], "I64");
  EXPECT_EQ(bytes.size(), 8 + n + 12 + 8);
}

// A second, independent reader of the published format, in Python's standard library.
TEST(Safetensors, PythonReadsWhatNebulaWrites) {
  if (std::system("python3 -c 'import array, json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  nebula::testing::TempDir dir("st");
  TensorFile f;
  f.tensors["w"] = at::arange(6, at::kFloat).reshape({2, 3}) * 0.5;
  save_safetensors(dir.file("m.safetensors"), f);
  const std::string script = dir.file("read.py");
  write_bytes(script, R"(import array, json, struct, sys
b = open(sys.argv[1], 'rb').read()
n = struct.unpack('<Q', b[:8])[0]
h = json.loads(b[8:8 + n])
assert h['w']['dtype'] == 'F32' and h['w']['shape'] == [2, 3], h
s, e = h['w']['data_offsets']
t = array.array('f')
t.frombytes(b[8 + n + s:8 + n + e])
assert list(t) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5], list(t)
)");
  EXPECT_EQ(std::system(("python3 " + script + " " + dir.file("m.safetensors") + " >/dev/null").c_str()), 0);
}

TEST(Safetensors, CorruptFilesAreDataErrorsNamingTheProblem) {
  nebula::testing::TempDir dir("st");
  const std::string path = dir.file("m.safetensors");
  TensorFile f;
  f.tensors["x"] = at::randn({4, 4});
  save_safetensors(path, f);
  const std::string good = read_bytes(path);

  write_bytes(path, good.substr(0, good.size() - 5));  // truncated data
  EXPECT_NE(error_of([&] { load_safetensors(path); }).find("'x'"), std::string::npos);
  write_bytes(path, std::string("\xff\xff\xff\xff\0\0\0\0", 8) + "{}");  // header longer than the file
  EXPECT_NE(error_of([&] { load_safetensors(path); }).find("header of"), std::string::npos);
  write_bytes(path, std::string("\x08\0\0\0\0\0\0\0", 8) + "not json");
  EXPECT_NE(error_of([&] { load_safetensors(path); }).find("JSON"), std::string::npos);
  write_bytes(path, "abc");
  EXPECT_NE(error_of([&] { load_safetensors(path); }).find("only 3 bytes"), std::string::npos);
  EXPECT_NE(error_of([&] { load_safetensors(dir.file("missing")); }).find("cannot open"), std::string::npos);
}

TEST(Safetensors, ModulesSaveAndLoadByName) {
  nebula::testing::TempDir dir("st");
  ModelConfig c = model::testing::tiny_model_config();
  at::manual_seed(1);
  MlmEncoder a(c, 40, 0);
  at::manual_seed(2);
  MlmEncoder b(c, 40, 0);
  save_module(*a, dir.file("a.safetensors"), {{"kind", "mlm_encoder"}});
  auto meta = load_module(*b, dir.file("a.safetensors"));
  EXPECT_EQ(meta.at("kind"), "mlm_encoder");
  at::Tensor ids = at::randint(5, 40, {2, 6}, at::kLong);
  EXPECT_TRUE(at::equal(a->forward(ids), b->forward(ids)));

  ModelConfig wider = c;
  wider.dim = 32;
  MlmEncoder w(wider, 40, 0);
  const std::string e = error_of([&] { load_module(*w, dir.file("a.safetensors")); });
  EXPECT_NE(e.find("tokens.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("[40, 16]"), std::string::npos) << e;
  EXPECT_NE(e.find("[40, 32]"), std::string::npos) << e;
}

}  // namespace
}  // namespace nebula::model
