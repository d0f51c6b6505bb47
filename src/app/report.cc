#include "app/report.h"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>

#include "eval/plot.h"
#include "eval/tensorboard.h"
#include "nebula/error.h"
#include "train/metrics.h"

namespace nebula::app {
namespace fs = std::filesystem;
namespace {

std::string run_name(const std::string& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();  // absolute: "." and ".." have a name too
  if (p.filename().empty()) p = p.parent_path();
  return p.filename().empty() ? "run" : p.filename().string();
}

std::string cell(const nlohmann::json& summary, const char* key, int precision = -1) {
  if (!summary.contains(key) || summary[key].is_null()) return "–";
  const auto& v = summary[key];
  if (v.is_number_float() && precision >= 0) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.*f", precision, v.get<double>());
    return buf;
  }
  return v.is_string() ? v.get<std::string>() : v.dump();
}

// A name that stays one path component below OUT/tensorboard.
bool is_file_name(const std::string& s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string::npos;
}

double number(const nlohmann::json& j, const char* key) {
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
}

// One site's lines, for its TensorBoard event file.
struct SiteLines {
  std::map<int64_t, std::map<int64_t, nlohmann::json>> training;  // step → rank → its line
  std::map<int64_t, nlohmann::json> eval;                         // step → the gateway's eval line
};

// Every number in `v`, nested objects flattened with '/': "eval/de/accuracy".
void add_numbers(eval::TensorBoardWriter& w, const std::string& tag, const nlohmann::json& v, int64_t step,
                 double time) {
  if (v.is_number()) {
    w.add_scalar(tag, step, v.get<float>(), time);
  } else if (v.is_object()) {
    for (const auto& [key, x] : v.items()) add_numbers(w, tag + "/" + key, x, step, time);
  }
}

// Replaces the event files in `dir` (an earlier report's) with one of `site`'s curves; returns its path.
std::string write_tensorboard(const std::string& dir, const SiteLines& site) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) fs::remove(e.path(), ec);
  eval::TensorBoardWriter w(dir);
  for (const auto& [step, ranks] : site.training) {
    double loss = 0, tokens_per_s = 0, time = 0;
    for (const auto& [rank, j] : ranks) {
      loss += j["loss"].get<double>();
      tokens_per_s += number(j, "tokens_per_s");
      time = std::max(time, number(j, "time"));
    }
    w.add_scalar("train/loss", step, static_cast<float>(loss / static_cast<double>(ranks.size())), time);
    w.add_scalar("train/tokens_per_s", step, static_cast<float>(tokens_per_s), time);
    if (auto gateway = ranks.find(0); gateway != ranks.end() && gateway->second.contains("wan_bytes_sent"))
      w.add_scalar("wan/bytes_sent", step, static_cast<float>(number(gateway->second, "wan_bytes_sent")), time);
  }
  for (const auto& [step, j] : site.eval) add_numbers(w, "eval", j["eval"], step, number(j, "time"));
  w.flush();
  return w.path();
}

}  // namespace

