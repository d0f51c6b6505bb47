// Runs build/nebula as a user would and checks what it leaves behind.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <fstream>
#include <thread>
#include <tuple>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <map>
#include <regex>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "e2e_util.h"
#include "nebula/error.h"

namespace fs = std::filesystem;

namespace {

using namespace nebula::e2e;

TEST(EndToEnd, SmokeRunTrainsOnTwoSitesAndWritesSummary) {
  const std::string dir = temp_run_dir("smoke");
  Result r = run("run examples/smoke.toml --set job.run_dir=\\\"" + dir + "\\\"");
  ASSERT_EQ(r.exit_code, 0) << r.output;

  std::ifstream sin(dir + "/summary.json");
  ASSERT_TRUE(sin) << "no summary.json in " << dir << "\n" << r.output;
  nlohmann::json summary = nlohmann::json::parse(sin);
  for (const char* key : {"steps", "tokens", "wall_seconds", "final_train_loss", "final_val_loss", "wan_bytes"})
    EXPECT_TRUE(summary.contains(key)) << key;
  EXPECT_EQ(summary["steps"].get<int>(), 60);
  EXPECT_EQ(summary["sites"].get<int>(), 2);
  EXPECT_GT(summary["tokens"].get<double>(), 0);
  EXPECT_GT(summary["wan_bytes"].get<double>(), 0);

  // Loss falls: each site's first logged loss is above its last one.
  std::ifstream min(dir + "/metrics.jsonl");
  std::map<std::string, std::vector<double>> losses;
  std::map<std::string, double> wan_sent;
  int estimates = 0;
  for (std::string line; std::getline(min, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("eval")) {  // a site's held-out evaluation (its own languages), not a training window
      for (const char* key : {"time", "site", "rank", "step"}) ASSERT_TRUE(j.contains(key)) << key << " missing in " << line;
      EXPECT_TRUE(j["eval"].contains("en")) << line;
      continue;
    }
    for (const char* key : {"time", "site", "rank", "step", "loss", "tokens", "wan_bytes_sent", "wan_bytes_received"})
      ASSERT_TRUE(j.contains(key)) << key << " missing in " << line;
    if (j["rank"] == 0) {
      losses[j["site"]].push_back(j["loss"]);
      wan_sent[j["site"]] = j["wan_bytes_sent"];
      // Link estimates: the measured RTT cannot beat the emulated 20 ms. Its samples come from
      // pings stamped before their write, so a loaded machine can only add delay (samples
      // timed from a data frame's write returning once gave 17.1 ms here).
      for (auto& [peer, e] : j["wan_links"].items()) {
        EXPECT_GE(e["rtt_ms"].get<double>(), 20.0) << peer;
        EXPECT_GT(e["bandwidth_bits_per_s"].get<double>(), 0) << peer;
        ++estimates;
      }
    }
  }
  ASSERT_EQ(losses.size(), 2u);
  EXPECT_GT(estimates, 0);
  for (auto& [site, l] : losses) {
    ASSERT_GE(l.size(), 3u) << site;
    EXPECT_LT(l.back(), l.front() - 0.3) << site << ": loss did not fall";
  }
  // Mutual TLS by default: local mode made a CA and site certificates, and the audit log has
  // one accepted line per connection on each side.
  EXPECT_EQ(summary["security"], "mutual TLS 1.3");
  EXPECT_TRUE(fs::exists(dir + "/certs/ca.pem"));
  std::ifstream ain(dir + "/audit.jsonl");
  int accepted = 0;
  for (std::string line; std::getline(ain, line);) {
    auto j = nlohmann::json::parse(line);
    EXPECT_EQ(j["outcome"], "accepted") << line;
    EXPECT_EQ(j["fingerprint"].get<std::string>().size(), 64u) << line;
    ++accepted;
  }
  EXPECT_EQ(accepted, 2);  // alpha accepted beta's stream; beta's dial was accepted
  // sync sends every step's full gradient: the summary's WAN bytes are the gateways' total.
  EXPECT_GE(summary["wan_bytes"].get<double>(), wan_sent["alpha"] + wan_sent["beta"]);

  // `nebula report` draws the run: three charts and a page showing them.
  Result report = run("report " + dir);
  ASSERT_EQ(report.exit_code, 0) << report.output;
  for (const char* file : {"loss_vs_time.svg", "loss_vs_tokens.svg", "loss_vs_wan.svg", "index.html"})
    EXPECT_TRUE(fs::exists(dir + "/report/" + file)) << file;
  EXPECT_NE(read_file(dir + "/report/loss_vs_time.svg").find("· beta"), std::string::npos);
  fs::remove_all(dir);
}

// Users' own corpora: a TSV of pairs (sites split by language) and a plain text file (sites
// split by slice).
TEST(EndToEnd, TrainsOnUsersTsvAndTextFiles) {
  const std::string dir = temp_run_dir("own");
  fs::create_directories(dir);
  const char* words[] = {"red", "green", "blue", "small", "large", "house", "tree", "river", "stone", "bird"};
  std::ofstream tsv(dir + "/pairs.tsv"), txt(dir + "/lines.txt");
  tsv << "# lang<TAB>English<TAB>other\n";
  for (int i = 0; i < 600; ++i) {
    std::string en, other;
    for (int j = 0; j < 5; ++j) {
      en += std::string(j ? " " : "") + words[(i * 7 + j * 3) % 10];
      other += std::string(j ? " " : "") + words[(i * 7 + j * 3) % 10] + "o";
    }
    tsv << (i % 2 ? "aa" : "bb") << "\t" << en << " " << i << "\t" << other << " " << i << "\n";
    txt << en << " " << i << "\n";
  }
  tsv.close();
  txt.close();
  const std::string common = " --set job.steps=6 --set data.vocab_size=60 --set job.run_dir=\\\"" + dir + "/run\\\"";
  Result r = run("run examples/smoke.toml --set data.source=tsv --set data.path=\\\"" + dir +
                 "/pairs.tsv\\\" --set 'sites.0.languages=[\"aa\"]' --set 'sites.1.languages=[\"bb\"]'" + common);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/run/summary.json"));
  Result t = run("run examples/smoke.toml --set data.source=text --set data.path=\\\"" + dir +
                 "/lines.txt\\\" --set sites.0.languages=[] --set sites.1.languages=[]" + common);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  // A language no line carries is an error naming the site, not an empty run.
  Result bad = run("run examples/smoke.toml --set data.source=tsv --set data.path=\\\"" + dir +
                   "/pairs.tsv\\\" --set 'sites.0.languages=[\"aa\"]' --set 'sites.1.languages=[\"zz\"]'" +
                   common);
  EXPECT_NE(bad.exit_code, 0) << bad.output;
  EXPECT_NE(bad.output.find("site 'beta' has no training sentences"), std::string::npos) << bad.output;
  fs::remove_all(dir);
}

// A WAN stall and then a cut mid-run cost time and a reconnection, nothing else: the job
// finishes and its model is bit-identical to a run without faults (every update applied
// exactly once). Faults apply to the first connection only (a reconnected link is a clean
// one), so the stall comes before the cut, or it would never fire.
TEST(EndToEnd, CutAndStalledWanLinkChangesNothingButTime) {
  const std::string dir = temp_run_dir("faults");
  fs::create_directories(dir);
  std::ifstream in(NEBULA_SOURCE_DIR "/examples/smoke.toml");
  std::stringstream text;
  text << in.rdbuf()
       << "\n[[wan.faults]]\nkind = \"stall\"\nafter = \"512KiB\"\nduration = \"300ms\"\n"
       << "\n[[wan.faults]]\nkind = \"cut\"\nafter = \"1MiB\"\n";
  std::ofstream(dir + "/faults.toml") << text.str();
  const std::string common = " --set job.steps=30 --set wan.streams=2";
  Result clean = run("run examples/smoke.toml" + common + " --set job.run_dir=\\\"" + dir + "/clean\\\"");
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  Result faulty = run("run " + dir + "/faults.toml" + common + " --set job.run_dir=\\\"" + dir + "/faulty\\\"");
  ASSERT_EQ(faulty.exit_code, 0) << faulty.output;

  auto summary = [&](const std::string& run_dir) {
    std::ifstream s(dir + "/" + run_dir + "/summary.json");
    return nlohmann::json::parse(s);
  };
  // Bit-identical: every tensor of the trained model, byte for byte (the losses follow).
  const auto clean_model = tensor_bytes(dir + "/clean/model.safetensors");
  ASSERT_GT(clean_model.size(), 5u);
  EXPECT_TRUE(tensor_bytes(dir + "/faulty/model.safetensors") == clean_model) << "the faults changed the model";
  EXPECT_EQ(summary("clean")["final_val_loss"], summary("faulty")["final_val_loss"]);
  // Both faults fired (the emulator logs each firing on the gateway that sends through it).
  auto logs_of = [&](const std::string& run_dir) {
    std::string logs;
    for (const auto& f : fs::directory_iterator(dir + "/" + run_dir + "/logs")) logs += read_file(f.path().string());
    return logs;
  };
  const std::string faulty_logs = logs_of("faulty");
  EXPECT_NE(faulty_logs.find("): cut;"), std::string::npos) << faulty_logs;
  EXPECT_NE(faulty_logs.find("): stall, nothing delivered for 300 ms"), std::string::npos) << faulty_logs;
  EXPECT_EQ(logs_of("clean").find("fault fires"), std::string::npos);
  // The wire carries more than the frames (TLS records, acks, probes; re-sends after the cut).
  // Compared on the receiving side: a frame is received only once all its bytes came off the
  // socket, while the sent side's wire count lags the frames still queued or in the emulator's
  // flight when the summary is taken.
  for (const char* run : {"clean", "faulty"})
    EXPECT_GT(summary(run)["wan_wire_bytes_received"].get<double>(), summary(run)["wan_bytes_received"].get<double>())
        << run;
  // The audit log shows the reconnection (a second generation of both streams).
  std::ifstream ain(dir + "/faulty/audit.jsonl");
  int reconnected = 0;
  for (std::string line; std::getline(ain, line);) {
    auto j = nlohmann::json::parse(line);
    reconnected += j["reason"] == "reconnected";
  }
  EXPECT_EQ(reconnected, 2) << "one reconnection of 2 streams expected";

  // [4/5] A black hole instead (no FIN, no RST: every byte vanishes both ways): the silence is
  // noticed within wan.liveness_timeout, the link is replaced, and again nothing else changes.
  std::ifstream smoke(NEBULA_SOURCE_DIR "/examples/smoke.toml");
  std::stringstream hole_text;
  hole_text << smoke.rdbuf() << "\n[[wan.faults]]\nkind = \"blackhole\"\nafter = \"1MiB\"\n";
  std::ofstream(dir + "/hole.toml") << hole_text.str();
  Result hole = run("run " + dir + "/hole.toml" + common + " --set wan.liveness_timeout=1s --set job.run_dir=\\\"" +
                    dir + "/hole\\\"");
  ASSERT_EQ(hole.exit_code, 0) << hole.output;
  EXPECT_TRUE(tensor_bytes(dir + "/hole/model.safetensors") == clean_model) << "the black hole changed the model";
  EXPECT_EQ(summary("clean")["final_val_loss"], summary("hole")["final_val_loss"]);
  const std::string logs = logs_of("hole");
  EXPECT_NE(logs.find("): black hole"), std::string::npos) << logs;
  EXPECT_NE(logs.find("(wan.liveness_timeout"), std::string::npos) << logs;
  std::ifstream hin(dir + "/hole/audit.jsonl");
  int replaced = 0;
  for (std::string line; std::getline(hin, line);) replaced += nlohmann::json::parse(line)["reason"] == "reconnected";
  EXPECT_EQ(replaced, 2) << "one reconnection of 2 streams expected";
  fs::remove_all(dir);
}

// Training with each codec on the inter-site leg reaches nearly the loss of exact float32,
// while the WAN carries fewer bytes. Tolerance: final validation loss within 3% of "none"
// (measured spread: see the closing note of issue [3/7]).
TEST(EndToEnd, EveryCodecTrainsToNearlyTheSameLossWithFewerWanBytes) {
  const std::string dir = temp_run_dir("codecs");
  std::map<std::string, nlohmann::json> summaries;
  for (const char* codec : {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd"}) {
    Result r = run(std::string("run examples/smoke.toml --set strategy.codec=") + codec +
                   " --set strategy.codec_density=0.05 --set job.run_dir=\\\"" + dir + "/" + codec + "\\\"");
    ASSERT_EQ(r.exit_code, 0) << codec << "\n" << r.output;
    std::ifstream in(dir + "/" + codec + "/summary.json");
    summaries[codec] = nlohmann::json::parse(in);
  }
  const double base_loss = summaries["none"]["final_val_loss"];
  const double base_bytes = summaries["none"]["wan_bytes"];
  // WAN bytes at most this fraction of "none" (headers, and PowerSGD sends small or 1-D
  // tensors raw: this model is small, so its share of raw tensors is large).
  const std::map<std::string, double> max_fraction = {{"fp16", 0.55}, {"bf16", 0.55}, {"int8", 0.3},
                                                      {"int4", 0.2},  {"topk", 0.2},  {"powersgd", 0.7}};
  for (auto& [codec, s] : summaries) {
    if (codec == "none") continue;
    EXPECT_NEAR(s["final_val_loss"].get<double>(), base_loss, 0.03 * base_loss) << codec;
    EXPECT_LT(s["wan_bytes"].get<double>(), base_bytes * max_fraction.at(codec)) << codec;
  }
  fs::remove_all(dir);
}

// [2/5] ZeRO-1 inside each site (two workers per site): AdamW's moments are sharded and the
// parameters all-gathered after every step. The math is the whole AdamW's, so sync and diloco
// end at the loss of the same job with shard = "none" (float differences only), and the log
// says how much optimizer state each worker holds.
// fn(x, y) for every pair of float32 values at one place of two model files' tensors
// (tensor_bytes); false, before any call, if their names or sizes differ.
bool each_value_pair(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b,
                     const std::function<void(double, double)>& fn) {
  if (a.size() != b.size()) return false;
  for (const auto& [name, bytes] : a) {
    auto it = b.find(name);
    if (it == b.end() || it->second.size() != bytes.size() || bytes.size() % 4) return false;
  }
  for (const auto& [name, bytes] : a)
    for (size_t i = 0; i < bytes.size(); i += 4) {
      float x, y;
      std::memcpy(&x, bytes.data() + i, 4);
      std::memcpy(&y, b.at(name).data() + i, 4);
      fn(x, y);
    }
  return true;
}

// The largest |a - b| / max(|a|, |b|, 1e-3) over the values of two model files, or +inf if their
// names or sizes differ.
double max_relative_difference(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  double worst = 0;
  const bool same = each_value_pair(a, b, [&](double x, double y) {
    worst = std::max(worst, std::fabs(x - y) / std::max({std::fabs(x), std::fabs(y), 1e-3}));
  });
  return same ? worst : HUGE_VAL;
}

// The largest |a - b| over the values of two model files (+inf as above).
double max_abs_difference(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  double worst = 0;
  const bool same = each_value_pair(a, b, [&](double x, double y) { worst = std::max(worst, std::fabs(x - y)); });
  return same ? worst : HUGE_VAL;
}

// ‖a − b‖ / ‖a‖ over every value of two model files (+inf as above, or for a of norm 0).
double relative_l2_difference(const std::map<std::string, std::string>& a, const std::map<std::string, std::string>& b) {
  double diff = 0, norm = 0;
  const bool same = each_value_pair(a, b, [&](double x, double y) {
    diff += (x - y) * (x - y);
    norm += x * x;
  });
  return same && norm > 0 ? std::sqrt(diff / norm) : HUGE_VAL;
}

// A model file's tensors without attention's key biases (the encoder's, the decoder's self- and
// cross-attention's), and those apart. A key bias's gradient
// is exactly zero (softmax ignores a shift shared by every key), so what backward gives it is
// rounding alone, and AdamW turns that into steps of up to lr: two runs that sum the same
// gradients in another order end with key biases apart by up to lr per step, and nothing else
// changes. They are compared apart, against the steps they took.
std::pair<std::map<std::string, std::string>, std::map<std::string, std::string>> split_key_biases(
    std::map<std::string, std::string> all) {
  std::map<std::string, std::string> key_bias;
  for (auto it = all.begin(); it != all.end();)
    if (it->first.size() > 7 && it->first.compare(it->first.size() - 6, 6, "k.bias") == 0 &&
        (it->first[it->first.size() - 7] == '.' || it->first[it->first.size() - 7] == '_')) {  // "layers.0.k.bias", "decoder.0.self_k.bias"
      key_bias.insert(*it);
      it = all.erase(it);
    } else {
      ++it;
    }
  return {all, key_bias};
}

// ZeRO-1 (sync, diloco), ZeRO-2 and ZeRO-3 (diloco, streaming) against the whole optimizer on the
// same data and seeds: the same final weights within 1e-6 relative, 1e-4 for ZeRO-3 (the same
// AdamW elementwise; ZeRO-2 and -3 sum the site's gradients by reduce-scatter, ZeRO-3 layer by
// layer, in another order than Gloo's all-reduce with more than 2 workers: see below), with 2
// workers on one site and 3 on the other (shards padded unless 3 divides the parameter count).
// ZeRO-3 with dropout runs with [parallel] recompute: its layers, run again in backward, draw the
// same masks again, so it ends where ZeRO-2 does; streaming's ZeRO-3 runs with prefetch.
TEST(EndToEnd, ZeroOneShardsTheOptimizerAndTrainsAsTheWholeOne) {
  const std::string dir = temp_run_dir("zero1");
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"sync", "none"},          {"sync", "optimizer"},      {"diloco", "none"},           {"diloco", "optimizer"},
      {"diloco", "gradients"},   {"diloco", "full"},         {"streaming", "none"},        {"streaming", "gradients"},
      {"streaming", "full"},     {"dropout", "gradients"},   {"dropout", "full"}};
  for (const auto& [kind, shard] : runs) {
    const std::string name = nebula::str_cat(kind, "-", shard);
    const std::string strategy = kind != "dropout"  ? kind
                                 : shard == "full" ? "diloco --set model.dropout=0.1 --set parallel.recompute=true"
                                                   : "diloco --set model.dropout=0.1";
    Result r = run(nebula::str_cat("run examples/smoke.toml --set sites.0.workers=2 --set sites.1.workers=3 --set strategy.kind=",
                                   strategy, " --set strategy.inner_steps=10 --set strategy.heterogeneous=false --set job.steps=40",
                                   kind == "streaming" ? " --set strategy.fragments=2 --set strategy.delay=2" : "",
                                   kind == "streaming" && shard == "full" ? " --set parallel.prefetch=true" : "",
                                   " --set parallel.shard=", shard, " --set job.run_dir=\\\"", dir, "/", name, "\\\""));
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    const std::string log = read_file(dir + "/" + name + "/logs/alpha-0.log");
    const char* zero = shard == "optimizer" ? "ZeRO-1" : shard == "gradients" ? "ZeRO-2" : shard == "full" ? "ZeRO-3" : "ZeRO-";
    EXPECT_EQ(log.find(zero) != std::string::npos, shard != "none") << name << "\n" << log;
  }
  auto weights = [&](const std::string& kind, const std::string& shard) {
    return tensor_bytes(dir + "/" + kind + "-" + shard + "/model.safetensors");
  };
  // ZeRO-3 cuts each layer over the workers, ZeRO-2 one flat vector: the 2-worker site sums in
  // the same order (a + b), the 3-worker site's rings start from other workers, so the sums agree
  // to rounding (parallel/full_shard_test.cc: bit-identical with 2 workers); the key biases
  // amplify that rounding (split_key_biases) and are compared apart.
  auto split = split_key_biases;
  for (const auto& [kind, shard] : runs) {
    if (shard == "none" || kind == "dropout") continue;
    const bool three = shard == "full";
    const auto [a, a_bias] = split(weights(kind, "none"));
    const auto [b, b_bias] = split(weights(kind, three ? "full" : shard));
    const double d = max_relative_difference(three ? a : weights(kind, "none"), three ? b : weights(kind, shard));
    std::printf("%s: shard = %s ends %.3g (relative) from shard = none%s\n", kind.c_str(), shard.c_str(), d,
                three ? " (the key biases apart)" : "");
    // ZeRO-1: the same all-reduce; ZeRO-2: its reduce-scatter sums in Gloo's ring order here;
    // ZeRO-3: reordered sums on the 3-worker site, which AdamW's normalisation amplifies where a
    // gradient is small next to its running scale (measured: 6.6e-5).
    EXPECT_LE(d, shard == "optimizer" ? 0.0 : three ? 1e-4 : 1e-6) << kind << " " << shard;
    if (three) {
      const double bias = max_abs_difference(a_bias, b_bias);  // against lr (examples/smoke.toml: 3e-3) per step (40)
      std::printf("%s: shard = full's key biases end %.3g from shard = none's\n", kind.c_str(), bias);
      EXPECT_LE(bias, 40 * 3e-3) << kind << ": the key biases moved further than their steps";
    }
  }
  for (const char* kind : {"dropout"}) {
    const double d = max_relative_difference(split(weights(kind, "gradients")).first, split(weights(kind, "full")).first);
    std::printf("%s: shard = full ends %.3g (relative) from shard = gradients (the key biases apart)\n", kind, d);
    EXPECT_LE(d, 1e-4) << kind << ": ZeRO-3 and ZeRO-2 end apart";
  }
  // ZeRO-2 and -3 with sync are refused, naming the key.
  for (const char* shard : {"gradients", "full"}) {
    Result r = run(nebula::str_cat("run examples/smoke.toml --set strategy.kind=sync --set parallel.shard=", shard), 60);
    EXPECT_EQ(r.exit_code, 2) << r.output;
    EXPECT_NE(r.output.find("parallel.shard"), std::string::npos) << r.output;
  }
  fs::remove_all(dir);
}

