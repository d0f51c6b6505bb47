// Which sentences a site (and each of its workers) trains on. Data never crosses sites: a site
// reads only its own languages (or its own slice) from its own files, and each worker takes
// every k-th sentence of its site's share.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "data/corpus.h"
#include "data/tokenizer.h"
#include "nebula/config.h"

namespace nebula::train {

struct SiteText {
  std::vector<data::SentencePair> train_pairs;  // this worker's share of the site's pairs
  std::vector<data::SentencePair> valid_pairs;
  std::vector<std::string> train;  // the sentences of those pairs, both sides (MLM is monolingual)
  // Likewise, less any text that is also a training sentence of the site (a name that is English
  // in one pair and a translation in another): MLM is scored on text it was not trained on.
  std::vector<std::string> valid;
  data::CorpusStats stats;
};

// The pairs of split `which` that the whole job (site == nullptr: every site's languages) or
// one site holds:
//  * source gettext / tsv / text: everything read, then split by data.valid_fraction and
//    data.test_fraction (data::assign_splits: by the hash of each pair's English sentence, the
//    same on every machine and site, so no sentence is in two splits of the job);
//  * source corpus: PATH/train.tsv, valid.tsv or test.tsv as `nebula corpus build` wrote them;
// then the site's languages (or, for a site without languages, its hash slice of the corpus),
// then the site's own cap (sites.N.max_pairs_per_language, training pairs only).
std::vector<data::SentencePair> load_pairs(const Config& config, const SiteConfig* site, data::Split which,
                                           data::CorpusStats* stats = nullptr);
// The site's training and validation pairs and sentences; worker `rank` of `workers` keeps
// every workers-th pair from its rank on.
SiteText load_site_text(const Config& config, size_t site_index, int rank, int workers);
// data.source = "tensors" (model.kind = "torchscript"): the site's own tensor files,
// DATA_PATH/<site>.safetensors or else every DATA_PATH/<site>/*.safetensors in name order, each
// holding "targets" and the model's inputs — one tensor "inputs", or "inputs.0", "inputs.1", ...
// (forward's arguments in that order) — all with the same number of rows (dimension 0).
// Row i (counted over the site's files) is held out when a hash of i falls below
// data.valid_fraction; worker `rank` of `workers` keeps every workers-th remaining row.
struct SiteTensors {
  std::vector<at::Tensor> train_inputs, valid_inputs;  // one tensor per model input
  at::Tensor train_targets;                             // this worker's share
  at::Tensor valid_targets;                             // its share of the held-out rows (may be 0)
  std::vector<std::string> files;
  int64_t train_rows() const { return train_targets.size(0); }
  int64_t valid_rows() const { return valid_targets.defined() ? valid_targets.size(0) : 0; }
};
SiteTensors load_site_tensors(const Config& config, size_t site_index, int rank, int workers);

// The site whose own data the job's vocabulary is trained on: data.tokenizer_site, else the
// first site with shareable = true, else the first site; nullptr when data.tokenizer_corpus
// (a shareable file) is given instead. Throws ConfigError for a tokenizer_site no site has.
const SiteConfig* tokenizer_site(const Config& config);
// The classifier's data (model.kind = "classifier", zero-shot cross-lingual transfer): English
// messages with their package labels to train and validate on, and held-out messages in
// English and in each of data.languages to evaluate on.
struct TransferData {
  using Labelled = std::vector<std::pair<std::string, int>>;  // (text, label)
  Labelled train, valid;                                     // English only
  std::map<std::string, Labelled> test;                      // "en" and each language
};

// Splits `messages` (data::read_package_messages) as a job does, deterministically:
//  * by the English message (data::split_of_sentence with valid/test fractions): a message
//    and all its translations are in one split, the same one the pre-training corpus put its
//    English sentence in (so the pre-trained encoder never trained on an evaluated message);
//  * with several sites, site `site` of `sites` keeps the messages of its hash slice (each
//    site evaluates its slice; the job sums the counts);
//  * an evaluated text equal to a training message or to a training message's translation in
//    the same language is dropped (catalogs translate different messages alike), so no English
//    training message appears, in any language, among the evaluated ones;
//  * balanced: every package keeps as many training messages as the smallest one, and as many
//    evaluated messages per language as the smallest one there, at most test_per_language /
//    packages; chance is then 1 / packages everywhere. Picks are hash-ordered, not alphabetical.
TransferData split_transfer_messages(const std::vector<data::PackageMessage>& messages,
                                     const std::vector<std::string>& languages, size_t packages,
                                     double valid_fraction, double test_fraction, size_t site, size_t sites,
                                     size_t test_per_language);
// read_package_messages from the config's catalogs, then split_transfer_messages for `site`.
TransferData load_transfer_data(const Config& config, size_t site);

// Trains the job's shared SentencePiece vocabulary into `model_prefix` (.model/.vocab) on the
// training split of tokenizer_site's data only, or on the lines of data.tokenizer_corpus: never
// on another site's text. The vocabulary then goes to every site (its pieces reveal frequent
// substrings of that text). Deterministic: the same data gives the same bytes.
void train_tokenizer(const Config& config, const std::string& model_prefix);
// BOS + pieces (truncated) + EOS, at most max_len ids per sentence.
std::vector<std::vector<int>> encode_all(const data::Tokenizer& tok, const std::vector<std::string>& sentences,
                                         int64_t max_len);
// Translation-LM sequences (XLM): BOS + en + EOS + other + EOS per pair with both sides, each
// side cut to (max_len - 3) / 2 pieces so that the pair fits in max_len. Pairs without an
// other side (text sources) give none.
std::vector<std::vector<int>> encode_tlm(const data::Tokenizer& tok, const std::vector<data::SentencePair>& pairs,
                                         int64_t max_len);

}  // namespace nebula::train
