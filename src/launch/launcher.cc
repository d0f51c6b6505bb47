#include "launch/launcher.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include "nebula/error.h"
#include "nebula/units.h"
#include "site/gateway.h"
#include "train/metrics.h"
#include "train/site_data.h"
#include "transport/tcp_link.h"

namespace nebula::launch {
namespace fs = std::filesystem;
namespace {

std::atomic<int> g_signal{0};
extern "C" void on_signal(int sig) { g_signal = sig; }

struct Child {
  pid_t pid;
  std::string site;
  int rank;
  std::string log;
  bool running = true;
  int status = 0;
  bool ended_on_its_own = false;  // ended before this launcher signalled any worker
};

// How a reaped worker ended, for messages: "exit code N" or "signal N".
std::string how_it_ended(int status) {
  return WIFEXITED(status) ? str_cat("exit code ", WEXITSTATUS(status)) : str_cat("signal ", WTERMSIG(status));
}

using Environment = std::vector<std::pair<std::string, std::string>>;

// `exe` with `args`: a path, or with `search_path` a program name found on PATH (a [job] command).
pid_t spawn(const std::string& exe, const std::vector<std::string>& args, const std::string& log, bool append,
            const Environment& env = {}, bool search_path = false) {
  int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC) | O_CLOEXEC, 0644);
  if (fd < 0) throw Error(str_cat(log, ": cannot create worker log: ", std::strerror(errno)));
  // NEBULA_WORKER_PREFIX="heaptrack" (or "perf record -g", "valgrind ..."): every worker runs
  // under that tool, found on PATH (words split at spaces). Built before fork: the child only execs.
  std::vector<std::string> prefix;
  if (const char* p = std::getenv("NEBULA_WORKER_PREFIX")) {
    std::istringstream words(p);
    for (std::string w; words >> w;) prefix.push_back(w);
  }
  std::vector<char*> argv;
  for (auto& w : prefix) argv.push_back(w.data());
  argv.push_back(const_cast<char*>(exe.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw Error(str_cat("fork failed: ", std::strerror(errno)));
  if (pid == 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    // One BLAS/OpenMP thread per worker: the workers share the machine's cores.
    ::setenv("OMP_NUM_THREADS", "1", 1);
    ::setenv("OPENBLAS_NUM_THREADS", "1", 1);
    ::setenv("MKL_NUM_THREADS", "1", 1);
    for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
    if (prefix.empty() && !search_path)
      ::execv(exe.c_str(), argv.data());
    else
      ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "exec %s failed: %s\n", argv[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(fd);
  return pid;
}

std::string tail_of(const std::string& path, size_t lines) {
  std::ifstream in(path);
  std::vector<std::string> all;
  for (std::string l; std::getline(in, l);) all.push_back(l);
  std::string out;
  for (size_t i = all.size() > lines ? all.size() - lines : 0; i < all.size(); ++i) out += "    " + all[i] + "\n";
  return out;
}

// Reads metrics.jsonl as it grows and shows one line per site: in place on a terminal,
// as plain lines otherwise.
class Progress {
 public:
  Progress(const Config& c, const std::string& path) : path_(path) {
    const std::string& mode = c.metrics.progress;
    enabled_ = mode != "off";
    in_place_ = mode == "auto" && ::isatty(1);
    for (const auto& s : c.sites) order_.push_back(s.name);
  }

  void poll() {
    if (!enabled_) return;
    std::ifstream in(path_);
    if (!in) return;
    in.seekg(static_cast<std::streamoff>(offset_));
    bool changed = false;
    for (std::string line; std::getline(in, line);) {
      if (in.eof()) break;  // a line still being written: read it next time
      offset_ += line.size() + 1;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (j.is_discarded() || !j.contains("site") || !j.contains("loss")) continue;  // eval, teacher lines: see summary
      Site& s = sites_[j["site"].get<std::string>()];
      int rank = j.value("rank", 0);
      s.loss[rank] = j.value("loss", 0.0);
      s.rate[rank] = j.value("tokens_per_s", 0.0);
      s.sent[rank] = j.value("wan_bytes_sent", 0.0);  // every worker's own with wan.mode = "every_worker"
      s.received[rank] = j.value("wan_bytes_received", 0.0);
      if (rank == 0) {
        s.step = j.value("step", 0);
        s.steps = j.value("steps", 0);
        if (!in_place_) std::printf("%s\n", render(j["site"].get<std::string>(), s).c_str());
      }
      changed = true;
    }
    if (changed && in_place_) draw();
    std::fflush(stdout);
  }

 private:
  struct Site {
    int step = 0, steps = 0;
    std::map<int, double> loss, rate, sent, received;
  };

  static std::string render(const std::string& name, const Site& s) {
    double loss = 0, rate = 0, sent = 0, received = 0;
    for (auto& [r, l] : s.loss) loss += l / static_cast<double>(s.loss.size());
    for (auto& [r, t] : s.rate) rate += t;
    for (auto& [r, b] : s.sent) sent += b;
    for (auto& [r, b] : s.received) received += b;
    // A bar of the job's steps (a fast site under heterogeneous diloco runs more local steps:
    // its bar is full early and the count goes on).
    constexpr int kWidth = 20;
    const int filled = s.steps > 0 ? std::min(kWidth, s.step * kWidth / s.steps) : 0;
    const std::string bar = "[" + std::string(static_cast<size_t>(filled), '#') +
                            std::string(static_cast<size_t>(kWidth - filled), '.') + "]";
    char buf[320];
    std::snprintf(buf, sizeof buf, "%-14s %s step %5d/%-5d loss %7.4f  %8.0f tok/s  WAN sent %s, received %s",
                  name.c_str(), bar.c_str(), s.step, s.steps, loss, rate, format_bytes(sent).c_str(),
                  format_bytes(received).c_str());
    return buf;
  }

  void draw() {
    if (drawn_) std::printf("\033[%zuA", order_.size());
    for (const auto& name : order_) {
      auto it = sites_.find(name);
      std::printf("\033[2K%s\n", it == sites_.end() ? (name + "  starting").c_str() : render(name, it->second).c_str());
    }
    drawn_ = true;
  }

  std::string path_;
  bool enabled_ = true, in_place_ = false, drawn_ = false;
  size_t offset_ = 0;
  std::vector<std::string> order_;
  std::map<std::string, Site> sites_;
};

// "host:0" → "host:<a free port>". The port is free now; a race with another process that
// grabs it before the worker binds it shows up as a clear bind error.
std::string with_port(const std::string& address) {
  auto [host, port] = transport::parse_host_port(address);
  if (port != 0) return address;
  uint16_t p = transport::pick_free_port(host);
  return (host.find(':') != std::string::npos ? "[" + host + "]" : host) + ":" + std::to_string(p);
}

void stop_all(std::vector<Child>& children, int sig) {
  for (auto& c : children)
    if (c.running) ::kill(c.pid, sig);
}

}  // namespace

int run_local(Config c, const LaunchOptions& options) {
  std::error_code made;
  fs::create_directories(c.job.run_dir + "/logs", made);
  if (made)
    throw DataError(str_cat(c.job.run_dir, "/logs: cannot create the run directory: ", made.message(),
                            " (job.run_dir in ", c.source_path, "; choose a directory that can be created there)"));
  // A resumed job appends to its metrics and audit log; a new one starts them afresh.
  fs::remove(c.job.run_dir + "/summary.json");
  if (!options.resume)
    for (const char* stale : {"/metrics.jsonl", "/audit.jsonl"}) fs::remove(c.job.run_dir + stale);
  if (c.security.insecure) spdlog::warn("security.insecure = true: links between sites will be PLAINTEXT");
  site::ensure_local_certificates(c);

  // The job's shared vocabulary. In a deployment it is trained once on the tokenizer site
  // (`nebula tokenizer`) and shipped with the job (data.tokenizer); in local mode we train it
  // here before the workers start, on that one site's data only, as the tokenizer site would.
  if (c.data.tokenizer.empty() && c.model.kind != "torchscript" && c.job.command.empty()) {
    std::string prefix = c.job.run_dir + "/tokenizer";
    if (!options.resume || !fs::exists(prefix + ".model")) train::train_tokenizer(c, prefix);
    c.data.tokenizer = prefix + ".model";
  }
  for (auto& s : c.sites) {
    s.gateway = with_port(s.gateway);
    s.store = with_port(s.store);
    if (c.wan.every_worker() && s.worker_addresses.empty())  // each worker's own WAN port
      s.worker_addresses.assign(static_cast<size_t>(s.workers - 1), "127.0.0.1:0");
    for (auto& a : s.worker_addresses) a = with_port(a);
  }
  fs::remove_all(c.job.run_dir + "/wan");  // the emulated site pairs' clocks (gateway.cc): fresh for every start
  const std::string job_file = c.job.run_dir + "/job.toml";
  {
    std::ofstream out(job_file);
    out << to_toml(c);
    if (!out) throw Error(str_cat(job_file, ": cannot write"));
  }

  struct sigaction sa {};
  sa.sa_handler = on_signal;
  ::sigaction(SIGINT, &sa, nullptr);
  ::sigaction(SIGTERM, &sa, nullptr);

  std::vector<Child> children;
  // Room for every restart: `failed` points into this vector.
  children.reserve(static_cast<size_t>(c.total_workers() * (1 + c.job.restarts)));
  // A [job] command (e.g. a Python program using the nebula package) runs as every worker,
  // placed by $NEBULA_SITE/$NEBULA_RANK with the job's config in $NEBULA_CONFIG.
  const std::string python_path = [&] {
    std::string dir = (fs::path(options.executable).parent_path() / "python").string();
    const char* old = std::getenv("PYTHONPATH");
    return old && *old ? dir + ":" + old : dir;
  }();
  auto start_site = [&](const SiteConfig& s, bool rejoin) {
    for (int r = 0; r < s.workers; ++r) {
      std::string log = str_cat(c.job.run_dir, "/logs/", s.name, "-", r, ".log");
      pid_t pid;
      if (c.job.command.empty()) {
        std::vector<std::string> args = {"worker", job_file, "--site", s.name, "--rank", std::to_string(r)};
        if (options.resume) args.push_back("--resume");
        if (rejoin) args.push_back("--rejoin");
        pid = spawn(options.executable, args, log, options.resume || rejoin);
      } else {
        const std::vector<std::string> args(c.job.command.begin() + 1, c.job.command.end());
        pid = spawn(c.job.command[0], args, log, options.resume,
                    {{"NEBULA_CONFIG", job_file}, {"NEBULA_SITE", s.name}, {"NEBULA_RANK", std::to_string(r)},
                     {"NEBULA_RESUME", options.resume ? "1" : "0"}, {"PYTHONPATH", python_path},
                     {"PYTHONUNBUFFERED", "1"}},
                    /*search_path=*/true);
      }
      children.push_back({pid, s.name, r, log});
    }
  };
  for (const auto& s : c.sites) start_site(s, false);
  spdlog::info("started {} workers on {} sites; logs in {}/logs", children.size(), c.sites.size(), c.job.run_dir);
  auto write_workers = [&] {  // who is who, for operators (and tests that stop one site)
    nlohmann::json workers = nlohmann::json::array();
    for (const auto& ch : children)
      if (ch.running) workers.push_back({{"site", ch.site}, {"rank", ch.rank}, {"pid", ch.pid}});
    train::write_json_atomically(c.job.run_dir + "/workers.json", workers);
  };
  write_workers();
  std::map<std::string, int64_t> restarts;  // elastic: restarts used per site
  std::set<std::string> lost_sites;  // elastic: sites whose workers failed; the others go on

  Progress progress(c, c.job.run_dir + "/metrics.jsonl");
  int exit_code = 0;
  const Child* failed = nullptr;
  size_t running = children.size();
  Clock::time_point stop_started{};
  while (running > 0) {
    std::vector<Child*> ended;
    for (auto& ch : children) {
      if (!ch.running) continue;
      if (::waitpid(ch.pid, &ch.status, WNOHANG) != ch.pid) continue;
      ch.running = false;
      --running;
      ch.ended_on_its_own = exit_code == 0 && !g_signal;
      ended.push_back(&ch);
    }
    // Workers that ended within one poll: one killed by a signal is the cause, not the peers
    // that exited because it hung up on them (they exit within milliseconds of it).
    std::stable_partition(ended.begin(), ended.end(), [](const Child* ch) { return WIFSIGNALED(ch->status); });
    std::set<std::string> restarted;  // elastic: sites started again in this poll
    for (Child* ended_child : ended) {
      Child& ch = *ended_child;
      if (restarted.count(ch.site)) continue;  // reaped with its site, which starts again
      bool ok = WIFEXITED(ch.status) && WEXITSTATUS(ch.status) == 0;
      // A worker that stopped on a signal after writing its checkpoint (128 + SIGINT/SIGTERM):
      // the job stops as if this launcher had been interrupted.
      const bool stopped = WIFEXITED(ch.status) && (WEXITSTATUS(ch.status) == 128 + SIGINT ||
                                                    WEXITSTATUS(ch.status) == 128 + SIGTERM);
      if (stopped && !g_signal && !failed) g_signal = WEXITSTATUS(ch.status) - 128;
      if (!ok && !failed && !g_signal && c.job.elastic && !lost_sites.count(ch.site)) {
        // The site is lost (its other workers cannot go on without this one); the other
        // sites leave it out once its link stays down past wan.reconnect_timeout.
        lost_sites.insert(ch.site);
        for (auto& other : children)
          if (other.running && other.site == ch.site) ::kill(other.pid, SIGKILL);
        spdlog::warn("site {} lost (worker {}/{}: {}); the other sites go on (job.elastic). Last lines of {}:\n{}",
                     ch.site, ch.site, ch.rank,
                     how_it_ended(ch.status),
                     ch.log, tail_of(ch.log, 5));
        if (restarts[ch.site] < c.job.restarts) {
          // Its workers are gone (killed above; reaped below): start the site again, to
          // resume from its checkpoint and rejoin the others at their next round.
          for (auto& other : children)
            if (other.running && other.site == ch.site) {
              ::waitpid(other.pid, &other.status, 0);
              other.running = false;
              --running;
            }
          ++restarts[ch.site];
          lost_sites.erase(ch.site);
          restarted.insert(ch.site);
          spdlog::warn("starting site {} again to rejoin (restart {} of {})", ch.site, restarts[ch.site],
                       c.job.restarts);
          const size_t before = children.size();
          start_site(c.sites[c.site_index(ch.site)], true);
          running += children.size() - before;
          write_workers();
          continue;
        }
        if (lost_sites.size() < c.sites.size()) continue;
      }
      if (!ok && !failed && !g_signal && !lost_sites.count(ch.site)) {
        failed = &ch;
        exit_code = 1;
        stop_all(children, SIGTERM);
      }
    }
    if (g_signal && exit_code == 0) {
      exit_code = 128 + g_signal;
      stop_all(children, SIGTERM);
    }
    progress.poll();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    // Workers that ignore SIGTERM for long are killed (a stopping worker first finishes its
    // step and writes a checkpoint); stop_all only reaches our own pids.
    if (exit_code != 0) {
      if (stop_started == Clock::time_point{}) stop_started = Clock::now();
      // After a failure the others are usually blocked on the lost worker: do not wait long.
      const auto grace = failed ? std::chrono::seconds(10) : std::chrono::seconds(30);
      if (Clock::now() - stop_started > grace) stop_all(children, SIGKILL);
    }
  }
  progress.poll();
  if (failed) {
    spdlog::error("worker {}/{} failed ({}); stopped the others. Last lines of {}:\n{}", failed->site, failed->rank,
                  how_it_ended(failed->status), failed->log, tail_of(failed->log, 15));
    // Workers that failed on their own too (not stopped by us): the first to exit is not always
    // the cause (a worker whose peer hung up exits as fast as the peer that failed).
    for (const auto& ch : children) {
      if (&ch == failed || ch.running) continue;
      if (WIFEXITED(ch.status)) {
        const int code = WEXITSTATUS(ch.status);
        if (code == 0 || code == 128 + SIGTERM || code == 128 + SIGINT) continue;
      } else if (!ch.ended_on_its_own) {
        continue;  // our SIGKILL after the grace period
      }
      spdlog::error("worker {}/{} failed too ({}). Last lines of {}:\n{}", ch.site, ch.rank, how_it_ended(ch.status),
                    ch.log, tail_of(ch.log, 15));
    }
    return exit_code;
  }
  if (exit_code) {
    spdlog::error("interrupted; stopped all workers (they checkpoint into {}): continue with nebula run {} --resume (and the same --set options)",
                  c.checkpoint.dir, c.source_path);
    return exit_code;
  }
  if (!lost_sites.empty()) {
    std::string names;
    for (const auto& s : lost_sites) names += (names.empty() ? "" : ", ") + s;
    spdlog::warn("finished without site(s) {} (job.elastic); summary.json lists when each was lost", names);
  }
  if (!print_summary(c.job.run_dir)) {
    if (!c.job.command.empty()) {  // the program's choice (nebula.Metrics writes one)
      spdlog::info("every worker finished; {}/summary.json was not written (nebula.Metrics.finish() writes it)",
                   c.job.run_dir);
      return 0;
    }
    spdlog::error("workers finished but {}/summary.json is missing", c.job.run_dir);
    return 1;
  }
  return 0;
}

bool print_summary(const std::string& run_dir) {
  std::ifstream in(run_dir + "/summary.json");
  if (!in) return false;
  auto j = nlohmann::json::parse(in, nullptr, false);
  if (j.is_discarded()) return false;
  auto num = [&](const char* k) { return j.contains(k) && j[k].is_number() ? j[k].get<double>() : 0.0; };
  std::printf("\nsummary of %s (%s)\n", run_dir.c_str(), (run_dir + "/summary.json").c_str());
  std::printf("  strategy          %s, %d sites, %d workers\n", j.value("strategy", "?").c_str(),
              j.value("sites", 0), j.value("workers", 0));
  std::printf("  steps             %.0f\n", num("steps"));
  std::printf("  tokens            %.0f\n", num("tokens"));
  std::printf("  wall time         %.1f s\n", num("wall_seconds"));
  std::printf("  final train loss  %.4f\n", num("final_train_loss"));
  if (j.contains("final_val_loss") && j["final_val_loss"].is_number())
    std::printf("  final val loss    %.4f\n", num("final_val_loss"));
  std::printf("  WAN bytes sent    %s (all sites; %s on the wire: TLS, acks, probes, re-sends)\n",
              format_bytes(num("wan_bytes")).c_str(), format_bytes(num("wan_wire_bytes")).c_str());
  if (j.contains("eval") && j["eval"].contains("bleu")) {
    std::printf("  BLEU              %.2f on %.0f test pairs (beam %d)\n", j["eval"].value("bleu", 0.0),
                j["eval"].value("sentences", 0.0), j["eval"].value("beam", 1));
  } else if (j.contains("eval") && j.contains("packages")) {
    // Zero-shot transfer (a classifier trained on English): accuracy per language, start → end.
    const double en = j["eval"].contains("en") ? j["eval"]["en"].value("accuracy", 0.0) : 0.0;
    std::printf("  %-8s %-24s (chance %.1f%%, %zu packages; trained on English only)\n", "held-out", "package accuracy",
                100 * j.value("chance", 0.0), j["packages"].size());
    for (auto& [lang, e] : j["eval"].items()) {
      const auto& s = j.contains("eval_start") && j["eval_start"].contains(lang) ? j["eval_start"][lang] : e;
      std::printf("  %-8s %5.1f%% -> %5.1f%%  %4.0f messages", lang.c_str(), 100 * s.value("accuracy", 0.0),
                  100 * e.value("accuracy", 0.0), e.value("messages", 0.0));
      if (lang != "en" && en > 0) std::printf("  %.2fx English", e.value("accuracy", 0.0) / en);
      std::printf("\n");
    }
  } else if (j.contains("eval") && j["eval"].is_object() && !j["eval"].empty()) {
    // Cross-lingual evaluation, start → end of the run, per language.
    std::printf("  %-8s %-22s %s\n", "held-out", "MLM accuracy", "retrieval accuracy (chance)");
    for (auto& [lang, e] : j["eval"].items()) {
      const auto& s = j["eval_start"].contains(lang) ? j["eval_start"][lang] : e;
      std::printf("  %-8s %5.1f%% -> %5.1f%%", lang.c_str(), 100 * s.value("mlm_accuracy", 0.0),
                  100 * e.value("mlm_accuracy", 0.0));
      if (e.contains("retrieval_accuracy"))
        std::printf("        %5.1f%% -> %5.1f%% (%.1f%%, %.0f pairs)", 100 * s.value("retrieval_accuracy", 0.0),
                    100 * e.value("retrieval_accuracy", 0.0), 100 / std::max(1.0, e.value("pairs", 1.0)),
                    e.value("pairs", 0.0));
      std::printf("\n");
    }
  }
  if (j.contains("distill")) {
    const auto& d = j["distill"];
    std::printf("  distillation      %.0f teacher tokens from %s, %.1f bytes/token (fp32 logits: %.0f, %.0fx more); "
                "waited %.2f s\n",
                d.value("tokens", 0.0), d.value("teacher_site", "?").c_str(), d.value("bytes_per_token", 0.0),
                d.value("fp32_logits_bytes_per_token", 0.0), d.value("reduction_vs_fp32_logits", 0.0),
                d.value("wait_seconds", 0.0));
  }
  return true;
}

}  // namespace nebula::launch
