#include "train/site_data.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <set>

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

std::vector<data::SentencePair> load_pairs(const Config& c, const SiteConfig* site, data::CorpusStats* stats) {
  std::vector<data::SentencePair> pairs;
  std::vector<std::string> langs = site_languages(c, site);
  if (c.data.source == "gettext") {
    if (!site) {  // the whole job: every site's languages
      std::set<std::string> all(c.data.languages.begin(), c.data.languages.end());
      for (const auto& s : c.sites) all.insert(s.languages.begin(), s.languages.end());
      langs.assign(all.begin(), all.end());
    }
    data::CorpusOptions o;
    o.locale_dir = c.data.path;
    o.languages = langs;
    o.max_pairs_per_language = static_cast<size_t>(c.data.max_pairs_per_language);
    pairs = data::build_gettext_corpus(o, stats);
  } else if (c.data.source == "tsv") {
    pairs = data::read_tsv_file(c.data.path, "xx");
    if (site && !site->languages.empty()) pairs = data::select_languages(pairs, site->languages);
  } else {  // text: monolingual lines, carried as pairs with an empty other side
    for (auto& line : data::read_text_file(c.data.path)) pairs.push_back({"text", std::move(line), ""});
  }
  // A site without its own languages gets its own slice of the corpus.
  if (site && site->languages.empty() && c.sites.size() > 1) {
    size_t index = static_cast<size_t>(site - c.sites.data());
    pairs = data::take_slice(pairs, index, c.sites.size());
  }
  if (pairs.empty())
    throw DataError(str_cat(c.source_path, ": ", site ? "site '" + site->name + "'" : std::string("the job"),
                            " has no sentences from data.source = \"", c.data.source, "\", data.path = \"",
                            c.data.path, "\"; check [data] and the site's languages"));
  return pairs;
}

SiteText load_site_text(const Config& c, size_t site_index, int rank, int workers) {
  SiteText out;
  auto pairs = load_pairs(c, &c.sites[site_index], &out.stats);
  std::vector<std::string> train, valid;
  add_sides(data::filter_split(pairs, data::Split::kTrain, c.data.valid_fraction, 0.0), train);
  add_sides(data::filter_split(pairs, data::Split::kValid, c.data.valid_fraction, 0.0), valid);
  auto keep_share = [&](std::vector<std::string>& v) {
    v.erase(std::remove(v.begin(), v.end(), std::string()), v.end());
    std::vector<std::string> mine;
    for (size_t i = static_cast<size_t>(rank); i < v.size(); i += static_cast<size_t>(workers)) mine.push_back(v[i]);
    v = std::move(mine);
  };
  keep_share(train);
  keep_share(valid);
  if (train.empty())
    throw DataError(str_cat("site '", c.sites[site_index].name, "' worker ", rank, ": no training sentences"));
  return {std::move(train), std::move(valid), out.stats};
}

void train_tokenizer(const Config& c, const std::string& model_prefix) {
  data::CorpusStats stats;
  auto pairs = load_pairs(c, nullptr, &stats);
  std::vector<std::string> sentences;
  add_sides(data::filter_split(pairs, data::Split::kTrain, c.data.valid_fraction, 0.0), sentences);
  sentences.erase(std::remove(sentences.begin(), sentences.end(), std::string()), sentences.end());
  spdlog::info("training a {}-piece SentencePiece vocabulary on {} sentences", c.data.vocab_size, sentences.size());
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

}  // namespace nebula::train
