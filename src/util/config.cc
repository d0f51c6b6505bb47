#include "nebula/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "nebula/error.h"
#include "nebula/units.h"
#include "util/toml_reader.h"

namespace nebula {
namespace {

using toml_reader::Section;
using toml_reader::where;

// The rule of transport/certs.h's check_site_name (util cannot link transport): a site name
// is a file name (logs/S-R.log, certificates S.pem) and a certificate's CN, so no '/', no
// spaces; "ca" is the CA's own file name.
bool is_valid_site_name(const std::string& name) {
  if (name.empty() || name.size() > 64) return false;
  for (char ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '.' && ch != '_' && ch != '-') return false;
  return !(name.size() == 2 && std::tolower(static_cast<unsigned char>(name[0])) == 'c' &&
           std::tolower(static_cast<unsigned char>(name[1])) == 'a');
}

void read_path(Section& s, WanPathConfig& p) {
  s.unit("bandwidth", p.bandwidth_bits, parse_rate_bits);
  s.unit("rtt", p.rtt, parse_duration);
  s.unit("jitter", p.jitter, parse_duration);
}

// sites = ["a", "b"]: two different sites of this job.
void read_pair_names(Section& s, const toml::table& t, const Config& c, std::string& a, std::string& b,
                     bool required) {
  std::vector<std::string> names;
  s.strings("sites", names);
  if (names.empty() && !required) return;
  if (names.size() != 2 || names[0] == names[1])
    s.fail(t, "sites", "expected two different site names, e.g. sites = [\"alpha\", \"beta\"]");
  for (const auto& n : names) {
    bool known = false;
    for (const auto& site : c.sites) known |= site.name == n;
    if (!known) s.fail(t, "sites", str_cat("no site named '", n, "' in [[sites]]"));
  }
  a = names[0];
  b = names[1];
}

// [distill] as built: two sites, the teacher's (serving, one worker) and the student's (one
// worker, its pairs marked shareable because they go to the teacher).
void check_distill(const Config& c, const toml::table& t, Section& s) {
  // The key's own line when it is in the file, else the [distill] header's.
  auto at = [&](const char* key) -> const toml::node& {
    const toml::node* n = t.get(key);
    return n ? *n : t;
  };
  if (c.model.kind != "seq2seq")
    s.fail(t, "teacher_site", "distillation trains a translation student: set [model] kind = \"seq2seq\"");
  bool known = false;
  for (const auto& site : c.sites) known |= site.name == c.distill.teacher_site;
  if (!known)
    s.fail(at("teacher_site"), "teacher_site",
           str_cat("no site named '", c.distill.teacher_site, "' in [[sites]]: name the site that holds the teacher"));
  if (c.distill.teacher.empty())
    s.fail(at("teacher"), "teacher", "give the teacher's model.safetensors (a path on the teacher site)");
  if (c.sites.size() != 2)
    s.fail(t, "teacher_site", str_cat("distillation runs on exactly two sites (teacher, student); this job has ",
                                      c.sites.size()));
  for (const auto& site : c.sites) {
    if (site.workers != 1)
      s.fail(t, "teacher_site", str_cat("site '", site.name, "' has workers = ", site.workers,
                                        ": with [distill] each site runs one worker (several are not built yet)"));
    if (site.name != c.distill.teacher_site && !site.shareable)
      s.fail(t, "teacher_site", str_cat("the student site '", site.name, "' would send its training pairs to '",
                                        c.distill.teacher_site, "': set shareable = true in its [[sites]] if they "
                                        "may leave it, or remove [distill]"));
  }
  if (c.distill.top_k > c.data.vocab_size)
    s.fail(at("top_k"), "top_k", str_cat(c.distill.top_k, " is more than data.vocab_size = ", c.data.vocab_size));
}

// "file:line:col" of root[table][key] if it is there, else of root[table], else "file": the
// most precise place for an error whose inputs may come from defaults or --set.
std::string place(const toml::table& root, const char* table, const char* key, const std::string& file) {
  const toml::table* t = root.get_as<toml::table>(table);
  if (!t) return file;
  const toml::node* n = *key ? t->get(key) : nullptr;
  return where(n ? *n : *t, file);
}

// Where a site's layout key `name` ("pipeline", "tensor") was set and its name: the site's own
// ([[sites]] parallel, when `own`), else the job's [parallel]. {place, key}
std::pair<std::string, std::string> layout_key(const toml::table& root, const std::string& file, size_t i, bool own,
                                               const char* name) {
  if (!own) return {place(root, "parallel", name, file), str_cat("parallel.", name)};
  const toml::node* n = root["sites"][i]["parallel"][name].node();
  return {n ? where(*n, file) : file, str_cat("sites[", i, "].parallel.", name)};
}

// [parallel] pipeline and [[sites]] parallel.pipeline: what the stages are cut from and what
// runs with them so far. An error names the key that asked for stages: the site's own, else the job's.
void check_pipeline(const Config& c, const toml::table& root, const std::string& file) {
  const ParallelConfig& p = c.parallel;
  size_t staged = c.sites.size();  // the first site with stages
  for (size_t i = 0; i < c.sites.size() && staged == c.sites.size(); ++i)
    if (c.pipeline_of(c.sites[i]) > 1) staged = i;
  auto site_key = [&](size_t i) { return layout_key(root, file, i, c.sites[i].pipeline > 0, "pipeline"); };
  if (staged == c.sites.size()) return;
  const auto [at, key] = site_key(staged);
  auto fail = [&, at = at, key = key](const std::string& why) { throw ConfigError(str_cat(at, ": key '", key, "': ", why)); };
  if (c.model.kind == "torchscript")
    fail("a TorchScript module is one piece to nebula, so it cannot be cut into stages (giving the "
         "stages as separate modules is not supported yet): use pipeline = 1");
  if (c.model.kind != "mlm_encoder")
    fail(str_cat("pipeline stages run model.kind = \"mlm_encoder\" so far, not \"", c.model.kind, "\": use pipeline = 1"));
  for (size_t i = 0; i < c.sites.size(); ++i) {
    const int64_t pipeline = c.pipeline_of(c.sites[i]);
    if (pipeline > c.model.layers) {
      const auto [where_i, key_i] = site_key(i);
      throw ConfigError(str_cat(where_i, ": key '", key_i, "': ", pipeline, " stages for a model of ", c.model.layers,
                                " layers (model.layers): each stage runs at least one layer"));
    }
  }
  for (size_t i = 0; i < c.sites.size(); ++i) {
    const int64_t pipeline = c.pipeline_of(c.sites[i]);
    if (c.sites[i].workers % pipeline != 0) {
      const auto [where_i, key_i] = site_key(i);
      throw ConfigError(str_cat(where_i, ": key '", key_i, "': site '", c.sites[i].name, "' has ", c.sites[i].workers,
                                " workers, not a multiple of pipeline = ", pipeline,
                                " (each stage runs on workers / pipeline of them)"));
    }
  }
  if (p.micro_batches > c.data.batch_size)
    throw ConfigError(str_cat(place(root, "parallel", "micro_batches", file), ": key 'parallel.micro_batches': ",
                              p.micro_batches, " micro-batches of a batch of ", c.data.batch_size,
                              " sequences (data.batch_size): at most one micro-batch per sequence"));
  if (p.shard == "full")
    fail("ZeRO-3 (shard = \"full\") of pipeline stages is not built yet: use shard = \"none\", "
         "\"optimizer\" or \"gradients\" (each stage's replicas shard its state)");
  if (c.data.contrastive_weight > 0)
    fail("the contrastive objective's in-batch negatives would change with the micro-batches: set "
         "data.contrastive_weight = 0 with pipeline stages");
  if (c.privacy.enabled())
    fail("[privacy] clips a site's whole update, and each pipeline stage holds a part of it: not with "
         "stages yet (remove [privacy] or set pipeline = 1)");
  if (c.sites.size() > 1 && c.strategy.kind == "sync")
    fail(str_cat("pipeline stages on sites that exchange over the WAN run strategy.kind = \"diloco\" or "
                 "\"streaming\" (sync sends each stage's gradients every step; not built): this job has ",
                 c.sites.size(), " sites"));
  if (c.sites.size() > 1 && c.job.elastic)
    fail("a site of pipeline stages cannot rejoin a running job yet: set job.elastic = false");
  if (c.sites.size() > 1 && c.distill.enabled())
    fail("pipeline stages do not run with [distill] yet: use pipeline = 1");
}

// [parallel] tensor and [[sites]] parallel.tensor: what the layers are split by and what runs
// with it so far. An error names the key that asked for slices: the site's own, else the job's.
void check_tensor(const Config& c, const toml::table& root, const std::string& file) {
  size_t sliced = c.sites.size();  // the first site with slices
  for (size_t i = 0; i < c.sites.size() && sliced == c.sites.size(); ++i)
    if (c.tensor_of(c.sites[i]) > 1) sliced = i;
  if (sliced == c.sites.size()) return;
  auto site_key = [&](size_t i) { return layout_key(root, file, i, c.sites[i].tensor > 0, "tensor"); };
  const auto [at, key] = site_key(sliced);
  auto fail = [&, at = at, key = key](const std::string& why) { throw ConfigError(str_cat(at, ": key '", key, "': ", why)); };
  if (c.model.kind != "mlm_encoder" && c.model.kind != "seq2seq")
    fail(str_cat("tensor parallelism splits model.kind = \"mlm_encoder\" and \"seq2seq\" so far, not \"",
                 c.model.kind, "\": use tensor = 1"));
  for (size_t i = 0; i < c.sites.size(); ++i) {
    const int64_t t = c.tensor_of(c.sites[i]);
    const auto [where_i, key_i] = site_key(i);
    if (c.model.heads % t != 0 || c.model.ffn % t != 0)
      throw ConfigError(str_cat(where_i, ": key '", key_i, "': tensor = ", t, " must divide model.heads = ",
                                c.model.heads, " and model.ffn = ", c.model.ffn,
                                " (each worker computes heads / tensor heads and ffn / tensor MLP units)"));
    const int64_t per_replica = c.pipeline_of(c.sites[i]) * t;
    if (c.sites[i].workers % per_replica != 0)
      throw ConfigError(str_cat(where_i, ": key '", key_i, "': site '", c.sites[i].name, "' has ", c.sites[i].workers,
                                " workers, not a multiple of pipeline × tensor = ", per_replica,
                                " (data × pipeline × tensor = the site's workers)"));
  }
  for (size_t i = 0; i < c.sites.size(); ++i)
    if (c.pipeline_of(c.sites[i]) > 1)
      fail(str_cat("pipeline stages and tensor slices in one job are not built yet (site '", c.sites[i].name,
                   "' has pipeline = ", c.pipeline_of(c.sites[i]), "): use pipeline = 1 or tensor = 1"));
  if (c.parallel.shard == "full")
    fail("ZeRO-3 (shard = \"full\") of tensor slices is not built yet: use shard = \"none\", \"optimizer\" or "
         "\"gradients\" (each slice's replicas shard its state)");
  if (c.peft.kind != "none") fail(str_cat("tensor parallelism of PEFT modules is not built: use peft.kind = \"none\""));
  if (c.privacy.enabled()) fail("[privacy] with tensor slices is not built: remove [privacy] or set tensor = 1");
  if (c.sites.size() > 1) {  // the sites exchange by position in the whole model's flat vector
    if (c.strategy.kind == "sync")
      fail(str_cat("tensor slices on sites that exchange over the WAN run strategy.kind = \"diloco\" or "
                   "\"streaming\" (sync sends each slice's gradients every step; not built): this job has ",
                   c.sites.size(), " sites"));
    if (c.job.elastic) fail("a site of tensor slices cannot rejoin a running job yet: set job.elastic = false");
    if (c.distill.enabled()) fail("tensor slices do not run with [distill] in a job of several sites yet: use tensor = 1");
  }
}

// [wan] mode = "every_worker": what it runs with, and each site's worker addresses.
void check_wan_mode(const Config& c, const toml::table& root, const std::string& file) {
  for (size_t i = 0; i < c.sites.size(); ++i) {
    const SiteConfig& s = c.sites[i];
    if (s.worker_addresses.empty()) continue;
    if (!c.wan.every_worker())
      throw ConfigError(str_cat(file, ": key 'sites[", i, "].worker_addresses': site '", s.name, "' lists worker "
                                "addresses, which only wan.mode = \"every_worker\" uses: remove them or set that mode"));
    if (static_cast<int64_t>(s.worker_addresses.size()) != s.workers - 1)
      throw ConfigError(str_cat(file, ": key 'sites[", i, "].worker_addresses': site '", s.name, "' has ", s.workers,
                                " workers and ", s.worker_addresses.size(), " worker addresses: list one \"host:port\" "
                                "for each of ranks 1 .. ", s.workers - 1, " (rank 0 listens at `gateway`)"));
  }
  if (c.security.host_certs && !c.wan.every_worker())
    throw ConfigError(str_cat(place(root, "security", "host_certs", file), ": key 'security.host_certs': one "
                              "certificate per host is for wan.mode = \"every_worker\" (each worker on the WAN); with "
                              "a gateway the site's certificate is the gateway's: set host_certs = false"));
  if (!c.wan.every_worker()) return;
  const std::string at = str_cat(place(root, "wan", "mode", file), ": key 'wan.mode': \"every_worker\" ");
  auto refuse = [&](const std::string& why) { throw ConfigError(at + why); };
  if (c.strategy.kind == "sync")
    refuse("runs diloco and streaming (each worker exchanges its own part of the pseudo-gradient); with sync use "
           "mode = \"gateway\"");
  if (c.job.elastic) refuse("does not support job.elastic yet (a lost site's rejoin is per gateway link): set one of them");
  if (c.distill.enabled()) refuse("does not run [distill] (the teacher talks to one gateway): use mode = \"gateway\"");
  if (c.strategy.codec == "powersgd" || c.strategy.codec == "auto")
    refuse(str_cat("cannot use strategy.codec = \"", c.strategy.codec, "\" (", c.strategy.codec == "auto"
                       ? "the controller decides on the gateway's links" : "PowerSGD encodes whole matrices",
                   "): choose none, fp16, bf16, int8, int4, topk or sparseloco"));
  if (c.privacy.enabled()) refuse("does not run [privacy] yet (clipping needs the site's whole update): use mode = \"gateway\"");
  for (const auto& s : c.sites)
    if (s.device != "cpu")
      refuse(str_cat("runs on CPU sites only so far, and site '", s.name, "' has device = \"", s.device, "\""));
}

// wan.liveness_timeout must let one piece of a message (WanConfig::piece_bytes) cross the
// slowest emulated path with room to spare (ResilientLink: each side writes at least every
// quarter of it), or a busy link would be taken for a dead one.
void check_liveness(const Config& c, const toml::table& root, const std::string& file) {
  if (c.wan.liveness_timeout.count() == 0) return;
  auto check = [&](const WanPathConfig& p, const std::string& between) {
    double bw = p.bandwidth_bits;
    if (c.wan.host_bandwidth_bits > 0 && (bw <= 0 || c.wan.host_bandwidth_bits < bw)) bw = c.wan.host_bandwidth_bits;
    const double piece_s = bw > 0 ? static_cast<double>(c.wan.piece_bytes()) * 8 / bw : 0;
    const double need_s = 4 * (piece_s + std::chrono::duration<double>(p.rtt + p.jitter).count());
    if (std::chrono::duration<double>(c.wan.liveness_timeout).count() < need_s)
      throw ConfigError(str_cat(place(root, "wan", "liveness_timeout", file), ": key 'wan.liveness_timeout': ",
                                std::chrono::duration<double>(c.wan.liveness_timeout).count(), " s is too short for ",
                                between, ": a piece of ", c.wan.piece_bytes(), " bytes plus the round trip takes ",
                                need_s / 4, " s there and each side must be heard from at least 4 times per timeout; "
                                "set liveness_timeout to at least ", std::ceil(need_s), "s or lower wan.max_frame"));
  };
  check(c.wan.path, "the default path");
  for (const auto& p : c.wan.pairs) check(p.path, str_cat("the path between '", p.a, "' and '", p.b, "'"));
}

// One [[sites]] table (the `i`-th): its keys, its own layout (parallel), and the checks of its
// name and device. The names' uniqueness is the caller's.
SiteConfig read_site(Section& s, const toml::table& st, size_t i, const std::string& file) {
  SiteConfig site;
  s.string("name", site.name);
  s.integer("workers", site.workers, 1, 1 << 16);
  s.string("device", site.device);
  s.string("gateway", site.gateway);
  s.string("store", site.store);
  s.strings("worker_addresses", site.worker_addresses);
  s.strings("languages", site.languages);
  s.number("slowdown", site.slowdown, 1.0, 1000.0);
  s.integer("max_pairs_per_language", site.max_pairs_per_language, 0, INT64_MAX);
  s.boolean("shareable", site.shareable);
  if (const toml::table* pt = s.table("parallel")) {  // this site's own layout
    Section ps(*pt, s.key_name("parallel"), file);
    ps.integer("pipeline", site.pipeline, 1, 1024);
    ps.integer("tensor", site.tensor, 1, 1024);
    ps.finish();
  }
  s.finish();  // unknown keys before the checks below
  const toml::node* name = st.get("name");
  if (site.name.empty())
    s.fail(name ? *name : st, "name", str_cat("[[sites]] #", i + 1, " needs a name, e.g. name = \"alpha\""));
  if (!is_valid_site_name(site.name))
    s.fail(*name, "name", str_cat("\"", site.name, "\" is not a valid site name: use 1 to 64 characters from "
                                  "A-Z a-z 0-9 . _ - (not \"ca\", which is reserved for the CA's files); a site "
                                  "name becomes file names (logs, certificates)"));
  if (site.device != "cpu" && site.device != "cuda" &&
      !(site.device.rfind("cuda:", 0) == 0 && site.device.size() > 5 && site.device.size() < 9 &&
        site.device.find_first_not_of("0123456789", 5) == std::string::npos))
    s.fail(*st.get("device"), "device", str_cat("\"", site.device, "\" is not a device: use \"cpu\", \"cuda\" (worker r of "
                                                "the site takes GPU r mod the GPUs it sees) or \"cuda:N\""));
  return site;
}

Config build(const toml::table& root, const std::string& file) {
  Config c;
  c.source_path = file;
  Section top(root, "", file);

  if (auto* t = top.table("job")) {
    Section s(*t, "job", file);
    s.string("name", c.job.name);
    s.string("run_dir", c.job.run_dir);
    s.unsigned_integer("seed", c.job.seed);
    s.integer("steps", c.job.steps, 0, 1'000'000'000);
    s.integer("log_every", c.job.log_every, 1, 1'000'000'000);
    s.integer("eval_batches", c.job.eval_batches, 0, 1'000'000);
    s.unit("timeout", c.job.timeout, parse_duration);
    s.boolean("elastic", c.job.elastic);
    s.integer("restarts", c.job.restarts, 0, 1000);
    s.strings("command", c.job.command);
    s.finish();
    // It goes into every site's certificate (transport/certs.h) and names the run directory.
    if (c.job.name.empty() || c.job.name.size() > 64 ||
        !std::all_of(c.job.name.begin(), c.job.name.end(), [](char ch) {
          return std::isalnum(static_cast<unsigned char>(ch)) || ch == '.' || ch == '_' || ch == '-';
        }))
      s.fail(*t, "name", str_cat("\"", c.job.name, "\" is not a job name: use 1 to 64 characters from A-Z a-z 0-9 . _ -"));
  }
  if (c.job.run_dir.empty()) c.job.run_dir = "runs/" + c.job.name;

  if (auto* t = top.table("eval")) {
    Section s(*t, "eval", file);
    s.integer("every", c.eval.every, 0, 1'000'000'000);
    s.integer("pairs", c.eval.pairs, 0, 1'000'000'000);
    s.integer("beam", c.eval.beam, 1, 256);
    s.number("length_penalty", c.eval.length_penalty, 0.0, 10.0);
    s.finish();
  }

  if (auto* t = top.table("model")) {
    Section s(*t, "model", file);
    s.string("kind", c.model.kind, {"mlm_encoder", "seq2seq", "classifier", "torchscript"});
    s.integer("dim", c.model.dim, 8, 65536);
    s.integer("layers", c.model.layers, 1, 1024);
    s.integer("heads", c.model.heads, 1, 1024);
    s.integer("ffn", c.model.ffn, 1, 1 << 20);
    s.integer("max_len", c.model.max_len, 4, 1 << 16);
    s.number("dropout", c.model.dropout, 0.0, 0.99);
    s.number("lr", c.model.lr, 0.0, 10.0);
    s.number("weight_decay", c.model.weight_decay, 0.0, 10.0);
    s.string("lr_schedule", c.model.lr_schedule, {"constant", "cosine", "linear"});
    s.integer("warmup_steps", c.model.warmup_steps, 0, INT64_MAX);
    s.number("lr_floor", c.model.lr_floor, 0.0, 1.0);
    s.number("clip_norm", c.model.clip_norm, 0.0, 1e9);
    s.number("label_smoothing", c.model.label_smoothing, 0.0, 0.9);
    s.boolean("freeze_encoder", c.model.freeze_encoder);
    s.integer("decoder_layers", c.model.decoder_layers, 1, 1024);
    s.string("init", c.model.init);
    s.string("script", c.model.script);
    s.string("loss", c.model.loss, {"output", "cross_entropy", "mse"});
    s.finish();
    if (c.model.kind == "torchscript" && c.model.script.empty())
      s.fail(*t, "script", "model.kind = \"torchscript\" needs the module: script = \"model.pt\" (torch.jit.save's file)");
    if (c.model.kind != "torchscript" && !c.model.script.empty())
      s.fail(*t->get("script"), "script", "a TorchScript module is trained with kind = \"torchscript\": set it or remove script");
    if (c.model.freeze_encoder && c.model.kind != "classifier")
      s.fail(*t->get("freeze_encoder"), "freeze_encoder",
             str_cat("trains a classifier's head alone (kind = \"classifier\"), not a \"", c.model.kind,
                     "\": remove it (PEFT, [peft], freezes an mlm_encoder's backbone)"));
    if (c.model.label_smoothing > 0 && c.model.kind != "seq2seq")
      s.fail(*t->get("label_smoothing"), "label_smoothing",
             str_cat("applies to the translation loss (kind = \"seq2seq\"), not to kind \"", c.model.kind,
                     "\": remove it"));
    if (!c.model.init.empty() && c.model.kind == "torchscript")
      s.fail(*t, "init", "a TorchScript model starts from its own module (model.script): remove init");
    if (c.model.dim % c.model.heads != 0) {
      const toml::node* dim = t->get("dim");
      s.fail(dim ? *dim : *t, "dim", str_cat(c.model.dim, " must be divisible by heads (", c.model.heads,
                                             "): each attention head gets dim / heads values"));
    }
  }

  if (auto* t = top.table("data")) {
    Section s(*t, "data", file);
    s.string("source", c.data.source, {"gettext", "tsv", "text", "corpus", "tensors"});
    s.string("path", c.data.path);
    s.strings("languages", c.data.languages);
    s.integer("max_pairs_per_language", c.data.max_pairs_per_language, 0, INT64_MAX);
    s.number("valid_fraction", c.data.valid_fraction, 0.0, 0.5);
    s.number("test_fraction", c.data.test_fraction, 0.0, 0.5);
    s.integer("vocab_size", c.data.vocab_size, 16, 1 << 20);
    s.string("tokenizer", c.data.tokenizer);
    s.string("tokenizer_site", c.data.tokenizer_site);
    s.string("tokenizer_corpus", c.data.tokenizer_corpus);
    s.integer("batch_size", c.data.batch_size, 1, 1 << 20);
    s.number("mask_prob", c.data.mask_prob, 0.01, 0.9);
    s.string("objective", c.data.objective, {"mlm", "mlm+tlm"});
    s.number("contrastive_weight", c.data.contrastive_weight, 0.0, 1000.0);
    s.integer("contrastive_batch", c.data.contrastive_batch, 2, 1 << 16);
    s.number("contrastive_temperature", c.data.contrastive_temperature, 1e-4, 10.0);
    s.strings("packages", c.data.packages);
    s.finish();
    if (c.model.kind == "classifier" && (c.data.packages.size() < 2 || c.data.source != "gettext" ||
                                         c.data.languages.empty()))
      s.fail(*t, "packages",
             str_cat("a classifier (model.kind) learns which of data.packages a message belongs to, from gettext "
                     "catalogs (source = \"gettext\", now \"", c.data.source, "\"), and is evaluated in "
                     "data.languages (", c.data.languages.size(), " given): name 2 or more packages, e.g. packages = "
                     "[\"git\", \"coreutils\", \"dpkg\"]"));
    if (!c.data.packages.empty() && c.model.kind != "classifier")
      s.fail(*t->get("packages"), "packages",
             str_cat("labels the messages of a classifier (model.kind = \"classifier\"), not of kind \"",
                     c.model.kind, "\": remove it"));
    if (c.data.contrastive_weight > 0 && c.model.kind != "mlm_encoder")
      s.fail(*t->get("contrastive_weight"), "contrastive_weight",
             str_cat("the contrastive alignment objective trains an mlm_encoder (model.kind is \"", c.model.kind,
                     "\"): remove contrastive_weight or set it to 0"));
  }


  std::set<std::string> names;
  size_t index = 0;
  top.tables("sites", [&](Section& s, const toml::table& st) {
    SiteConfig site = read_site(s, st, index++, file);
    if (!names.insert(site.name).second)
      s.fail(*st.get("name"), "name", str_cat("site name '", site.name, "' is used twice: give each [[sites]] its own name"));
    c.sites.push_back(site);
  });
  if (c.sites.empty()) throw ConfigError(str_cat(file, ": no [[sites]]: a job needs at least one site"));
  if (!c.data.tokenizer_site.empty()) {
    std::string names;
    bool known = false;
    for (const auto& site : c.sites) {
      known |= site.name == c.data.tokenizer_site;
      names += str_cat(names.empty() ? "" : ", ", "'", site.name, "'");
    }
    if (!known)
      throw ConfigError(str_cat(place(root, "data", "tokenizer_site", file), ": key 'data.tokenizer_site': no site named '",
                                c.data.tokenizer_site, "': the vocabulary is trained on one site's own data; name one "
                                "of the job's sites (", names, ")"));
    if (!c.data.tokenizer_corpus.empty())
      throw ConfigError(str_cat(place(root, "data", "tokenizer_corpus", file),
                                ": key 'data.tokenizer_corpus': set either data.tokenizer_site (train the vocabulary on "
                                "that site's data) or data.tokenizer_corpus (on that shareable file), not both"));
  }
  if (c.model.kind == "seq2seq") {
    for (const auto& site : c.sites)
      if (site.device != "cpu")
        throw ConfigError(str_cat(place(root, "model", "kind", file), ": key 'model.kind': site '", site.name,
                                  "' has device = \"", site.device, "\", but a seq2seq model (and [distill]) trains "
                                  "on the CPU only so far: set device = \"cpu\" (GPU sites train mlm_encoder and "
                                  "torchscript models)"));
    std::set<std::string> langs(c.data.languages.begin(), c.data.languages.end());
    for (const auto& site : c.sites) langs.insert(site.languages.begin(), site.languages.end());
    if (langs.size() > 1)
      throw ConfigError(str_cat(place(root, "model", "kind", file),
                                ": key 'model.kind': a seq2seq model translates English into one language, but "
                                "[data] and [[sites]] name ", langs.size(), " (", *langs.begin(), ", ", *std::next(langs.begin()),
                                ", ...): keep one (several target languages need target tags, not built yet)"));
  }
  if ((c.model.kind == "torchscript") != (c.data.source == "tensors"))
    throw ConfigError(str_cat(place(root, "data", "source", file), ": key 'data.source': \"", c.data.source,
                              "\" with model.kind \"", c.model.kind, "\": a TorchScript model (kind = \"torchscript\") "
                              "trains on tensor files (source = \"tensors\"), and only it does; set both or neither"));
  if (c.data.valid_fraction + c.data.test_fraction >= 1)
    throw ConfigError(str_cat(place(root, "data", "test_fraction", file),
                              ": key 'data.test_fraction': data.valid_fraction + data.test_fraction = ",
                              c.data.valid_fraction + c.data.test_fraction,
                              " leaves nothing to train on: keep their sum below 1 (e.g. 0.05 each)"));

  if (auto* t = top.table("wan")) {
    Section s(*t, "wan", file);
    s.string("mode", c.wan.mode, {"gateway", "every_worker"});
    read_path(s, c.wan.path);
    s.unit("host_bandwidth", c.wan.host_bandwidth_bits, parse_rate_bits);
    s.integer("streams", c.wan.streams, 1, 256);
    s.unit("window", c.wan.window_bytes, parse_size);
    s.unit("max_frame", c.wan.max_frame, parse_size);
    s.unit("max_pending", c.wan.max_pending, parse_size);
    s.unit("handshake_timeout", c.wan.handshake_timeout, parse_duration);
    s.unit("reconnect_timeout", c.wan.reconnect_timeout, parse_duration);
    s.unit("liveness_timeout", c.wan.liveness_timeout, parse_duration);
    s.strings("allow", c.wan.allow);  // parsed (and refused when malformed) by the gateway
    if (c.wan.max_frame < 64 * 1024)
      s.fail(*t, "max_frame", str_cat("must be at least 64KiB (messages travel in pieces of half of it), got ",
                                       c.wan.max_frame, " bytes"));
    if (c.wan.liveness_timeout.count() != 0 && c.wan.liveness_timeout < std::chrono::milliseconds(100))
      s.fail(*t, "liveness_timeout", "must be \"0\" (off) or at least \"100ms\"");
    s.tables("pairs", [&](Section& p, const toml::table& pt) {
      WanPairConfig pair;
      read_pair_names(p, pt, c, pair.a, pair.b, /*required=*/true);
      read_path(p, pair.path);
      c.wan.pairs.push_back(pair);
    });
    s.tables("faults", [&](Section& f, const toml::table& ft) {
      WanFaultConfig fault;
      f.string("kind", fault.kind, {"cut", "stall", "corrupt", "blackhole"});
      read_pair_names(f, ft, c, fault.a, fault.b, /*required=*/false);
      std::chrono::nanoseconds at{0};
      uint64_t after = 0;
      if (f.has("at")) {
        f.unit("at", at, parse_duration);
        fault.at = at;
      }
      if (f.has("after")) {
        f.unit("after", after, parse_size);
        fault.after_bytes = after;
      }
      f.unit("duration", fault.duration, parse_duration);
      if (f.has("every")) {
        std::chrono::nanoseconds every{0};
        f.unit("every", every, parse_duration);
        if (every.count() <= 0) f.fail(ft, "every", "must be a positive duration, e.g. \"3s\"");
        if (fault.kind != "cut") f.fail(ft, "every", "only a cut repeats (kind = \"cut\")");
        fault.every = every;
        if (!fault.at && !fault.after_bytes) fault.at = every;
      }
      if (fault.kind.empty())
        f.fail(ft, "kind", "each [[wan.faults]] needs kind = \"cut\" | \"stall\" | \"corrupt\" | \"blackhole\"");
      if (fault.at.has_value() == fault.after_bytes.has_value())
        f.fail(ft, "at", "give exactly one of at = \"5s\" (time) or after = \"10MiB\" (bytes sent)");
      if (fault.kind == "stall" && fault.duration.count() <= 0)
        f.fail(ft, "duration", "a stall needs duration = \"...\" (e.g. \"2s\")");
      c.wan.faults.push_back(fault);
    });
    s.finish();
  }
  if (auto* t = top.table("strategy")) {
    Section s(*t, "strategy", file);
    s.string("kind", c.strategy.kind, {"sync", "diloco", "streaming"});
    s.string("codec", c.strategy.codec,
             {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd", "sparseloco", "auto"});
    s.integer("codec_block", c.strategy.codec_block, 2, 1 << 24);
    s.boolean("codec_stochastic", c.strategy.codec_stochastic);
    s.number("codec_density", c.strategy.codec_density, 1e-6, 1.0);
    s.integer("codec_rank", c.strategy.codec_rank, 1, 1024);
    s.boolean("codec_error_feedback", c.strategy.codec_error_feedback);
    s.number("codec_error_decay", c.strategy.codec_error_decay, 0.0, 1.0);
    s.string("codec_indices", c.strategy.codec_indices, {"fixed", "rice"});
    s.integer("codec_value_bits", c.strategy.codec_value_bits, 1, 2);
    s.unit("bucket", c.strategy.bucket_bytes, parse_size);
    if (c.strategy.bucket_bytes < 1024) s.fail(*t, "bucket", "must be at least 1KiB");
    s.integer("inner_steps", c.strategy.inner_steps, 0, 1 << 20);
    s.number("outer_lr", c.strategy.outer_lr, 1e-6, 100.0);
    s.number("outer_momentum", c.strategy.outer_momentum, 0.0, 0.999);
    s.boolean("outer_nesterov", c.strategy.outer_nesterov);
    s.integer("fragments", c.strategy.fragments, 1, 1 << 16);
    s.unit("staging", c.strategy.staging_bytes, parse_size);
    if (c.strategy.staging_bytes < (64u << 10)) s.fail(*t, "staging", "must be at least 64KiB");
    s.integer("delay", c.strategy.delay, 0, 1 << 20);
    s.boolean("adaptive", c.strategy.adaptive);
    s.boolean("heterogeneous", c.strategy.heterogeneous);
    s.number("max_update_norm", c.strategy.max_update_norm, 0.0, 1e30);
    s.number("max_loss_penalty", c.strategy.max_loss_penalty, 0.0, 1.0);
    if (c.strategy.max_loss_penalty > 0) {
      if (c.strategy.kind != "diloco")
        s.fail(*t, "max_loss_penalty",
               str_cat("max_loss_penalty = ", c.strategy.max_loss_penalty, " needs kind = \"diloco\" (kind = \"",
                       c.strategy.kind, "\": its merge gap is measured around a round's one outer step); set it to 0"));
      if (c.strategy.codec != "auto" && c.strategy.inner_steps > 0)
        s.fail(*t, "max_loss_penalty",
               str_cat("max_loss_penalty = ", c.strategy.max_loss_penalty, " leaves the controller nothing to choose: codec = \"",
                       c.strategy.codec, "\" and inner_steps = ", c.strategy.inner_steps,
                       " are pinned (set codec = \"auto\" or inner_steps = 0)"));
    }
    if (c.strategy.kind == "sync" && (c.strategy.codec == "auto" || c.strategy.codec == "sparseloco"))
      s.fail(*t, "codec", str_cat("codec = \"", c.strategy.codec,
                                  "\" needs kind = \"diloco\" or \"streaming\" (sync sends every gradient)"));
    if (c.strategy.kind == "streaming" && c.strategy.inner_steps > 0 &&
        c.strategy.delay >= c.strategy.inner_steps)
      s.fail(*t, "delay", str_cat("delay = ", c.strategy.delay, " must be below inner_steps = ",
                                  c.strategy.inner_steps, " (a fragment must be merged before it is sent again)"));
    s.finish();
  }
  if (auto* t = top.table("parallel")) {
    Section s(*t, "parallel", file);
    s.string("shard", c.parallel.shard, {"none", "optimizer", "gradients", "full"});
    const toml::node& key = t->get("shard") ? *t->get("shard") : static_cast<const toml::node&>(*t);
    if ((c.parallel.shard == "gradients" || c.parallel.shard == "full") && c.strategy.kind == "sync")
      s.fail(key, "shard",
             str_cat("\"", c.parallel.shard, "\" (ZeRO-", c.parallel.shard == "full" ? 3 : 2,
                     ") runs with strategy.kind = \"diloco\" or \"streaming\" (inside the site); sync's gradients "
                     "cross the WAN every step, whole: use shard = \"optimizer\" with sync"));
    if (c.parallel.shard == "full" && c.model.kind == "torchscript")
      s.fail(key, "shard",
             "\"full\" (ZeRO-3) gathers the parameters layer by layer, which only the built-in models "
             "(mlm_encoder, seq2seq) can do; a TorchScript module runs shard = \"optimizer\" or \"gradients\"");
    s.boolean("recompute", c.parallel.recompute);
    s.boolean("prefetch", c.parallel.prefetch);
    if (c.parallel.prefetch && c.parallel.shard != "full")
      s.fail(t->get("prefetch") ? *t->get("prefetch") : static_cast<const toml::node&>(*t), "prefetch",
             str_cat("prefetch = true gathers ZeRO-3's next layer ahead; with shard = \"", c.parallel.shard,
                     "\" nothing is gathered: set shard = \"full\" or drop prefetch"));
    s.unit("bucket", c.parallel.bucket_bytes, parse_size);
    if (c.parallel.bucket_bytes < 1024) s.fail(*t, "bucket", "must be at least 1KiB");
    s.integer("pipeline", c.parallel.pipeline, 1, 1024);
    s.integer("micro_batches", c.parallel.micro_batches, 1, 1 << 20);
    s.integer("tensor", c.parallel.tensor, 1, 1024);
    s.finish();
  }
  if (auto* t = top.table("peft")) {
    Section s(*t, "peft", file);
    s.string("kind", c.peft.kind, {"none", "lora", "adapter"});
    s.integer("rank", c.peft.rank, 1, 4096);
    s.number("alpha", c.peft.alpha, 1e-6, 1e6);
    s.integer("adapter_dim", c.peft.adapter_dim, 1, 1 << 16);
    s.finish();
  }
  if (auto* t = top.table("distill")) {
    Section s(*t, "distill", file);
    s.string("teacher_site", c.distill.teacher_site);
    s.string("teacher", c.distill.teacher);
    s.integer("top_k", c.distill.top_k, 1, 1 << 16);
    s.number("temperature", c.distill.temperature, 0.05, 100.0);
    s.number("alpha", c.distill.alpha, 0.0, 1.0);
    s.integer("prefetch", c.distill.prefetch, 0, 1 << 16);
    s.finish();
    if (c.distill.enabled()) check_distill(c, *t, s);
  }
  if (auto* t = top.table("privacy")) {
    Section s(*t, "privacy", file);
    s.number("clip", c.privacy.clip, 0.0, 1e30);
    s.number("noise_multiplier", c.privacy.noise_multiplier, 0.0, 1e6);
    s.number("delta", c.privacy.delta, 1e-30, 0.999999);
    s.finish();
    if (c.privacy.enabled() && c.strategy.kind == "sync")
      s.fail(*t, "clip", "differential privacy protects the updates diloco and streaming send: set [strategy] kind "
                         "= \"diloco\" or \"streaming\" (sync sends every gradient)");
    if (!c.privacy.enabled() && c.privacy.noise_multiplier > 0)
      s.fail(*t, "noise_multiplier", "noise is calibrated to the clipping norm: set clip > 0 too");
  }
  if (auto* t = top.table("security")) {
    Section s(*t, "security", file);
    s.boolean("insecure", c.security.insecure);
    s.string("certs", c.security.certs);
    s.string("ca", c.security.ca);
    s.string("cert", c.security.cert);
    s.string("key", c.security.key);
    s.string("audit_log", c.security.audit_log);
    s.boolean("host_certs", c.security.host_certs);
    s.finish();
    if (c.security.host_certs && (!c.security.cert.empty() || !c.security.key.empty()))
      s.fail(*t, "host_certs", "host_certs reads <certs>/hosts/<site>/<rank>.pem: set certs = \"DIR\", not cert and key");
  }
  if (auto* t = top.table("metrics")) {
    Section s(*t, "metrics", file);
    s.string("progress", c.metrics.progress, {"auto", "plain", "off"});
    s.finish();
  }
  if (!c.job.command.empty() && (c.job.elastic || c.distill.enabled()))
    throw ConfigError(str_cat(file, ": [job] command runs your own program as every worker; job.elastic and [distill] "
                              "are `nebula worker`'s (rejoin, the teacher site): remove them or the command"));
  if (!c.job.command.empty() && c.job.command[0].empty())
    throw ConfigError(str_cat(file, ": [job] command = [\"\", ...]: the first word is the program to run (e.g. \"python3\")"));
  if (c.job.restarts > 0 && (!c.job.elastic || c.strategy.kind == "sync" || c.distill.enabled()))
    throw ConfigError(str_cat(file, ": [job] restarts = ", c.job.restarts,
                              ": a lost site can rejoin only an elastic diloco or streaming job without [distill]: set "
                              "job.elastic = true and strategy.kind = \"diloco\" or \"streaming\", or restarts = 0"));
  if (auto* t = top.table("checkpoint")) {
    Section s(*t, "checkpoint", file);
    s.integer("every", c.checkpoint.every, 0, INT64_MAX);
    s.integer("keep", c.checkpoint.keep, 2, 1000);
    s.string("dir", c.checkpoint.dir);
    s.finish();
  }
  top.finish();
  check_pipeline(c, root, file);
  // recompute reruns ZeRO-3's gathered layers, or a pipeline stage's forward, in backward.
  if (c.parallel.recompute && c.parallel.shard != "full" &&
      std::none_of(c.sites.begin(), c.sites.end(), [&](const SiteConfig& s) { return c.pipeline_of(s) > 1; }))
    throw ConfigError(str_cat(place(root, "parallel", "recompute", file), ": key 'parallel.recompute': recompute = true "
                              "runs ZeRO-3's gathered layers or a pipeline stage's forward again in backward; with shard = \"",
                              c.parallel.shard, "\" and no pipeline stages there is nothing to recompute: set shard = "
                              "\"full\" or pipeline > 1, or drop recompute"));
  check_tensor(c, root, file);
  check_wan_mode(c, root, file);
  check_liveness(c, root, file);
  if (c.checkpoint.dir.empty()) c.checkpoint.dir = c.job.run_dir + "/checkpoints";
  try {
    check_peft(c.model, c.peft);
  } catch (const ConfigError& e) {
    throw ConfigError(str_cat(place(root, "peft", "", file), ": ", e.what()));
  }

  return c;
}

}  // namespace

WanPathConfig WanConfig::path_between(const std::string& a, const std::string& b) const {
  for (const auto& p : pairs)
    if ((p.a == a && p.b == b) || (p.a == b && p.b == a)) return p.path;
  return path;
}

bool WanConfig::emulated() const {
  auto any = [](const WanPathConfig& p) { return p.bandwidth_bits > 0 || p.rtt.count() > 0 || p.jitter.count() > 0; };
  if (any(path) || !faults.empty() || host_bandwidth_bits > 0) return true;
  for (const auto& p : pairs)
    if (any(p.path)) return true;
  return false;
}

int64_t Config::total_workers() const {
  int64_t n = 0;
  for (const auto& s : sites) n += s.workers;
  return n;
}

size_t Config::site_index(const std::string& name) const {
  std::string known;
  for (size_t i = 0; i < sites.size(); ++i) {
    if (sites[i].name == name) return i;
    known += str_cat(known.empty() ? "" : ", ", sites[i].name);
  }
  throw ConfigError(str_cat(source_path, ": no site named '", name, "' (sites: ", known, ")"));
}

Config parse_config(const std::string& text, const std::string& name, const std::vector<std::string>& overrides) {
  toml::table root = toml_reader::parse(text, name);
  for (const auto& o : overrides) toml_reader::apply_override(root, o, "job.steps=20");
  return build(root, name);
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(str_cat(path, ": cannot open config file"));
  std::stringstream buf;
  buf << in.rdbuf();
  return parse_config(buf.str(), path, overrides);
}

std::string to_toml(const Config& c) {
  auto strs = [](const std::vector<std::string>& v) {
    toml::array a;
    for (const auto& s : v) a.push_back(s);
    return a;
  };
  auto dur = [](std::chrono::nanoseconds d) { return str_cat(d.count(), "ns"); };
  toml::table root;
  root.insert("job", toml::table{{"name", c.job.name},
                                 {"run_dir", c.job.run_dir},
                                 {"seed", static_cast<int64_t>(c.job.seed)},
                                 {"steps", c.job.steps},
                                 {"log_every", c.job.log_every},
                                 {"eval_batches", c.job.eval_batches},
                                 {"timeout", dur(c.job.timeout)},
                                 {"elastic", c.job.elastic},
                                 {"restarts", c.job.restarts},
                                 {"command", strs(c.job.command)}});
  root.insert("eval", toml::table{{"every", c.eval.every}, {"pairs", c.eval.pairs}, {"beam", c.eval.beam},
                                  {"length_penalty", c.eval.length_penalty}});
  root.insert("model", toml::table{{"kind", c.model.kind},
                                   {"dim", c.model.dim},
                                   {"layers", c.model.layers},
                                   {"heads", c.model.heads},
                                   {"ffn", c.model.ffn},
                                   {"max_len", c.model.max_len},
                                   {"dropout", c.model.dropout},
                                   {"lr", c.model.lr},
                                   {"weight_decay", c.model.weight_decay},
                                   {"lr_schedule", c.model.lr_schedule},
                                   {"warmup_steps", c.model.warmup_steps},
                                   {"lr_floor", c.model.lr_floor},
                                   {"clip_norm", c.model.clip_norm},
                                   {"label_smoothing", c.model.label_smoothing},
                                   {"freeze_encoder", c.model.freeze_encoder},
                                   {"decoder_layers", c.model.decoder_layers},
                                   {"init", c.model.init},
                                   {"script", c.model.script},
                                   {"loss", c.model.loss}});
  root.insert("data", toml::table{{"source", c.data.source},
                                  {"path", c.data.path},
                                  {"languages", strs(c.data.languages)},
                                  {"max_pairs_per_language", c.data.max_pairs_per_language},
                                  {"valid_fraction", c.data.valid_fraction},
                                  {"test_fraction", c.data.test_fraction},
                                  {"vocab_size", c.data.vocab_size},
                                  {"tokenizer", c.data.tokenizer},
                                  {"tokenizer_site", c.data.tokenizer_site},
                                  {"tokenizer_corpus", c.data.tokenizer_corpus},
                                  {"batch_size", c.data.batch_size},
                                  {"mask_prob", c.data.mask_prob},
                                  {"objective", c.data.objective},
                                  {"contrastive_weight", c.data.contrastive_weight},
                                  {"contrastive_batch", c.data.contrastive_batch},
                                  {"contrastive_temperature", c.data.contrastive_temperature},
                                  {"packages", strs(c.data.packages)}});
  toml::array sites;
  for (const auto& s : c.sites) {
    sites.push_back(toml::table{{"name", s.name},
                                {"workers", s.workers},
                                {"device", s.device},
                                {"gateway", s.gateway},
                                {"store", s.store},
                                {"worker_addresses", strs(s.worker_addresses)},
                                {"languages", strs(s.languages)},
                                {"slowdown", s.slowdown},
                                {"max_pairs_per_language", s.max_pairs_per_language},
                                {"shareable", s.shareable}});
    if (s.pipeline > 0 || s.tensor > 0) {
      toml::table own;
      if (s.pipeline > 0) own.insert("pipeline", s.pipeline);
      if (s.tensor > 0) own.insert("tensor", s.tensor);
      sites.back().as_table()->insert("parallel", std::move(own));
    }
  }
  root.insert("sites", std::move(sites));
  auto path = [&](toml::table t, const WanPathConfig& p) {
    t.insert("bandwidth", str_cat(static_cast<int64_t>(p.bandwidth_bits), "bit"));
    t.insert("rtt", dur(p.rtt));
    t.insert("jitter", dur(p.jitter));
    return t;
  };
  auto bytes = [](uint64_t b) { return str_cat(b, "B"); };
  toml::table wan = path(toml::table{{"mode", c.wan.mode},
                                     {"host_bandwidth", str_cat(static_cast<int64_t>(c.wan.host_bandwidth_bits), "bit")},
                                     {"streams", c.wan.streams},
                                     {"window", bytes(c.wan.window_bytes)},
                                     {"max_frame", bytes(c.wan.max_frame)},
                                     {"max_pending", bytes(c.wan.max_pending)},
                                     {"handshake_timeout", dur(c.wan.handshake_timeout)},
                                     {"reconnect_timeout", dur(c.wan.reconnect_timeout)},
                                     {"liveness_timeout", dur(c.wan.liveness_timeout)},
                                     {"allow", strs(c.wan.allow)}},
                         c.wan.path);
  toml::array pairs, faults;
  for (const auto& p : c.wan.pairs) pairs.push_back(path(toml::table{{"sites", strs({p.a, p.b})}}, p.path));
  for (const auto& f : c.wan.faults) {
    toml::table t{{"kind", f.kind}, {"duration", dur(f.duration)}};
    if (!f.a.empty()) t.insert("sites", strs({f.a, f.b}));
    if (f.at) t.insert("at", dur(*f.at));
    if (f.after_bytes) t.insert("after", bytes(*f.after_bytes));
    if (f.every) t.insert("every", dur(*f.every));
    faults.push_back(std::move(t));
  }
  if (!pairs.empty()) wan.insert("pairs", std::move(pairs));
  if (!faults.empty()) wan.insert("faults", std::move(faults));
  root.insert("wan", std::move(wan));
  root.insert("strategy", toml::table{{"kind", c.strategy.kind},
                                      {"codec", c.strategy.codec},
                                      {"codec_block", c.strategy.codec_block},
                                      {"codec_stochastic", c.strategy.codec_stochastic},
                                      {"codec_density", c.strategy.codec_density},
                                      {"codec_rank", c.strategy.codec_rank},
                                      {"codec_error_feedback", c.strategy.codec_error_feedback},
                                      {"codec_error_decay", c.strategy.codec_error_decay},
                                      {"codec_indices", c.strategy.codec_indices},
                                      {"codec_value_bits", c.strategy.codec_value_bits},
                                      {"bucket", bytes(c.strategy.bucket_bytes)},
                                      {"inner_steps", c.strategy.inner_steps},
                                      {"outer_lr", c.strategy.outer_lr},
                                      {"outer_momentum", c.strategy.outer_momentum},
                                      {"outer_nesterov", c.strategy.outer_nesterov},
                                      {"fragments", c.strategy.fragments},
                                      {"staging", bytes(c.strategy.staging_bytes)},
                                      {"delay", c.strategy.delay},
                                      {"adaptive", c.strategy.adaptive},
                                      {"heterogeneous", c.strategy.heterogeneous},
                                      {"max_update_norm", c.strategy.max_update_norm},
                                      {"max_loss_penalty", c.strategy.max_loss_penalty}});
  root.insert("peft", toml::table{{"kind", c.peft.kind},
                                  {"rank", c.peft.rank},
                                  {"alpha", c.peft.alpha},
                                  {"adapter_dim", c.peft.adapter_dim}});
  if (c.distill.enabled())
    root.insert("distill", toml::table{{"teacher_site", c.distill.teacher_site},
                                       {"teacher", c.distill.teacher},
                                       {"top_k", c.distill.top_k},
                                       {"temperature", c.distill.temperature},
                                       {"alpha", c.distill.alpha},
                                       {"prefetch", c.distill.prefetch}});
  root.insert("privacy", toml::table{{"clip", c.privacy.clip},
                                     {"noise_multiplier", c.privacy.noise_multiplier},
                                     {"delta", c.privacy.delta}});
  root.insert("parallel", toml::table{{"shard", c.parallel.shard},
                                      {"recompute", c.parallel.recompute},
                                      {"prefetch", c.parallel.prefetch},
                                      {"pipeline", c.parallel.pipeline},
                                      {"micro_batches", c.parallel.micro_batches},
                                      {"tensor", c.parallel.tensor},
                                      {"bucket", bytes(c.parallel.bucket_bytes)}});
  root.insert("security", toml::table{{"insecure", c.security.insecure},
                                      {"certs", c.security.certs},
                                      {"ca", c.security.ca},
                                      {"cert", c.security.cert},
                                      {"key", c.security.key},
                                      {"audit_log", c.security.audit_log},
                                      {"host_certs", c.security.host_certs}});
  root.insert("metrics", toml::table{{"progress", c.metrics.progress}});
  root.insert("checkpoint",
              toml::table{{"every", c.checkpoint.every}, {"keep", c.checkpoint.keep}, {"dir", c.checkpoint.dir}});
  std::ostringstream out;
  out << "# written by nebula from " << c.source_path << "\n" << root << "\n";
  return out.str();
}

namespace {
[[noreturn]] void peft_error(const std::string& key, const std::string& msg) {
  throw ConfigError(str_cat("key '", key, "': ", msg));
}
}  // namespace

void check_peft(const ModelConfig& model, const PeftConfig& peft) {
  if (peft.kind != "none" && peft.kind != "lora" && peft.kind != "adapter")
    peft_error("peft.kind", str_cat("\"", peft.kind, "\" is not one of \"none\", \"lora\", \"adapter\""));
  if (peft.kind == "none") return;
  if (model.kind != "mlm_encoder" && model.kind != "seq2seq")
    peft_error("peft.kind", str_cat("\"", peft.kind, "\" needs a model whose layers PEFT knows; model.kind \"",
                                      model.kind, "\" is not one (supported: \"mlm_encoder\", \"seq2seq\")"));
  if (peft.kind == "lora") {
    // The narrowest Linear is dim×dim (or dim×ffn): a B·A of higher rank does not exist.
    const int64_t max_rank = std::min(model.dim, model.ffn);
    if (peft.rank < 1 || peft.rank > max_rank)
      peft_error("peft.rank", str_cat(peft.rank, " is out of range [1, ", max_rank,
                                        "]: the update of a Linear cannot have a rank above min(model.dim, model.ffn)"));
    if (!(peft.alpha > 0)) peft_error("peft.alpha", str_cat(peft.alpha, " must be positive"));
  } else if (peft.adapter_dim < 1 || peft.adapter_dim > model.dim) {
    peft_error("peft.adapter_dim", str_cat(peft.adapter_dim, " is out of range [1, ", model.dim,
                                             "]: a bottleneck is at most model.dim wide"));
  }
}

std::string training_fingerprint(const Config& c) {
  toml::table t = toml_reader::parse(to_toml(c), "the resolved config");
  // [parallel] and a site's workers may change between a checkpoint and its resume: the worker
  // reshards (train/worker.cc).
  for (const char* section : {"eval", "wan", "security", "metrics", "checkpoint", "parallel"}) t.erase(section);
  if (auto* job = t["job"].as_table()) {
    const int64_t seed = static_cast<int64_t>(c.job.seed);
    job->clear();
    job->insert("seed", seed);
  }
  if (auto* sites = t["sites"].as_array())
    for (auto& s : *sites)
      if (auto* site = s.as_table())
        for (const char* key : {"gateway", "store", "worker_addresses", "slowdown", "device", "workers", "parallel"}) site->erase(key);
  std::ostringstream out;
  out << t;
  uint64_t h = 1469598103934665603ull;  // FNV-1a, 64 bits
  for (unsigned char ch : out.str()) h = (h ^ ch) * 1099511628211ull;
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
  return hex;
}

}  // namespace nebula