// [parallel] tensor: a one-site job's tensor slices train as the same job without them (no
// dropout, gradients clipped by the whole model's norm): 2 slices as one worker (the MLM encoder,
// and the translation model with label smoothing), 2 slices × 2 replicas as 2 replicas (sync,
// and diloco with ZeRO-1 and -2 along the data dimension), to rounding
// (the slices' partial sums add in another order). Each worker holds its slices; the gateway
// writes the whole model; a stop and resume changes nothing. Bad layouts are refused naming the key.
TEST(EndToEnd, TensorSlicesTrainAsTheWholeModel) {
  const std::string dir = temp_run_dir("tensor");
  const std::string diloco = "--set strategy.kind=diloco --set strategy.inner_steps=5";
  const std::string s2s = "--set model.kind=seq2seq --set 'data.languages=[\"de\"]' --set model.label_smoothing=0.1 "
                          "--set eval.pairs=20 --set eval.beam=2";
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"one", "--set sites.0.workers=1 --set parallel.tensor=1"},
      {"tp2", "--set sites.0.workers=2"},
      {"data2", "--set sites.0.workers=2 --set parallel.tensor=1"},
      {"tp2x2", ""},
      {"data2-diloco", "--set sites.0.workers=2 --set parallel.tensor=1 " + diloco},
      {"tp2x2-diloco-zero1", diloco + " --set parallel.shard=optimizer"},
      {"tp2x2-diloco-zero2", diloco + " --set parallel.shard=gradients"},
      {"s2s-one", s2s + " --set sites.0.workers=1 --set parallel.tensor=1"},
      {"s2s-tp2", s2s + " --set sites.0.workers=2"}};
  for (const auto& [name, args] : runs) {
    Result r = run(nebula::str_cat("run examples/tensor.toml --set job.steps=20 ", args, " --set job.run_dir=\\\"",
                                   dir, "/", name, "\\\""));
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
  }
  EXPECT_NE(read_file(dir + "/tp2x2/logs/alpha-3.log").find("tensor slice 1 of 2: 1 of 2 heads per layer, 32 of 64 MLP units"),
            std::string::npos);
  EXPECT_NE(read_file(dir + "/tp2x2-diloco-zero1/logs/alpha-1.log").find("ZeRO-1 over 2 replicas of tensor slice 1"),
            std::string::npos);
  auto weights = [&](const std::string& name) { return split_key_biases(tensor_bytes(dir + "/" + name + "/model.safetensors")); };
  auto summary = [&](const std::string& name) { return nlohmann::json::parse(read_file(dir + "/" + name + "/summary.json")); };
  for (const auto& [plain, sliced] : {std::pair{"one", "tp2"}, std::pair{"data2", "tp2x2"},
                                      std::pair{"data2-diloco", "tp2x2-diloco-zero1"},
                                      std::pair{"data2-diloco", "tp2x2-diloco-zero2"}, std::pair{"s2s-one", "s2s-tp2"}}) {
    const auto [a, a_bias] = weights(plain);
    const auto [b, b_bias] = weights(sliced);
    ASSERT_FALSE(a.empty());
    const double l2 = relative_l2_difference(a, b), d = max_relative_difference(a, b);
    std::printf("tensor: %s ends %.3g from %s (relative L2; elementwise at most %.3g), the key biases %.3g apart\n",
                sliced, l2, plain, d, max_abs_difference(a_bias, b_bias));
    EXPECT_LE(l2, 1e-5) << sliced << " against " << plain;
    EXPECT_LE(max_abs_difference(a_bias, b_bias), 20 * 3e-3) << sliced << ": the key biases moved further than their steps";
    EXPECT_EQ(summary(plain)["tokens"], summary(sliced)["tokens"]) << "the same batches, counted once";
    EXPECT_EQ(summary(plain)["parameters"], summary(sliced)["parameters"]) << "the whole model's, every slice's";
    EXPECT_NEAR(summary(plain)["final_val_loss"].get<double>(), summary(sliced)["final_val_loss"].get<double>(), 1e-3);
    EXPECT_EQ(summary(sliced)["tensor"]["slices"], 2);
  }
  // Stopped and resumed (each worker's checkpoint holds its slices): the uninterrupted run's
  // weights bit for bit. Onto another layout (one worker): cut anew, the one data replica
  // continuing its data, ending where one worker ends.
  const std::string sliced = nebula::str_cat("run examples/tensor.toml --set job.steps=20 --set sites.0.workers=2 "
                                             "--set job.run_dir=\\\"", dir, "/tp2");
  for (const char* name : {"-stopped", "-relaid"}) {
    Result stopped = run(sliced + name + "\\\"", 600, "NEBULA_TEST_STOP_AT_STEP=9");
    ASSERT_EQ(stopped.exit_code, 128 + 15) << stopped.output;
  }
  Result resumed = run(sliced + "-stopped\\\" --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(tensor_bytes(dir + "/tp2-stopped/model.safetensors"), tensor_bytes(dir + "/tp2/model.safetensors"));
  Result relaid = run(sliced + "-relaid\\\" --resume --set parallel.tensor=1 --set sites.0.workers=1");
  ASSERT_EQ(relaid.exit_code, 0) << relaid.output;
  EXPECT_NE(read_file(dir + "/tp2-relaid/logs/alpha-0.log").find("written by 2 tensor slices × 1 anew for 1 worker "),
            std::string::npos);
  const double relaid_l2 = relative_l2_difference(weights("one").first, weights("tp2-relaid").first);
  std::printf("tensor: stopped as tensor 2, resumed as one worker, ends %.3g (relative L2) from one\n", relaid_l2);
  EXPECT_LE(relaid_l2, 1e-5);
  EXPECT_EQ(summary("one")["tokens"], summary("tp2-relaid")["tokens"]);
  // Bad layouts: exit code 2 and the key.
  for (const std::string args : {"--set parallel.tensor=4", "--set sites.0.workers=3",
                                 "--set peft.kind=lora",
                                 "--set parallel.shard=full --set strategy.kind=diloco",
                                 "--set parallel.pipeline=2"}) {
    Result r = run("run examples/tensor.toml " + args, 60);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find("parallel.tensor"), std::string::npos) << args << "\n" << r.output;
    if (args.find("parallel.tensor") == std::string::npos) {  // the key is the file's: its line is named
      EXPECT_NE(r.output.find("tensor.toml:"), std::string::npos) << args << "\n" << r.output;
    }
  }
  fs::remove_all(dir);
}

// [parallel] pipeline: a one-site job's stages train as the same job without them (sync, no
// dropout, gradients clipped by the whole model's norm): 2 stages × 2 replicas as 2 replicas,
// 4 stages as one worker, to rounding (each micro-batch's loss is summed apart; the key biases
// apart, as above). Each stage holds part of
// the model; the gateway writes the whole one; a stop and resume changes nothing. Bad layouts are
// refused naming the key.
TEST(EndToEnd, PipelineStagesTrainAsTheWholeModel) {
  const std::string dir = temp_run_dir("pipeline");
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"data2", "--set sites.0.workers=2 --set parallel.pipeline=1"},
      {"pipe2x2", ""},
      {"one", "--set sites.0.workers=1 --set parallel.pipeline=1"},
      {"pipe4", "--set parallel.pipeline=4 --set parallel.micro_batches=3"},
      {"pipe2x2-zero1", "--set parallel.shard=optimizer"},
      {"pipe2x2-diloco", "--set strategy.kind=diloco --set strategy.inner_steps=5"},
      {"pipe2x2-diloco-zero2", "--set strategy.kind=diloco --set strategy.inner_steps=5 --set parallel.shard=gradients"},
      {"pipe2x2-dropout", "--set model.dropout=0.1"},
      {"pipe2x2-dropout-recompute", "--set model.dropout=0.1 --set parallel.recompute=true"}};
  for (const auto& [name, args] : runs) {
    Result r = run(nebula::str_cat("run examples/pipeline.toml --set job.steps=20 ", args, " --set job.run_dir=\\\"",
                                   dir, "/", name, "\\\""));
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
  }
  const std::string log = read_file(dir + "/pipe4/logs/alpha-3.log");
  EXPECT_NE(log.find("pipeline stage 3 of 4: layers [3, 4), the final norm and the tied projection"), std::string::npos)
      << log;
  auto weights = [&](const std::string& name) { return split_key_biases(tensor_bytes(dir + "/" + name + "/model.safetensors")); };
  auto summary = [&](const std::string& name) { return nlohmann::json::parse(read_file(dir + "/" + name + "/summary.json")); };
  for (const auto& [plain, staged] : {std::pair{"data2", "pipe2x2"}, std::pair{"one", "pipe4"}}) {
    const auto [a, a_bias] = weights(plain);
    const auto [b, b_bias] = weights(staged);
    ASSERT_FALSE(a.empty());
    const double l2 = relative_l2_difference(a, b), d = max_relative_difference(a, b);
    const double bias = max_relative_difference(a_bias, b_bias);
    std::printf("pipeline: %s ends %.3g from %s (relative L2; elementwise at most %.3g), the key biases %.3g\n",
                staged, l2, plain, d, bias);
    // The whole weight vector within 1e-5 (measured: 9.3e-7 and 3.1e-7). Elementwise, AdamW amplifies the
    // rounding of reordered sums where a gradient is small next to its running scale (as with
    // ZeRO-3 above; measured 5.3e-4 after 20 steps); the key biases move up to lr per step.
    EXPECT_LE(l2, 1e-5) << staged << " against " << plain;
    EXPECT_LE(d, 2e-3) << staged << " against " << plain;
    EXPECT_LE(max_abs_difference(a_bias, b_bias), 20 * 3e-3) << staged << ": the key biases moved further than their steps";
    EXPECT_EQ(summary(plain)["tokens"], summary(staged)["tokens"]) << "the same batches, counted once";
    EXPECT_EQ(summary(plain)["parameters"], summary(staged)["parameters"]) << "the whole model's, every stage's";
    EXPECT_NEAR(summary(plain)["final_val_loss"].get<double>(), summary(staged)["final_val_loss"].get<double>(), 1e-3);
  }
  // ZeRO along the data dimension: each stage's 2 replicas shard its AdamW state (ZeRO-1, the same
  // arithmetic: bit for bit) and its gradients (ZeRO-2, reduce-scattered: the same sums of 2).
  const auto zero1 = tensor_bytes(dir + "/pipe2x2-zero1/model.safetensors");
  ASSERT_FALSE(zero1.empty());
  EXPECT_EQ(zero1, tensor_bytes(dir + "/pipe2x2/model.safetensors"));
  const double zero2 = relative_l2_difference(tensor_bytes(dir + "/pipe2x2-diloco/model.safetensors"),
                                              tensor_bytes(dir + "/pipe2x2-diloco-zero2/model.safetensors"));
  std::printf("pipeline: diloco with ZeRO-2 inside the stages ends %.3g (relative L2) from without\n", zero2);
  EXPECT_LE(zero2, 1e-6);
  EXPECT_NE(read_file(dir + "/pipe2x2-diloco-zero2/logs/alpha-2.log").find("ZeRO-2 over 2 replicas of pipeline stage 1"),
            std::string::npos);
  // recompute: the first stage runs each forward again in backward, its generator set back so
  // dropout draws the same masks: the same weights bit for bit.
  const auto dropped = tensor_bytes(dir + "/pipe2x2-dropout/model.safetensors");
  ASSERT_FALSE(dropped.empty());
  EXPECT_NE(dropped, tensor_bytes(dir + "/pipe2x2/model.safetensors")) << "dropout changed nothing";
  EXPECT_EQ(dropped, tensor_bytes(dir + "/pipe2x2-dropout-recompute/model.safetensors"));
  // Stopped and resumed (each worker's checkpoint holds its stage): the uninterrupted run's weights
  // bit for bit.
  const std::string piped = nebula::str_cat("run examples/pipeline.toml --set job.steps=20 --set job.run_dir=\\\"", dir,
                                            "/pipe2x2");
  Result stopped = run(piped + "-stopped\\\"", 600, "NEBULA_TEST_STOP_AT_STEP=9");
  ASSERT_EQ(stopped.exit_code, 128 + 15) << stopped.output;
  Result resumed = run(piped + "-stopped\\\" --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(tensor_bytes(dir + "/pipe2x2-stopped/model.safetensors"), tensor_bytes(dir + "/pipe2x2/model.safetensors"));
  // Onto another layout: the 2 stages × 2 replicas' checkpoints cut anew for 2 unstaged workers,
  // whose 2 data replicas continue where the old ones stopped: the unstaged run's weights to
  // rounding, its tokens exactly.
  Result relaid_stop = run(piped + "-relaid\\\"", 600, "NEBULA_TEST_STOP_AT_STEP=9");
  ASSERT_EQ(relaid_stop.exit_code, 128 + 15) << relaid_stop.output;
  Result relaid = run(piped + "-relaid\\\" --resume --set parallel.pipeline=1 --set sites.0.workers=2");
  ASSERT_EQ(relaid.exit_code, 0) << relaid.output;
  EXPECT_NE(read_file(dir + "/pipe2x2-relaid/logs/alpha-1.log")
                .find("cut the checkpoint of step 9 written by 2 pipeline stages × 2 anew for 2 workers (each data "
                      "replica continues its position)"),
            std::string::npos);
  {
    const auto [a, a_bias] = weights("data2");
    const auto [b, b_bias] = weights("pipe2x2-relaid");
    const double l2 = relative_l2_difference(a, b);
    std::printf("pipeline: stopped in stages, resumed unstaged, ends %.3g (relative L2) from the unstaged run\n", l2);
    EXPECT_LE(l2, 1e-5);
    EXPECT_EQ(summary("data2")["tokens"], summary("pipe2x2-relaid")["tokens"]);
  }
  // A one-site job's diloco keeps its outer state per stage: onto another layout it is refused,
  // saying which to resume with.
  Result outer_stop = run(piped + "-diloco-stopped\\\" --set strategy.kind=diloco --set strategy.inner_steps=5", 600,
                          "NEBULA_TEST_STOP_AT_STEP=7");
  ASSERT_EQ(outer_stop.exit_code, 128 + 15) << outer_stop.output;
  Result other = run(piped + "-diloco-stopped\\\" --set strategy.kind=diloco --set strategy.inner_steps=5 --resume "
                     "--set parallel.pipeline=1 --set sites.0.workers=2", 120);
  EXPECT_NE(other.exit_code, 0) << other.output;
  EXPECT_NE(other.output.find("resume with parallel.pipeline = 2, parallel.tensor = 1 and the site's 4 workers"),
            std::string::npos) << other.output;
  // Bad layouts: exit code 2 and the key.
  for (const auto& [args, key] : std::vector<std::pair<std::string, std::string>>{
           {"--set parallel.pipeline=3", "parallel.pipeline"},
           {"--set parallel.pipeline=5 --set sites.0.workers=5", "parallel.pipeline"},
           {"--set parallel.micro_batches=17", "parallel.micro_batches"},
           {"--set model.kind=seq2seq --set 'data.languages=[\"de\"]'", "parallel.pipeline"},
           {"--set parallel.shard=full --set strategy.kind=diloco", "parallel.pipeline"}}) {
    Result r = run("run examples/pipeline.toml " + args, 60);
    EXPECT_EQ(r.exit_code, 2) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(key), std::string::npos) << args << "\n" << r.output;
    if (args.find(key) == std::string::npos) {  // the key is the file's: its line is named
      EXPECT_NE(r.output.find("pipeline.toml:"), std::string::npos) << args << "\n" << r.output;
    }
  }
  fs::remove_all(dir);
}

