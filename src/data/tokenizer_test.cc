#include "data/tokenizer.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <thread>

#include "data/corpus.h"
#include "data/mo_test_util.h"
#include "nebula/error.h"

namespace nebula::data {
namespace {

using testing::read_bytes;
using testing::TempDir;
using testing::write_bytes;

// Trains one model for the whole suite (training is the slow part).
class TokenizerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (!std::filesystem::exists("/usr/share/locale/de/LC_MESSAGES")) return;
    CorpusOptions opt;
    opt.languages = {"de"};
    opt.max_pairs_per_language = 3000;
    for (const SentencePair& p : build_gettext_corpus(opt)) {
      sentences_->push_back(p.en);
      sentences_->push_back(p.other);
    }
    dir_ = std::make_unique<TempDir>("tokenizer");
    Tokenizer::train(*sentences_, dir_->file("spm"), 500);
  }
  static void TearDownTestSuite() {
    dir_.reset();
    sentences_->clear();
  }
  void SetUp() override {
    if (!dir_) GTEST_SKIP() << "no German catalogs in /usr/share/locale to train on";
  }
  static std::string model_path() { return dir_->file("spm.model"); }

  static inline std::unique_ptr<TempDir> dir_;
  static inline std::unique_ptr<std::vector<std::string>> sentences_ = std::make_unique<std::vector<std::string>>();
};

TEST_F(TokenizerTest, TrainWritesModelAndVocabWithSpecifiedIds) {
  EXPECT_EQ(sentences_->size(), 6000u);
  EXPECT_TRUE(std::filesystem::exists(dir_->file("spm.vocab")));
  // The temporary training input is gone.
  for (const auto& entry : std::filesystem::directory_iterator(dir_->path())) {
    EXPECT_EQ(entry.path().string().find("train-input"), std::string::npos) << entry.path();
  }
  const Tokenizer t = Tokenizer::load(model_path());
  EXPECT_EQ(t.vocab_size(), 500);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.unk_id(), 1);
  EXPECT_EQ(t.bos_id(), 2);
  EXPECT_EQ(t.eos_id(), 3);
  EXPECT_EQ(t.mask_id(), 4);
  const auto ids = t.encode("Open the <mask> file");
  EXPECT_NE(std::find(ids.begin(), ids.end(), 4), ids.end());
}

TEST_F(TokenizerTest, EncodeDecodeRoundTrip) {
  const Tokenizer t = Tokenizer::load(model_path());
  for (const std::string s : {"Cannot open the file", "Datei konnte nicht geöffnet werden", "invalid option"}) {
    const auto ids = t.encode(s);
    ASSERT_FALSE(ids.empty());
    EXPECT_LT(ids.size(), s.size()) << "subwords should be longer than one byte on average";
    for (int id : ids) {
      EXPECT_GE(id, 0);
      EXPECT_LT(id, t.vocab_size());
      EXPECT_NE(id, t.unk_id()) << s;
    }
    EXPECT_EQ(t.decode(ids), s);
  }
  EXPECT_TRUE(t.encode("").empty());
  EXPECT_EQ(t.decode({}), "");
  EXPECT_THROW(t.decode({5, 500}), DataError);
  EXPECT_THROW(t.decode({-1}), DataError);
}

TEST_F(TokenizerTest, CopiesShareTheModelAndEncodeConcurrently) {
  const Tokenizer t = Tokenizer::load(model_path());
  std::vector<std::vector<int>> expected;
  for (size_t i = 0; i < 200; ++i) expected.push_back(t.encode((*sentences_)[i]));
  std::vector<std::vector<int>> got_a(200), got_b(200);
  const Tokenizer copy = t;
  std::thread a([&] {
    for (size_t i = 0; i < 200; ++i) got_a[i] = t.encode((*sentences_)[i]);
  });
  std::thread b([&] {
    for (size_t i = 0; i < 200; ++i) got_b[i] = copy.encode((*sentences_)[i]);
  });
  a.join();
  b.join();
  EXPECT_EQ(got_a, expected);
  EXPECT_EQ(got_b, expected);
}

TEST_F(TokenizerTest, TrainingIsDeterministic) {
  // A smaller, quicker model trained twice on the same input must come out identical.
  std::vector<std::string> part(sentences_->begin(), sentences_->begin() + 2000);
  Tokenizer::train(part, dir_->file("d1"), 300);
  Tokenizer::train(part, dir_->file("d2"), 300);
  // Compare the pieces and scores (.vocab): the .model also records the trainer's
  // arguments, which name the (different) output paths.
  const std::string v1 = read_bytes(dir_->file("d1.vocab"));
  ASSERT_GT(std::count(v1.begin(), v1.end(), '\n'), 299);
  EXPECT_TRUE(v1 == read_bytes(dir_->file("d2.vocab"))) << "vocabularies differ";
}

// [6/7] hostile input: a real model cut short (an interrupted copy) is a DataError naming the
// file, never a crash or a model with fewer pieces.
TEST_F(TokenizerTest, TruncatedModelThrowsNamingThePath) {
  const std::string bytes = read_bytes(model_path());
  TempDir dir("tok_cut");
  for (size_t len : {bytes.size() / 2, bytes.size() - 7, size_t{5}}) {
    const std::string path = dir.file("cut-" + std::to_string(len) + ".model");
    write_bytes(path, bytes.substr(0, len));
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << "no DataError for a model cut to " << len << " of " << bytes.size() << " bytes";
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(path + ": not a valid SentencePiece model"), std::string::npos)
          << e.what();
    }
  }
}

TEST(Tokenizer, LoadMissingOrGarbageFileThrowsNamingThePath) {
  TempDir dir("tok_bad");
  for (const std::string& path : {dir.file("missing.model"), dir.file("garbage.model"), dir.file("empty.model")}) {
    if (path.ends_with("garbage.model")) write_bytes(path, "\xff\xfe this is definitely not a protobuf \x01\x02\x03");
    if (path.ends_with("empty.model")) write_bytes(path, "");
    try {
      Tokenizer::load(path);
      ADD_FAILURE() << "no DataError for " << path;
    } catch (const DataError& e) {
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    }
  }
}

TEST(Tokenizer, VocabTooLargeForTinyInputSaysSo) {
  TempDir dir("tok_tiny");
  try {
    Tokenizer::train({"a tiny corpus", "with few words"}, dir.file("tiny"), 500);
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("vocab_size 500 is too large"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Tokenizer::train({"", "  "}, dir.file("empty"), 100), DataError);
}

}  // namespace
}  // namespace nebula::data
