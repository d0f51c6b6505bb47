#include "train/evaluation.h"

#include <set>

#include "data/corpus.h"
#include "train/site_data.h"

namespace nebula::train {

std::vector<std::string> XlingualProbe::slot_names(const Config& c) {
  std::set<std::string> named(c.data.languages.begin(), c.data.languages.end());
  for (const auto& s : c.sites) named.insert(s.languages.begin(), s.languages.end());
  std::vector<std::string> out(named.begin(), named.end());
  if (out.empty()) out.push_back("all");
  out.push_back("en");
  return out;
}

XlingualProbe::XlingualProbe(const Config& c, size_t site, const data::Tokenizer& tok, const model::SpecialIds& ids)
    : ids_(ids), mask_prob_(c.data.mask_prob), seed_(c.job.seed ^ 0xe7a1) {
  for (const auto& name : slot_names(c)) slots_.push_back({name, {}, {}});
  const bool named = slots_.front().name != "all";

  auto pairs = load_pairs(c, &c.sites[site], data::Split::kValid);
  data::cap_per_language(pairs, static_cast<size_t>(c.eval.pairs));
  for (const auto& p : pairs) {
    if (p.en.empty() || p.other.empty()) continue;
    Slot* slot = named ? nullptr : &slots_[0];
    for (size_t i = 0; !slot && i + 1 < slots_.size(); ++i)
      if (slots_[i].name == p.lang) slot = &slots_[i];
    if (!slot) continue;  // a language the config does not name (e.g. from a TSV file)
    auto en = encode_all(tok, {p.en}, c.model.max_len), other = encode_all(tok, {p.other}, c.model.max_len);
    slot->en.push_back(en[0]);
    slot->other.push_back(other[0]);
    slots_.back().en.push_back(en[0]);
  }
}

std::vector<double> XlingualProbe::run(model::MlmEncoderImpl& model) const {
  std::vector<double> counts;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& s = slots_[i];
    const bool english = i + 1 == slots_.size();
    const auto mlm = model::mlm_accuracy(model, english ? s.en : s.other, ids_, mask_prob_, seed_);
    const auto retrieval = english ? model::Accuracy{} : model::retrieval_accuracy(model, s.en, s.other, ids_.pad);
    for (int64_t v : {mlm.correct, mlm.total, retrieval.correct, retrieval.total}) counts.push_back(static_cast<double>(v));
  }
  return counts;
}

nlohmann::json XlingualProbe::to_json(const Config& config, const std::vector<double>& counts) {
  nlohmann::json out = nlohmann::json::object();
  const auto names = slot_names(config);
  for (size_t i = 0; i < names.size(); ++i) {
    const double* c = &counts.at(4 * i);
    if (c[1] == 0 && c[3] == 0) continue;  // not held here
    nlohmann::json j = {{"mlm_accuracy", c[1] > 0 ? c[0] / c[1] : 0.0}};
    if (c[3] > 0) {
      j["retrieval_accuracy"] = c[2] / c[3];
      j["pairs"] = c[3] / 2;
    }
    out[names[i]] = j;
  }
  return out;
}

}  // namespace nebula::train
