// What a pre-training job measures besides its loss: cross-lingual MLM accuracy and parallel-
// sentence retrieval (model/xlingual.h) per language, on a site's own held-out pairs.
//
// Every site's gateway evaluates its own languages (data never leaves the site); the counts
// travel as numbers in the end-of-run totals, so summary.json has job-wide values per language.
// The slots are the job's languages as the config names them (sorted), then "en" (English
// MLM over every site's English sides); a job that names no languages has one slot "all".
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "model/mlm_encoder.h"
#include "model/xlingual.h"
#include "nebula/config.h"

namespace nebula::train {

class XlingualProbe {
 public:
  // Loads site `site`'s held-out pairs (at most eval.pairs per language) and tokenizes them.
  XlingualProbe(const Config& config, size_t site, const data::Tokenizer& tok, const model::SpecialIds& ids);

  // One evaluation: 4 counts per slot (MLM correct, MLM total, retrieval correct, retrieval
  // total); languages this site does not hold are zeros.
  std::vector<double> run(model::MlmEncoderImpl& model) const;
  // A metrics-line / summary object from counts (this site's, or summed over the job):
  // {"de": {"mlm_accuracy", "retrieval_accuracy", "pairs"}, ..., "en": {"mlm_accuracy"}}.
  static nlohmann::json to_json(const Config& config, const std::vector<double>& counts);

  // Counts per run() for a job of this config (the same on every worker).
  static size_t size(const Config& config) { return 4 * slot_names(config).size(); }
  static std::vector<std::string> slot_names(const Config& config);

 private:
  struct Slot {
    std::string name;
    std::vector<std::vector<int>> en, other;  // aligned pairs
  };
  std::vector<Slot> slots_;  // languages, then "en" (its `en` holds every English side)
  model::SpecialIds ids_;
  double mask_prob_;
  uint64_t seed_;
};

}  // namespace nebula::train
