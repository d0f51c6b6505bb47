// The job configuration: one TOML file per job (see examples/). Loaded and validated in one
// place (config.cc): unknown keys, wrong types and bad units are ConfigErrors naming the file,
// line, column and key. Every default lives in the structs below.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace nebula {

struct JobConfig {
  std::string name = "nebula";
  std::string run_dir;              // default: runs/<name>
  uint64_t seed = 1;
  int64_t steps = 100;              // optimizer steps per worker
  int64_t log_every = 10;           // steps between metrics lines
  int64_t eval_batches = 8;         // validation batches per worker at the end
  std::chrono::nanoseconds timeout = std::chrono::seconds(120);  // deadline of every collective
};

struct ModelConfig {
  std::string kind = "mlm_encoder";  // the only kind so far
  int64_t dim = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t ffn = 256;
  int64_t max_len = 32;              // tokens per sequence, including BOS/EOS
  double dropout = 0.0;
  double lr = 1e-3;                  // AdamW
  double weight_decay = 0.01;
};

struct DataConfig {
  std::string source = "gettext";    // gettext | tsv | text
  std::string path = "/usr/share/locale";  // locale dir (gettext) or a file (tsv, text)
  std::vector<std::string> languages;      // gettext: the languages of the whole job
  int64_t max_pairs_per_language = 2000;   // 0 = all
  double valid_fraction = 0.05;
  int64_t vocab_size = 1000;
  std::string tokenizer;             // an existing SentencePiece .model; empty = train one
  int64_t batch_size = 16;           // sentences per worker per step
  double mask_prob = 0.15;
};

struct SiteConfig {
  std::string name;
  int64_t workers = 1;
  std::string device = "cpu";        // cpu (cuda: issue [7/7])
  std::string gateway = "127.0.0.1:0";  // WAN listen address of the site's gateway (rank 0)
  std::string store = "127.0.0.1:0";    // intra-site rendezvous (c10d TCPStore on rank 0)
  std::vector<std::string> languages;   // this site's shard; empty = a slice of the whole corpus
};

struct WanConfig {
  double bandwidth_bits = 0;         // emulated in local mode; 0 = unlimited
  std::chrono::nanoseconds rtt{0};   // emulated round trip (half each way)
};

struct StrategyConfig {
  std::string kind = "sync";         // sync (diloco, streaming: issue [4/7])
};

struct SecurityConfig {
  bool insecure = false;             // plaintext inter-site links; TLS arrives with issue [2/7]
};

struct MetricsConfig {
  std::string progress = "auto";     // auto (in place on a terminal) | plain | off
};

struct Config {
  std::string source_path;           // the file it came from
  JobConfig job;
  ModelConfig model;
  DataConfig data;
  std::vector<SiteConfig> sites;
  WanConfig wan;
  StrategyConfig strategy;
  SecurityConfig security;
  MetricsConfig metrics;

  int64_t total_workers() const;
  // Index of the site named `name`; ConfigError listing the known names if absent.
  size_t site_index(const std::string& name) const;
};

// Parses and validates `path`, after applying `overrides` ("section.key=value", the value in
// TOML syntax, or a bare string). Throws ConfigError.
Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Same, from text; `name` is used in messages in place of a file name.
Config parse_config(const std::string& text, const std::string& name,
                    const std::vector<std::string>& overrides = {});
// Serialises back to TOML (what `nebula run` hands to its workers), so that
// parse_config(to_toml(c)) == c.
std::string to_toml(const Config& config);

}  // namespace nebula
