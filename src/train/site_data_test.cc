// What each site reads (data never crosses sites), the translation-LM sequences, and the
// cross-lingual probe's slots.
#include "train/site_data.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>

#include "data/corpus.h"
#include "model/safetensors.h"
#include "nebula/error.h"
#include "train/evaluation.h"
#include "train/translate.h"
#include "util/temp_dir.h"

namespace nebula::train {
namespace {

std::vector<data::SentencePair> make_pairs(const std::string& lang, int n) {
  std::vector<data::SentencePair> out;
  for (int i = 0; i < n; ++i)
    out.push_back({lang, "open file number " + std::to_string(i), lang + " datei nummer " + std::to_string(i)});
  return out;
}

// A `nebula corpus build` directory with de and fr pairs, and a config of two sites reading it.
struct CorpusJob {
  nebula::testing::TempDir dir{"site_data"};
  Config config;
  CorpusJob() {
    data::Corpus c;
    for (const auto* lang : {"de", "fr"})
      for (auto& p : make_pairs(lang, 40)) c.train.push_back(p);
    c.valid = make_pairs("de", 5);
    c.test = make_pairs("fr", 3);
    data::write_corpus(dir.path(), c, {});
    config = parse_config(str_cat("[data]\nsource = \"corpus\"\npath = \"", dir.path(),
                                  "\"\n[[sites]]\nname = \"a\"\nlanguages = [\"de\"]\n"
                                  "[[sites]]\nname = \"b\"\nlanguages = [\"fr\"]\nmax_pairs_per_language = 7\n"),
                          "job.toml");
  }
};

// [6/7] hostile input: data.path that is missing, a directory where a file belongs, a file in
// another encoding, a TSV line without a tab, a corpus directory without its files: each is a
// DataError naming the file (and line), the key it came from and what that source reads.
TEST(SiteData, BadDataPathNamesTheFileTheKeyAndWhatTheSourceReads) {
  nebula::testing::TempDir dir("site_data_bad");
  std::ofstream(dir.file("latin1.tsv")) << "de\tOpen\t\xd6" "ffnen\n";
  std::ofstream(dir.file("notab.tsv")) << "de\tOpen\t\xc3\x96" "ffnen\nde Close Schliessen\n";
  struct Case {
    std::string source, path, says;
  };
  const std::vector<Case> cases = {
      {"tsv", dir.file("missing.tsv"), dir.file("missing.tsv") + ": cannot open"},
      {"tsv", dir.path(), dir.path() + ": cannot read"},
      {"text", dir.path(), dir.path() + ": cannot read"},
      {"tsv", dir.file("latin1.tsv"), dir.file("latin1.tsv") + ":1:9: not valid UTF-8"},
      {"tsv", dir.file("notab.tsv"), dir.file("notab.tsv") + ":2: expected 2 or 3 tab-separated columns"},
      {"corpus", dir.path(), dir.file("train.tsv") + ": cannot open"},
      {"gettext", dir.file("no-locale"), "no gettext catalogs"},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.source + " " + k.path);
    Config c = parse_config(str_cat("[data]\nsource = \"", k.source, "\"\npath = \"", k.path,
                                    "\"\nlanguages = [\"de\"]\n[[sites]]\nname = \"a\"\n"),
                            "job.toml");
    try {
      load_pairs(c, &c.sites[0], data::Split::kTrain);
      ADD_FAILURE() << "no DataError";
    } catch (const DataError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find(k.says), std::string::npos) << msg;
      EXPECT_NE(msg.find("data.path = \"" + k.path + "\" in job.toml"), std::string::npos) << msg;
      EXPECT_NE(msg.find("data.source = \"" + k.source + "\" reads "), std::string::npos) << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
}

TEST(SiteData, CorpusDirectorySplitsAreReadAsWrittenAndSitesKeepTheirLanguages) {
  CorpusJob job;
  const auto a = load_pairs(job.config, &job.config.sites[0], data::Split::kTrain);
  const auto b = load_pairs(job.config, &job.config.sites[1], data::Split::kTrain);
  ASSERT_EQ(a.size(), 40u);  // data.max_pairs_per_language (2000 by default) is gettext's, not applied here
  EXPECT_EQ(b.size(), 7u);   // the site's own cap
  for (const auto& p : a) EXPECT_EQ(p.lang, "de");
  for (const auto& p : b) EXPECT_EQ(p.lang, "fr");
  EXPECT_EQ(load_pairs(job.config, &job.config.sites[0], data::Split::kValid).size(), 5u);
  EXPECT_EQ(load_pairs(job.config, &job.config.sites[1], data::Split::kTest).size(), 3u);
  EXPECT_TRUE(load_pairs(job.config, &job.config.sites[1], data::Split::kValid).empty());  // fr has none
  // The cap keeps a fixed subset: the same 7 on every call.
  EXPECT_EQ(load_pairs(job.config, &job.config.sites[1], data::Split::kTrain), b);

  // Workers split their site's pairs: disjoint, complete.
  std::set<std::string> seen;
  for (int rank = 0; rank < 3; ++rank) {
    SiteText t = load_site_text(job.config, 0, rank, 3);
    EXPECT_EQ(t.train.size(), 2 * t.train_pairs.size());  // both sides of each pair
    for (const auto& p : t.train_pairs) EXPECT_TRUE(seen.insert(p.en).second) << p.en;
  }
  EXPECT_EQ(seen.size(), 40u);

  job.config.data.path = job.dir.file("missing");
  try {
    load_pairs(job.config, &job.config.sites[0], data::Split::kTrain);
    ADD_FAILURE() << "no error for a missing corpus directory";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("missing/train.tsv"), std::string::npos) << e.what();
  }
}

// XLM's TLM sequence: <s> en </s> other </s>, each side cut to (max_len - 3) / 2 pieces.
TEST(SiteData, TranslationLmSequencesHoldBothSidesWithinMaxLen) {
  CorpusJob job;
  std::vector<std::string> text;
  for (const auto& p : make_pairs("de", 40)) text.insert(text.end(), {p.en, p.other});
  data::Tokenizer::train(text, job.dir.file("spm"), 30);
  const auto tok = data::Tokenizer::load(job.dir.file("spm.model"));
  const std::vector<data::SentencePair> pairs = {{"de", "open file", "datei"}, {"text", "no translation", ""}};
  auto seqs = encode_tlm(tok, pairs, 64);
  ASSERT_EQ(seqs.size(), 1u);  // a pair without its other side gives none
  std::vector<int> expected{tok.bos_id()};
  for (int id : tok.encode("open file")) expected.push_back(id);
  expected.push_back(tok.eos_id());
  for (int id : tok.encode("datei")) expected.push_back(id);
  expected.push_back(tok.eos_id());
  EXPECT_EQ(seqs[0], expected);
  // Long sides are cut so that the pair fits: (12 - 3) / 2 = 4 pieces each.
  const std::string long_text = "open file number 1 open file number 2 open file number 3";
  seqs = encode_tlm(tok, {{"de", long_text, long_text}}, 12);
  ASSERT_EQ(seqs.size(), 1u);
  EXPECT_EQ(seqs[0].size(), 11u);
  EXPECT_EQ(seqs[0][5], tok.eos_id());
  EXPECT_EQ(seqs[0].back(), tok.eos_id());
}

TEST(SiteData, ProbeSlotsAreTheNamedLanguagesThenEnglish) {
  CorpusJob job;
  EXPECT_EQ(XlingualProbe::slot_names(job.config), (std::vector<std::string>{"de", "fr", "en"}));
  EXPECT_EQ(XlingualProbe::size(job.config), 12u);
  // Counts → values; a language nobody holds is left out.
  std::vector<double> counts = {3, 10, 8, 10, /*fr*/ 0, 0, 0, 0, /*en*/ 5, 20, 0, 0};
  const auto j = XlingualProbe::to_json(job.config, counts);
  EXPECT_DOUBLE_EQ(j["de"]["mlm_accuracy"].get<double>(), 0.3);
  EXPECT_DOUBLE_EQ(j["de"]["retrieval_accuracy"].get<double>(), 0.8);
  EXPECT_DOUBLE_EQ(j["de"]["pairs"].get<double>(), 5);
  EXPECT_FALSE(j.contains("fr"));
  EXPECT_DOUBLE_EQ(j["en"]["mlm_accuracy"].get<double>(), 0.25);
  EXPECT_FALSE(j["en"].contains("retrieval_accuracy"));
}

// Lines "lang<TAB>en<TAB>other": `n` pairs per language; each English sentence recurs in every
// language (as a gettext msgid does in many catalogs), and `variant` changes the other side.
std::string shared_english_tsv(const std::vector<std::string>& langs, int n, const std::string& variant = "") {
  static const char* kWords[] = {"open", "close", "save", "file", "window", "print", "search", "folder", "network",
                                 "settings", "user", "password", "delete", "copy", "paste", "help"};
  std::string text;
  for (const auto& lang : langs)
    for (int i = 0; i < n; ++i) {
      const std::string en = str_cat(kWords[i % 16], " the ", kWords[(i / 16) % 16], " ", kWords[(i * 7) % 16], " ", i);
      text += str_cat(lang, "\t", en, "\t", lang, variant, "-", kWords[(i * 5) % 16], kWords[(i / 3) % 16], " ", i, "\n");
    }
  return text;
}

// [1/5] review: sites read different languages, yet one English sentence is in the same split at
// every site, and no site validates MLM on a sentence any site trains on.
TEST(SiteData, SitesSplitByTheEnglishSentenceAlike) {
  nebula::testing::TempDir dir("site_splits");
  std::ofstream(dir.file("p.tsv")) << shared_english_tsv({"de", "fr"}, 400);
  Config c = parse_config(str_cat("[data]\nsource = \"tsv\"\npath = \"", dir.file("p.tsv"),
                                  "\"\nvalid_fraction = 0.1\ntest_fraction = 0.1\n[[sites]]\nname = \"a\"\n"
                                  "languages = [\"de\"]\n[[sites]]\nname = \"b\"\nlanguages = [\"fr\"]\n"),
                          "job.toml");
  std::set<std::string> train_en, held_out_en, train_text, valid_text;
  for (size_t site = 0; site < 2; ++site) {
    for (const auto& p : load_pairs(c, &c.sites[site], data::Split::kTrain)) train_en.insert(p.en);
    for (const auto split : {data::Split::kValid, data::Split::kTest})
      for (const auto& p : load_pairs(c, &c.sites[site], split)) held_out_en.insert(p.en);
    for (int rank = 0; rank < 2; ++rank) {
      SiteText t = load_site_text(c, site, rank, 2);
      train_text.insert(t.train.begin(), t.train.end());
      valid_text.insert(t.valid.begin(), t.valid.end());
    }
  }
  EXPECT_GT(held_out_en.size(), 40u);
  for (const auto& en : held_out_en) EXPECT_EQ(train_en.count(en), 0u) << en;  // keyed by the pair, most would be
  EXPECT_GT(valid_text.size(), 40u);
  for (const auto& s : valid_text) EXPECT_EQ(train_text.count(s), 0u) << s;
}

// [1/5] review: the shared vocabulary is trained on the tokenizer site's own data only.
struct TwoSiteTsvJob {
  nebula::testing::TempDir dir{"tokenizer_site"};
  Config config(const std::string& tsv, const std::string& extra = "") {
    std::ofstream(dir.file("p.tsv")) << tsv;
    return parse_config(str_cat("[data]\nsource = \"tsv\"\npath = \"", dir.file("p.tsv"), "\"\nvocab_size = 60\n",
                                extra, "[[sites]]\nname = \"a\"\nlanguages = [\"de\"]\n"
                                "[[sites]]\nname = \"b\"\nlanguages = [\"fr\"]\n"),
                        "job.toml");
  }
  // One output path for all: the model records its prefix (and its training input's file name).
  std::string model_bytes(const Config& c) {
    train_tokenizer(c, dir.file("tok"));
    return read(dir.file("tok.model"));
  }
  static std::string read(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
};

TEST(SiteData, TokenizerIsTrainedOnTheTokenizerSiteAlone) {
  TwoSiteTsvJob job;
  Config two = job.config(shared_english_tsv({"de"}, 300) + shared_english_tsv({"fr"}, 300));
  EXPECT_EQ(tokenizer_site(two), &two.sites[0]);  // the default: the first site
  const std::string both = job.model_bytes(two);
  ASSERT_GT(both.size(), 1000u);
  // Both sites' text pooled, as nebula did before: that would see the other site's change below.
  auto pooled = [&](const Config& c) {
    std::vector<std::string> text;
    for (const auto& site : c.sites)
      for (const auto& p : load_pairs(c, &site, data::Split::kTrain)) text.insert(text.end(), {p.en, p.other});
    data::Tokenizer::train(text, job.dir.file("tok"), 60);
    return TwoSiteTsvJob::read(job.dir.file("tok.model"));
  };
  const std::string pooled_before = pooled(two);
  // The other site's text changed: the same bytes (pooling both sites' text, as before, changes them).
  Config other_changed = job.config(shared_english_tsv({"de"}, 300) + shared_english_tsv({"fr"}, 300, "xyzzy"));
  EXPECT_EQ(job.model_bytes(other_changed), both);
  EXPECT_NE(pooled(other_changed), pooled_before);
  // The tokenizer site's data alone (no site b at all): the same bytes.
  Config alone = job.config(shared_english_tsv({"de"}, 300));
  alone.sites.pop_back();
  EXPECT_EQ(job.model_bytes(alone), both);
  // Site b as the tokenizer site: its own vocabulary.
  Config b = job.config(shared_english_tsv({"de"}, 300) + shared_english_tsv({"fr"}, 300), "tokenizer_site = \"b\"\n");
  EXPECT_EQ(tokenizer_site(b), &b.sites[1]);
  EXPECT_NE(job.model_bytes(b), both);
  // A shareable site is the default (its pairs may leave it anyway).
  Config shareable = job.config(shared_english_tsv({"de"}, 300), "");
  shareable.sites[1].shareable = true;
  EXPECT_EQ(tokenizer_site(shareable), &shareable.sites[1]);
  // A shareable file instead of any site's data.
  std::vector<std::string> lines;
  std::string text;
  for (int i = 0; i < 300; ++i) {
    lines.push_back(str_cat("shared sentence number ", i, " of the public corpus ", i * 7));
    text += lines.back() + "\n";
  }
  std::ofstream(job.dir.file("shared.txt")) << text;
  Config corpus = job.config(shared_english_tsv({"de"}, 300),
                             str_cat("tokenizer_corpus = \"", job.dir.file("shared.txt"), "\"\n"));
  EXPECT_EQ(tokenizer_site(corpus), nullptr);
  data::Tokenizer::train(lines, job.dir.file("tok"), 60);
  const std::string direct = TwoSiteTsvJob::read(job.dir.file("tok.model"));
  EXPECT_EQ(job.model_bytes(corpus), direct);
  corpus.data.tokenizer_corpus = job.dir.file("missing.txt");
  try {
    train_tokenizer(corpus, job.dir.file("missing"));
    ADD_FAILURE() << "no DataError";
  } catch (const DataError& e) {
    EXPECT_NE(std::string(e.what()).find("missing.txt"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("data.tokenizer_corpus"), std::string::npos) << e.what();
  }
  // A Config built in code with an unknown site: a ConfigError naming the key.
  two.data.tokenizer_site = "zeta";
  EXPECT_THROW(tokenizer_site(two), ConfigError);
}

// [7/7] data.source = "tensors": each site reads its own files; rows are held out by a hash
// of their number, and each worker keeps every workers-th of the rest.
TEST(SiteData, TensorFilesAreSplitBetweenValidationAndWorkersWithoutOverlap) {
  nebula::testing::TempDir dir("site_tensors");
  std::filesystem::create_directory(dir.file("b"));
  auto write = [&](const std::string& path, int64_t first, int64_t rows) {
    model::TensorFile f;
    f.tensors["inputs"] = at::arange(first, first + rows, at::kLong).unsqueeze(1).repeat({1, 3});
    f.tensors["targets"] = at::arange(first, first + rows, at::kFloat);
    model::save_safetensors(path, f);
  };
  write(dir.file("a.safetensors"), 0, 200);
  write(dir.file("b/part-1.safetensors"), 1000, 150);  // a site's shards, read in name order
  write(dir.file("b/part-2.safetensors"), 2000, 50);
  Config c = parse_config(str_cat("[model]\nkind = \"torchscript\"\nscript = \"m.pt\"\n[data]\nsource = \"tensors\"\n"
                                  "valid_fraction = 0.1\npath = \"", dir.path(), "\"\n[[sites]]\nname = \"a\"\n"
                                  "workers = 2\n[[sites]]\nname = \"b\"\n"),
                          "job.toml");
  std::set<int64_t> seen;
  int64_t valid = 0;
  for (int rank = 0; rank < 2; ++rank) {
    SiteTensors t = load_site_tensors(c, 0, rank, 2);
    EXPECT_EQ(t.files, std::vector<std::string>{dir.file("a.safetensors")});
    ASSERT_EQ(t.train_inputs.size(), 1u);
    EXPECT_TRUE(at::equal(t.train_inputs[0].select(1, 0).to(at::kFloat), t.train_targets));  // rows stay whole
    for (const at::Tensor& col : {t.train_targets, t.valid_targets})
      for (int64_t i = 0; i < col.size(0); ++i) EXPECT_TRUE(seen.insert(col[i].item<int64_t>()).second);
    valid += t.valid_targets.size(0);
    // The same rows every time.
    EXPECT_TRUE(at::equal(load_site_tensors(c, 0, rank, 2).valid_targets, t.valid_targets));
  }
  EXPECT_EQ(seen.size(), 200u);  // every row once, in one place
  EXPECT_GT(valid, 5);
  EXPECT_LT(valid, 40);
  SiteTensors b = load_site_tensors(c, 1, 0, 1);
  EXPECT_EQ(b.files.size(), 2u);
  EXPECT_EQ(b.train_rows() + b.valid_rows(), 200);
  const at::Tensor all_b = at::cat({b.train_targets, b.valid_targets});
  EXPECT_EQ(all_b.min().item<int64_t>(), 1000);  // both shards, nothing of site a
  EXPECT_EQ(all_b.max().item<int64_t>(), 2049);
}

// A model of several inputs: "inputs.0", "inputs.1", ... each split with the same rows.
TEST(SiteData, SeveralInputsAreSplitAlike) {
  nebula::testing::TempDir dir("site_tensors_multi");
  model::TensorFile f;
  f.tensors["inputs.0"] = at::arange(100, at::kLong).unsqueeze(1).repeat({1, 4});
  f.tensors["inputs.1"] = at::arange(100, at::kFloat) * 2;
  f.tensors["targets"] = at::arange(100, at::kFloat);
  model::save_safetensors(dir.file("a.safetensors"), f);
  Config c = parse_config(str_cat("[model]\nkind = \"torchscript\"\nscript = \"m.pt\"\n[data]\nsource = \"tensors\"\n"
                                  "valid_fraction = 0.2\npath = \"", dir.path(), "\"\n[[sites]]\nname = \"a\"\n"),
                          "job.toml");
  SiteTensors t = load_site_tensors(c, 0, 0, 1);
  ASSERT_EQ(t.train_inputs.size(), 2u);
  ASSERT_EQ(t.valid_inputs.size(), 2u);
  EXPECT_TRUE(at::equal(t.train_inputs[0].select(1, 0).to(at::kFloat), t.train_targets));
  EXPECT_TRUE(at::equal(t.train_inputs[1], t.train_targets * 2));
  EXPECT_TRUE(at::equal(t.valid_inputs[1], t.valid_targets * 2));
  EXPECT_EQ(t.train_rows() + t.valid_rows(), 100);
}

TEST(SiteData, BadTensorFilesNameTheFileAndWhatIsWrong) {
  nebula::testing::TempDir dir("site_tensors_bad");
  Config c = parse_config(str_cat("[model]\nkind = \"torchscript\"\nscript = \"m.pt\"\n[data]\nsource = \"tensors\"\n"
                                  "path = \"", dir.path(), "\"\n[[sites]]\nname = \"a\"\n"),
                          "job.toml");
  auto error = [&] {
    try {
      load_site_tensors(c, 0, 0, 1);
    } catch (const DataError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error().find("site 'a' has no tensor files: neither " + dir.file("a.safetensors")), std::string::npos)
      << error();
  model::TensorFile f;
  f.tensors["inputs"] = at::zeros({4, 2});
  model::save_safetensors(dir.file("a.safetensors"), f);
  EXPECT_NE(error().find(dir.file("a.safetensors") + ": no tensor \"targets\""), std::string::npos) << error();
  f.tensors["inputs.1"] = at::zeros({4, 2});  // "inputs" and numbered ones together
  f.tensors["targets"] = at::zeros({4});
  model::save_safetensors(dir.file("a.safetensors"), f);
  EXPECT_NE(error().find("this file has 2 tensor(s) named inputs*"), std::string::npos) << error();
  f.tensors.erase("inputs.1");
  f.tensors["targets"] = at::zeros({3});
  model::save_safetensors(dir.file("a.safetensors"), f);
  EXPECT_NE(error().find("\"inputs\" has 4 rows and \"targets\" 3"), std::string::npos) << error();
}

// Zero-shot transfer's splits: deterministic; held out by the English message; no training
// message appears among the evaluated texts in English or in any language (also when a
// catalog translates two messages alike); balanced classes; sites' slices are disjoint.
TEST(TransferSplits, NoTrainingMessageIsEvaluatedInAnyLanguage) {
  std::vector<data::PackageMessage> messages;
  for (int i = 0; i < 600; ++i) {
    data::PackageMessage m;
    m.en = "message number " + std::to_string(i);
    m.label = i % 3;
    m.translations["de"] = "Nachricht " + std::to_string(i);
    if (i % 2 == 0) m.translations["fr"] = "message n° " + std::to_string(i);
    messages.push_back(m);
  }
  // Two messages whose German translations coincide, and a translation equal to an English message.
  messages[10].translations["de"] = messages[11].translations["de"] = "Gleich";
  messages[12].translations["fr"] = messages[13].en;
  const std::vector<std::string> langs = {"de", "fr"};
  const TransferData a = split_transfer_messages(messages, langs, 3, 0.1, 0.3, 0, 1, 90);
  const TransferData b = split_transfer_messages(messages, langs, 3, 0.1, 0.3, 0, 1, 90);
  EXPECT_EQ(a.train, b.train);
  EXPECT_EQ(a.test, b.test);
  ASSERT_FALSE(a.train.empty());
  std::map<std::string, std::set<std::string>> trained;  // every text of a training message
  for (const auto& [en, label] : a.train) {
    EXPECT_EQ(data::split_of_sentence(en, 0.1, 0.3), data::Split::kTrain) << en;
    for (const auto& m : messages)
      if (m.en == en) {
        trained["en"].insert(en);
        for (const auto& [lang, text] : m.translations) trained[lang].insert(text);
      }
  }
  for (const auto& [slot, items] : a.test) {
    ASSERT_FALSE(items.empty()) << slot;
    std::map<int, int> per_label;
    for (const auto& [text, label] : items) {
      EXPECT_EQ(trained[slot].count(text) + trained["en"].count(text), 0u) << slot << ": '" << text << "' was trained on";
      ++per_label[label];
    }
    EXPECT_EQ(per_label.size(), 3u) << slot;
    for (const auto& [label, n] : per_label) EXPECT_EQ(n, per_label.begin()->second) << slot << " unbalanced";
    EXPECT_LE(items.size(), 90u);
  }
  std::map<int, int> train_labels;
  for (const auto& [en, label] : a.train) ++train_labels[label];
  for (const auto& [label, n] : train_labels) EXPECT_EQ(n, train_labels.begin()->second);
  // Two sites: disjoint slices of the messages.
  const TransferData s0 = split_transfer_messages(messages, langs, 3, 0.1, 0.3, 0, 2, 90);
  const TransferData s1 = split_transfer_messages(messages, langs, 3, 0.1, 0.3, 1, 2, 90);
  std::set<std::string> first;
  for (const auto& [en, label] : s0.train) first.insert(en);
  for (const auto& [en, label] : s1.train) EXPECT_EQ(first.count(en), 0u) << en;
  EXPECT_THROW(split_transfer_messages(messages, langs, 1, 0.1, 0.3, 0, 1, 90), Error);
}

// translate() decodes sentences in batches of similar length: each output is the sentence's
// own translation (as translating it alone), in the input's order.
TEST(Translate, BatchesByLengthAndAnswersInTheInputsOrder) {
  CorpusJob job;
  std::vector<std::string> text;
  for (const auto& p : make_pairs("de", 40)) text.insert(text.end(), {p.en, p.other});
  data::Tokenizer::train(text, job.dir.file("spm"), 30);
  const auto tok = data::Tokenizer::load(job.dir.file("spm.model"));
  ModelConfig c;
  c.dim = 16, c.layers = 1, c.heads = 2, c.ffn = 32, c.max_len = 24, c.dropout = 0;
  at::manual_seed(5);
  model::Seq2Seq m(c, 1, tok.vocab_size(), special_ids(tok));
  {
    at::NoGradGuard no_grad;
    for (auto& p : m->parameters())
      if (p.dim() == 2) p.normal_(0, 0.3);  // a random model whose output depends on its input
  }
  const std::vector<std::string> sentences = {"open file number 12 and more text here", "file", "",
                                              "number 3", "open the file number 1 2 3 4 5 6 7 8 9"};
  const auto batched = translate(*m, tok, sentences, /*beam=*/2, 0.6, /*batch_size=*/2);
  ASSERT_EQ(batched.size(), sentences.size());
  std::set<std::string> distinct;
  for (size_t i = 0; i < sentences.size(); ++i) {
    EXPECT_EQ(batched[i], translate(*m, tok, {sentences[i]}, 2, 0.6, 1).at(0)) << "sentence " << i;
    distinct.insert(batched[i]);
  }
  EXPECT_GT(distinct.size(), 2u) << ::testing::PrintToString(batched);  // different outputs, not one repeated
  EXPECT_THROW(translate(*m, tok, sentences, 2, 0.6, 0), Error);
}

}  // namespace
}  // namespace nebula::train
