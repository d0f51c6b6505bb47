// nebula: the command line. The only place that reads argv and turns exceptions into
// one-line messages and exit codes.
#include <CLI/CLI.hpp>
#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "cli/demo_config.h"
#include "nebula/config.h"
#include "nebula/error.h"
#include "nebula/log.h"
#include "plan/plan.h"
#include "train/launcher.h"
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
const char* first_env(std::initializer_list<const char*> names) {
  for (const char* n : names)
    if (const char* v = std::getenv(n)) return v;
  return nullptr;
}

int parse_rank(const std::string& text, const char* from) {
  try {
    size_t used = 0;
    int r = std::stoi(text, &used);
    if (used == text.size() && r >= 0) return r;
  } catch (const std::exception&) {
  }
  throw nebula::ConfigError(nebula::str_cat(from, " = \"", text, "\" is not a rank (a non-negative integer)"));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"nebula: train one model across several sites joined by a slow WAN"};
  app.require_subcommand(1);

  std::string config_path;
  std::vector<std::string> overrides;
  auto* run = app.add_subcommand("run", "Run a job in local mode: every worker of every site as a process here");
  run->add_option("config", config_path, "Job config (TOML)")->required()->check(CLI::ExistingFile);
  run->add_option("--set", overrides, "Override a config key, e.g. --set job.steps=20 (repeatable)")
      ->allow_extra_args(false);

  std::string site_name;
  std::string rank_text;
  auto* worker = app.add_subcommand("worker", "Run one worker process of a deployed job");
  worker->add_option("config", config_path, "Job config (TOML)")->required()->check(CLI::ExistingFile);
  worker->add_option("--site", site_name, "This worker's site (default: $NEBULA_SITE)");
  worker->add_option("--rank", rank_text, "Rank inside the site; 0 is the gateway (default: $LOCAL_RANK)");
  worker->add_option("--set", overrides, "Override a config key (repeatable)")->allow_extra_args(false);

  std::string demo_dir = "runs/demo";
  auto* demo = app.add_subcommand("demo", "Two emulated sites over an emulated WAN on this machine's gettext corpus");
  demo->add_option("--run-dir", demo_dir, "Where the demo writes its run (default: runs/demo)");
  demo->add_option("--set", overrides, "Override a key of the demo config (repeatable)")->allow_extra_args(false);

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
  certs_issue->add_option("--days", days, "Validity in days (default 825)");

  std::string topology_path;
  bool plan_json = false;
  size_t plan_top = 0;
  auto* plan = app.add_subcommand(
      "plan", "Predict step time, WAN bytes and compute utilization of each strategy and codec for a topology, "
              "and recommend one (see examples/plan_*.toml)");
  plan->add_option("topology", topology_path, "Topology (TOML): [model], [[sites]], [wan], [candidates], [planner]")
      ->required()
      ->check(CLI::ExistingFile);
  plan->add_option("--set", overrides, "Override a topology key, e.g. --set wan.bandwidth='\"10Gbit\"' (repeatable)")
      ->allow_extra_args(false);
  plan->add_flag("--json", plan_json, "Print the same as JSON");
  plan->add_option("--top", plan_top, "Show only the best N rows of the table (default: all)");

  CLI11_PARSE(app, argc, argv);
  nebula::init_logging("nebula");
  try {
    if (*run) {
      nebula::Config c = nebula::load_config(config_path, overrides);
      return nebula::train::run_local(c, {self_executable()});
    }
    if (*demo) {
      overrides.insert(overrides.begin(), "job.run_dir=\"" + demo_dir + "\"");
      nebula::Config c = nebula::parse_config(nebula::kDemoConfig, "examples/demo.toml", overrides);
      std::printf("nebula demo: MLM pre-training on two sites (%s) over an emulated WAN; run dir %s\n",
                  (c.sites[0].name + ", " + c.sites[1].name).c_str(), c.job.run_dir.c_str());
      return nebula::train::run_local(c, {self_executable()});
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
      nebula::transport::issue_site_certificate(certs_dir, site_name, days > 0 ? days : 825);
      std::printf("issued %s/%s.pem and %s/%s.key (fingerprint %s); give both to site '%s' only\n",
                  certs_dir.c_str(), site_name.c_str(), certs_dir.c_str(), site_name.c_str(),
                  nebula::transport::certificate_fingerprint(certs_dir + "/" + site_name + ".pem").c_str(),
                  site_name.c_str());
      return 0;
    }
    if (*worker) {
      nebula::Config c = nebula::load_config(config_path, overrides);
      if (site_name.empty()) {
        const char* env = first_env({"NEBULA_SITE"});
        if (!env) throw nebula::ConfigError("nebula worker: no --site and no $NEBULA_SITE: say which site this is");
        site_name = env;
      }
      // Rank inside the site: --rank, else what a launcher set (torchrun's RANK is the rank in
      // its world, which for nebula is one site).
      int rank = 0;
      if (!rank_text.empty()) {
        rank = parse_rank(rank_text, "--rank");
      } else if (const char* env = first_env({"NEBULA_RANK", "RANK", "LOCAL_RANK"})) {
        rank = parse_rank(env, "$RANK");
      } else {
        throw nebula::ConfigError("nebula worker: no --rank and no $RANK / $LOCAL_RANK: say which rank this is");
      }
      const auto& site = c.sites[c.site_index(site_name)];
      if (const char* world = first_env({"WORLD_SIZE"}); world && std::to_string(site.workers) != world)
        throw nebula::ConfigError(nebula::str_cat("$WORLD_SIZE = ", world, " but site '", site_name, "' has workers = ",
                                                  site.workers, " in ", config_path, ": make them agree"));
      nebula::train::run_worker(c, {c.site_index(site_name), rank});
      return 0;
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