// [wan] mode = "every_worker": each worker carries its own part of the site's WAN traffic over
// its own mutual-TLS links. With the exact codec, diloco ends bit-identical to gateway mode
// (unsharded and with ZeRO-2, 2 + 3 workers); streaming with ZeRO-3 and int8 passes every hash
// check. Every worker sends bytes (in gateway mode only the gateways), and they add up to the
// job's total. Bad configs are refused naming the key.
// Sites of different layouts ([[sites]] parallel, examples/mixed_layouts.toml): site alpha in 2
// pipeline stages (× 2 data replicas, with ZeRO-1 over each stage's pair), or in 2 tensor slices
// (× 2 data replicas, with ZeRO-2 over each slice's pair; and the translation model's), beside site beta of plain data parallelism train as the same job with
// alpha unstaged, to rounding (the stages sum each micro-batch's loss apart; the slices' sums
// run in another order): diloco in both WAN modes and streaming, every outer step's
// global weights agreeing on every site (hash_checks), the same bytes on the WAN in gateway mode.
TEST(EndToEnd, SitesOfDifferentLayoutsTrainOneModel) {
  const std::string dir = temp_run_dir("mixed_layouts");
  const std::string base = "run examples/mixed_layouts.toml --set job.steps=20 --set strategy.inner_steps=5 "
                           "--set sites.1.workers=1 --set strategy.heterogeneous=false ";
  const std::string equal = "--set sites.0.parallel.pipeline=1 ";
  const std::string every = "--set wan.mode=every_worker ";
  const std::string stream = "--set strategy.kind=streaming --set strategy.fragments=2 --set strategy.delay=1 ";
  const std::string tensor = "--set sites.0.parallel.pipeline=1 --set sites.0.parallel.tensor=2 ";
  const std::string s2s = "--set model.kind=seq2seq --set 'data.languages=[\"de\"]' --set model.label_smoothing=0.1 "
                          "--set eval.pairs=20 --set eval.beam=2 ";
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"equal", equal + "--set sites.0.workers=1"},
      {"mixed", "--set sites.0.workers=2"},
      {"mixed-every", every + "--set sites.0.workers=2"},
      {"equal-stream", stream + every + equal + "--set sites.0.workers=1"},
      {"mixed-stream", stream + every + "--set sites.0.workers=2"},
      {"equal-data2", equal + "--set sites.0.workers=2"},
      {"mixed-2x2-zero1", every + "--set sites.0.workers=4 --set parallel.shard=optimizer"},
      {"tensor", tensor + "--set sites.0.workers=2"},
      {"tensor-every", tensor + every + "--set sites.0.workers=2"},
      {"tensor-stream", tensor + stream + every + "--set sites.0.workers=2"},
      {"tensor-2x2-zero2", tensor + every + "--set sites.0.workers=4 --set parallel.shard=gradients"},
      {"s2s-equal", s2s + equal + "--set sites.0.workers=1"},
      {"s2s-tensor", s2s + tensor + every + "--set sites.0.workers=2"}};
  std::map<std::string, nlohmann::json> summaries;
  for (const auto& [name, sets] : runs) {
    Result r = run(base + sets + " --set job.run_dir=\\\"" + dir + "/" + name + "\\\"");
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    summaries[name] = nlohmann::json::parse(read_file(dir + "/" + name + "/summary.json"));
    EXPECT_GT(summaries[name]["strategy_metrics"]["hash_checks"].get<double>(), 0) << name;
  }
  auto weights = [&](const std::string& name) { return tensor_bytes(dir + "/" + name + "/model.safetensors"); };
  // The key biases amplify rounding (split_key_biases, as with the stages of one site): apart.
  for (const auto& [plain, mixed] : {std::pair{"equal", "mixed"}, std::pair{"equal-stream", "mixed-stream"},
                                     std::pair{"equal-data2", "mixed-2x2-zero1"}, std::pair{"equal", "tensor"},
                                     std::pair{"equal-stream", "tensor-stream"}, std::pair{"equal-data2", "tensor-2x2-zero2"}, std::pair{"s2s-equal", "s2s-tensor"}}) {
    const auto [a, a_bias] = split_key_biases(weights(plain));
    const auto [b, b_bias] = split_key_biases(weights(mixed));
    ASSERT_FALSE(a.empty());
    const double l2 = relative_l2_difference(a, b);
    std::printf("mixed layouts: %s ends %.3g (relative L2; the key biases %.3g) from %s\n", mixed, l2,
                relative_l2_difference(a_bias, b_bias), plain);
    EXPECT_LE(l2, 1e-5) << mixed << " against " << plain;
    EXPECT_LE(max_abs_difference(a_bias, b_bias), 20 * 3e-3) << mixed << ": the key biases moved further than their steps";
    EXPECT_EQ(summaries[plain]["tokens"], summaries[mixed]["tokens"]) << mixed;
    EXPECT_NEAR(summaries[plain]["final_val_loss"].get<double>(), summaries[mixed]["final_val_loss"].get<double>(), 1e-3)
        << mixed;
  }
  // Each worker's own piece over its own links: the same arithmetic as the gateway's, bit for bit.
  EXPECT_EQ(weights("mixed-every"), weights("mixed"));
  EXPECT_EQ(weights("tensor-every"), weights("tensor"));
  // Gateway mode: alpha's gateway assembles each fragment from the stages, so the WAN carries
  // what it carries between unstaged sites (framing and liveness aside).
  const double equal_bytes = summaries["equal"]["wan_bytes"].get<double>();
  const double mixed_bytes = summaries["mixed"]["wan_bytes"].get<double>();
  std::printf("mixed layouts: %.0f WAN bytes with alpha in stages, %.0f without\n", mixed_bytes, equal_bytes);
  EXPECT_NEAR(mixed_bytes / equal_bytes, 1.0, 0.02);
  // every_worker: both of alpha's stages carry their own values over their own links.
  const auto by_worker = summaries["mixed-every"]["wan_bytes_sent_by_worker"].get<std::vector<double>>();
  ASSERT_EQ(by_worker.size(), 3u);
  for (double b : by_worker) EXPECT_GT(b, 0);
  // Alpha's tensor slices too: each carries its own values (slice 0 also the whole parameters),
  // and the WAN the bytes of unsliced sites.
  const auto by_slice = summaries["tensor-every"]["wan_bytes_sent_by_worker"].get<std::vector<double>>();
  ASSERT_EQ(by_slice.size(), 3u);
  for (double b : by_slice) EXPECT_GT(b, 0);
  EXPECT_NEAR(summaries["tensor"]["wan_bytes"].get<double>() / equal_bytes, 1.0, 0.02);
  // Stopped mid-round and resumed (each worker's checkpoint holds its stage and its piece of the
  // outer state): the uninterrupted run's weights, bit for bit.
  const std::string stop = base + "--set sites.0.workers=2 --set job.run_dir=\\\"" + dir + "/mixed-stopped\\\"";
  Result stopped = run(stop, 600, "NEBULA_TEST_STOP_AT_STEP=7");
  ASSERT_EQ(stopped.exit_code, 128 + 15) << stopped.output;
  Result resumed = run(stop + " --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(weights("mixed-stopped"), weights("mixed"));
  // The same with alpha's slices (each worker's checkpoint holds its slice and its piece).
  const std::string stop_sliced =
      base + tensor + "--set sites.0.workers=2 --set job.run_dir=\\\"" + dir + "/tensor-stopped\\\"";
  Result sliced_stop = run(stop_sliced, 600, "NEBULA_TEST_STOP_AT_STEP=7");
  ASSERT_EQ(sliced_stop.exit_code, 128 + 15) << sliced_stop.output;
  Result sliced_resume = run(stop_sliced + " --resume");
  ASSERT_EQ(sliced_resume.exit_code, 0) << sliced_resume.output;
  EXPECT_EQ(weights("tensor-stopped"), weights("tensor"));
  // Onto another layout, mid-round: alpha's 2 stages × 2 replicas (ZeRO-1) cut anew as 2 tensor
  // slices × 2 replicas (ZeRO-2), and alpha's 2 slices as one unsliced worker. The same data
  // replicas continue, AdamW's moments and the outer state are each worker's new part: each
  // ends at its uninterrupted run's weights to rounding, with its tokens.
  for (const auto& [name, before, after, uninterrupted] : std::vector<std::tuple<std::string, std::string, std::string, std::string>>{
           {"staged-as-sliced", every + "--set sites.0.workers=4 --set parallel.shard=optimizer",
            tensor + every + "--set sites.0.workers=4 --set parallel.shard=gradients", "mixed-2x2-zero1"},
           {"sliced-as-one", tensor + "--set sites.0.workers=2", equal + "--set sites.0.workers=1", "tensor"}}) {
    const std::string at = " --set job.run_dir=\\\"" + dir + "/" + name + "\\\"";
    Result first = run(base + before + at, 600, "NEBULA_TEST_STOP_AT_STEP=7");
    ASSERT_EQ(first.exit_code, 128 + 15) << name << "\n" << first.output;
    Result second = run(base + after + at + " --resume");
    ASSERT_EQ(second.exit_code, 0) << name << "\n" << second.output;
    EXPECT_NE(read_file(dir + "/" + name + "/logs/alpha-0.log").find("cut the checkpoint of step 7 written by "),
              std::string::npos) << name;
    const auto [a, a_bias] = split_key_biases(weights(uninterrupted));
    const auto [b, b_bias] = split_key_biases(weights(name));
    const double l2 = relative_l2_difference(a, b);
    std::printf("mixed layouts: %s ends %.3g (relative L2) from %s\n", name.c_str(), l2, uninterrupted.c_str());
    EXPECT_LE(l2, 1e-5) << name;
    const auto after_summary = nlohmann::json::parse(read_file(dir + "/" + name + "/summary.json"));
    EXPECT_EQ(after_summary["tokens"], summaries[uninterrupted]["tokens"]) << name;
    EXPECT_GT(after_summary["strategy_metrics"]["hash_checks"].get<double>(), 0) << name;
  }
  // Refused by key: sync between a staged site and another.
  Result r = run("run examples/mixed_layouts.toml --set strategy.kind=sync", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("sites[0].parallel.pipeline"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(EndToEnd, EveryWorkerCarriesItsOwnShardOverItsOwnLinks) {
  const std::string dir = temp_run_dir("every_worker");
  const std::string base = "run examples/smoke.toml --set sites.0.workers=2 --set sites.1.workers=3 "
                           "--set strategy.inner_steps=10 --set strategy.heterogeneous=false --set job.steps=30 ";
  const std::vector<std::pair<std::string, std::string>> runs = {
      {"gateway-none", "--set strategy.kind=diloco"},
      {"every-none", "--set strategy.kind=diloco --set wan.mode=every_worker"},
      {"gateway-gradients", "--set strategy.kind=diloco --set parallel.shard=gradients"},
      {"every-gradients", "--set strategy.kind=diloco --set parallel.shard=gradients --set wan.mode=every_worker"},
      {"every-streaming", "--set strategy.kind=streaming --set strategy.fragments=2 --set strategy.delay=2 "
                          "--set parallel.shard=full --set strategy.codec=int8 --set wan.mode=every_worker"},
      {"every-hosts", "--set strategy.kind=diloco --set wan.mode=every_worker --set security.host_certs=true"}};
  std::map<std::string, nlohmann::json> summaries;
  for (const auto& [name, sets] : runs) {
    Result r = run(base + sets + " --set job.run_dir=\"" + dir + "/" + name + "\"");
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    std::ifstream in(dir + "/" + name + "/summary.json");
    summaries[name] = nlohmann::json::parse(in);
    const auto by_worker = summaries[name]["wan_bytes_sent_by_worker"].get<std::vector<double>>();
    ASSERT_EQ(by_worker.size(), 5u) << name;
    double sum = 0;
    for (size_t g = 0; g < by_worker.size(); ++g) {
      sum += by_worker[g];
      const bool gateway = g == 0 || g == 2;
      if (name.rfind("every", 0) == 0 || gateway) EXPECT_GT(by_worker[g], 0) << name << " worker #" << g;
      else EXPECT_EQ(by_worker[g], 0) << name << " worker #" << g;
    }
    EXPECT_EQ(sum, summaries[name]["wan_bytes"].get<double>()) << name;
    EXPECT_GT(summaries[name]["strategy_metrics"]["hash_checks"].get<double>(), 0) << name;
  }
  auto weights = [&](const std::string& name) { return tensor_bytes(dir + "/" + name + "/model.safetensors"); };
  EXPECT_EQ(weights("every-none"), weights("gateway-none"));
  EXPECT_EQ(weights("every-gradients"), weights("gateway-gradients"));
  // One certificate per host: the same weights; the audit log names 5 hosts' certificates.
  EXPECT_EQ(weights("every-hosts"), weights("every-none"));
  auto fingerprints = [&](const std::string& name) {
    std::set<std::string> seen;
    for (const auto& line : lines_of(dir + "/" + name + "/audit.jsonl")) {
      auto j = nlohmann::json::parse(line);
      if (j["outcome"] == "accepted") seen.insert(j["fingerprint"].get<std::string>());
    }
    return seen.size();
  };
  EXPECT_EQ(fingerprints("every-hosts"), 5u);
  EXPECT_EQ(fingerprints("every-none"), 2u);  // the sites' certificates, on every host
  // A site whose hosts have no certificates of their own: the worker names the file and the command.
  const std::string certs = dir + "/certs";
  ASSERT_EQ(std::system(("cd " NEBULA_SOURCE_DIR " && " NEBULA_BINARY_DIR "/nebula certs init " + certs + " > /dev/null && " +
                         NEBULA_BINARY_DIR "/nebula certs issue " + certs + " --site alpha --job smoke --workers 2 > /dev/null && " +
                         NEBULA_BINARY_DIR "/nebula certs issue " + certs + " --site beta --job smoke > /dev/null").c_str()),
            0);
  Result missing = run(base + "--set strategy.kind=diloco --set wan.mode=every_worker --set security.host_certs=true "
                       "--set security.certs=\\\"" + certs + "\\\" --set job.run_dir=\\\"" + dir + "/missing\\\"", 120);
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find(certs + "/hosts/beta/"), std::string::npos) << missing.output;
  EXPECT_NE(missing.output.find("--site beta --job smoke --workers N"), std::string::npos) << missing.output;
  // Refused by key: sync, and a wrong number of worker addresses.
  Result r = run("run examples/smoke.toml --set strategy.kind=sync --set wan.mode=every_worker", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("wan.mode"), std::string::npos) << r.output;
  r = run("run examples/smoke.toml --set strategy.kind=diloco --set sites.0.workers=2 "
          "--set sites.0.worker_addresses='[\"127.0.0.1:1\", \"127.0.0.1:2\"]' --set wan.mode=every_worker", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("sites[0].worker_addresses"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

// every_worker: a worker SIGKILLed in the middle of training takes its site down as a unit
// (its part of every exchange is gone); the job stops with an error naming the worker, without
// hanging (elastic rejoin is refused with every_worker at load, so nothing waits for it).
TEST(EndToEnd, EveryWorkerAKilledWorkerStopsTheJob) {
  const std::string dir = temp_run_dir("every_worker_kill");
  fs::create_directories(dir);
  Background job("run examples/smoke.toml --set job.steps=100000 --set sites.1.workers=2 --set strategy.kind=diloco "
                 "--set strategy.inner_steps=5 --set wan.mode=every_worker --set job.timeout=\\\"30s\\\" "
                 "--set job.run_dir=\\\"" + dir + "/run\\\"",
                 dir + "/out.log", 300);
  // beta/1 has logged a step past the first outer steps.
  ASSERT_TRUE(wait_for_step(dir + "/run/metrics.jsonl", "beta", 1, 20, std::chrono::seconds(150))) << read_file(dir + "/out.log");
  std::ifstream win(dir + "/run/workers.json");
  for (const auto& w : nlohmann::json::parse(win))
    if (w["site"] == "beta" && w["rank"] == 1) ::kill(w["pid"].get<pid_t>(), SIGKILL);
  EXPECT_EQ(job.wait(), 1);
  const std::string out = read_file(dir + "/out.log");
  EXPECT_NE(out.find("worker beta/1 failed (signal 9)"), std::string::npos) << out;
  fs::remove_all(dir);
}

// The WAN-efficient strategies through the real binary: each trains (validation loss well
// below the uniform guess ln(vocab)), diloco/streaming carry far fewer WAN bytes than sync,
// PEFT fewer still, and the adaptive controller records its decisions.
TEST(EndToEnd, DilocoStreamingPeftAndControllerTrainWithFarFewerWanBytes) {
  const std::string dir = temp_run_dir("strategies");
  const std::map<std::string, std::string> runs = {
      {"sync", "--set strategy.kind=sync"},
      {"diloco", "--set strategy.kind=diloco --set strategy.inner_steps=10 --set strategy.codec=int4"},
      {"sparse", "--set strategy.kind=diloco --set strategy.inner_steps=10 --set strategy.codec=sparseloco "
                 "--set strategy.codec_block=1024 --set strategy.outer_momentum=0 --set strategy.outer_lr=1"},
      {"sparse-rice", "--set strategy.kind=diloco --set strategy.inner_steps=10 --set strategy.codec=sparseloco "
                      "--set strategy.codec_block=1024 --set strategy.outer_momentum=0 --set strategy.outer_lr=1 "
                      "--set strategy.codec_indices=rice"},
      {"streaming", "--set strategy.kind=streaming --set strategy.inner_steps=10 --set strategy.codec=int4 "
                    "--set strategy.fragments=2 --set strategy.delay=2"},
      {"lora", "--set strategy.kind=diloco --set strategy.inner_steps=10 --set strategy.codec=int4 "
               "--set peft.kind=lora --set peft.rank=4"},
      {"auto", "--set strategy.kind=diloco --set strategy.inner_steps=0 --set strategy.codec=auto "
               "--set strategy.adaptive=true --set job.steps=150"},  // rounds of 50: decides at step 100
      // [4/7]: the controller watching quality chooses the codec at H = 10 (9 rounds). It starts
      // at int4 whatever the time says; round 0's merge gap, measured in round 1's first steps,
      // reaches every site with round 1's exchange, round 1's with round 2's, and it acts on two
      // in a row: at round 3, in every run (no timing in it).
      {"quality", "--set strategy.kind=diloco --set strategy.inner_steps=10 --set strategy.codec=auto "
                  "--set strategy.max_loss_penalty=0.02 --set strategy.outer_momentum=0 --set job.steps=90"},
      // [6/7]: differential privacy of the site updates, and the update guard (a bound no
      // honest update here comes near).
      {"private", "--set strategy.kind=diloco --set strategy.inner_steps=10 --set strategy.codec=int4 "
                  "--set strategy.max_update_norm=1000 --set privacy.clip=10 --set privacy.noise_multiplier=0.001"},
  };
  std::map<std::string, nlohmann::json> summaries;
  for (const auto& [name, sets] : runs) {
    // heterogeneous = false: inner steps per round must not depend on measured speed here.
    Result r = run("run examples/smoke.toml --set strategy.heterogeneous=false " + sets + " --set job.run_dir=\\\"" + dir + "/" + name + "\\\"");
    ASSERT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    std::ifstream in(dir + "/" + name + "/summary.json");
    summaries[name] = nlohmann::json::parse(in);
    // LoRA on a random frozen backbone learns slowly (PEFT is for adapting a trained model):
    // its loss ends only ~2% below the uniform guess (0.981-0.983 x ln 300 measured), too
    // close to it to show learning. It must still learn: its held-out masked-token accuracy
    // rises in every language from the start's 0 (measured 0.04-0.16 at the end).
    const double bound = name == "lora" ? 0.99 : 0.95;
    EXPECT_LT(summaries[name]["final_val_loss"].get<double>(), bound * std::log(300.0)) << name;
    if (name == "lora") {
      const auto& start = summaries[name]["eval_start"];
      const auto& end = summaries[name]["eval"];
      ASSERT_FALSE(end.empty()) << summaries[name].dump();
      for (auto& [lang, e] : end.items())
        EXPECT_GT(e["mlm_accuracy"].get<double>(), start[lang]["mlm_accuracy"].get<double>())
            << "LoRA did not learn " << lang << ": " << summaries[name].dump();
    }
  }
  EXPECT_EQ(summaries["streaming"]["strategy"], "streaming");
  // Privacy: 6 releases per site, ε reported (tiny noise: a huge ε, but finite), nothing rejected.
  const auto& dp = summaries["private"]["strategy_metrics"];
  EXPECT_EQ(dp["dp_releases"].get<double>(), 6) << dp.dump();
  // A number (JSON has no infinity: nlohmann writes an infinite double as null), finite, > 0.
  ASSERT_TRUE(dp["dp_epsilon"].is_number()) << dp.dump();
  EXPECT_TRUE(std::isfinite(dp["dp_epsilon"].get<double>())) << dp.dump();
  EXPECT_GT(dp["dp_epsilon"].get<double>(), 0) << dp.dump();
  EXPECT_EQ(dp["dp_delta"].get<double>(), 1e-5) << dp.dump();
  EXPECT_EQ(dp["rejected_updates"].get<double>(), 0) << dp.dump();
  const double sync_bytes = summaries["sync"]["wan_bytes"];
  // 6 rounds instead of 60 steps; int4 ~7x, sparseloco ~100x smaller than float32.
  EXPECT_LT(summaries["diloco"]["wan_bytes"].get<double>(), sync_bytes / 30);
  EXPECT_LT(summaries["streaming"]["wan_bytes"].get<double>(), sync_bytes / 30);
  EXPECT_LT(summaries["sparse"]["wan_bytes"].get<double>(), sync_bytes / 300);
  // Rice-coded indices send the same values (the same training, to the last bit) in fewer bytes:
  // here 10 of each 1,024 values, ~8.2 bits per index in place of 10 beside 64 bits of levels a
  // chunk, ~0.9x the payload.
  EXPECT_EQ(summaries["sparse-rice"]["final_val_loss"], summaries["sparse"]["final_val_loss"]);
  EXPECT_LT(summaries["sparse-rice"]["wan_bytes"].get<double>(), 0.95 * summaries["sparse"]["wan_bytes"].get<double>());
  std::printf("strategies: sparseloco %.0f WAN bytes with fixed-width indices, %.0f Rice-coded\n",
              summaries["sparse"]["wan_bytes"].get<double>(), summaries["sparse-rice"]["wan_bytes"].get<double>());
  // LoRA r=4 trains about a fifth of this model's values.
  EXPECT_LT(summaries["lora"]["wan_bytes"].get<double>(), 0.4 * summaries["diloco"]["wan_bytes"].get<double>());
  // A safe start, then a decision from measured numbers (which choice depends on this
  // machine's speed: not asserted).
  const auto& decisions = summaries["auto"]["decisions"];
  ASSERT_GE(decisions.size(), 2u) << summaries["auto"].dump();
  EXPECT_NE(decisions[0].get<std::string>().find("no measurements yet"), std::string::npos);
  EXPECT_EQ(decisions.back().get<std::string>().find("no measurements yet"), std::string::npos);
  EXPECT_NE(decisions.back().get<std::string>().find("Mbit/s"), std::string::npos);
  // The decisions as applied: each round runs the H of the newest decision at or before it
  // ("round R: codec C, H N — why"; the last round ends with the steps), one outer step each.
  std::map<int64_t, int64_t> h_from;  // round: H decided there
  for (const auto& d : decisions) {
    const std::string line = d.get<std::string>();
    if (line.find(": codec ") == std::string::npos) continue;  // "this site runs ..."
    h_from[std::stoll(line.substr(6))] = std::stoll(line.substr(line.find(", H ") + 4));
  }
  ASSERT_TRUE(h_from.count(0)) << summaries["auto"].dump();
  int64_t rounds = 0;
  for (int64_t done = 0; done < 150; ++rounds) done += std::min(std::prev(h_from.upper_bound(rounds))->second, 150 - done);
  EXPECT_EQ(summaries["auto"]["strategy_metrics"]["outer_steps"].get<double>(), rounds) << summaries["auto"].dump();
  // Watching quality: round 3's choice rests on the two merge gaps measured at the start's setting, and says so.
  const auto& quality = summaries["quality"]["decisions"];
  ASSERT_FALSE(quality.empty());
  EXPECT_NE(quality[0].get<std::string>().find("round 0: codec int4, H 10 — watching quality"), std::string::npos)
      << quality.dump();
  int64_t first_on_gap = -1;
  for (const auto& d : quality) {
    const std::string line = d.get<std::string>();
    if (line.find("merge gap ") == std::string::npos) continue;
    EXPECT_NE(line.find("budget 2%"), std::string::npos) << line;
    EXPECT_EQ(line.find("Mbit/s"), std::string::npos) << line;
    if (first_on_gap < 0) first_on_gap = std::stoll(line.substr(6));
  }
  EXPECT_EQ(first_on_gap, 3) << quality.dump();
  fs::remove_all(dir);
}

// A site whose certificate comes from another CA is refused, the refusal is audited, and
// the job stops with a message that says why.
TEST(EndToEnd, SiteWithCertificateFromAnotherCaIsRefused) {
  const std::string dir = temp_run_dir("badca");
  ASSERT_EQ(run("certs init " + dir + "/good", 30).exit_code, 0);
  ASSERT_EQ(run("certs issue " + dir + "/good --site alpha --job smoke", 30).exit_code, 0);
  ASSERT_EQ(run("certs init " + dir + "/other", 30).exit_code, 0);
  ASSERT_EQ(run("certs issue " + dir + "/other --site beta --job smoke", 30).exit_code, 0);
  fs::copy_file(dir + "/other/beta.pem", dir + "/good/beta.pem");
  fs::copy_file(dir + "/other/beta.key", dir + "/good/beta.key");
  Result r = run("run examples/smoke.toml --set job.steps=3 --set wan.handshake_timeout=\\\"5s\\\" "
                 "--set job.timeout=\\\"20s\\\" --set security.certs=\\\"" + dir + "/good\\\" "
                 "--set job.run_dir=\\\"" + dir + "/run\\\"", 120);
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("unknown CA"), std::string::npos) << r.output;
  std::ifstream ain(dir + "/run/audit.jsonl");
  int refused = 0;
  for (std::string line; std::getline(ain, line);) refused += nlohmann::json::parse(line)["outcome"] == "refused";
  EXPECT_GE(refused, 1);
  fs::remove_all(dir);
}

TEST(EndToEnd, CertsCommandsMakeAUsableCaAndSayWhatIsWrong) {
  const std::string dir = temp_run_dir("certs");
  Result init = run("certs init " + dir, 30);
  ASSERT_EQ(init.exit_code, 0) << init.output;
  EXPECT_NE(run("certs init " + dir, 30).exit_code, 0);  // never overwrite a CA
  Result issue = run("certs issue " + dir + " --site alpha --job smoke", 30);
  ASSERT_EQ(issue.exit_code, 0) << issue.output;
  EXPECT_NE(issue.output.find("fingerprint"), std::string::npos);
  EXPECT_NE(issue.output.find("urn:nebula:job:smoke:site:alpha"), std::string::npos) << issue.output;
  EXPECT_NE(run("certs issue " + dir + " --site beta", 30).exit_code, 0);  // --job is required
  Result bad = run("certs issue " + dir + " --site 'no spaces' --job smoke", 30);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.output.find("no spaces"), std::string::npos) << bad.output;
  // The real openssl command agrees that the site certificate chains to the CA.
  std::string verify = "openssl verify -CAfile " + dir + "/ca.pem " + dir + "/alpha.pem > /dev/null 2>&1";
  EXPECT_EQ(std::system(verify.c_str()), 0);
  fs::remove_all(dir);
}

// The command line of a live process, NULs as spaces; empty once it is gone (or a zombie).
std::string cmdline_of(pid_t pid) {
  std::string s = read_file("/proc/" + std::to_string(pid) + "/cmdline");
  std::replace(s.begin(), s.end(), '\0', ' ');
  return s;
}

// One worker of a long job dies (SIGKILL, as the OOM killer would) while the others are
// training. DiLoCo with rounds longer than the job: site alpha trains alone and touches the
// WAN only at a round's end, so it cannot notice that beta lost a worker; only the launcher
// can stop it. The launcher names beta/1 as the cause, stops the others (alpha checkpoints and
// stops on its SIGTERM) and exits 1 promptly: well within its 10 s grace (then SIGKILL) plus
// polling, where alpha left alone would train for hours. None of the job's worker processes
// outlives the launcher.
TEST(EndToEnd, OneFailingWorkerStopsTheJobWithNonZeroExit) {
  const std::string dir = temp_run_dir("fail");
  fs::create_directories(dir);
  const std::string run_dir = dir + "/run";
  Background job("run examples/smoke.toml --set job.steps=100000 --set sites.1.workers=2 --set strategy.kind=diloco "
                 "--set strategy.inner_steps=100000 --set strategy.heterogeneous=false "
                 "--set job.timeout=\\\"300s\\\" --set wan.reconnect_timeout=\\\"300s\\\" "
                 "--set job.run_dir=\\\"" + run_dir + "\\\"",
                 dir + "/out.log", 200);
  ASSERT_TRUE(wait_for_step(run_dir + "/metrics.jsonl", "beta", 1, 10, std::chrono::seconds(150)))
      << read_file(dir + "/out.log");
  ASSERT_TRUE(wait_for_step(run_dir + "/metrics.jsonl", "alpha", 0, 10, std::chrono::seconds(150)))
      << read_file(dir + "/out.log");
  std::map<std::string, pid_t> pids;  // "site/rank" -> pid
  for (const auto& w : nlohmann::json::parse(read_file(run_dir + "/workers.json")))
    pids[w["site"].get<std::string>() + "/" + std::to_string(w["rank"].get<int>())] = w["pid"].get<pid_t>();
  ASSERT_EQ(pids.size(), 3u) << read_file(run_dir + "/workers.json");
  for (const auto& [name, pid] : pids) ASSERT_NE(cmdline_of(pid).find(" worker "), std::string::npos) << name;
  const auto killed_at = std::chrono::steady_clock::now();
  ASSERT_EQ(::kill(pids.at("beta/1"), SIGKILL), 0);
  const int code = job.wait();
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  const std::string out = read_file(dir + "/out.log");
  std::printf("launcher exited %d, %.1f s after beta/1 was killed\n", code, took);
  EXPECT_EQ(code, 1) << out;
  EXPECT_LT(took, 60.0) << out;
  EXPECT_NE(out.find("worker beta/1 failed (signal 9); stopped the others"), std::string::npos) << out;
  for (const char* other : {"alpha/0", "beta/0"})
    EXPECT_EQ(out.find(std::string("worker ") + other + " failed ("), std::string::npos) << other << " named as the cause\n" << out;
  // alpha was stopped by the launcher's SIGTERM (nothing else reached it).
  const std::string alpha_log = read_file(run_dir + "/logs/alpha-0.log");
  EXPECT_NE(alpha_log.find("stopping (signal 15)"), std::string::npos) << alpha_log;
  for (const auto& [name, pid] : pids) {
    const std::string cmd = cmdline_of(pid);
    const bool alive = cmd.find(" worker ") != std::string::npos && cmd.find(run_dir) != std::string::npos;
    EXPECT_FALSE(alive) << name << " (pid " << pid << ") outlived the launcher: " << cmd;
    if (alive) ::kill(pid, SIGKILL);  // ours (its command line names this test's run directory)
  }
  fs::remove_all(dir);
}

// NEBULA_WORKER_PREFIX runs every worker under a tool (heaptrack, perf, valgrind): here a
// script that records its arguments and execs them. A short job that finishes (so no worker
// is stopped before its tool wrote its line): one line per worker, each a distinct site/rank.
TEST(EndToEnd, WorkerPrefixRunsEveryWorkerUnderTheTool) {
  const std::string dir = temp_run_dir("prefix");
  fs::create_directories(dir);
  const std::string tool = dir + "/tool.sh", seen = dir + "/seen";
  std::ofstream(tool) << "#!/bin/sh\necho \"$@\" >> " << seen << "\nexec \"$@\"\n";
  fs::permissions(tool, fs::perms::owner_all);
  Result r = run("run examples/smoke.toml --set job.steps=2 --set sites.1.workers=2 --set job.run_dir=\\\"" + dir +
                     "/run\\\"",
                 300, "NEBULA_WORKER_PREFIX='" + tool + "'");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  std::vector<std::string> lines = lines_of(seen);
  std::set<std::string> workers;
  for (const auto& l : lines) {
    EXPECT_NE(l.find(" worker "), std::string::npos) << l;
    const size_t site = l.find(" --site "), rank = l.find(" --rank ");
    ASSERT_NE(site, std::string::npos) << l;
    ASSERT_NE(rank, std::string::npos) << l;
    std::string s, k;
    std::istringstream(l.substr(site + 8)) >> s;
    std::istringstream(l.substr(rank + 8)) >> k;
    workers.insert(s + "/" + k);
  }
  EXPECT_EQ(lines.size(), 3u) << r.output;
  EXPECT_EQ(workers, (std::set<std::string>{"alpha/0", "beta/0", "beta/1"})) << r.output;
  // A tool that is not there: the worker's exec fails, saying what.
  const std::string args = "run examples/smoke.toml --set job.run_dir=\\\"" + dir +
                           "/run2\\\" --set data.tokenizer=\\\"/nonexistent/tok.model\\\"";
  r = run(args, 120, "NEBULA_WORKER_PREFIX='/nonexistent/tool --flag'");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("exec /nonexistent/tool failed"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(EndToEnd, BadConfigGivesOneLineNamingTheKey) {
  Result r = run("run examples/smoke.toml --set 'wan.rtt=\"80 parsecs\"'", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("wan.rtt"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("parsecs"), std::string::npos) << r.output;
}

TEST(EndToEnd, HelpWorksForEverySubcommand) {
  for (const char* sub : {"", "run ", "worker ", "demo ", "plan ", "certs ", "certs init ", "certs issue ", "corpus ",
                          "corpus build ", "bleu ", "translate ", "tokenizer "}) {
    Result r = run(std::string(sub) + "--help", 30);
    EXPECT_EQ(r.exit_code, 0) << sub << r.output;
    EXPECT_NE(r.output.find("Usage"), std::string::npos) << sub << r.output;
  }
}

// A deployed worker (no launcher to make a CA) without certificates says what to configure.
TEST(EndToEnd, DeployedWorkerWithoutCertificatesSaysWhatToSet) {
  const std::string dir = temp_run_dir("nocerts");
  Result prep = run("run examples/smoke.toml --set job.steps=1 --set job.run_dir=\\\"" + dir + "\\\"", 120);
  ASSERT_EQ(prep.exit_code, 0) << prep.output;  // leaves a tokenizer in dir
  Result r = run("worker examples/smoke.toml --site alpha --rank 0 --set job.run_dir=\\\"" + dir + "\\\"", 60);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("nebula certs issue DIR --site alpha"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

TEST(EndToEnd, WorkerWithoutSiteSaysSo) {
  Result r = run("worker examples/smoke.toml --rank 0", 30);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("--site"), std::string::npos) << r.output;
  r = run("worker examples/smoke.toml --site nowhere --rank 0", 30);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("no site named 'nowhere'"), std::string::npos) << r.output;
}

// `nebula plan`: the table with a recommendation, the same as JSON, and config errors (exit 2).
TEST(EndToEnd, PlanPrintsTableOrJsonAndNamesBadKeys) {
  Result r = run("plan examples/plan_8x512_70b.toml", 30);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("recommended: "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("WAN/1000 steps"), std::string::npos) << r.output;
  r = run("plan examples/plan_demo.toml --json --set 'wan.bandwidth=\"1Gbit\"'", 30);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  auto j = nlohmann::json::parse(r.output);
  EXPECT_EQ(j["topology"]["wan_bandwidth_bits_per_s"].get<double>(), 1e9);
  EXPECT_TRUE(j["recommended"].contains("reason"));
  EXPECT_GT(j["candidates"].size(), 10u);
  r = run("plan examples/plan_demo.toml --set 'candidates.codecs=[\"int9\"]'", 30);
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_NE(r.output.find("candidates.codecs"), std::string::npos) << r.output;
}

// `nebula corpus build` on this machine's real catalogs: three disjoint, non-empty splits,
// byte-identical on a second run; a corrupt catalog in a copied locale tree is skipped with
// a warning naming it and changes nothing else.
TEST(EndToEnd, CorpusBuildFromRealCatalogsIsDisjointDeterministicAndSkipsCorruptFiles) {
  for (const char* lang : {"de", "fr"}) {
    if (!fs::exists(std::string("/usr/share/locale/") + lang + "/LC_MESSAGES"))
      GTEST_SKIP() << "no " << lang << " catalogs on this machine";
  }
  const std::string dir = temp_run_dir("corpus");
  const std::string args = " --languages de,fr --max-pairs-per-language 400 --valid-fraction 0.1 --test-fraction 0.1";
  Result a = run("corpus build" + args + " --out " + dir + "/a", 120);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("\nde "), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("\ntotal "), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("duplicates removed"), std::string::npos) << a.output;
  Result b = run("corpus build" + args + " --out " + dir + "/b", 120);
  ASSERT_EQ(b.exit_code, 0) << b.output;

  std::set<std::string> seen;
  size_t total = 0;
  for (const char* split : {"train.tsv", "valid.tsv", "test.tsv"}) {
    const auto lines = lines_of(dir + "/a/" + split);
    EXPECT_FALSE(lines.empty()) << split;
    for (const auto& line : lines) {
      EXPECT_TRUE(line.starts_with("de\t") || line.starts_with("fr\t")) << line;
      EXPECT_EQ(std::count(line.begin(), line.end(), '\t'), 2) << line;
      EXPECT_TRUE(seen.insert(line).second) << "in two splits or twice: " << line;
    }
    total += lines.size();
  }
  EXPECT_EQ(total, 800u);  // 400 per language: both have far more
  for (const char* f : {"train.tsv", "valid.tsv", "test.tsv", "stats.json"})
    EXPECT_EQ(read_file(dir + "/a/" + f), read_file(dir + "/b/" + f)) << f << " differs between two runs";
  auto stats = nlohmann::json::parse(read_file(dir + "/a/stats.json"));
  EXPECT_EQ(stats["pairs"].get<size_t>(), 800u);
  size_t de_pairs = 0;
  for (const char* split : {"train", "valid", "test"}) de_pairs += stats["languages"]["de"][split]["pairs"].get<size_t>();
  EXPECT_EQ(de_pairs, 400u);

  // The same catalogs plus a truncated copy of one of them.
  for (const char* lang : {"de", "fr"}) {
    fs::create_directories(dir + "/locale/" + lang);
    fs::copy(std::string("/usr/share/locale/") + lang + "/LC_MESSAGES", dir + "/locale/" + lang + "/LC_MESSAGES",
             fs::copy_options::recursive);
  }
  std::string catalog;
  for (const auto& e : fs::directory_iterator(dir + "/locale/de/LC_MESSAGES"))
    if (e.path().extension() == ".mo" && e.file_size() > 4096 && (catalog.empty() || e.path().string() < catalog))
      catalog = e.path().string();
  ASSERT_FALSE(catalog.empty());
  const std::string bytes = read_file(catalog);
  std::ofstream(dir + "/locale/de/LC_MESSAGES/zz-corrupt.mo", std::ios::binary) << bytes.substr(0, bytes.size() / 2);
  Result c = run("corpus build --path " + dir + "/locale" + args + " --out " + dir + "/c", 120);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("warning"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find(dir + "/locale/de/LC_MESSAGES/zz-corrupt.mo"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("1 skipped"), std::string::npos) << c.output;
  stats = nlohmann::json::parse(read_file(dir + "/c/stats.json"));
  EXPECT_EQ(stats["files_skipped"].get<int>(), 1);
  for (const char* f : {"train.tsv", "valid.tsv", "test.tsv"})
    EXPECT_EQ(read_file(dir + "/a/" + f), read_file(dir + "/c/" + f)) << f;
  fs::remove_all(dir);
}

TEST(EndToEnd, CorpusBuildBadOptionGivesOneLineAndExitCode2) {
  const std::string dir = temp_run_dir("corpus-bad");
  for (const std::string bad : {"--valid-fraction 2", "--valid-fraction 0.6 --test-fraction 0.5",
                                 "--valid-fraction abc", "--source csv", "--source tsv"}) {
    Result r = run("corpus build " + bad + " --out " + dir, 30);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << bad << "\n" << r.output;
    const std::string option = bad.substr(0, bad.find(' '));
    EXPECT_NE(r.output.find(option), std::string::npos) << bad << "\n" << r.output;
  }
  EXPECT_FALSE(fs::exists(dir));
}

// `nebula bleu` prints sacreBLEU's score line; a hand-computed case and sacreBLEU's README
// example (two reference files) give the published numbers.
TEST(EndToEnd, BleuPrintsTheScoreLine) {
  const std::string dir = temp_run_dir("bleu");
  fs::create_directories(dir);
  std::ofstream(dir + "/hyp.txt") << "the cat sat on a mat\n";
  std::ofstream(dir + "/ref.txt") << "the cat sat on the mat\n";
  Result r = run("bleu " + dir + "/hyp.txt " + dir + "/ref.txt", 30);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // (5/6 * 3/5 * 2/4 * 1/3)^(1/4) = 0.5373 (see bleu_test.cc)
  EXPECT_EQ(r.output, "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:none|version:nebula = 53.73 83.3/60.0/50.0/33.3 "
                      "(BP = 1.000 ratio = 1.000 hyp_len = 6 ref_len = 6)\n");

  std::ofstream(dir + "/h.txt") << "The dog bit the man.\nIt wasn't surprising.\nThe man had just bitten him.\n";
  std::ofstream(dir + "/r1.txt") << "The dog bit the man.\nIt was not unexpected.\nThe man bit him first.\n";
  std::ofstream(dir + "/r2.txt") << "The dog had bit the man.\nNo one was surprised.\nThe man had bitten the dog.\n";
  r = run("bleu " + dir + "/h.txt " + dir + "/r1.txt " + dir + "/r2.txt --smooth exp", 30);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("BLEU|nrefs:2|case:mixed|eff:no|tok:13a|smooth:exp|version:nebula = 48.53 "),
            std::string::npos)
      << r.output;

  // An empty translation is a segment (score 0), not a missing line.
  std::ofstream(dir + "/empty.txt") << "\n";
  r = run("bleu " + dir + "/empty.txt " + dir + "/ref.txt", 30);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find(" = 0.00 "), std::string::npos) << r.output;
  // Misaligned files name both; a missing file or a bad option is a usage error.
  r = run("bleu " + dir + "/h.txt " + dir + "/ref.txt", 30);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("ref.txt has 1 lines but " + dir + "/h.txt has 3"), std::string::npos) << r.output;
  EXPECT_EQ(run("bleu " + dir + "/nonexistent.txt " + dir + "/ref.txt", 30).exit_code, 2);
  EXPECT_EQ(run("bleu " + dir + "/hyp.txt " + dir + "/ref.txt --smooth add-k", 30).exit_code, 2);
  fs::remove_all(dir);
}

// Issue [5/7]'s story, tiny: corpus → two-site MLM+TLM pre-training → sync baseline → teacher →
// student distilled across the WAN → student alone → summary and charts; then `nebula
// translate` with the teacher it made.
TEST(EndToEnd, DemoQuickRunsEveryStageAndTranslateUsesItsModel) {
  const std::string dir = temp_run_dir("demo");
  Result r = run("demo --quick --run-dir " + dir + " --set 'metrics.progress=\"off\"'", 600);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* stage : {"[1/8]", "[2/8]", "[3/8]", "[4/8]", "[5/8]", "[6/8]", "[7/8]", "[8/8]"})
    EXPECT_NE(r.output.find(stage), std::string::npos) << stage;
  const nlohmann::json s = nlohmann::json::parse(read_file(dir + "/summary.json"));
  EXPECT_TRUE(s["quick"].get<bool>());
  // The report of every stage, with TensorBoard files per stage and site.
  EXPECT_TRUE(fs::exists(dir + "/report/index.html"));
  for (const char* stage : {"pretrain/europe-west", "pretrain/europe-south", "student-kd"})
    EXPECT_TRUE(fs::exists(dir + "/report/tensorboard/" + stage)) << stage;
  // Pre-training against sync at equal tokens: far fewer WAN bytes, and both runs learned
  // (validation loss below ln(vocab) = 6.91, the uniform guess; in 20 quick steps MLM shares
  // the encoder with the contrastive objective, so it falls to ~6.5-6.6, not further), the
  // difference reported.
  const auto& pre = s["pretrain"];
  const auto& sync = s["pretrain_sync"];
  EXPECT_EQ(sync["strategy"], "sync");
  EXPECT_EQ(pre["tokens"], sync["tokens"]);
  EXPECT_GT(s["wan_reduction_vs_sync"].get<double>(), 10) << s.dump();
  EXPECT_LT(pre["final_val_loss"].get<double>(), std::log(1000.0) - 0.15);
  EXPECT_LT(sync["final_val_loss"].get<double>(), std::log(1000.0) - 0.15);
  EXPECT_GT(pre["contrastive"]["mean_loss"].get<double>(), 0);
  // The cost is taken from the two stages' own summaries (not the demo's copies of them).
  const nlohmann::json pre_own = nlohmann::json::parse(read_file(dir + "/pretrain/summary.json"));
  const nlohmann::json sync_own = nlohmann::json::parse(read_file(dir + "/pretrain-sync/summary.json"));
  EXPECT_EQ(sync_own["strategy"], "sync");
  EXPECT_NE(pre_own["strategy"], "sync");
  EXPECT_NEAR(s["val_loss_cost_vs_sync"].get<double>(),
              pre_own["final_val_loss"].get<double>() - sync_own["final_val_loss"].get<double>(), 1e-9);
  EXPECT_NE(pre_own["final_val_loss"], sync_own["final_val_loss"]);
  const std::string md = read_file(dir + "/summary.md");
  EXPECT_NE(md.find("fewer WAN bytes than sync; its validation loss is"), std::string::npos) << md;
  EXPECT_EQ(pre["objective"], "mlm+tlm");
  for (const char* lang : {"de", "es", "fr", "it"}) {
    for (const auto* run : {&pre, &sync}) {
      ASSERT_TRUE((*run)["eval"].contains(lang)) << lang;
      const auto& e = (*run)["eval"][lang];
      // Retrieval among N held-out pairs: well above chance (1/N) for both runs.
      EXPECT_GT(e["retrieval_accuracy"].get<double>(), 2 / e["pairs"].get<double>()) << lang;
      EXPECT_TRUE((*run)["eval_start"].contains(lang)) << lang;
    }
  }
  EXPECT_TRUE(pre["eval"].contains("en"));
  // Zero-shot transfer: the classifier learned from English only and was scored in every
  // pre-training language, on the pre-trained encoder and on a random one. As a linear probe
  // (freeze_encoder) its encoder is the pre-trained one, bit for bit.
  for (const char* lang : {"en", "de", "es", "fr", "it"}) {
    ASSERT_TRUE(s["transfer"].contains(lang)) << s["transfer"].dump();
    EXPECT_GT(s["transfer"][lang]["messages"].get<double>(), 0) << lang;
    // An accuracy is a count of the held-out messages classified right.
    const double messages = s["transfer"][lang]["messages"].get<double>();
    for (const char* which : {"pretrained", "random"}) {
      const double right = s["transfer"][lang][which].get<double>() * messages;
      EXPECT_NEAR(right, std::round(right), 1e-6) << lang << " " << which;
      EXPECT_TRUE(right >= 0 && right <= messages) << lang << " " << which << " " << right;
    }
  }
  // The probe learned from English: above chance (1/8 packages) on held-out English messages
  // (measured 0.25 of 40 at this size; the random encoder's 0.125).
  EXPECT_GT(s["transfer"]["en"]["pretrained"].get<double>(), 1.0 / 8) << s["transfer"].dump();
  const auto pretrained = tensor_bytes(dir + "/pretrain/model.safetensors");
  const auto probe = tensor_bytes(dir + "/transfer/model.safetensors");
  size_t same = 0;
  for (const auto& [name, bytes] : pretrained) {
    ASSERT_TRUE(probe.count("encoder." + name)) << name;
    EXPECT_EQ(probe.at("encoder." + name), bytes) << name << " changed under freeze_encoder";
    ++same;
  }
  EXPECT_GT(same, 5u);
  EXPECT_NE(tensor_bytes(dir + "/transfer-random/model.safetensors").at("encoder.tokens.weight"),
            probe.at("encoder.tokens.weight"));
  // The students' BLEU difference, with its paired-bootstrap interval over the same sentences.
  const auto& boot = s["distill_bleu_bootstrap"];
  // --quick translates at most 20 test sentences (eval.pairs), the same ones for both students.
  EXPECT_EQ(boot["segments"].get<double>(), std::min(20.0, s["translation_corpus_pairs"][2].get<double>()));
  EXPECT_LE(boot["low"].get<double>(), boot["delta"].get<double>());
  EXPECT_GE(boot["high"].get<double>(), boot["delta"].get<double>());
  EXPECT_NEAR(boot["delta"].get<double>(), s["student_kd_bleu"].get<double>() - s["student_bleu"].get<double>(), 1e-6);
  // PEFT on the trained teacher: LoRA's backbone is the teacher's, bit for bit (a LoRA-wrapped
  // Linear keeps its weights under ".base"), and only the trainable values crossed the WAN: the
  // two runs exchanged the same frames but for each step's gradient, whose size is the encoded
  // size of the trainable values (float32, codec none), so their WAN bytes differ by exactly
  // steps x sites x 4 x the difference of their trainable values.
  const auto& peft = s["peft"];
  const double full_values = peft["full"]["trainable_parameters"], lora_values = peft["lora"]["trainable_parameters"];
  EXPECT_GT(lora_values, 0);
  EXPECT_LT(lora_values, full_values / 4);
  const auto s_full = nlohmann::json::parse(read_file(dir + "/peft-full/summary.json"));
  EXPECT_EQ(s_full["parameters"].get<double>(), full_values);
  EXPECT_EQ(peft["full"]["wan_bytes"].get<double>() - peft["lora"]["wan_bytes"].get<double>(),
            s_full["steps"].get<double>() * s_full["sites"].get<double>() * 4 * (full_values - lora_values))
      << peft.dump();
  const auto teacher_weights = tensor_bytes(dir + "/teacher/model.safetensors");
  const auto lora_weights = tensor_bytes(dir + "/peft-lora/model.safetensors");
  size_t wrapped = 0;
  for (const auto& [name, bytes] : teacher_weights) {
    std::string there = name;
    if (!lora_weights.count(there)) {
      there = name.substr(0, name.rfind('.')) + ".base" + name.substr(name.rfind('.'));
      ++wrapped;
    }
    ASSERT_TRUE(lora_weights.count(there)) << name;
    EXPECT_EQ(lora_weights.at(there), bytes) << name << " changed under LoRA";
  }
  EXPECT_GT(wrapped, 10u);
  EXPECT_NE(tensor_bytes(dir + "/peft-full/model.safetensors"), teacher_weights);  // full fine-tuning moved them
  EXPECT_LE(peft["bleu_bootstrap"]["low"].get<double>(), peft["bleu_bootstrap"]["delta"].get<double>());
  EXPECT_NEAR(peft["bleu_bootstrap"]["delta"].get<double>(),
              peft["lora"]["bleu"].get<double>() - peft["full"]["bleu"].get<double>(), 1e-6);
  // Distillation happened over the link, compressed: top-8 of a 1000-piece vocabulary is
  // 8 × (2 + 1) bytes + 1 per token against 4000 for float32 logits.
  const auto& d = s["distill"];
  EXPECT_GT(d["tokens"].get<double>(), 0);
  EXPECT_LT(d["bytes_per_token"].get<double>(), 30);
  EXPECT_EQ(d["fp32_logits_bytes_per_token"].get<double>(), 4000);
  EXPECT_GT(d["link_bytes_received"].get<double>(), d["response_bytes"].get<double>());  // framing, TLS records
  // The teacher answered every request without an error.
  bool served = false;
  for (const auto& line : lines_of(dir + "/student-kd/metrics.jsonl")) {
    auto j = nlohmann::json::parse(line);
    if (!j.contains("teacher")) continue;
    served = true;
    EXPECT_EQ(j["teacher"]["errors"], 0);
    EXPECT_EQ(j["teacher"]["requests"].get<double>(), d["requests"].get<double>());
  }
  EXPECT_TRUE(served);
  for (const char* f : {"/summary.md", "/pretrain_loss.svg", "/retrieval.svg", "/translation_loss.svg",
                        "/pretrain/model.safetensors", "/teacher/model.safetensors", "/student/model.safetensors",
                        "/student-kd/translations-europe-south.tsv", "/corpus/test.tsv", "/corpus-de/test.tsv"})
    EXPECT_TRUE(fs::exists(dir + f)) << f;
  EXPECT_NE(read_file(dir + "/retrieval.svg").find("<polyline"), std::string::npos);

  // nebula translate: one line out per line in, with the tokenizer the model file records.
  std::ofstream(dir + "/in.txt") << "Open file\nSave\n\nQuit the program\n";
  Result t = run("translate " + dir + "/teacher/model.safetensors --beam 2 --input " + dir + "/in.txt", 120);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_EQ(std::count(t.output.begin(), t.output.end(), '\n'), 4) << t.output;
  // The pre-trained encoder is not a translation model: one line saying so.
  t = run("translate " + dir + "/pretrain/model.safetensors --input " + dir + "/in.txt", 60);
  EXPECT_EQ(t.exit_code, 1) << t.output;
  EXPECT_NE(t.output.find("not a translation model"), std::string::npos) << t.output;
  // A student site whose pairs may not leave it cannot be distilled: the config says how to allow it.
  t = run("run examples/demo_mt.toml --set sites.1.shareable=false", 60);
  EXPECT_EQ(t.exit_code, 2) << t.output;
  EXPECT_NE(t.output.find("shareable = true"), std::string::npos) << t.output;
  fs::remove_all(dir);
}

// Distillation against the same run without the teacher ([1/5]): a teacher fine-tuned on one
// site's en→de pairs, then a student on another site's few pairs, once distilled across the
// WAN and once alone. Both students draw the same batches in the same order (the batch seed is
// keyed by the site's name, not its place in [[sites]]), so the teacher is the only difference,
// and the result is deterministic: the distilled student's validation loss is lower.
std::string translation_job(const std::string& name, int steps, const std::string& dir, const std::string& sites,
                            const std::string& extra) {
  return "[job]\nname = \"" + name + "\"\nsteps = " + std::to_string(steps) + "\nlog_every = 50\neval_batches = 8\nrun_dir = \"" + dir + "/" +
         name + "\"\n[eval]\npairs = 20\nbeam = 1\n[model]\nkind = \"seq2seq\"\ndim = 32\nlayers = 1\n"
         "decoder_layers = 1\nheads = 2\nffn = 64\nmax_len = 24\nlr = 3e-3\n[data]\nsource = \"corpus\"\npath = \"" +
         dir + "/corpus\"\nlanguages = [\"de\"]\nbatch_size = 32\nvocab_size = 400\n" + extra + sites +
         "[security]\ninsecure = true\n[metrics]\nprogress = \"off\"\n";
}

TEST(EndToEnd, TheDistilledStudentBeatsThePlainOneOnTheSameBatches) {
  if (!fs::exists("/usr/share/locale/de/LC_MESSAGES")) GTEST_SKIP() << "no de catalogs on this machine";
  const std::string dir = temp_run_dir("distill");
  Result r = run("corpus build --languages de --max-pairs-per-language 6000 --out " + dir + "/corpus", 120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string teacher_site = "[[sites]]\nname = \"west\"\nlanguages = [\"de\"]\n";
  const std::string student_site =
      "[[sites]]\nname = \"south\"\nlanguages = [\"de\"]\nmax_pairs_per_language = 300\nshareable = true\n";
  std::ofstream(dir + "/teacher.toml") << translation_job("teacher", 600, dir, teacher_site, "");
  const std::string tok = "tokenizer = \"" + dir + "/teacher/tokenizer.model\"\n";
  std::ofstream(dir + "/kd.toml") << translation_job("kd", 150, dir, teacher_site + student_site, tok) +
                                         "[distill]\nteacher_site = \"west\"\nteacher = \"" + dir +
                                         "/teacher/model.safetensors\"\ntop_k = 8\nalpha = 0.5\n";
  std::ofstream(dir + "/plain.toml") << translation_job("plain", 150, dir, student_site, tok);
  for (const char* job : {"teacher", "kd", "plain"}) {
    r = run(std::string("run ") + dir + "/" + job + ".toml", 600);
    ASSERT_EQ(r.exit_code, 0) << job << "\n" << r.output;
  }
  auto summary = [&](const char* job) { return nlohmann::json::parse(read_file(dir + "/" + job + "/summary.json")); };
  const auto teacher = summary("teacher"), kd = summary("kd"), plain = summary("plain");
  EXPECT_EQ(kd["tokens"], plain["tokens"]);  // the same steps on the same batches
  EXPECT_GT(kd["distill"]["tokens"].get<double>(), 0);
  const double kd_loss = kd["final_val_loss"], plain_loss = plain["final_val_loss"];
  std::printf("validation loss: teacher %.4f, distilled student %.4f, plain student %.4f\n",
              teacher["final_val_loss"].get<double>(), kd_loss, plain_loss);
  EXPECT_LT(kd_loss, plain_loss) << "teacher " << teacher["final_val_loss"] << ", distilled " << kd_loss << ", plain "
                                 << plain_loss;
  // Both translated the same test sentences (what the demo's paired bootstrap needs).
  const auto a = lines_of(dir + "/kd/translations-south.tsv"), b = lines_of(dir + "/plain/translations-south.tsv");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(a[i].substr(0, a[i].rfind('\t')), b[i].substr(0, b[i].rfind('\t')));
  fs::remove_all(dir);
}

// --- [6/7] hostile input --------------------------------------------------------------

// A `nebula` process started in the background with its output in `log`. Stopped (SIGTERM to
// the `timeout` wrapper, which passes it on) if the test ends before it does; only this pid.
// Connects to 127.0.0.1:port, retrying while nothing listens there yet (at most 180 s).
int connect_when_listening(uint16_t port) {
  for (int attempt = 0; attempt < 1800; ++attempt) {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return fd;
    ::close(fd);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return -1;
}

// Sends `bytes` to the gateway at `port`, closes our sending side, and reads until the gateway
// hangs up: true if it did within 60 s. The gateway audits a refusal before it closes.
bool gateway_hangs_up_on(uint16_t port, const std::string& bytes) {
  const int fd = connect_when_listening(port);
  if (fd < 0) return false;
  ::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  ::shutdown(fd, SHUT_WR);
  bool closed = false;
  for (char buf[4096];;) {
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 60000) <= 0) break;
    if (::recv(fd, buf, sizeof buf, 0) <= 0) {
      closed = true;
      break;
    }
  }
  ::close(fd);
  return closed;
}

// A nebula frame header (docs/architecture.md, "Wire protocol"), written out byte by byte:
// a hello announcing a payload of `payload_len` bytes.
std::string frame_header(uint64_t payload_len) {
  std::string h(40, '\0');
  const uint32_t magic = 0x4E42554C;
  for (int i = 0; i < 4; ++i) h[i] = static_cast<char>(magic >> (8 * i));
  h[4] = 1;  // version
  h[5] = 1;  // hello
  for (int i = 0; i < 8; ++i) h[28 + i] = static_cast<char>(payload_len >> (8 * i));
  return h;  // the checksum is not looked at: the length is refused first
}

// A two-site job run as deployed workers would be (each started by hand), so that hostile
// connections reach site alpha's gateway while it waits for beta: garbage bytes and a frame
// header announcing 1 TiB. Both are refused and audited with their reason, and the job then
// trains and ends normally. With mutual TLS (the default) both are refused before TLS; with
// security.insecure the frame checks refuse them.
void run_job_with_hostile_connections(bool insecure, const std::vector<std::string>& reasons) {
  const std::string dir = temp_run_dir(insecure ? "hostile-plain" : "hostile-tls");
  Result prep = prepare_deployment(dir);
  ASSERT_EQ(prep.exit_code, 0) << prep.output;
  const std::string run_dir = dir + "/run";
  const auto ports = free_ports(4);
  ASSERT_EQ(ports.size(), 4u);
  std::string sets = " --set job.steps=20 --set 'job.timeout=\"300s\"' --set 'job.run_dir=\"" + run_dir + "\"'";
  if (insecure) sets += " --set security.insecure=true";
  const char* keys[] = {"sites.0.gateway", "sites.0.store", "sites.1.gateway", "sites.1.store"};
  for (int i = 0; i < 4; ++i) sets += std::string(" --set '") + keys[i] + "=\"127.0.0.1:" + std::to_string(ports[i]) + "\"'";
  const std::string job = dir + "/prep/job.toml";

  Background alpha("worker " + job + " --site alpha --rank 0" + sets, run_dir + "/alpha.log", 600);
  EXPECT_TRUE(gateway_hangs_up_on(ports[0], std::string(64, 'G'))) << read_file(run_dir + "/alpha.log");
  EXPECT_TRUE(gateway_hangs_up_on(ports[0], frame_header(uint64_t{1} << 40))) << read_file(run_dir + "/alpha.log");
  Background beta("worker " + job + " --site beta --rank 0" + sets, run_dir + "/beta.log", 600);
  EXPECT_EQ(alpha.wait(), 0) << read_file(run_dir + "/alpha.log");
  EXPECT_EQ(beta.wait(), 0) << read_file(run_dir + "/beta.log");

  ASSERT_TRUE(fs::exists(run_dir + "/summary.json")) << read_file(run_dir + "/alpha.log");
  EXPECT_EQ(nlohmann::json::parse(read_file(run_dir + "/summary.json"))["steps"].get<int>(), 20);
  std::vector<nlohmann::json> refused;
  int accepted = 0;
  for (const auto& line : lines_of(run_dir + "/audit.jsonl")) {
    auto j = nlohmann::json::parse(line);
    if (j["outcome"] == "refused") refused.push_back(j);
    accepted += j["outcome"] == "accepted";
  }
  EXPECT_EQ(accepted, 2) << read_file(run_dir + "/audit.jsonl");
  ASSERT_EQ(refused.size(), reasons.size()) << read_file(run_dir + "/audit.jsonl");
  // Each connection's handshake runs on its own thread: the audit lines come in either order.
  std::vector<bool> matched(reasons.size(), false);
  for (const auto& r : refused) {
    EXPECT_EQ(r["local_site"], "alpha") << r.dump();
    EXPECT_TRUE(r["address"].get<std::string>().starts_with("127.0.0.1:")) << r.dump();
    bool found = false;
    for (size_t i = 0; i < reasons.size() && !found; ++i)
      if (!matched[i] && r["reason"].get<std::string>().find(reasons[i]) != std::string::npos) matched[i] = found = true;
    EXPECT_TRUE(found) << "unexpected refusal: " << r.dump();
  }
  fs::remove_all(dir);
}

TEST(EndToEnd, GarbageAndOversizeFramesAtATlsGatewayAreRefusedAuditedAndTheJobFinishes) {
  run_job_with_hostile_connections(false, {"not speaking TLS", "not speaking TLS"});
}

TEST(EndToEnd, GarbageAndOversizeFramesAtAPlaintextGatewayAreRefusedAuditedAndTheJobFinishes) {
  run_job_with_hostile_connections(true, {"bad magic", "payload_len 1099511627776 of a hello frame exceeds the maximum 65536"});
}

// Bad data files through the real binary: one line naming the file (and line), the key it
// came from, and no worker started.
TEST(EndToEnd, BadDataFilesGiveOneLineNamingTheFileAndTheKey) {
  const std::string dir = temp_run_dir("baddata");
  fs::create_directories(dir + "/folder");
  std::ofstream(dir + "/latin1.tsv", std::ios::binary) << "aa\tOpen\t\xd6" "ffnen\n";
  std::ofstream(dir + "/notab.tsv", std::ios::binary) << "aa\tOpen\tAuf\nOpen Auf\n";
  const std::string common = " --set data.source=tsv --set 'data.languages=[]' --set 'sites.0.languages=[]' "
                             "--set 'sites.1.languages=[]' --set 'job.run_dir=\"" + dir + "/run\"'";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {dir + "/missing.tsv", dir + "/missing.tsv: cannot open: No such file or directory"},
      {dir + "/folder", dir + "/folder: cannot read: Is a directory"},
      {dir + "/latin1.tsv", dir + "/latin1.tsv:1:9: not valid UTF-8 (byte 0xD6)"},
      {dir + "/notab.tsv", dir + "/notab.tsv:2: expected 2 or 3 tab-separated columns, got 1"},
  };
  for (const auto& [path, says] : cases) {
    Result r = run("run examples/smoke.toml --set 'data.path=\"" + path + "\"'" + common, 120);
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("data.path = \"" + path + "\" in examples/smoke.toml"), std::string::npos) << r.output;
    EXPECT_EQ(r.output.find("started"), std::string::npos) << "workers were started:\n" << r.output;
  }
  // `nebula corpus build` on the same file: the same line, and nothing written (it used to
  // fail later, writing stats.json, with a bare JSON library error naming no file).
  Result cb = run("corpus build --source tsv --path " + dir + "/latin1.tsv --out " + dir + "/corpus", 60);
  EXPECT_EQ(cb.exit_code, 1) << cb.output;
  EXPECT_NE(cb.output.find(dir + "/latin1.tsv:1:9: not valid UTF-8 (byte 0xD6)"), std::string::npos) << cb.output;
  EXPECT_FALSE(fs::exists(dir + "/corpus")) << cb.output;
  // job.run_dir where a file is: one line naming it and the key.
  Result rd = run("run examples/smoke.toml --set 'job.run_dir=\"" + dir + "/latin1.tsv\"'", 60);
  EXPECT_EQ(rd.exit_code, 1) << rd.output;
  EXPECT_NE(rd.output.find(dir + "/latin1.tsv/logs: cannot create the run directory: Not a directory (job.run_dir in "
                           "examples/smoke.toml"),
            std::string::npos)
      << rd.output;
  // A tokenizer file that is not one: the workers say which file.
  std::ofstream(dir + "/garbage.model", std::ios::binary) << std::string(3000, '\x07');
  Result r = run("run examples/smoke.toml --set job.steps=2 --set 'data.tokenizer=\"" + dir +
                     "/garbage.model\"' --set 'job.run_dir=\"" + dir + "/run\"'",
                 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find(dir + "/garbage.model: not a valid SentencePiece model"), std::string::npos) << r.output;
  fs::remove_all(dir);
}

}  // namespace

