#include "app/demo.h"

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>

#include "data/corpus.h"
#include "eval/bleu.h"
#include "eval/plot.h"
#include "nebula/config.h"
#include "nebula/error.h"
#include "nebula/units.h"
#include "launch/launcher.h"
#include "train/metrics.h"
#include "app/report.h"

namespace nebula::app {
namespace fs = std::filesystem;
namespace {

constexpr int kStages = 8;

void banner(int stage, const std::string& what) {
  std::printf("\n\033[1m[%d/%d] %s\033[0m\n", stage, kStages, what.c_str());
  std::fflush(stdout);
}

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (!in || j.is_discarded()) throw DataError(str_cat(path, ": missing or unreadable (did the stage finish?)"));
  return j;
}

// Training loss per site (the gateways' lines), as chart series labelled "<prefix><site>".
std::vector<eval::Series> loss_series(const std::string& run_dir, const std::string& prefix) {
  std::map<std::string, eval::Series> by_site;
  for (const auto& j : train::read_metrics(run_dir + "/metrics.jsonl"))
    if (j.contains("loss") && j.value("rank", -1) == 0) {
      auto& s = by_site[j["site"]];
      s.label = prefix + j["site"].get<std::string>();
      s.points.emplace_back(j.value("step", 0.0), j.value("loss", 0.0));
    }
  std::vector<eval::Series> out;
  for (auto& [site, s] : by_site) out.push_back(std::move(s));
  return out;
}

// Retrieval accuracy per language over the steps of the run (each site evaluates its own).
std::vector<eval::Series> retrieval_series(const std::string& run_dir, const std::string& prefix) {
  std::map<std::string, eval::Series> by_lang;
  for (const auto& j : train::read_metrics(run_dir + "/metrics.jsonl")) {
    if (!j.contains("eval")) continue;
    for (auto& [lang, e] : j["eval"].items())
      if (e.contains("retrieval_accuracy")) {
        by_lang[lang].label = prefix + lang;
        by_lang[lang].points.emplace_back(j.value("step", 0.0), 100 * e.value("retrieval_accuracy", 0.0));
      }
  }
  std::vector<eval::Series> out;
  for (auto& [lang, s] : by_lang) out.push_back(std::move(s));
  return out;
}

// translations-<site>.tsv (source, reference, translation per line, after a header line).
struct Translations {
  std::vector<std::string> sources, references, hypotheses;
};
Translations read_translations(const std::string& path) {
  Translations t;
  size_t line_no = 0;
  for (const std::string& line : data::read_lines(path)) {
    ++line_no;
    if (line.empty() || (line_no == 1 && line.rfind("# source", 0) == 0)) continue;  // the header (a sentence may start with "# ")
    const size_t a = line.find('\t'), b = a == std::string::npos ? a : line.find('\t', a + 1);
    if (b == std::string::npos || line.find('\t', b + 1) != std::string::npos)
      throw DataError(str_cat(path, ":", line_no, ": expected source<TAB>reference<TAB>translation"));
    t.sources.push_back(line.substr(0, a));
    t.references.push_back(line.substr(a + 1, b - a - 1));
    t.hypotheses.push_back(line.substr(b + 1));
  }
  return t;
}

// One translation run's BLEU against another's on the same test sentences of `site` (the
// system's minus the baseline's, with its paired-bootstrap interval).
eval::PairedBootstrap bootstrap_runs(const std::string& baseline_dir, const std::string& system_dir,
                                     const std::string& site) {
  const Translations base = read_translations(str_cat(baseline_dir, "/translations-", site, ".tsv"));
  const Translations sys = read_translations(str_cat(system_dir, "/translations-", site, ".tsv"));
  if (base.sources != sys.sources || base.references != sys.references)
    throw DataError(str_cat(baseline_dir, " and ", system_dir, ": the two runs translated different test sentences (",
                            base.sources.size(), " and ", sys.sources.size(), "); they cannot be compared pairwise"));
  eval::BootstrapOptions o;
  o.bleu.smoothing = eval::BleuSmoothing::kExp;  // as the task's own BLEU
  return eval::paired_bootstrap(base.hypotheses, sys.hypotheses, base.references, o);
}

nlohmann::json bootstrap_json(const eval::PairedBootstrap& b) {
  return {{"delta", b.delta}, {"low", b.low}, {"high", b.high}, {"segments", b.segments}, {"samples", b.samples},
          {"system_better", b.system_better}};
}

int run_stage(const Config& c, const DemoOptions& o) {
  const int rc = launch::run_local(c, {o.executable});
  if (rc != 0) spdlog::error("demo stage {} failed (exit code {}); its logs are in {}/logs", c.job.name, rc, c.job.run_dir);
  return rc;
}

std::string pct(double v) {
  char b[32];
  std::snprintf(b, sizeof b, "%.1f%%", 100 * v);
  return b;
}
std::string fixed(double v, int digits) {
  char b[32];
  std::snprintf(b, sizeof b, "%.*f", digits, v);
  return b;
}

// The pre-training's controller decisions as a list: the moves, and the rounds that stayed counted
// (each is in the run's summary.json). Empty without decisions.
std::string decisions_markdown(const nlohmann::json& summary, const std::string& run_dir) {
  if (!summary.contains("decisions") || summary["decisions"].empty()) return "";
  std::string md = "\nThe controller's decisions (each round's codec and H from then on, and why):\n\n";
  int stayed = 0;
  for (const auto& d : summary["decisions"]) {
    const std::string line = d.get<std::string>();
    if (line.find("; stays") != std::string::npos) {
      ++stayed;
    } else {
      md += str_cat("- ", line, "\n");
    }
  }
  if (stayed > 0)
    md += str_cat("- and ", stayed, " rounds that stayed at the setting in use on their measured merge gaps (", run_dir,
                  "/summary.json has each)\n");
  return md;
}

}  // namespace

