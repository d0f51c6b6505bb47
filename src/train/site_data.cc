#include "train/site_data.h"

#include <spdlog/spdlog.h>

#include <ATen/ATen.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <set>
#include <string_view>

#include "model/safetensors.h"
#include "nebula/error.h"

namespace nebula::train {
namespace {

std::vector<std::string> site_languages(const Config& c, const SiteConfig* site) {
  if (site && !site->languages.empty()) return site->languages;
  return c.data.languages;
}

void add_sides(const std::vector<data::SentencePair>& pairs, std::vector<std::string>& out) {
  for (const auto& p : pairs) {
    out.push_back(p.en);
    out.push_back(p.other);
  }
}

}  // namespace

namespace {

std::vector<std::string> job_or_site_languages(const Config& c, const SiteConfig* site) {
  if (site) return site_languages(c, site);
  std::set<std::string> all(c.data.languages.begin(), c.data.languages.end());  // the whole job: every site's
  for (const auto& s : c.sites) all.insert(s.languages.begin(), s.languages.end());
  return {all.begin(), all.end()};
}

// What data.source holds for these languages: every pair (gettext, tsv, text), or the one
// split file of a corpus directory.
std::vector<data::SentencePair> read_source_unchecked(const Config& c, const std::vector<std::string>& langs,
                                                      data::Split which, data::CorpusStats* stats) {
  if (c.data.source == "gettext") {
    data::CorpusOptions o;
    o.locale_dir = c.data.path;
    o.languages = langs;
    o.max_pairs_per_language = static_cast<size_t>(c.data.max_pairs_per_language);
    return data::build_gettext_corpus(o, stats);
  }
  if (c.data.source == "tsv") return data::select_languages(data::read_tsv_file(c.data.path, "xx"), langs);
  std::vector<data::SentencePair> pairs;
  if (c.data.source == "text") {  // monolingual lines, carried as pairs with an empty other side
    for (auto& line : data::read_text_file(c.data.path)) pairs.push_back({"text", std::move(line), ""});
    return pairs;
  }
  static const char* kFiles[] = {"train.tsv", "valid.tsv", "test.tsv"};  // corpus: as `nebula corpus build` wrote it
  // (corpus build already chose its pairs: data.max_pairs_per_language is for gettext)
  return data::select_languages(data::read_tsv_file(c.data.path + "/" + kFiles[static_cast<int>(which)], "xx"), langs);
}

// read_source_unchecked, with a data error completed by where the path comes from and what
// the source expects there (the reader's message already names the file, and line if any).
std::vector<data::SentencePair> read_source(const Config& c, const std::vector<std::string>& langs, data::Split which,
                                            data::CorpusStats* stats) {
  try {
    return read_source_unchecked(c, langs, which, stats);
  } catch (const DataError& e) {
    const char* expects =
        c.data.source == "gettext" ? "a locale directory holding LANG/LC_MESSAGES/*.mo"
        : c.data.source == "tsv"   ? "a UTF-8 file of lang<TAB>en<TAB>other lines"
        : c.data.source == "text"  ? "a UTF-8 file of one sentence per line"
                                   : "the directory `nebula corpus build --out DIR` wrote (train.tsv, valid.tsv, test.tsv)";
    throw DataError(str_cat(e.what(), " [data.path = \"", c.data.path, "\" in ", c.source_path, ": data.source = \"",
                            c.data.source, "\" reads ", expects, "]"));
  }
}

// read_source's pairs → split `which` of the site (or the job).
std::vector<data::SentencePair> narrow(const Config& c, const SiteConfig* site, data::Split which,
                                       std::vector<data::SentencePair> pairs) {
  if (c.data.source != "corpus") pairs = data::filter_split(pairs, which, c.data.valid_fraction, c.data.test_fraction);
  // A site without its own languages gets its own slice of the corpus.
  if (site && site->languages.empty() && c.sites.size() > 1) {
    size_t index = static_cast<size_t>(site - c.sites.data());
    pairs = data::take_slice(pairs, index, c.sites.size());
  }
  if (site && which == data::Split::kTrain)
    data::cap_per_language(pairs, static_cast<size_t>(site->max_pairs_per_language));
  if (pairs.empty() && which == data::Split::kTrain)
    throw DataError(str_cat(c.source_path, ": ", site ? "site '" + site->name + "'" : std::string("the job"),
                            " has no training sentences from data.source = \"", c.data.source, "\", data.path = \"",
                            c.data.path, "\"; check [data] and the site's languages"));
  return pairs;
}

}  // namespace

std::vector<data::SentencePair> load_pairs(const Config& c, const SiteConfig* site, data::Split which,
                                           data::CorpusStats* stats) {
  return narrow(c, site, which, read_source(c, job_or_site_languages(c, site), which, stats));
}

SiteText load_site_text(const Config& c, size_t site_index, int rank, int workers) {
  SiteText out;
  const SiteConfig* site = &c.sites[site_index];
  auto share = [&](std::vector<data::SentencePair> v) {
    std::vector<data::SentencePair> mine;
    for (size_t i = static_cast<size_t>(rank); i < v.size(); i += static_cast<size_t>(workers))
      mine.push_back(std::move(v[i]));
    return mine;
  };
  const auto langs = job_or_site_languages(c, site);
  auto all = read_source(c, langs, data::Split::kTrain, &out.stats);  // corpus: train.tsv only
  out.valid_pairs = share(narrow(c, site, data::Split::kValid,
                                 c.data.source == "corpus" ? read_source(c, langs, data::Split::kValid, nullptr) : all));
  const auto site_train = narrow(c, site, data::Split::kTrain, std::move(all));
  // The splits keep each sentence of a language in one split; a text can still be English in
  // one pair and a translation in another ("Parameter", names): the site leaves such texts out
  // of its MLM validation sentences (all its workers alike: against the site's whole train).
  std::set<std::string_view> site_train_text;
  for (const auto& p : site_train) site_train_text.insert({p.en, p.other});
  out.train_pairs = share(site_train);
  add_sides(out.train_pairs, out.train);
  add_sides(out.valid_pairs, out.valid);
  out.valid.erase(std::remove_if(out.valid.begin(), out.valid.end(),
                                 [&](const std::string& s) { return site_train_text.count(s) > 0; }),
                  out.valid.end());
  for (auto* v : {&out.train, &out.valid}) v->erase(std::remove(v->begin(), v->end(), std::string()), v->end());
  if (out.train.empty())
    throw DataError(str_cat("site '", c.sites[site_index].name, "' worker ", rank, ": no training sentences"));
  return out;
}

SiteTensors load_site_tensors(const Config& c, size_t site_index, int rank, int workers) {
  namespace fs = std::filesystem;
  const std::string& site = c.sites[site_index].name;
  const std::string one = c.data.path + "/" + site + ".safetensors", dir = c.data.path + "/" + site;
  const std::string where = str_cat("[data.path = \"", c.data.path, "\" in ", c.source_path, "]");
  SiteTensors out;
  if (fs::is_regular_file(one)) {
    out.files.push_back(one);
  } else if (fs::is_directory(dir)) {
    for (const auto& e : fs::directory_iterator(dir))
      if (e.path().extension() == ".safetensors") out.files.push_back(e.path().string());
    std::sort(out.files.begin(), out.files.end());
  }
  if (out.files.empty())
    throw DataError(str_cat("site '", site, "' has no tensor files: neither ", one, " nor ", dir,
                            "/*.safetensors exists ", where, "; write them as examples/torchscript/export.py does"));
  // Per file: its model inputs ("inputs", or "inputs.0", "inputs.1", ...) and its targets.
  std::vector<std::vector<at::Tensor>> inputs;  // [input][file]
  std::vector<at::Tensor> targets;              // [file]
  for (const auto& f : out.files) {
    model::TensorFile file = model::load_safetensors(f);
    std::vector<std::pair<std::string, at::Tensor>> xs;
    if (file.tensors.count("inputs")) xs.emplace_back("inputs", file.tensors["inputs"]);
    for (size_t k = 0; file.tensors.count(str_cat("inputs.", k)); ++k)
      xs.emplace_back(str_cat("inputs.", k), file.tensors[str_cat("inputs.", k)]);
    size_t named = 0;  // every tensor whose name starts with "inputs" must be one of those
    for (const auto& [name, t] : file.tensors) named += name.rfind("inputs", 0) == 0;
    if (xs.empty() || named != xs.size() || (xs.size() > 1 && xs[0].first == "inputs"))
      throw DataError(str_cat(f, ": the model's inputs are one tensor \"inputs\", or several \"inputs.0\", "
                              "\"inputs.1\", ... numbered from 0 without gaps (forward's arguments in that order); "
                              "this file has ", named, " tensor(s) named inputs* ", where));
    if (!file.tensors.count("targets") || file.tensors["targets"].dim() == 0)
      throw DataError(str_cat(f, ": no tensor \"targets\" with a row dimension: a tensor file holds the inputs and "
                              "\"targets\", one example per row (dimension 0) ", where));
    const at::Tensor& y = file.tensors["targets"];
    if (!inputs.empty() && (xs.size() != inputs.size() || !y.sizes().slice(1).equals(targets[0].sizes().slice(1)) ||
                            y.scalar_type() != targets[0].scalar_type()))
      throw DataError(str_cat(f, ": rows of another shape or dtype, or another number of inputs, than in ",
                              out.files[0], ": every file of a site must hold the same kind of rows"));
    inputs.resize(xs.size());
    for (size_t k = 0; k < xs.size(); ++k) {
      const auto& [name, x] = xs[k];
      if (x.dim() == 0 || x.size(0) != y.size(0))
        throw DataError(str_cat(f, ": \"", name, "\" has ", x.dim() ? x.size(0) : 0, " rows and \"targets\" ",
                                y.size(0), ": give one target row per input row"));
      if (!inputs[k].empty() && (!x.sizes().slice(1).equals(inputs[k][0].sizes().slice(1)) ||
                                 x.scalar_type() != inputs[k][0].scalar_type()))
        throw DataError(str_cat(f, ": \"", name, "\" has rows of another shape or dtype than in ", out.files[0],
                                ": every file of a site must hold the same kind of rows"));
      inputs[k].push_back(x);
    }
    targets.push_back(y);
  }
  std::vector<at::Tensor> x;  // each input over all the files
  for (const auto& per_file : inputs) x.push_back(at::cat(per_file));
  const at::Tensor y = at::cat(targets);
  // Held out by a hash of the row number: the same rows on every machine and every run.
  std::vector<int64_t> train_rows, valid_rows;
  for (int64_t i = 0; i < y.size(0); ++i) {
    uint64_t h = static_cast<uint64_t>(i) + 0x9e3779b97f4a7c15ull;  // splitmix64
    h = (h ^ (h >> 30)) * 0xbf58476d1ce4e5b9ull;
    h = (h ^ (h >> 27)) * 0x94d049bb133111ebull;
    h ^= h >> 31;
    auto& rows = static_cast<double>(h >> 11) / 9007199254740992.0 < c.data.valid_fraction ? valid_rows : train_rows;
    if (rows.size() % static_cast<size_t>(workers) == static_cast<size_t>(rank)) rows.push_back(i);
    else rows.push_back(-1 - i);  // another worker's row: counted, not kept
  }
  auto keep = [&](const std::vector<int64_t>& rows, std::vector<at::Tensor>& xs, at::Tensor& ys) {
    std::vector<int64_t> mine;
    for (int64_t r : rows) if (r >= 0) mine.push_back(r);
    const at::Tensor index = at::tensor(mine, at::kLong);
    for (const auto& input : x) xs.push_back(input.index_select(0, index));
    ys = y.index_select(0, index);
  };
  keep(train_rows, out.train_inputs, out.train_targets);
  keep(valid_rows, out.valid_inputs, out.valid_targets);
  if (out.train_rows() == 0)
    throw DataError(str_cat("site '", site, "' worker ", rank, " of ", workers, ": no training rows in ",
                            out.files[0], out.files.size() > 1 ? " and the other files" : "", " (", y.size(0),
                            " rows in all)"));
  return out;
}

const SiteConfig* tokenizer_site(const Config& c) {
  if (!c.data.tokenizer_corpus.empty()) return nullptr;
  if (!c.data.tokenizer_site.empty()) {
    for (const auto& s : c.sites)
      if (s.name == c.data.tokenizer_site) return &s;
    // load_config checks this; a Config built in code reaches here.
    throw ConfigError(str_cat(c.source_path, ": key 'data.tokenizer_site': no site named '", c.data.tokenizer_site,
                              "' in [[sites]]: name the site whose own data the vocabulary is trained on"));
  }
  NEBULA_CHECK(!c.sites.empty(), c.source_path, ": a job without sites has no data to train a vocabulary on");
  for (const auto& s : c.sites)
    if (s.shareable) return &s;  // its pairs may leave it anyway
  return &c.sites.front();
}

void train_tokenizer(const Config& c, const std::string& model_prefix) {
  std::vector<std::string> sentences;
  std::string from;
  if (const SiteConfig* site = tokenizer_site(c)) {
    add_sides(load_pairs(c, site, data::Split::kTrain), sentences);
    from = str_cat("the training data of site '", site->name, "' only (data.tokenizer_site",
                   c.data.tokenizer_site.empty() ? ", by default" : "", ")");
  } else {
    try {
      sentences = data::read_text_file(c.data.tokenizer_corpus);
    } catch (const DataError& e) {
      throw DataError(str_cat(e.what(), " [data.tokenizer_corpus in ", c.source_path,
                              ": a UTF-8 file of one sentence per line that every site may see]"));
    }
    from = str_cat(c.data.tokenizer_corpus, " (data.tokenizer_corpus)");
  }
  sentences.erase(std::remove(sentences.begin(), sentences.end(), std::string()), sentences.end());
  spdlog::info("training a {}-piece SentencePiece vocabulary on {} sentences of {}; every site gets it",
               c.data.vocab_size, sentences.size(), from);
  data::Tokenizer::train(sentences, model_prefix, static_cast<int>(c.data.vocab_size));
}

std::vector<std::vector<int>> encode_all(const data::Tokenizer& tok, const std::vector<std::string>& sentences,
                                         int64_t max_len) {
  std::vector<std::vector<int>> out;
  out.reserve(sentences.size());
  for (const auto& s : sentences) {
    std::vector<int> ids{tok.bos_id()};
    auto pieces = tok.encode(s);
    const size_t room = static_cast<size_t>(max_len) - 2;
    if (pieces.size() > room) pieces.resize(room);
    ids.insert(ids.end(), pieces.begin(), pieces.end());
    ids.push_back(tok.eos_id());
    out.push_back(std::move(ids));
  }
  return out;
}

std::vector<std::vector<int>> encode_tlm(const data::Tokenizer& tok, const std::vector<data::SentencePair>& pairs,
                                         int64_t max_len) {
  const size_t side = static_cast<size_t>(std::max<int64_t>(1, (max_len - 3) / 2));
  std::vector<std::vector<int>> out;
  for (const auto& p : pairs) {
    if (p.en.empty() || p.other.empty()) continue;
    auto en = tok.encode(p.en), other = tok.encode(p.other);
    if (en.size() > side) en.resize(side);
    if (other.size() > side) other.resize(side);
    std::vector<int> ids{tok.bos_id()};
    ids.insert(ids.end(), en.begin(), en.end());
    ids.push_back(tok.eos_id());
    ids.insert(ids.end(), other.begin(), other.end());
    ids.push_back(tok.eos_id());
    out.push_back(std::move(ids));
  }
  return out;
}

namespace {
constexpr uint64_t kTransferSliceSalt = 0x7472736c6963ULL;  // "trslic": sites' slices of the messages
constexpr uint64_t kTransferPickSalt = 0x747270696bULL;     // "trpik": which messages a cap keeps

// At most `per_class` of each label's entries (hash order), and no more than the rarest label
// has: balanced classes.
TransferData::Labelled balanced(const TransferData::Labelled& in, size_t classes, size_t per_class_cap) {
  std::vector<TransferData::Labelled> by_label(classes);
  for (const auto& e : in) by_label[static_cast<size_t>(e.second)].push_back(e);
  size_t per_class = per_class_cap;
  for (auto& v : by_label) {
    std::sort(v.begin(), v.end(), [](const auto& a, const auto& b) {
      return std::pair(data::sentence_hash(a.first, kTransferPickSalt), a.first) <
             std::pair(data::sentence_hash(b.first, kTransferPickSalt), b.first);
    });
    per_class = std::min(per_class, v.size());
  }
  TransferData::Labelled out;
  for (const auto& v : by_label) out.insert(out.end(), v.begin(), v.begin() + static_cast<std::ptrdiff_t>(per_class));
  return out;
}
}  // namespace

TransferData split_transfer_messages(const std::vector<data::PackageMessage>& messages,
                                     const std::vector<std::string>& languages, size_t packages,
                                     double valid_fraction, double test_fraction, size_t site, size_t sites,
                                     size_t test_per_language) {
  NEBULA_CHECK(packages >= 2 && sites >= 1 && site < sites, "transfer split: ", packages, " packages, site ", site,
               " of ", sites);
  TransferData out;
  TransferData::Labelled test_en;
  std::map<std::string, TransferData::Labelled> test_other;
  // Texts a training message has, per language ("en": the message itself).
  std::map<std::string, std::set<std::string>> trained;
  std::vector<const data::PackageMessage*> held_out;
  for (const auto& m : messages) {
    NEBULA_CHECK(m.label >= 0 && static_cast<size_t>(m.label) < packages, "message '", m.en, "' has label ", m.label,
                 " of ", packages, " packages");
    if (sites > 1 && data::sentence_hash(m.en, kTransferSliceSalt) % sites != site) continue;
    switch (data::split_of_sentence(m.en, valid_fraction, test_fraction)) {
      case data::Split::kTrain:
        out.train.emplace_back(m.en, m.label);
        break;
      case data::Split::kValid:
        out.valid.emplace_back(m.en, m.label);
        break;
      case data::Split::kTest:
        held_out.push_back(&m);
        break;
    }
  }
  out.train = balanced(out.train, packages, SIZE_MAX);
  // What the kept training messages are, in every language (a translation counts even in a
  // language this job does not evaluate: it is text the classifier saw the meaning of).
  std::set<std::string> train_en;
  for (const auto& [en, label] : out.train) train_en.insert(en);
  for (const auto& m : messages)
    if (train_en.count(m.en)) {
      trained["en"].insert(m.en);
      for (const auto& [lang, text] : m.translations) trained[lang].insert(text);
    }
  const size_t per_class = std::max<size_t>(1, test_per_language / packages);
  auto seen = [&](const std::string& lang, const std::string& text) {
    auto it = trained.find(lang);
    return trained["en"].count(text) > 0 || (it != trained.end() && it->second.count(text) > 0);
  };
  for (const auto* m : held_out) {
    if (!seen("en", m->en)) test_en.emplace_back(m->en, m->label);
    for (const std::string& lang : languages)
      if (auto t = m->translations.find(lang); t != m->translations.end() && !seen(lang, t->second))
        test_other[lang].emplace_back(t->second, m->label);
  }
  out.test["en"] = balanced(test_en, packages, per_class);
  for (const std::string& lang : languages) out.test[lang] = balanced(test_other[lang], packages, per_class);
  return out;
}

TransferData load_transfer_data(const Config& c, size_t site) {
  const auto messages = data::read_package_messages(c.data.path, c.data.packages, c.data.languages);
  return split_transfer_messages(messages, c.data.languages, c.data.packages.size(), c.data.valid_fraction,
                                 c.data.test_fraction, site, c.sites.size(), static_cast<size_t>(c.eval.pairs));
}

}  // namespace nebula::train
