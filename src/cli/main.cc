// nebula: the command line. The only place that reads argv and turns exceptions into
// one-line messages and exit codes.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <string>

#include "cli/demo_config.h"
#include "util/allocator.h"
#include "data/corpus.h"
#include "eval/bleu.h"
#include "nebula/config.h"
#include "nebula/error.h"
#include "nebula/placement.h"
#include "nebula/log.h"
#include "plan/plan.h"
#include "model/safetensors.h"
#include "app/demo.h"
#include "launch/launcher.h"
#include "train/translate.h"
#include "app/report.h"
#include "train/site_data.h"
#include "train/worker.h"
#include "transport/certs.h"

namespace {

std::string self_executable() {
  std::error_code ec;
  auto p = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) throw nebula::Error("cannot find the nebula executable (/proc/self/exe): " + ec.message());
  return p.string();
}

// The first of these environment variables that is set, else nullptr.
// A fraction option of `nebula corpus build`: in [0, 1], else a ConfigError naming it.
void check_fraction(const char* option, double value) {
  if (!(value >= 0 && value <= 1))
    throw nebula::ConfigError(nebula::str_cat(option, " = ", value, " is not a fraction in [0, 1]"));
}

}  // namespace

int main(int argc, char** argv) {
  nebula::tune_allocator();  // jemalloc as it is; under glibc, large buffers reused (util/allocator.h)
  CLI::App app{"nebula: train one model across several sites joined by a slow WAN"};
  app.require_subcommand(1);

  std::string config_path;
  std::vector<std::string> overrides;
  auto* run = app.add_subcommand("run", "Run a job in local mode: every worker of every site as a process here");
  run->add_option("config", config_path, "Job config (TOML)")->required()->check(CLI::ExistingFile);
  run->add_option("--set", overrides, "Override a config key, e.g. --set job.steps=20 (repeatable)")
      ->allow_extra_args(false);
  bool resume = false;
  run->add_flag("--resume", resume, "Continue from the newest checkpoints in [checkpoint] dir (the same config)");

  std::string site_name;
  std::string rank_text;
  auto* worker = app.add_subcommand("worker", "Run one worker process of a deployed job");
  worker->add_option("config", config_path, "Job config (TOML)")->required()->check(CLI::ExistingFile);
  worker->add_option("--site", site_name, "This worker's site (default: $NEBULA_SITE)");
  worker->add_option("--rank", rank_text, "Rank inside the site; 0 is the gateway (default: $LOCAL_RANK)");
  worker->add_option("--set", overrides, "Override a config key (repeatable)")->allow_extra_args(false);
  worker->add_flag("--resume", resume, "Continue from this worker's newest checkpoint (every worker of the job must)");
  bool rejoin = false;
  worker->add_flag("--rejoin", rejoin,
                   "This site was lost and the others went on (job.elastic): resume it and join them again");

  std::string tokenizer_out;
  auto* tokenizer = app.add_subcommand(
      "tokenizer", "Train the job's SentencePiece vocabulary on one site's own training data (data.tokenizer_site) "
                   "or on data.tokenizer_corpus; in a deployment run it on that site, then copy the file to every site "
                   "and set data.tokenizer");
  tokenizer->add_option("config", config_path, "Job config (TOML)")->required()->check(CLI::ExistingFile);
  tokenizer->add_option("--out", tokenizer_out,
                        "The .model file to write (default: data.tokenizer, else RUN_DIR/tokenizer.model)");
  tokenizer->add_option("--set", overrides, "Override a config key (repeatable)")->allow_extra_args(false);

  std::string demo_dir = "runs/demo";
  bool demo_quick = false;
  auto* demo = app.add_subcommand(
      "demo", "The whole story on this machine: corpus, two-site multilingual pre-training over an emulated WAN, "
              "cross-site distilled translation, evaluation, summary and charts");
  demo->add_option("--run-dir", demo_dir, "Where the demo writes its stages (default: runs/demo)");
  demo->add_option("--set", overrides, "Override a key of the pre-training config, examples/demo.toml (repeatable)")
      ->allow_extra_args(false);
  demo->add_flag("--quick", demo_quick, "A tiny version of every stage (a minute or two; for tests)");

  std::string certs_dir;
  int days = 0;
  auto* certs = app.add_subcommand("certs", "Make the certificates for mutual TLS between sites");
  certs->require_subcommand(1);
  auto* certs_init = certs->add_subcommand("init", "Create a site CA in DIR (ca.pem, ca.key)");
  certs_init->add_option("dir", certs_dir, "Directory for the CA")->required();
  certs_init->add_option("--days", days, "Validity in days (default 3650)");
  auto* certs_issue = certs->add_subcommand("issue", "Issue DIR/NAME.pem and DIR/NAME.key for one site, signed by DIR's CA");
  certs_issue->add_option("dir", certs_dir, "Directory holding the CA")->required();
  certs_issue->add_option("--site", site_name, "The site's name, as in [[sites]] name")->required();
  std::string job_name;
  certs_issue->add_option("--job", job_name,
                          "The job's name, as in [job] name: the certificate is good for that job only")
      ->required();
  certs_issue->add_option("--days", days, "Validity in days (default 825)");
  int host_workers = 0;
  certs_issue->add_option("--workers", host_workers,
                          "Also one certificate per host, for ranks 0 .. N-1 (DIR/hosts/SITE/RANK.pem; "
                          "wan.mode = \"every_worker\" with security.host_certs = true)")
      ->check(CLI::Range(1, 1 << 16));

  std::string topology_path;
  bool plan_json = false;
  size_t plan_top = 0;
  auto* plan = app.add_subcommand(
      "plan", "Predict step time, WAN bytes, compute utilization and memory per worker of each strategy and codec "
              "for a topology, and recommend one that nebula can run and that fits (see examples/plan_*.toml)");
  plan->add_option("topology", topology_path, "Topology (TOML): [model], [[sites]], [wan], [candidates], [planner]")
      ->required()
      ->check(CLI::ExistingFile);
  plan->add_option("--set", overrides, "Override a topology key, e.g. --set wan.bandwidth='\"10Gbit\"' (repeatable)")
      ->allow_extra_args(false);
  plan->add_flag("--json", plan_json, "Print the same as JSON");
  plan->add_option("--top", plan_top, "Show only the best N rows of the table (default: all)");

  nebula::data::CorpusBuildOptions corpus_opt;
  std::string corpus_out;
  auto* corpus = app.add_subcommand("corpus", "Parallel corpora for the NLP workloads");
  corpus->require_subcommand(1);
  auto* corpus_build = corpus->add_subcommand(
      "build", "Build a deduplicated English-X corpus with deterministic train/valid/test splits: "
               "OUT/train.tsv, valid.tsv, test.tsv (lang<TAB>en<TAB>other) and OUT/stats.json");
  corpus_build->add_option("--source", corpus_opt.source, "gettext (this machine's catalogs), tsv or text")
      ->check(CLI::IsMember({"gettext", "tsv", "text"}))
      ->capture_default_str();
  corpus_build->add_option("--path", corpus_opt.path,
                           "gettext: the locale directory (default /usr/share/locale); tsv, text: the file");
  corpus_build->add_option("--languages", corpus_opt.languages, "Languages to keep, e.g. de,fr (default: all found)")
      ->delimiter(',');
  corpus_build->add_option("--max-pairs-per-language", corpus_opt.max_pairs_per_language,
                           "Keep at most N pairs per language, a fixed hash-chosen subset (default 0: all)");
  corpus_build->add_option("--valid-fraction", corpus_opt.valid_fraction, "Share of pairs in valid.tsv")
      ->capture_default_str();
  corpus_build->add_option("--test-fraction", corpus_opt.test_fraction, "Share of pairs in test.tsv")
      ->capture_default_str();
  corpus_build->add_option("--out", corpus_out, "Output directory (created)")->required();

  std::string hyp_path;
  std::vector<std::string> ref_paths;
  std::string bleu_smooth = "none";
  std::string bleu_tokenize = "13a";
  auto* bleu = app.add_subcommand(
      "bleu", "Corpus BLEU of translations against references, as sacreBLEU computes it (13a tokenization)");
  bleu->add_option("hypotheses", hyp_path, "The translations, one sentence per line")
      ->required()
      ->check(CLI::ExistingFile);
  bleu->add_option("references", ref_paths,
                   "The reference translations, line by line with the hypotheses (several files: several "
                   "references per sentence)")
      ->required()
      ->check(CLI::ExistingFile);
  bleu->add_option("--smooth", bleu_smooth, "Smoothing: none, exp (sacreBLEU's default) or floor (0.1)")
      ->check(CLI::IsMember({"none", "exp", "floor"}))
      ->capture_default_str();
  bleu->add_option("--tokenize", bleu_tokenize, "13a, or none for text that is already tokenized")
      ->check(CLI::IsMember({"13a", "none"}))
      ->capture_default_str();

  std::string model_path, tokenizer_override, input_path;
  int64_t beam = 4;
  auto* translate = app.add_subcommand(
      "translate", "Translate English sentences (one per line, from --input or stdin) with a seq2seq model");
  translate->add_option("model", model_path, "A seq2seq job's RUN_DIR/model.safetensors")
      ->required()
      ->check(CLI::ExistingFile);
  translate->add_option("--tokenizer", tokenizer_override,
                        "The SentencePiece model (default: the one recorded in the model file)");
  translate->add_option("--beam", beam, "Beam width (1 = greedy)")->check(CLI::Range(1, 64))->capture_default_str();
  translate->add_option("--input", input_path, "A file of sentences (default: stdin)")->check(CLI::ExistingFile);
  double length_penalty = 0.6;
  translate->add_option("--length-penalty", length_penalty,
                        "The beam's length normalisation alpha (as [eval] length_penalty; larger = longer)")
      ->check(CLI::Range(0.0, 10.0))
      ->capture_default_str();

  std::vector<std::string> report_runs;
  std::string report_out;
  auto* report = app.add_subcommand("report",
                                    "Charts (SVG), an HTML page and TensorBoard event files of finished runs, side by "
                                    "side (tensorboard --logdir OUT/tensorboard)");
  report->add_option("runs", report_runs, "Run directories (RUN_DIR of each job)")->required()->check(CLI::ExistingDirectory);
  report->add_option("--out", report_out, "Where to write them (default: FIRST_RUN/report)");

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);  // --help
    // A wrong command line is a config error: one line naming the option, exit 2.
    std::fprintf(stderr, "nebula: %s (see --help)\n", e.what());
    return 2;
  }
  nebula::init_logging("nebula");
  try {
    if (*run) {
      nebula::Config c = nebula::load_config(config_path, overrides);
      return nebula::launch::run_local(c, {self_executable(), resume});
    }
    if (*tokenizer) {
      nebula::Config c = nebula::load_config(config_path, overrides);
      if (c.model.kind == "torchscript")
        throw nebula::ConfigError(config_path + ": model.kind = \"torchscript\" trains on tensor files: no vocabulary");
      std::string out = !tokenizer_out.empty() ? tokenizer_out
                        : !c.data.tokenizer.empty() ? c.data.tokenizer
                                                    : c.job.run_dir + "/tokenizer.model";
      const std::string suffix = ".model";
      if (out.size() <= suffix.size() || out.compare(out.size() - suffix.size(), suffix.size(), suffix) != 0)
        throw nebula::ConfigError(out + ": a SentencePiece model file ends in .model (its .vocab is written beside it)");
      const std::filesystem::path parent = std::filesystem::path(out).parent_path();
      if (!parent.empty()) std::filesystem::create_directories(parent);
      nebula::train::train_tokenizer(c, out.substr(0, out.size() - suffix.size()));
      const nebula::SiteConfig* from = nebula::train::tokenizer_site(c);
      std::printf("wrote %s, trained on %s; copy it to every site and set data.tokenizer = \"%s\"\n", out.c_str(),
                  from ? ("the training data of site '" + from->name + "' only").c_str() : c.data.tokenizer_corpus.c_str(),
                  out.c_str());
      return 0;
    }
    if (*demo) {
      nebula::app::DemoOptions o;
      o.run_dir = demo_dir;
      o.quick = demo_quick;
      o.executable = self_executable();
      o.pretrain_config = nebula::kDemoConfig;
      o.translate_config = nebula::kDemoMtConfig;
      o.transfer_config = nebula::kTransferConfig;
      o.overrides = overrides;
      return nebula::app::run_demo(o);
    }
    if (*plan) {
      nebula::plan::Topology t = nebula::plan::load_topology(topology_path, overrides);
      nebula::plan::Plan p = nebula::plan::make_plan(t);
      std::fputs((plan_json ? nebula::plan::format_json(t, p) : nebula::plan::format_table(t, p, plan_top)).c_str(),
                 stdout);
      return 0;
    }
    if (*certs_init) {
      std::filesystem::create_directories(certs_dir);
      nebula::transport::create_ca(certs_dir, days > 0 ? days : 3650);
      std::printf("created %s/ca.pem and %s/ca.key (keep ca.key offline; copy ca.pem to every site)\n",
                  certs_dir.c_str(), certs_dir.c_str());
      return 0;
    }
    if (*certs_issue) {
      nebula::transport::issue_site_certificate(certs_dir, site_name, job_name, days > 0 ? days : 825);
      std::printf("issued %s/%s.pem and %s/%s.key (%s, fingerprint %s); give both to site '%s' only\n",
                  certs_dir.c_str(), site_name.c_str(), certs_dir.c_str(), site_name.c_str(),
                  nebula::transport::identity_uri(job_name, site_name).c_str(),
                  nebula::transport::certificate_fingerprint(certs_dir + "/" + site_name + ".pem").c_str(),
                  site_name.c_str());
      for (int r = 0; r < host_workers; ++r) {
        nebula::transport::issue_host_certificate(certs_dir, site_name, r, job_name, days > 0 ? days : 825);
        const std::string pem = nebula::transport::host_cert_path(certs_dir, site_name, r);
        std::printf("issued %s and its .key (fingerprint %s); give both to the host of worker %d of site '%s' only\n",
                    pem.c_str(), nebula::transport::certificate_fingerprint(pem).c_str(), r, site_name.c_str());
      }
      return 0;
    }
    if (*corpus_build) {
      check_fraction("--valid-fraction", corpus_opt.valid_fraction);
      check_fraction("--test-fraction", corpus_opt.test_fraction);
      if (corpus_opt.valid_fraction + corpus_opt.test_fraction >= 1)
        throw nebula::ConfigError(nebula::str_cat("--valid-fraction + --test-fraction = ",
                                                  corpus_opt.valid_fraction + corpus_opt.test_fraction,
                                                  " leaves nothing for train: make the sum less than 1"));
      if (corpus_opt.source != "gettext" && corpus_opt.path.empty())
        throw nebula::ConfigError(nebula::str_cat("--source ", corpus_opt.source, " needs --path FILE"));
      if (corpus_opt.source == "text" && !corpus_opt.languages.empty())
        throw nebula::ConfigError("--languages does not apply to --source text (each line is one monolingual "
                                  "sentence): leave it out");
      nebula::data::Corpus c = nebula::data::build_corpus(corpus_opt);
      nebula::data::write_corpus(corpus_out, c, corpus_opt);
      std::fputs(nebula::data::format_corpus_stats(c, corpus_opt).c_str(), stdout);
      std::printf("wrote %s/{train,valid,test}.tsv (%zu, %zu, %zu pairs) and %s/stats.json\n", corpus_out.c_str(),
                  c.train.size(), c.valid.size(), c.test.size(), corpus_out.c_str());
      return 0;
    }
    if (*translate) {
      const nebula::model::TensorFile file = nebula::model::load_safetensors(model_path);
      std::string tok_path = tokenizer_override;
      if (tok_path.empty()) {
        auto recorded = file.metadata.find("tokenizer");
        if (recorded == file.metadata.end())
          throw nebula::ConfigError(model_path + " does not record its tokenizer: give --tokenizer PATH");
        tok_path = recorded->second;
      }
      nebula::data::Tokenizer tok = nebula::data::Tokenizer::load(tok_path);
      nebula::train::LoadedTranslator t = nebula::train::load_translator(file, model_path, tok);
      std::vector<std::string> lines;
      if (!input_path.empty()) {
        lines = nebula::data::read_lines(input_path);
      } else {
        for (std::string line; std::getline(std::cin, line);) lines.push_back(line);
      }
      for (const std::string& out : nebula::train::translate(*t.model, tok, lines, beam, length_penalty)) std::printf("%s\n", out.c_str());
      return 0;
    }
    if (*bleu) {
      std::vector<std::string> hyps = nebula::data::read_lines(hyp_path);
      std::vector<std::vector<std::string>> refs;
      for (const std::string& path : ref_paths) {
        refs.push_back(nebula::data::read_lines(path));
        if (refs.back().size() != hyps.size())
          throw nebula::DataError(nebula::str_cat(path, " has ", refs.back().size(), " lines but ", hyp_path, " has ",
                                                  hyps.size(), ": one sentence per line, in the same order"));
      }
      nebula::eval::BleuOptions o;
      o.smoothing = bleu_smooth == "exp"     ? nebula::eval::BleuSmoothing::kExp
                    : bleu_smooth == "floor" ? nebula::eval::BleuSmoothing::kFloor
                                             : nebula::eval::BleuSmoothing::kNone;
      o.tokenize = bleu_tokenize == "13a";
      nebula::eval::BleuScore score;
      try {
        score = nebula::eval::corpus_bleu_multi(hyps, refs, o);
      } catch (const nebula::DataError& e) {  // "segment N: ..." is line N of the reference files
        std::string files;
        for (const std::string& path : ref_paths) files += (files.empty() ? "" : ", ") + path;
        throw nebula::DataError(nebula::str_cat(files, ": ", e.what()));
      }
      std::printf("%s\n", score.format().c_str());
      return 0;
    }
    if (*report) {
      const std::string out = report_out.empty() ? report_runs.front() + "/report" : report_out;
      const auto r = nebula::app::write_report(report_runs, out);
      std::printf("wrote %s (%zu charts)%s\n", r.files.back().c_str(), r.files.size() - 1,
                  r.skipped_lines ? nebula::str_cat("; skipped ", r.skipped_lines, " malformed metrics lines").c_str() : "");
      return 0;
    }
    if (*worker) {
      nebula::Config c = nebula::load_config(config_path, overrides);
      // Site, rank and store: --site/--rank, or what torchrun, Open MPI or Slurm set.
      const nebula::Placement p =
          nebula::resolve_placement(c, site_name, rank_text, [](const char* name) { return std::getenv(name); });
      spdlog::info("worker {}/{} (from the {}), site store {}{}", c.sites[p.site].name, p.rank, p.launcher, p.store,
                   p.external_store ? " (the launcher's)" : "");
      // 0, or 128 + the signal after a clean stop on SIGINT/SIGTERM (with a checkpoint).
      return nebula::train::run_worker(c, {p.site, p.rank, p.store, p.external_store}, resume, rejoin);
    }
  } catch (const nebula::ConfigError& e) {
    spdlog::error("config: {}", e.what());
    return 2;
  } catch (const std::exception& e) {
    spdlog::error("{}", e.what());
    return 1;
  }
  return 0;
}