// Checkpoints and --resume (diloco with int8 error feedback, two sites, two workers on one):
// a stop at step 25 (as SIGTERM would, at a fixed step) and a resume give bit-identical
// weights to an uninterrupted run; so does a crash in the middle of writing checkpoint 20,
// after which every worker resumes from checkpoint 10.
TEST(EndToEnd, StopOrCrashThenResumeGivesTheSameWeightsAsAnUninterruptedRun) {
  const std::string dir = temp_run_dir("resume");
  const std::string common =
      "run examples/smoke.toml --set strategy.kind=\\\"diloco\\\" --set strategy.codec=\\\"int8\\\" "
      "--set strategy.inner_steps=10 --set strategy.heterogeneous=false --set sites.0.workers=2 "
      "--set checkpoint.every=10 --set job.run_dir=\\\"" + dir;
  Result whole = run(common + "/whole\\\"");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const auto expected = tensor_bytes(dir + "/whole/model.safetensors");
  ASSERT_EQ(expected.size(), 20u);

  Result stopped = run(common + "/stopped\\\"", 600, "NEBULA_TEST_STOP_AT_STEP=25");
  ASSERT_EQ(stopped.exit_code, 128 + 15) << stopped.output;
  EXPECT_NE(stopped.output.find("--resume"), std::string::npos) << stopped.output;
  EXPECT_FALSE(fs::exists(dir + "/stopped/summary.json"));
  for (const char* worker : {"alpha/rank-0", "alpha/rank-1", "beta/rank-0"}) {
    const std::string ck = dir + "/stopped/checkpoints/" + worker;
    EXPECT_TRUE(fs::exists(ck + "/step-000000000025/manifest.json")) << ck;
    EXPECT_TRUE(fs::exists(ck + "/step-000000000020/tensors.safetensors")) << ck;
    EXPECT_FALSE(fs::exists(ck + "/step-000000000010")) << ck << ": keep = 2";
  }
  Result resumed = run(common + "/stopped\\\" --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(tensor_bytes(dir + "/stopped/model.safetensors"), expected);
  std::ifstream sin(dir + "/stopped/summary.json");
  auto summary = nlohmann::json::parse(sin);
  // 60 steps, H = 10: six outer steps, each checked (ids and hashes) on every site, plus the final check.
  EXPECT_EQ(summary["strategy_metrics"]["outer_steps"].get<double>(), 6);
  EXPECT_EQ(summary["strategy_metrics"]["hash_checks"].get<double>(), 7);

  Result crashed = run(common + "/crashed\\\"", 600, "NEBULA_TEST_CRASH_IN_CHECKPOINT=20");
  ASSERT_NE(crashed.exit_code, 0) << crashed.output;
  for (const char* worker : {"alpha/rank-0", "alpha/rank-1", "beta/rank-0"}) {
    const std::string ck = dir + "/crashed/checkpoints/" + worker;
    if (!fs::exists(ck + "/step-000000000020.tmp")) continue;  // killed by the launcher before it got there
    EXPECT_FALSE(fs::exists(ck + "/step-000000000020")) << ck;
    EXPECT_TRUE(fs::exists(ck + "/step-000000000010/manifest.json")) << ck;
  }
  Result recovered = run(common + "/crashed\\\" --resume");
  ASSERT_EQ(recovered.exit_code, 0) << recovered.output;
  EXPECT_NE(read_file(dir + "/crashed/logs/beta-0.log").find("step-10 "), std::string::npos);
  EXPECT_EQ(tensor_bytes(dir + "/crashed/model.safetensors"), expected);
  fs::remove_all(dir);
}

// [2/5] ZeRO-1's, -2's and -3's checkpoints hold each worker's own shard of AdamW's moments, of
// diloco's outer state and of the trainable parameters (no worker gathers the model): a run
// stopped at step 15 and resumed ends with bit-identical weights; resumed unsharded (the shards
// joined) too; resumed on 3 workers instead of 2 it reshards and the sites' global weights
// still agree at every merge.
TEST(EndToEnd, ZeroOneStopAndResumeFromShardedCheckpointsGivesTheSameWeights) {
  for (const char* mode : {"optimizer", "gradients", "full"}) {
    SCOPED_TRACE(mode);
    const std::string dir = temp_run_dir(nebula::str_cat("resume-", mode));
    const std::string common =
        "run examples/smoke.toml --set strategy.kind=\\\"diloco\\\" --set strategy.inner_steps=10 "
        "--set strategy.heterogeneous=false --set sites.0.workers=2 --set job.steps=30 --set checkpoint.every=10 "
        "--set job.run_dir=\\\"" + dir;
    const std::string zero = nebula::str_cat(" --set parallel.shard=\\\"", mode, "\\\"");
    Result whole = run(common + "/whole\\\"" + zero);
    ASSERT_EQ(whole.exit_code, 0) << whole.output;
    Result stopped = run(common + "/stopped\\\"" + zero, 600, "NEBULA_TEST_STOP_AT_STEP=15");
    ASSERT_EQ(stopped.exit_code, 128 + 15) << stopped.output;
    // Each rank of the two-worker site holds a different half of the moments.
    const auto r0 = tensor_bytes(dir + "/stopped/checkpoints/alpha/rank-0/step-000000000015/tensors.safetensors");
    const auto r1 = tensor_bytes(dir + "/stopped/checkpoints/alpha/rank-1/step-000000000015/tensors.safetensors");
    ASSERT_TRUE(r0.count("optim/0/exp_avg") && r1.count("optim/0/exp_avg"));
    EXPECT_FALSE(r0.count("optim/1/exp_avg")) << "one flat shard, not one entry per parameter";
    EXPECT_EQ(r0.at("optim/0/exp_avg").size(), r1.at("optim/0/exp_avg").size());
    EXPECT_NE(r0.at("optim/0/exp_avg"), r1.at("optim/0/exp_avg"));
    // The parameters too: each rank its half, and no trainable model tensor whole.
    ASSERT_TRUE(r0.count("optim/0/param") && r1.count("optim/0/param"));
    EXPECT_EQ(r0.at("optim/0/param").size(), r0.at("optim/0/exp_avg").size());
    EXPECT_NE(r0.at("optim/0/param"), r1.at("optim/0/param"));
    for (const auto& [name, bytes] : r0) EXPECT_NE(name.rfind("model/", 0), 0u) << name << " saved whole";
    fs::copy(dir + "/stopped", dir + "/unsharded", fs::copy_options::recursive);
    fs::copy(dir + "/stopped", dir + "/three", fs::copy_options::recursive);
    Result resumed = run(common + "/stopped\\\" --resume" + zero);
    ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
    const auto expected = tensor_bytes(dir + "/whole/model.safetensors");
    ASSERT_FALSE(expected.empty());
    EXPECT_EQ(tensor_bytes(dir + "/stopped/model.safetensors"), expected);
    // The same checkpoints resumed unsharded: the shards are joined (moments, θ_global,
    // momentum), every worker keeps its data position, and the run ends as the whole one did.
    // (The copies share the stopped run's vocabulary, which its fingerprint names by path.)
    const std::string vocabulary = " --set data.tokenizer=\\\"" + dir + "/stopped/tokenizer.model\\\"";
    Result unsharded = run(common + "/unsharded\\\" --resume" + vocabulary);
    ASSERT_EQ(unsharded.exit_code, 0) << unsharded.output;
    const std::string unsharded_log = read_file(dir + "/unsharded/logs/alpha-1.log");
    EXPECT_NE(unsharded_log.find("resharded the checkpoint of step 15 from 2 workers onto 2"), std::string::npos)
        << unsharded_log;
    EXPECT_EQ(tensor_bytes(dir + "/unsharded/model.safetensors"), expected);
    if (std::string(mode) == "full") {
      // ZeRO-3 from the unsharded run's last checkpoint (the parameters whole in each file), at
      // the run's end: each worker reads its pieces by range, nothing gathered, the same model.
      fs::copy(dir + "/unsharded", dir + "/refull", fs::copy_options::recursive);
      fs::remove(dir + "/refull/model.safetensors");
      Result refull = run(common + "/refull\\\" --resume" + zero + vocabulary);
      ASSERT_EQ(refull.exit_code, 0) << refull.output;
      const std::string log = read_file(dir + "/refull/logs/alpha-1.log");
      EXPECT_NE(log.find("ZeRO-3: the trainable parameters, saved whole"), std::string::npos) << log;
      EXPECT_EQ(tensor_bytes(dir + "/refull/model.safetensors"), tensor_bytes(dir + "/unsharded/model.safetensors"));
    }
    // On three workers: resharded 2 -> 3 (the data partitioned anew, so other weights), and
    // every merge's hash check across the sites passes (site 0's θ_global rejoined exactly).
    Result three = run(common + "/three\\\" --resume --set sites.0.workers=3" + zero + vocabulary);
    ASSERT_EQ(three.exit_code, 0) << three.output;
    const std::string three_log = read_file(dir + "/three/logs/alpha-2.log");
    EXPECT_NE(three_log.find("resharded the checkpoint of step 15 from 2 workers onto 3"), std::string::npos)
        << three_log;
    // Each of the three read only its part of the old workers' sharded state: about a third.
    for (int r = 0; r < 3; ++r) {
      const std::string log = read_file(nebula::str_cat(dir, "/three/logs/alpha-", r, ".log"));
      std::smatch m;
      ASSERT_TRUE(std::regex_search(log, m, std::regex("resharding read (\\d+) of the old workers' (\\d+) bytes")))
          << log;
      const double read = std::stod(m[1].str()), all = std::stod(m[2].str());
      EXPECT_GT(read, 0) << "worker " << r;
      EXPECT_LE(read, all / 3 * 1.02) << "worker " << r << " read more than its third";
    }
    const nlohmann::json summary = nlohmann::json::parse(read_file(dir + "/three/summary.json"));
    EXPECT_EQ(summary["workers"].get<int>(), 4);
    // Every worker's peak memory in each phase, and its bytes to its site's other workers.
    const nlohmann::json& peaks = summary["peak_rss_bytes_by_phase"];
    EXPECT_EQ(summary.value("allocator", ""), "jemalloc") << "build/nebula is linked with jemalloc (src/cli/CMakeLists.txt)";
    for (const char* phase : {"init", "resume", "step", "outer_sync", "checkpoint", "eval"}) {
      ASSERT_TRUE(peaks.contains(phase)) << summary.dump();
      const auto by_worker = peaks[phase].get<std::vector<double>>();
      ASSERT_EQ(by_worker.size(), 4u) << phase;
      for (size_t w = 0; w < by_worker.size(); ++w)
        EXPECT_GT(by_worker[w], 1e7) << phase << ", worker " << w;
    }
    const auto site_bytes = summary["site_bytes_sent_by_worker"].get<std::vector<double>>();
    ASSERT_EQ(site_bytes.size(), 4u);
    for (size_t w = 0; w < 3; ++w) EXPECT_GT(site_bytes[w], 0) << "worker " << w << " of the 3-worker site";
    EXPECT_EQ(site_bytes[3], 0) << "a site of one worker sends nothing inside it";
    // And back onto two (3 -> 2) from the three's last checkpoint, at the run's end: nothing
    // left to train, so the model is the three's, bit for bit, each worker having read about half.
    fs::copy(dir + "/three", dir + "/back", fs::copy_options::recursive);
    fs::remove(dir + "/back/model.safetensors");
    Result back = run(common + "/back\\\" --resume" + zero + vocabulary);
    ASSERT_EQ(back.exit_code, 0) << back.output;
    EXPECT_NE(read_file(dir + "/back/logs/alpha-1.log").find("from 3 workers onto 2"), std::string::npos);
    for (int r = 0; r < 2; ++r) {
      const std::string log = read_file(nebula::str_cat(dir, "/back/logs/alpha-", r, ".log"));
      std::smatch m;
      ASSERT_TRUE(std::regex_search(log, m, std::regex("resharding read (\\d+) of the old workers' (\\d+) bytes")))
          << log;
      EXPECT_LE(std::stod(m[1].str()), std::stod(m[2].str()) / 2 * 1.02) << "worker " << r << " read more than its half";
    }
    EXPECT_EQ(tensor_bytes(dir + "/back/model.safetensors"), tensor_bytes(dir + "/three/model.safetensors"));
    fs::remove_all(dir);
  }
}

// sync: the same for plain data parallel with an error-feedback codec (the bucket residuals
// are in the checkpoint).
TEST(EndToEnd, SyncStopAndResumeGivesTheSameWeights) {
  const std::string dir = temp_run_dir("resume-sync");
  const std::string common =
      "run examples/smoke.toml --set job.steps=40 --set strategy.codec=\\\"int8\\\" --set sites.0.workers=2 "
      "--set job.run_dir=\\\"" + dir;
  Result whole = run(common + "/whole\\\"");
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  Result stopped = run(common + "/stopped\\\"", 600, "NEBULA_TEST_STOP_AT_STEP=17");
  ASSERT_EQ(stopped.exit_code, 128 + 15) << stopped.output;
  Result resumed = run(common + "/stopped\\\" --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto expected = tensor_bytes(dir + "/whole/model.safetensors");
  ASSERT_FALSE(expected.empty());
  EXPECT_EQ(tensor_bytes(dir + "/stopped/model.safetensors"), expected);
  fs::remove_all(dir);
}

// A site whose newest checkpoint is a round behind (here: its later ones were lost) takes the
// global state of the site furthest ahead, and the job goes on with every exchange's id and
// hash agreeing. Resuming under another config is refused, naming the hashes.
TEST(EndToEnd, ASiteResumingFromAnOlderCheckpointTakesTheGlobalStateOfTheOthers) {
  const std::string dir = temp_run_dir("reconcile");
  const std::string common =
      "run examples/smoke.toml --set strategy.kind=\\\"diloco\\\" --set strategy.inner_steps=10 "
      "--set strategy.heterogeneous=false --set checkpoint.every=10 --set checkpoint.keep=3 "
      "--set job.run_dir=\\\"" + dir + "\\\"";
  Result stopped = run(common, 600, "NEBULA_TEST_STOP_AT_STEP=25");
  ASSERT_EQ(stopped.exit_code, 128 + 15) << stopped.output;
  for (const char* step : {"step-000000000020", "step-000000000025"})
    ASSERT_TRUE(fs::remove_all(dir + "/checkpoints/beta/rank-0/" + step)) << step;

  Result other = run(common + " --set model.ffn=48 --resume");
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.output.find("config hash"), std::string::npos) << other.output;

  Result resumed = run(common + " --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const std::string beta = read_file(dir + "/logs/beta-0.log");
  EXPECT_NE(beta.find("resumed from " + dir + "/checkpoints/beta/rank-0/step-10 "), std::string::npos) << beta;
  EXPECT_NE(beta.find("takes its global state"), std::string::npos) << beta;
  std::ifstream sin(dir + "/summary.json");
  auto summary = nlohmann::json::parse(sin);
  EXPECT_EQ(summary["strategy_metrics"]["outer_steps"].get<double>(), 6);
  EXPECT_EQ(summary["strategy_metrics"]["hash_checks"].get<double>(), 7);
  fs::remove_all(dir);
}

// The WAN link cut again and again for a whole diloco run (the first cut after 50 KiB, then
// 700 ms after every reconnection): the run completes; every outer step is applied once
// (six of them, counted) with ids and weight hashes agreeing on both sites at each one; and
// the weights are bit-identical to a run without cuts.
TEST(EndToEnd, RepeatedLinkCutsApplyEveryOuterStepOnceWithAgreeingHashes) {
  const std::string dir = temp_run_dir("cuts");
  fs::create_directories(dir);
  std::ifstream in(NEBULA_SOURCE_DIR "/examples/smoke.toml");
  std::stringstream text;
  text << in.rdbuf() << "\n[[wan.faults]]\nkind = \"cut\"\nafter = \"50KiB\"\nevery = \"700ms\"\n";
  std::ofstream(dir + "/cuts.toml") << text.str();
  const std::string common =
      " --set job.steps=120 --set strategy.kind=\\\"diloco\\\" --set strategy.inner_steps=20 "
      "--set strategy.codec=\\\"int8\\\" --set strategy.heterogeneous=false --set wan.streams=2";
  Result clean = run("run examples/smoke.toml" + common + " --set job.run_dir=\\\"" + dir + "/clean\\\"");
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  Result cut = run("run " + dir + "/cuts.toml" + common + " --set job.run_dir=\\\"" + dir + "/cut\\\"");
  ASSERT_EQ(cut.exit_code, 0) << cut.output;

  std::ifstream sin(dir + "/cut/summary.json");
  auto summary = nlohmann::json::parse(sin);
  EXPECT_EQ(summary["strategy_metrics"]["outer_steps"].get<double>(), 6);
  EXPECT_EQ(summary["strategy_metrics"]["hash_checks"].get<double>(), 7);
  int reconnected = 0;
  for (const auto& line : lines_of(dir + "/cut/audit.jsonl"))
    reconnected += nlohmann::json::parse(line)["reason"] == "reconnected";
  EXPECT_GE(reconnected, 2) << "at least the first cut (2 streams)";
  EXPECT_EQ(tensor_bytes(dir + "/cut/model.safetensors"), tensor_bytes(dir + "/clean/model.safetensors"));
  fs::remove_all(dir);
}

// Elastic diloco: site beta (two workers) is lost twice and comes back twice. First both its
// workers crash in the middle of writing checkpoint 80; later, after it rejoined, its gateway
// is killed with SIGKILL in the middle of training. Each time the launcher (job.restarts)
// starts it again; it resumes from its newest intact checkpoint, alpha admits it at a round
// start and it takes alpha's global state. The run completes with every outer step's ids and
// hashes agreeing, and its validation loss is within 6% of a run without faults (the gap is
// the rounds beta missed while down, which vary with the machine's load: see the bound below).
// Alpha runs at a sixth of its speed (sites.0.slowdown, in both runs): alone, it took ~15 ms a
// step, so while beta restarted (3-5 s) it could run out its 400 steps before beta rejoined a
// second time (seen in a clean-checkout run: 1 rejoin of 2). Slowed, it waits for the rejoins
// with room to spare: two runs side by side on 2 cores both passed, 1.6 % from the clean loss.
TEST(EndToEnd, ALostSiteRejoinsTwiceAndTheRunEndsNearTheCleanLoss) {
  const std::string dir = temp_run_dir("elastic");
  const std::string common =
      "run examples/smoke.toml --set job.steps=400 --set job.elastic=true --set wan.reconnect_timeout=\\\"2s\\\" "
      "--set strategy.kind=\\\"diloco\\\" --set strategy.inner_steps=20 --set strategy.heterogeneous=false "
      "--set sites.1.workers=2 --set checkpoint.every=20 --set data.batch_size=64 --set sites.0.slowdown=6 "
      "--set job.run_dir=\\\"" + dir;
  Result clean = run(common + "/clean\\\"");
  ASSERT_EQ(clean.exit_code, 0) << clean.output;

  // The faulty run, in the background; its output goes to a file.
  const std::string faulty = dir + "/faulty";
  const std::string cmd = "cd " NEBULA_SOURCE_DIR " && NEBULA_TEST_CRASH_IN_CHECKPOINT=beta:80 timeout -k 10 600 " +
                          std::string(NEBULA_BINARY_DIR) + "/nebula " + common +
                          "/faulty\\\" --set job.restarts=2 > " + dir + "/faulty.out 2>&1; echo $? > " + dir +
                          "/faulty.rc";
  fs::create_directories(dir);
  std::thread job([cmd] { ASSERT_EQ(std::system(cmd.c_str()), 0); });
  // Wait (bounded) until the restarted beta's gateway has logged step 100, then kill it. (At
  // step 200 alpha could finish its 400 steps before the restarted beta had rejoined a second
  // time, on a loaded machine: seen once in a clean-checkout run, 1 rejoin of 2. Killed at 100,
  // alpha has 300 steps left for beta's restart.)
  const bool reached =
      wait_for_step(faulty + "/metrics.jsonl", "beta", 0, 100, std::chrono::seconds(300), dir + "/faulty.rc");
  if (reached) {
    std::ifstream win(faulty + "/workers.json");
    for (const auto& w : nlohmann::json::parse(win))
      if (w["site"] == "beta" && w["rank"] == 0) ::kill(w["pid"].get<pid_t>(), SIGKILL);
  }
  job.join();
  ASSERT_TRUE(reached) << read_file(dir + "/faulty.out");
  ASSERT_EQ(read_file(dir + "/faulty.rc"), "0\n") << read_file(dir + "/faulty.out");

  const std::string out = read_file(dir + "/faulty.out");
  EXPECT_NE(out.find("starting site beta again to rejoin (restart 2 of 2)"), std::string::npos) << out;
  const std::string beta = read_file(faulty + "/logs/beta-0.log");
  EXPECT_NE(beta.find("resumed from " + faulty + "/checkpoints/beta/rank-0/step-60 "), std::string::npos)
      << "checkpoint 80 was torn: the first restart resumes from 60\n" << beta;
  size_t taken = 0;
  for (size_t at = beta.find("takes its global state"); at != std::string::npos;
       at = beta.find("takes its global state", at + 1))
    ++taken;
  EXPECT_EQ(taken, 2u) << beta;
  std::ifstream fin(faulty + "/summary.json"), cin(dir + "/clean/summary.json");
  auto summary = nlohmann::json::parse(fin), reference = nlohmann::json::parse(cin);
  EXPECT_EQ(summary["sites_rejoined"], nlohmann::json::array({"beta", "beta"}));
  // 400 steps, H = 20: twenty outer steps on alpha, each with agreeing ids and hashes where beta took part.
  EXPECT_EQ(summary["strategy_metrics"]["outer_steps"].get<double>(), 20);
  EXPECT_EQ(summary["strategy_metrics"]["hash_checks"].get<double>(), 21);
  const double loss = summary["final_val_loss"].get<double>(), ref = reference["final_val_loss"].get<double>();
  std::printf("validation loss %.4f with two losses of site beta, %.4f without faults\n", loss, ref);
  // The gap is the rounds beta missed while down (its restart time, which may vary with the
  // machine's load). With held-out sentences that no site trains on ([1/5]: splits keyed by
  // sentence) it was 2.8% at this commit (twice the same) and 4.0-4.5% on a branch with only
  // the split change; with the leaky splits before, 1.4%.
  EXPECT_LT(std::abs(loss - ref) / ref, 0.06) << loss << " vs " << ref << " without faults";
  fs::remove_all(dir);
}

// [7/7] launchers: the sites of one job started the way clusters start processes. Site alpha
// (2 workers) is one torchrun launch: RANK, WORLD_SIZE, LOCAL_RANK, and its store at
// MASTER_ADDR:MASTER_PORT (rank 0 hosts it: no agent store here). Site beta is one Slurm task:
// SLURM_PROCID, SLURM_NTASKS. Neither gets --site or --rank. The job trains to the end.
TEST(EndToEnd, WorkersStartedWithTorchrunAndSlurmVariablesFormTheJob) {
  const std::string dir = temp_run_dir("launchers");
  Result prep = prepare_deployment(dir);
  ASSERT_EQ(prep.exit_code, 0) << prep.output;
  const std::string run_dir = dir + "/run";
  const auto ports = free_ports(4);  // beta's gateway and store, alpha's gateway, torchrun's master port
  ASSERT_EQ(ports.size(), 4u);
  const std::string sets = " --set job.steps=20 --set sites.0.workers=2 --set 'job.run_dir=\"" + run_dir +
                           "\"' --set 'sites.0.gateway=\"127.0.0.1:" + std::to_string(ports[0]) +
                           "\"' --set 'sites.1.gateway=\"127.0.0.1:" + std::to_string(ports[1]) +
                           "\"' --set 'sites.1.store=\"127.0.0.1:" + std::to_string(ports[2]) + "\"'";
  const std::string job = dir + "/prep/job.toml";
  const std::string torchrun =
      "NEBULA_SITE=alpha WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(ports[3]);
  Background a0("worker " + job + sets, run_dir + "/a0.log", 600, torchrun + " RANK=0 LOCAL_RANK=0");
  Background a1("worker " + job + sets, run_dir + "/a1.log", 600, torchrun + " RANK=1 LOCAL_RANK=1");
  Background b0("worker " + job + sets, run_dir + "/b0.log", 600, "NEBULA_SITE=beta SLURM_PROCID=0 SLURM_NTASKS=1");
  EXPECT_EQ(a0.wait(), 0) << read_file(run_dir + "/a0.log");
  EXPECT_EQ(a1.wait(), 0) << read_file(run_dir + "/a1.log");
  EXPECT_EQ(b0.wait(), 0) << read_file(run_dir + "/b0.log");
  EXPECT_NE(read_file(run_dir + "/a1.log").find("worker alpha/1 (from the torchrun)"), std::string::npos);
  EXPECT_NE(read_file(run_dir + "/b0.log").find("worker beta/0 (from the slurm)"), std::string::npos);
  ASSERT_TRUE(fs::exists(run_dir + "/summary.json")) << read_file(run_dir + "/a0.log");
  auto summary = nlohmann::json::parse(read_file(run_dir + "/summary.json"));
  EXPECT_EQ(summary["workers"].get<int>(), 3);
  EXPECT_EQ(summary["steps"].get<int>(), 20);

  // A launch of the wrong size is refused before anything starts, naming both numbers.
  Result wrong = run("worker " + job + sets, 60, "NEBULA_SITE=beta SLURM_PROCID=0 SLURM_NTASKS=4");
  EXPECT_EQ(wrong.exit_code, 2) << wrong.output;
  EXPECT_NE(wrong.output.find("$SLURM_NTASKS = 4 but site 'beta' has workers = 1"), std::string::npos) << wrong.output;
  fs::remove_all(dir);
}

namespace {

// [7/7] Real launchers: site alpha's two workers run under `program` (torchrun or mpirun),
// which sets their rank variables; beta is a plain worker; the job completes and alpha's log
// says which launcher placed each worker and which store it used. `ports[3]` is free for the
// launcher's own use (torchrun's master port); alpha's store is ports[4].
void run_alpha_under(const std::string& program, const std::function<std::string(const std::vector<uint16_t>&)>& args,
                     const std::string& env, const std::function<std::string(const std::vector<uint16_t>&)>& expect) {
  const std::string dir = temp_run_dir("launcher-" + fs::path(program).filename().string());
  Result prep = prepare_deployment(dir);
  ASSERT_EQ(prep.exit_code, 0) << prep.output;
  const std::string run_dir = dir + "/run";
  const auto ports = free_ports(5);
  ASSERT_EQ(ports.size(), 5u);
  const std::string sets = " --set job.steps=20 --set sites.0.workers=2 --set 'job.run_dir=\"" + run_dir +
                           "\"' --set 'sites.0.gateway=\"127.0.0.1:" + std::to_string(ports[0]) +
                           "\"' --set 'sites.0.store=\"127.0.0.1:" + std::to_string(ports[4]) +
                           "\"' --set 'sites.1.gateway=\"127.0.0.1:" + std::to_string(ports[1]) +
                           "\"' --set 'sites.1.store=\"127.0.0.1:" + std::to_string(ports[2]) + "\"'";
  const std::string worker = NEBULA_BINARY_DIR "/nebula worker " + dir + "/prep/job.toml" + sets;
  Background alpha(args(ports) + " " + worker, run_dir + "/alpha.log", 300, env, program);
  Background beta("worker " + dir + "/prep/job.toml" + sets, run_dir + "/beta.log", 300, "NEBULA_SITE=beta NEBULA_RANK=0");
  EXPECT_EQ(alpha.wait(), 0) << read_file(run_dir + "/alpha.log");
  EXPECT_EQ(beta.wait(), 0) << read_file(run_dir + "/beta.log");
  const std::string log = read_file(run_dir + "/alpha.log");
  for (const char* worker_name : {"alpha/0", "alpha/1"})
    EXPECT_NE(log.find(std::string("worker ") + worker_name + " " + expect(ports)), std::string::npos) << log;
  ASSERT_TRUE(fs::exists(run_dir + "/summary.json")) << log;
  EXPECT_EQ(nlohmann::json::parse(read_file(run_dir + "/summary.json"))["workers"].get<int>(), 3);
  fs::remove_all(dir);
}

// Debian's torchrun (python3-torch): ranks from RANK/WORLD_SIZE, and the store is torchrun's
// agent store (TORCHELASTIC_USE_AGENT_STORE). `-r 1 -t 1`: Debian 12's torchrun 1.13 fails on
// Python 3.11 with the default `-r 0`, in torch's own Std.from_str; redirecting stdout avoids
// that code path.
TEST(EndToEnd, WorkersUnderARealTorchrunFormTheSite) {
  if (!fs::exists("/usr/bin/torchrun")) GTEST_SKIP() << "no /usr/bin/torchrun (python3-torch)";
  const std::string logs = temp_run_dir("torchrun-logs");
  run_alpha_under(
      "/usr/bin/torchrun",
      [&](const std::vector<uint16_t>& p) {
        return "--nnodes=1 --nproc_per_node=2 --master_port=" + std::to_string(p[3]) + " --log_dir " + logs +
               " -r 1 -t 1 --no_python";
      },
      "NEBULA_SITE=alpha",
      [](const std::vector<uint16_t>& p) {
        return "(from the torchrun), site store 127.0.0.1:" + std::to_string(p[3]) + " (the launcher's)";
      });
  fs::remove_all(logs);
}

// Debian's Open MPI (openmpi-bin): ranks from OMPI_COMM_WORLD_RANK/SIZE, the store from
// [[sites]] store.
TEST(EndToEnd, WorkersUnderARealMpirunFormTheSite) {
  if (!fs::exists("/usr/bin/mpirun")) GTEST_SKIP() << "no /usr/bin/mpirun (openmpi-bin)";
  run_alpha_under(
      "/usr/bin/mpirun", [](const std::vector<uint16_t>&) { return std::string("-np 2 --allow-run-as-root --oversubscribe -x NEBULA_SITE=alpha"); },
      "", [](const std::vector<uint16_t>& p) { return "(from the open mpi), site store 127.0.0.1:" + std::to_string(p[4]); });
}

// [7/7] A GPU site: here (CPU-only LibTorch, no GPU) it is refused before training, naming the
// site and what to do; on a machine with a CUDA LibTorch and a GPU the same job trains there.
TEST(EndToEnd, AGpuSiteTrainsOnTheGpuOrIsRefusedSayingWhy) {
  const std::string dir = temp_run_dir("gpu");
  Result r = run("run examples/smoke.toml --set job.steps=20 --set sites.1.device=\\\"cuda\\\" --set job.run_dir=\\\"" +
                 dir + "\\\"", 300);
  if (r.exit_code == 0) {  // a GPU machine (bench/gpu_check.sh)
    EXPECT_NE(read_file(dir + "/logs/beta-0.log").find("training on cuda:0"), std::string::npos);
  } else {
    EXPECT_NE(r.output.find("site 'beta' has device = \"cuda\", but this LibTorch sees no CUDA device"),
              std::string::npos) << r.output;
    EXPECT_NE(r.output.find("set device = \"cpu\""), std::string::npos) << r.output;
  }
  fs::remove_all(dir);
}

// GPU sites shard ([2/7]): two sites of two workers sharing the GPU, diloco with ZeRO-2 and ZeRO-3
// (their reduce-scatters run inside backward, on each worker's own autograd thread for the GPU:
// one process per worker, as deployed), end within 1 % of the validation loss of the same job on
// CPU sites. Runs where LibTorch has CUDA and a GPU (bench/gpu_check.sh); skipped elsewhere, after
// checking that the GPU site was refused for that reason.
TEST(EndToEnd, ShardedGpuSitesTrainAsCpuSites) {
  const std::string dir = temp_run_dir("gpu-shard");
  auto job = [&](const std::string& device, const std::string& shard) {
    return run(nebula::str_cat("run examples/smoke.toml --set job.steps=30 --set sites.0.workers=2 --set sites.1.workers=2",
                               " --set strategy.kind=diloco --set strategy.inner_steps=10 --set parallel.shard=", shard,
                               " --set sites.0.device=\\\"", device, "\\\" --set sites.1.device=\\\"", device,
                               "\\\" --set job.run_dir=\\\"", dir, "/", device, "-", shard, "\\\""),
               300);
  };
  for (const std::string shard : {"full", "gradients"}) {
    SCOPED_TRACE(shard);
    Result gpu = job("cuda", shard);
    if (gpu.exit_code != 0 && gpu.output.find("but this LibTorch sees no CUDA device") != std::string::npos)
      GTEST_SKIP() << "no CUDA device for LibTorch here";
    ASSERT_EQ(gpu.exit_code, 0) << gpu.output;
    Result cpu = job("cpu", shard);
    ASSERT_EQ(cpu.exit_code, 0) << cpu.output;
    for (const char* worker : {"beta-0", "beta-1"})  // both on the one GPU (worker r takes GPU r mod 1)
      EXPECT_NE(read_file(dir + "/cuda-" + shard + "/logs/" + worker + ".log").find("training on cuda:0"), std::string::npos);
    const std::string log = read_file(dir + "/cuda-" + shard + "/logs/beta-0.log");
    EXPECT_NE(log.find(shard == "full" ? "ZeRO-3" : "ZeRO-2"), std::string::npos) << log;
    auto val_loss = [&](const std::string& device) {
      std::ifstream in(dir + "/" + device + "-" + shard + "/summary.json");
      return nlohmann::json::parse(in)["final_val_loss"].get<double>();
    };
    const double on_gpu = val_loss("cuda"), on_cpu = val_loss("cpu");
    EXPECT_LT(std::abs(on_gpu - on_cpu), 0.01 * on_cpu) << "validation loss " << on_gpu << " on the GPU, " << on_cpu
                                                        << " on the CPU";
  }
  fs::remove_all(dir);
}

// [7/7] Library use: examples/library/my_training_loop.cc, a user's own LibTorch loop calling
// nebula::Session and nebula::Synchronizer, trains on two sites over mutual TLS; every replica
// ends with the same weights and the job's test loss falls.
TEST(EndToEnd, TheLibraryExampleTrainsItsOwnLoopOnTwoSitesOverMutualTls) {
  const std::string dir = temp_run_dir("library");
  fs::create_directories(dir);
  ASSERT_EQ(run("certs init " + dir + "/certs").exit_code, 0);
  for (const char* site : {"alpha", "beta"})
    ASSERT_EQ(run("certs issue " + dir + "/certs --job library --site " + site).exit_code, 0);
  const auto ports = free_ports(4);
  ASSERT_EQ(ports.size(), 4u);
  const std::string example = NEBULA_BINARY_DIR "/examples/library/my_training_loop";
  for (const std::string kind : {"diloco", "sync"}) {
    SCOPED_TRACE(kind);
    const std::string run_dir = dir + "/" + kind;
    std::string toml = read_file(NEBULA_SOURCE_DIR "/examples/library/job.toml");
    for (auto [from, to] : std::vector<std::pair<std::string, std::string>>{
             {"29610", std::to_string(ports[0])}, {"29611", std::to_string(ports[1])},
             {"29620", std::to_string(ports[2])}, {"29621", std::to_string(ports[3])},
             {"insecure = true", "certs = \"" + dir + "/certs\""},
             {"kind = \"diloco\"", "kind = \"" + kind + "\""},
             {"name = \"library\"", "name = \"library\"\nrun_dir = \"" + run_dir + "\""}})
      toml.replace(toml.find(from), from.size(), to);
    const std::string config = dir + "/" + kind + ".toml";
    std::ofstream(config) << toml;
    std::vector<std::unique_ptr<Background>> workers;
    const std::vector<std::string> names = {"alpha 0", "alpha 1", "beta 0"};
    for (const auto& w : names) {
      const std::string site = w.substr(0, w.find(' ')), rank = w.substr(w.find(' ') + 1);
      workers.push_back(std::make_unique<Background>(config + " --steps 200", dir + "/" + kind + site + rank + ".log", 300,
                                                     "NEBULA_SITE=" + site + " NEBULA_RANK=" + rank, example));
    }
    std::set<std::string> crcs;
    for (size_t i = 0; i < workers.size(); ++i) {
      const std::string log = dir + "/" + kind + names[i].substr(0, names[i].find(' ')) + names[i].back() + ".log";
      EXPECT_EQ(workers[i]->wait(), 0) << read_file(log);
      const std::string out = read_file(log);
      const auto at = out.find("parameters crc32 ");
      ASSERT_NE(at, std::string::npos) << out;
      crcs.insert(out.substr(at + 17, 8));
      if (i != 1) {  // "connected to site ... (1 stream, mutual TLS)"
        EXPECT_NE(out.find("mutual TLS)"), std::string::npos) << out;
      }
      if (i == 0) {
        double before = 0, after = 0;
        const auto line = out.find("test loss, mean over 3 workers on 2 sites: ");
        ASSERT_NE(line, std::string::npos) << out;
        ASSERT_EQ(std::sscanf(out.c_str() + line + 43, "%lf -> %lf", &before, &after), 2) << out;
        EXPECT_LT(after, 0.2 * before) << out;
      }
    }
    EXPECT_EQ(crcs.size(), 1u) << "the replicas differ";
  }
  // A rank the site does not have is refused, naming it.
  Result wrong = shell(example + " " + dir + "/sync.toml --site beta --rank 3", 60);
  EXPECT_EQ(wrong.exit_code, 2) << wrong.output;
  EXPECT_NE(wrong.output.find("site 'beta' has workers = 1"), std::string::npos) << wrong.output;
  fs::remove_all(dir);
}

}  // namespace