ReportResult write_report(const std::vector<std::string>& run_dirs, const std::string& out_dir) {
  NEBULA_CHECK(!run_dirs.empty(), "write_report without runs");
  ReportResult result;
  // x → series, one per (run, site), from the site gateways' training lines.
  struct Curves {
    std::vector<eval::Series> time, tokens, wan;
  } curves;
  std::vector<std::pair<std::string, nlohmann::json>> summaries;
  // tensorboard/RUN/SITE → its lines; RUN gets a suffix if two run directories share a name.
  std::map<std::string, SiteLines> tensorboard;
  std::set<std::string> tensorboard_runs;
  for (const auto& dir : run_dirs) {
    size_t skipped = 0;
    const auto lines = train::read_metrics(dir + "/metrics.jsonl", &skipped);
    result.skipped_lines += skipped;
    std::string tb_run = run_name(dir);
    for (int k = 2; !tensorboard_runs.insert(tb_run).second; ++k) tb_run = str_cat(run_name(dir), "-", k);
    std::map<std::string, std::array<eval::Series, 3>> by_site;  // the charts: the gateways' training lines
    for (const auto& j : lines) {
      if (!j.contains("site") || !j["site"].is_string()) continue;
      const std::string site = j["site"].get<std::string>();
      const bool training = j.contains("loss") && j["loss"].is_number();
      if (training && j.value("rank", -1) == 0) {
        auto& s = by_site[site];
        const double loss = j["loss"].get<double>();
        s[0].points.emplace_back(j.value("elapsed", 0.0), loss);
        s[1].points.emplace_back(j.value("tokens", 0.0), loss);
        s[2].points.emplace_back(j.value("wan_bytes_sent", 0.0) / (1 << 20), loss);
      }
      if (!j.contains("step") || !j["step"].is_number_integer() || !is_file_name(site)) continue;
      auto& s = tensorboard[str_cat(tb_run, "/", site)];
      const auto step = j["step"].get<int64_t>();
      // A later line for the same step replaces an earlier one: a resumed run repeats steps.
      if (training)
        s.training[step][j.contains("rank") && j["rank"].is_number_integer() ? j["rank"].get<int64_t>() : -1] = j;
      else if (j.contains("eval") && j["eval"].is_object())
        s.eval[step] = j;
    }
    if (by_site.empty())
      throw DataError(str_cat(dir, "/metrics.jsonl: no training lines (is ", dir, " a nebula run directory?)"));
    for (auto& [site, s] : by_site) {
      const std::string label = str_cat(run_name(dir), " · ", site);
      for (auto& series : s) series.label = label;
      curves.time.push_back(std::move(s[0]));
      curves.tokens.push_back(std::move(s[1]));
      curves.wan.push_back(std::move(s[2]));
    }
    std::ifstream in(dir + "/summary.json");
    auto summary = nlohmann::json::parse(in, nullptr, false);
    if (!in || summary.is_discarded() || !summary.is_object()) {
      spdlog::warn("{}/summary.json: missing or unreadable (the run did not finish?); its table row is empty", dir);
      summary = nlohmann::json::object();
    }
    summaries.emplace_back(dir, std::move(summary));
  }

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec || !fs::is_directory(out_dir))
    throw DataError(str_cat(out_dir, ": cannot create the report directory", ec ? ": " + ec.message() : ""));
  const struct {
    const char* file;
    std::vector<eval::Series>* series;
    const char* title;
    const char* x;
  } charts[] = {{"loss_vs_time.svg", &curves.time, "Training loss against time", "seconds since start"},
                {"loss_vs_tokens.svg", &curves.tokens, "Training loss against tokens", "tokens (per site gateway)"},
                {"loss_vs_wan.svg", &curves.wan, "Training loss against WAN traffic", "MiB sent by the site's gateway"}};
  std::string images;
  for (const auto& ch : charts) {
    const std::string path = out_dir + "/" + ch.file;
    eval::write_line_chart(path, *ch.series, {ch.title, ch.x, "training loss"});
    result.files.push_back(path);
    images += str_cat("<figure><img src=\"", ch.file, "\" alt=\"", ch.title, "\"></figure>\n");
  }
  for (const auto& [run_site, site] : tensorboard)
    result.event_files.push_back(write_tensorboard(str_cat(out_dir, "/tensorboard/", run_site), site));

  std::string rows;
  for (const auto& [dir, s] : summaries) {
    rows += str_cat("<tr><td>", eval::xml_escape(run_name(dir)), "</td>");
    for (auto [key, precision] : {std::pair{"strategy", -1}, std::pair{"codec", -1}, std::pair{"sites", -1},
                                  std::pair{"workers", -1}, std::pair{"steps", -1}, std::pair{"tokens", 0},
                                  std::pair{"wall_seconds", 1}, std::pair{"final_train_loss", 4},
                                  std::pair{"final_val_loss", 4}, std::pair{"wan_bytes", 0}})
      rows += str_cat("<td>", eval::xml_escape(cell(s, key, precision)), "</td>");
    rows += "</tr>\n";
  }
  // The strategy's decisions (the adaptive controller's choices and the measured reasons they
  // rest on: step time, bandwidth, merge gap), one list per run that made any.
  std::string decisions;
  for (const auto& [dir, s] : summaries) {
    if (!s.contains("decisions") || !s["decisions"].is_array() || s["decisions"].empty()) continue;
    decisions += str_cat("<h2>Decisions of ", eval::xml_escape(run_name(dir)), "</h2>\n<ol>\n");
    for (const auto& d : s["decisions"])
      decisions += str_cat("<li>", eval::xml_escape(d.is_string() ? d.get<std::string>() : d.dump()), "</li>\n");
    decisions += "</ol>\n";
  }
  const std::string html = str_cat(
      "<!doctype html>\n<html><head><meta charset=\"utf-8\"><title>nebula report</title>\n"
      "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
      "td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td:first-child{text-align:left}"
      "figure{display:inline-block;margin:1em 1em 0 0}</style></head><body>\n<h1>nebula report</h1>\n"
      "<table><tr><th>run</th><th>strategy</th><th>codec</th><th>sites</th><th>workers</th><th>steps</th>"
      "<th>tokens</th><th>wall s</th><th>train loss</th><th>val loss</th><th>WAN bytes</th></tr>\n",
      rows, "</table>\n", decisions, images, "<p>The same curves in TensorBoard: <code>tensorboard --logdir ",
      eval::xml_escape(out_dir), "/tensorboard</code></p>\n",
      result.skipped_lines ? str_cat("<p>", result.skipped_lines, " malformed metrics lines were skipped.</p>\n") : "",
      "</body></html>\n");
  const std::string index = out_dir + "/index.html";
  std::ofstream out(index);
  out << html;
  if (!out.flush()) throw DataError(str_cat(index, ": cannot write"));
  result.files.push_back(index);
  return result;
}

}  // namespace nebula::app