int run_demo(const DemoOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string run = o.run_dir;
  fs::create_directories(run);
  const bool q = o.quick;

  // 1. Corpus: this machine's gettext catalogs → deduplicated, split English↔X pairs.
  banner(1, "corpora: English-X pairs from this machine's gettext catalogs (pre-training; translation)");
  data::CorpusBuildOptions co;
  co.languages = {"de", "es", "fr", "it"};
  co.max_pairs_per_language = q ? 300 : 3000;
  data::Corpus corpus = data::build_corpus(co);
  data::write_corpus(run + "/corpus", corpus, co);
  std::fputs(data::format_corpus_stats(corpus, co).c_str(), stdout);
  // Translation (en→de) gets its own, larger corpus: the teacher's site holds all of it.
  data::CorpusBuildOptions mo = co;
  mo.languages = {"de"};
  mo.max_pairs_per_language = q ? 600 : 40000;
  data::Corpus mt_corpus = data::build_corpus(mo);
  data::write_corpus(run + "/corpus-de", mt_corpus, mo);
  std::fputs(data::format_corpus_stats(mt_corpus, mo).c_str(), stdout);

  // 2. Multilingual pre-training on two sites (different languages each) over the emulated WAN.
  std::vector<std::string> sets = {"job.run_dir=\"" + run + "/pretrain\"", "data.source=\"corpus\"",
                                   "data.path=\"" + run + "/corpus\""};
  if (q) sets.insert(sets.end(), {"job.steps=20", "job.log_every=5", "eval.every=10", "eval.pairs=30", "model.warmup_steps=2"});
  sets.insert(sets.end(), o.overrides.begin(), o.overrides.end());
  Config pre = parse_config(o.pretrain_config, "examples/demo.toml", sets);
  banner(2, str_cat("pre-training: MLM + TLM", pre.data.contrastive_weight > 0 ? " + contrastive alignment" : "", " on ",
                    pre.sites[0].name, " (", pre.sites[0].languages.size(),
                    " languages) and ", pre.sites[1].name, ", ", pre.job.steps, " steps, strategy ", pre.strategy.kind,
                    " with codec ", pre.strategy.codec, ", over ", format_rate_bits(pre.wan.path.bandwidth_bits), " / ",
                    std::chrono::duration_cast<std::chrono::milliseconds>(pre.wan.path.rtt).count(), " ms"));
  if (int rc = run_stage(pre, o)) return rc;
  const std::string tokenizer = pre.job.run_dir + "/tokenizer.model";

  // 3. The baseline: the same job, steps, data and seed with synchronous data parallel, so the
  // two are compared at equal tokens. Its bytes and losses do not depend on the link (every
  // step exchanges the same gradients), so it runs over an unlimited one and takes less time.
  // Sync at its own best learning rate, as tuned as the strategy: bench/frontier.sh's sweep on
  // this job (2,000 steps: lr 1e-3 5.264, 2e-3 5.008, 4e-3 4.856) puts it at twice the
  // strategy's inner rate; at the inner rate itself, sync made diloco look 3 % better than it is.
  Config sync = pre;
  sync.job.name = "demo-sync";
  sync.job.run_dir = run + "/pretrain-sync";
  sync.strategy = StrategyConfig{};  // sync, no codec
  sync.model.lr = 2 * pre.model.lr;
  sync.wan.path = WanPathConfig{};
  sync.wan.pairs.clear();
  sync.data.tokenizer = tokenizer;
  banner(3, str_cat("baseline: the same ", sync.job.steps, " steps with synchronous data parallel at lr ", sync.model.lr,
                    ", its best (every step's gradients over the WAN; an unlimited link)"));
  if (int rc = run_stage(sync, o)) return rc;

  // 4. Zero-shot cross-lingual transfer (examples/transfer.toml): a package classifier trained
  // on English messages alone, on the pre-trained encoder and on a random one, both scored on
  // held-out translations in the pre-training languages.
  Config xfer = parse_config(o.transfer_config, "examples/transfer.toml",
                             {"data.tokenizer=\"" + tokenizer + "\"", "model.init=\"" + pre.job.run_dir + "/model.safetensors\"",
                              "job.run_dir=\"" + run + "/transfer\""});
  if (q) {
    xfer.job.steps = 20;
    xfer.model.warmup_steps = 2;
    xfer.job.log_every = 5;
    xfer.eval.every = 0;
    xfer.eval.pairs = 40;
  }
  banner(4, str_cat("zero-shot transfer: which of ", xfer.data.packages.size(),
                    " packages a message is from, trained on English only, scored in ",
                    xfer.data.languages.size(), " languages; the pre-trained encoder, then a random one"));
  if (int rc = run_stage(xfer, o)) return rc;
  Config xfer_random = xfer;
  xfer_random.job.name = "transfer-random";
  xfer_random.job.run_dir = run + "/transfer-random";
  xfer_random.model.init.clear();
  if (int rc = run_stage(xfer_random, o)) return rc;

  // 5–7. Translation (examples/demo_mt.toml): the teacher on site A, then the student on site
  // B with and without distillation from it. The teacher trains the translation vocabulary on
  // its site's pairs (RUN/teacher/tokenizer.model); the students use it too.
  Config mt = parse_config(o.translate_config, "examples/demo_mt.toml",
                           {"data.path=\"" + run + "/corpus-de\"",
                            "data.tokenizer=\"" + run + "/teacher/tokenizer.model\"",
                            "distill.teacher=\"" + run + "/teacher/model.safetensors\""});
  if (q) {
    mt.job.steps = 20;
    mt.job.log_every = 5;
    mt.eval.pairs = 20;
    mt.eval.beam = 2;
    mt.data.vocab_size = 1000;  // a quick corpus is too small for more pieces
    mt.model.warmup_steps = 2;
    mt.sites[1].max_pairs_per_language = 150;
  }
  Config teacher = mt;
  teacher.job.name = "demo-teacher";
  teacher.job.run_dir = run + "/teacher";
  teacher.job.steps = q ? 20 : 3 * mt.job.steps;  // three times the student's
  teacher.sites = {mt.sites[0]};
  teacher.distill = DistillConfig{};
  teacher.data.tokenizer.clear();  // trained on this (single-site) job's training pairs
  banner(5, str_cat("teacher: en->", mt.data.languages[0], " trained on all of ", teacher.sites[0].name, "'s pairs with a ",
                    mt.data.vocab_size, "-piece vocabulary of its own, ", teacher.job.steps, " steps"));
  if (int rc = run_stage(teacher, o)) return rc;

  Config kd = mt;
  kd.job.name = "demo-student-kd";
  kd.job.run_dir = run + "/student-kd";
  banner(6, str_cat("student with distillation: trains on ", kd.sites[1].name, " (", kd.sites[1].max_pairs_per_language,
                    " pairs at most), asks the teacher on ", kd.sites[0].name, " for its top-", kd.distill.top_k,
                    " over the WAN"));
  if (int rc = run_stage(kd, o)) return rc;

  Config alone = mt;
  alone.job.name = "demo-student";
  alone.job.run_dir = run + "/student";
  alone.sites = {mt.sites[1]};
  alone.distill = DistillConfig{};
  banner(7, "student without distillation (the baseline): the same site, data, steps and seed");
  if (int rc = run_stage(alone, o)) return rc;

  // 8. PEFT (examples/demo_mt.toml + [peft]): the teacher adapted further on both sites' pairs
  // with sync, once fully and once with LoRA, the same steps and batches: what crosses the WAN
  // is each step's gradient of the trainable values only. Like the sync baseline, over an
  // unlimited link: the bytes and the losses do not depend on it.
  Config full = mt;
  full.job.name = "demo-peft-full";
  full.job.run_dir = run + "/peft-full";
  full.job.steps = q ? 10 : mt.job.steps / 2;
  full.distill = DistillConfig{};
  full.strategy = StrategyConfig{};  // sync: every step's gradients cross the WAN
  full.wan.path = WanPathConfig{};
  full.wan.pairs.clear();
  full.model.init = teacher.job.run_dir + "/model.safetensors";
  full.model.lr = mt.model.lr / 2;
  full.peft = PeftConfig{};
  Config lora = full;
  lora.job.name = "demo-peft-lora";
  lora.job.run_dir = run + "/peft-lora";
  lora.peft.kind = "lora";
  lora.peft.rank = 8;
  lora.model.lr = mt.model.lr;  // twice full fine-tuning's, as usual for LoRA: its update starts at zero, low-rank
  banner(8, str_cat("PEFT: the teacher adapted on both sites' pairs with sync (an unlimited link), ", full.job.steps,
                    " steps, fully and then with LoRA rank ", lora.peft.rank, " (only its values cross the WAN)"));
  if (int rc = run_stage(full, o)) return rc;
  if (int rc = run_stage(lora, o)) return rc;

  // The summary: one table and three charts.
  const auto s_pre = read_json(pre.job.run_dir + "/summary.json"), s_sync = read_json(sync.job.run_dir + "/summary.json"),
             s_teacher = read_json(teacher.job.run_dir + "/summary.json"),
             s_kd = read_json(kd.job.run_dir + "/summary.json"), s_alone = read_json(alone.job.run_dir + "/summary.json");
  const double sync_bytes = s_sync.value("wan_bytes", 0.0), pre_bytes = s_pre.value("wan_bytes", 0.0);
  auto bleu = [](const nlohmann::json& s) { return s["eval"].value("bleu", 0.0); };
  auto val = [](const nlohmann::json& s) { return s["final_val_loss"].is_number() ? s["final_val_loss"].get<double>() : 0.0; };
  const auto& d = s_kd["distill"];

  std::string md = "# nebula demo summary\n\n";
  md += str_cat("Corpora: pre-training ", corpus.train.size(), " / ", corpus.valid.size(), " / ", corpus.test.size(),
                " train / valid / test pairs (de, es, fr, it; ", run, "/corpus); translation ", mt_corpus.train.size(),
                " / ", mt_corpus.valid.size(), " / ", mt_corpus.test.size(), " (en→de; ", run, "/corpus-de).\n\n");

  // Pre-training: diloco against sync at equal tokens, quality next to bytes.
  const double reduction = sync_bytes / std::max(1.0, pre_bytes);
  const double loss_cost = val(s_pre) - val(s_sync);
  md += str_cat("## Pre-training: ", s_pre.value("strategy", "?"), " against sync, the same ", pre.job.steps,
                " steps on 2 sites\n\n");
  const double loss_cost_pct = val(s_sync) > 0 ? 100 * loss_cost / val(s_sync) : 0.0;
  md += str_cat("**", s_pre.value("strategy", "?"), " sent ", fixed(reduction, 0), "× fewer WAN bytes than sync; its "
                "validation loss is ", fixed(val(s_pre), 3), " against ", fixed(val(s_sync), 3), " for sync (",
                loss_cost >= 0 ? "+" : "", fixed(loss_cost, 3), ", ", loss_cost >= 0 ? "+" : "", fixed(loss_cost_pct, 2),
                " %)**, at equal tokens; sync at lr ", sync.model.lr, ", its best, the strategy's inner steps at ",
                pre.model.lr, ".\n\n");
  md += str_cat("| | ", s_pre.value("strategy", "?"), " | sync |\n|---|---|---|\n");
  md += str_cat("| tokens | ", fixed(s_pre.value("tokens", 0.0), 0), " | ", fixed(s_sync.value("tokens", 0.0), 0), " |\n");
  md += str_cat("| WAN bytes | ", format_bytes(pre_bytes), " | ", format_bytes(sync_bytes), " |\n");
  md += str_cat("| validation loss | ", fixed(val(s_pre), 3), " | ", fixed(val(s_sync), 3), " |\n");
  md += str_cat("| wall time | ", fixed(s_pre.value("wall_seconds", 0.0), 1), " s | ",
                fixed(s_sync.value("wall_seconds", 0.0), 1), " s (unlimited link) |\n");
  // Held-out probes, start → end, each on the run's final (merged) model; chance is 1/N.
  auto probe = [&](const nlohmann::json& s, const std::string& lang, const char* key) {
    const auto& end = s["eval"];
    if (!end.contains(lang) || !end[lang].contains(key)) return std::string("–");
    const auto& st = s.contains("eval_start") && s["eval_start"].contains(lang) ? s["eval_start"][lang] : end[lang];
    return str_cat(pct(st.value(key, 0.0)), " → ", pct(end[lang].value(key, 0.0)));
  };
  for (auto& [lang, e] : s_pre["eval"].items()) {
    md += str_cat("| ", lang, " MLM accuracy | ", probe(s_pre, lang, "mlm_accuracy"), " | ",
                  probe(s_sync, lang, "mlm_accuracy"), " |\n");
    if (e.contains("retrieval_accuracy"))
      md += str_cat("| ", lang, " retrieval (", e.value("pairs", 0.0), " pairs, chance ",
                    pct(1 / std::max(1.0, e.value("pairs", 1.0))), ") | ", probe(s_pre, lang, "retrieval_accuracy"),
                    " | ", probe(s_sync, lang, "retrieval_accuracy"), " |\n");
  }
  md += decisions_markdown(s_pre, pre.job.run_dir);
  md += "\n";

  // Zero-shot transfer: accuracy per language, pre-trained encoder against random.
  const auto s_xfer = read_json(xfer.job.run_dir + "/summary.json"),
             s_xfer_random = read_json(xfer_random.job.run_dir + "/summary.json");
  auto acc = [](const nlohmann::json& s, const std::string& lang) {
    return s["eval"].contains(lang) ? s["eval"][lang].value("accuracy", 0.0) : 0.0;
  };
  md += str_cat("## Zero-shot cross-lingual transfer\n\nWhich of ", xfer.data.packages.size(),
                " software packages a message comes from (chance ", pct(1.0 / double(xfer.data.packages.size())),
                "), a linear probe trained on English messages only (", xfer.job.steps,
                " steps), scored on held-out messages that no training message shares in any language:\n\n"
                "| held out | pre-trained encoder | × English | random encoder |\n|---|---|---|---|\n");
  nlohmann::json transfer_summary = nlohmann::json::object();
  for (const std::string& lang : std::vector<std::string>{"en", "de", "es", "fr", "it"}) {
    if (!s_xfer["eval"].contains(lang)) continue;
    const double ratio = acc(s_xfer, "en") > 0 ? acc(s_xfer, lang) / acc(s_xfer, "en") : 0.0;
    md += str_cat("| ", lang, " (", fixed(s_xfer["eval"][lang].value("messages", 0.0), 0), " messages) | ",
                  pct(acc(s_xfer, lang)), " | ", lang == "en" ? "–" : fixed(ratio, 2), " | ", pct(acc(s_xfer_random, lang)),
                  " |\n");
    transfer_summary[lang] = {{"pretrained", acc(s_xfer, lang)}, {"random", acc(s_xfer_random, lang)},
                              {"vs_english", ratio}, {"messages", s_xfer["eval"][lang].value("messages", 0.0)}};
  }
  md += "\n";

  // Translation: the two students saw the same batches in the same order (batch_seed is keyed by
  // the site's name); the difference of their BLEU on the whole test split, with its noise.
  const auto boot = bootstrap_runs(alone.job.run_dir, kd.job.run_dir, mt.sites[1].name);
  md += "## Translation\n\n| model | BLEU | validation loss |\n|---|---|---|\n";
  md += str_cat("| teacher (", teacher.sites[0].name, ", ", teacher.job.steps, " steps) | ", fixed(bleu(s_teacher), 2), " | ",
                fixed(val(s_teacher), 3), " |\n");
  md += str_cat("| student without distillation (", alone.sites[0].name, ", ", alone.job.steps, " steps) | ",
                fixed(bleu(s_alone), 2), " | ", fixed(val(s_alone), 3), " |\n");
  md += str_cat("| student with distillation (the same batches) | ", fixed(bleu(s_kd), 2), " | ", fixed(val(s_kd), 3),
                " |\n");
  md += str_cat("\nDistillation changed the student's BLEU by ", boot.delta >= 0 ? "+" : "", fixed(boot.delta, 2),
                " (95% paired-bootstrap interval ", fixed(boot.low, 2), " to ", fixed(boot.high, 2), ", ", boot.samples,
                " resamples of ", boot.segments, " test sentences; better in ", pct(boot.system_better),
                " of them) and its validation loss by ", fixed(val(s_kd) - val(s_alone), 3), ". The teacher sent ",
                d.value("tokens", 0), " tokens' top-", mt.distill.top_k, " at ", fixed(d.value("bytes_per_token", 0.0), 1),
                " bytes/token against ", fixed(d.value("fp32_logits_bytes_per_token", 0.0), 0), " for fp32 logits (",
                fixed(d.value("reduction_vs_fp32_logits", 0.0), 0), "× less); the student waited ",
                fixed(d.value("wait_seconds", 0.0), 2), " s for it in all.\n");
  md += str_cat("\nBLEU: sacreBLEU-compatible corpus BLEU (13a tokenization, exp smoothing), beam ", mt.eval.beam, ", on ",
                s_kd["eval"].value("sentences", 0.0), " en→", mt.data.languages[0], " test pairs.\n");

  // PEFT against full fine-tuning: BLEU on the teacher site's whole test split, WAN bytes.
  const auto s_full = read_json(full.job.run_dir + "/summary.json"), s_lora = read_json(lora.job.run_dir + "/summary.json");
  const auto peft_boot = bootstrap_runs(full.job.run_dir, lora.job.run_dir, full.sites[0].name);
  auto site_bleu = [](const std::string& dir, const std::string& site) {
    const Translations t = read_translations(str_cat(dir, "/translations-", site, ".tsv"));
    eval::BleuOptions o;
    o.smoothing = eval::BleuSmoothing::kExp;
    return eval::corpus_bleu(t.hypotheses, t.references, o).score;
  };
  const double full_bleu = site_bleu(full.job.run_dir, full.sites[0].name),
               lora_bleu = site_bleu(lora.job.run_dir, full.sites[0].name);
  const double full_bytes = s_full.value("wan_bytes", 0.0), lora_bytes = s_lora.value("wan_bytes", 0.0);
  auto trainable = [](const nlohmann::json& s) { return s.contains("trainable_parameters") ? s["trainable_parameters"].get<double>() : 0.0; };
  md += str_cat("\n## PEFT: adapting the teacher on both sites\n\nThe teacher fine-tuned further on ", full.sites[0].name,
                "'s and ", full.sites[1].name, "'s pairs with sync, ", full.job.steps, " steps on the same batches (lr ",
                full.model.lr, " full, ", lora.model.lr, " LoRA); BLEU on ", full.sites[0].name, "'s test split (beam ",
                mt.eval.beam, "):\n\n"
                "| | full fine-tuning | LoRA r = ", lora.peft.rank, " |\n|---|---|---|\n");
  md += str_cat("| trainable values | ", fixed(trainable(s_full), 0), " | ", fixed(trainable(s_lora), 0), " |\n");
  md += str_cat("| WAN bytes | ", format_bytes(full_bytes), " | ", format_bytes(lora_bytes), " (",
                fixed(full_bytes / std::max(1.0, lora_bytes), 1), "× fewer) |\n");
  md += str_cat("| BLEU | ", fixed(full_bleu, 2), " | ", fixed(lora_bleu, 2), " |\n");
  md += str_cat("| validation loss | ", fixed(val(s_full), 3), " | ", fixed(val(s_lora), 3), " |\n");
  md += str_cat("\nLoRA minus full fine-tuning: ", peft_boot.delta >= 0 ? "+" : "", fixed(peft_boot.delta, 2),
                " BLEU (95% paired-bootstrap interval ", fixed(peft_boot.low, 2), " to ", fixed(peft_boot.high, 2), ", ",
                peft_boot.segments, " test sentences).\n\n");

  eval::ChartOptions loss_chart{"Pre-training loss per site", "step", "training loss (MLM + TLM)"};
  auto series = loss_series(pre.job.run_dir, "");
  for (auto& s : loss_series(sync.job.run_dir, "sync: ")) series.push_back(std::move(s));
  eval::write_line_chart(run + "/pretrain_loss.svg", series, loss_chart);
  eval::ChartOptions retrieval_chart{"Parallel-sentence retrieval (held-out pairs)", "step", "accuracy (%)"};
  retrieval_chart.y_from_zero = true;
  auto retrieval = retrieval_series(pre.job.run_dir, "");
  for (auto& r : retrieval_series(sync.job.run_dir, "sync: ")) retrieval.push_back(std::move(r));
  eval::write_line_chart(run + "/retrieval.svg", retrieval, retrieval_chart);
  auto mt_series = loss_series(teacher.job.run_dir, "teacher ");
  for (auto& s : loss_series(alone.job.run_dir, "student ")) mt_series.push_back(std::move(s));
  for (auto& s : loss_series(kd.job.run_dir, "student + KD ")) mt_series.push_back(std::move(s));
  eval::write_line_chart(run + "/translation_loss.svg", mt_series,
                         {"Translation training loss (with KD: (1-a)·CE + a·KD)", "step", "training loss"});
  md += str_cat("\nCharts: ", run, "/pretrain_loss.svg, ", run, "/retrieval.svg, ", run, "/translation_loss.svg\n");
  // Every stage side by side (`nebula report`): charts, a page and TensorBoard event files.
  const auto report = write_report({pre.job.run_dir, sync.job.run_dir, xfer.job.run_dir, xfer_random.job.run_dir,
                                    teacher.job.run_dir, kd.job.run_dir, alone.job.run_dir, full.job.run_dir,
                                    lora.job.run_dir},
                                   run + "/report");
  md += str_cat("Report of every stage: ", report.files.back(), "; TensorBoard: tensorboard --logdir ", run,
                "/report/tensorboard (", report.event_files.size(), " event files)\n");
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  md += str_cat("\nThe whole demo took ", fixed(seconds, 0), " s.\n");

  nlohmann::json summary = {{"quick", q},
                            {"seconds", seconds},
                            {"corpus_pairs", {corpus.train.size(), corpus.valid.size(), corpus.test.size()}},
                            {"translation_corpus_pairs", {mt_corpus.train.size(), mt_corpus.valid.size(), mt_corpus.test.size()}},
                            {"pretrain", s_pre},
                            {"pretrain_sync", s_sync},
                            {"wan_reduction_vs_sync", reduction},
                            {"val_loss_cost_vs_sync", loss_cost},
                            {"transfer", transfer_summary},
                            {"teacher_bleu", bleu(s_teacher)},
                            {"student_bleu", bleu(s_alone)},
                            {"student_kd_bleu", bleu(s_kd)},
                            {"distill", d},
                            {"distill_bleu_bootstrap", bootstrap_json(boot)},
                            {"peft", {{"full", {{"bleu", full_bleu},
                                                {"wan_bytes", full_bytes},
                                                {"trainable_parameters", trainable(s_full)},
                                                {"final_val_loss", val(s_full)}}},
                                      {"lora", {{"bleu", lora_bleu},
                                                {"wan_bytes", lora_bytes},
                                                {"trainable_parameters", trainable(s_lora)},
                                                {"final_val_loss", val(s_lora)}}},
                                      {"wan_reduction", full_bytes / std::max(1.0, lora_bytes)},
                                      {"bleu_bootstrap", bootstrap_json(peft_boot)}}}};
  train::write_json_atomically(run + "/summary.json", summary);
  {
    std::ofstream out(run + "/summary.md");
    out << md;
  }
  std::printf("\n%s\nwritten: %s/summary.md, %s/summary.json\n", md.c_str(), run.c_str(), run.c_str());
  return 0;
}

}  // namespace nebula::app
