// Which sentences a site (and each of its workers) trains on. Data never crosses sites: a site
// reads only its own languages (or its own slice) from its own files, and each worker takes
// every k-th sentence of its site's share.
#pragma once

#include <string>
#include <vector>

#include "data/corpus.h"
#include "data/tokenizer.h"
#include "nebula/config.h"

namespace nebula::train {

struct SiteText {
  std::vector<std::string> train;  // sentences (both sides of every pair: MLM is monolingual)
  std::vector<std::string> valid;
  data::CorpusStats stats;
};

// The parallel pairs the whole job (site == nullopt) or one site trains on.
std::vector<data::SentencePair> load_pairs(const Config& config, const SiteConfig* site, data::CorpusStats* stats);
// The site's sentences split into train / valid; worker `rank` of `workers` keeps its share.
SiteText load_site_text(const Config& config, size_t site_index, int rank, int workers);
// Trains the job's shared SentencePiece vocabulary into `model_prefix` (.model/.vocab).
void train_tokenizer(const Config& config, const std::string& model_prefix);
// BOS + pieces (truncated) + EOS, at most max_len ids per sentence.
std::vector<std::vector<int>> encode_all(const data::Tokenizer& tok, const std::vector<std::string>& sentences,
                                         int64_t max_len);

}  // namespace nebula::train
