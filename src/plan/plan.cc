#include "plan/plan.h"

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <toml++/toml.h>
#include <tuple>

#include "nebula/error.h"
#include "nebula/units.h"
#include "util/toml_reader.h"

namespace nebula::plan {
namespace {

// ─── Reading the topology file ──────────────────────────────────────────────────────────────
// The same reader as the job config (util/toml_reader.h): every error names file:line:col and
// the key, unknown keys are errors. Added here: the unit-bearing numbers a topology needs
// ("70B" parameters, "400T" FLOP/s), and rates where "0" means unlimited.

using toml_reader::Section;

const char* kUnitExamples = "\"50ms\", \"1Gbit\"";

// A number, or a string with an SI suffix and optional unit words ("70B", "400T").
void read_si(Section& s, const std::string& key, double& out, double min, std::initializer_list<const char*> units,
             const char* forms) {
  const toml::node* n = s.find(key);
  if (!n) return;
  double v = 0;
  if (n->is_number()) {
    v = *n->value<double>();
  } else if (n->is_string()) {
    try {
      v = parse_si(*n->value<std::string>(), units, forms);
    } catch (const ConfigError& e) {
      s.fail(*n, key, e.what());
    }
  } else {
    s.fail(*n, key, str_cat("expected a number or a string like \"70B\", got ", Section::type_name(*n)));
  }
  out = s.check_range(*n, key, v, min, 1e30);
}

// A rate ("1Gbit"); "0" means unlimited, as in the job config's [wan].
void read_rate(Section& s, const std::string& key, double& out) {
  s.unit(
      key, out,
      [](const std::string& text) {
        double bits = parse_rate_bits(text);
        return bits == 0 ? kUnlimited : bits;
      },
      kUnitExamples);
}

void read_duration(Section& s, const std::string& key, double& seconds) {
  s.unit(
      key, seconds,
      [](const std::string& text) { return std::chrono::duration<double>(parse_duration(text)).count(); },
      kUnitExamples);
}

// A byte size ("80GiB"); leaving the key out skips the memory check, so 0 is an error.
void read_size(Section& s, const std::string& key, double& out) {
  s.unit(key, out, [](const std::string& text) { return static_cast<double>(parse_size(text)); },
         "\"80GiB\", \"512GB\"");
  if (const toml::node* n = s.find(key); n && out == 0)
    s.fail(*n, key, "must be more than 0 (leave the key out to skip the memory check)");
}

const char* kCountForms = "e.g. 70e9 or \"70B\" (K, M, B or G, T)";
const char* kFlopsForms = "e.g. 4e14 or \"400T\" / \"400TFLOP/s\" (K, M, G, T, P, E)";

Topology build(const toml::table& root, const std::string& file) {
  Topology t;
  t.source = file;
  Section top(root, "", file);

  const toml::table* model = top.table("model");
  if (!model) throw ConfigError(str_cat(file, ": key 'model': missing: a topology needs [model] parameters = ..."));
  {
    Section s(*model, "model", file);
    s.require("parameters", "parameters = 70e9");
    s.require("tokens_per_step_per_worker", "tokens_per_step_per_worker = 4096");
    read_si(s, "parameters", t.parameters, 1, {}, kCountForms);
    read_si(s, "trainable", t.trainable, 1, {}, kCountForms);
    read_si(s, "tokens_per_step_per_worker", t.tokens_per_step_per_worker, 1e-9, {}, kCountForms);
    read_si(s, "flops_per_token", t.flops_per_token, 1e-9, {"FLOP", "FLOPs", "flop"}, kFlopsForms);
    s.integer("layers", t.layers, 1, 1 << 20);
    s.integer("hidden", t.hidden, 1, 1 << 24);
    s.integer("heads", t.heads, 1, 1 << 20);
    s.integer("sequence", t.sequence, 1, int64_t{1} << 30);
    s.finish();
    // The activation estimate needs the whole shape; half of it would silently give 0.
    const std::pair<const char*, int64_t> shape[] = {
        {"layers", t.layers}, {"hidden", t.hidden}, {"heads", t.heads}, {"sequence", t.sequence}};
    bool any = false;
    for (const auto& [key, v] : shape) any |= v > 0;
    for (const auto& [key, v] : shape)
      if (any && v == 0)
        s.fail(*model, key,
               "missing: the activation estimate needs all of layers, hidden, heads and sequence (e.g. layers = 80, "
               "hidden = 8192, heads = 64, sequence = 4096), or none of them");
    if (t.trainable == 0) t.trainable = t.parameters;
    if (t.trainable > t.parameters)
      s.fail(*model->get("trainable"), "trainable",
             str_cat(t.trainable, " is more than parameters = ", t.parameters));
    if (t.flops_per_token == 0) t.flops_per_token = 6 * t.parameters;
  }

  std::set<std::string> names;
  if (!top.has("sites")) throw ConfigError(str_cat(file, ": key 'sites': missing: a topology needs [[sites]] blocks"));
  top.tables("sites", [&](Section& s, const toml::table& st) {
    SitePlan site;
    s.require("name", "name = \"alpha\"");
    s.string("name", site.name);
    s.integer("workers", site.workers, 1, int64_t{1} << 30);
    read_si(s, "worker_flops", site.worker_flops, 1e-9, {"FLOP/s", "FLOPS", "flop/s"}, kFlopsForms);
    read_si(s, "tokens_per_second_per_worker", site.tokens_per_second_per_worker, 1e-9, {}, kCountForms);
    read_rate(s, "lan_bandwidth", site.lan_bandwidth_bits);
    read_duration(s, "lan_latency", site.lan_latency_s);
    read_size(s, "worker_memory", site.worker_memory);
    read_size(s, "host_memory", site.host_memory);
    if (site.name.empty()) s.fail(st, "name", "must not be empty");
    if (!names.insert(site.name).second) s.fail(st, "name", str_cat("site name '", site.name, "' is used twice"));
    if ((site.worker_flops > 0) == (site.tokens_per_second_per_worker > 0))
      s.fail(st, "worker_flops",
             "give exactly one of worker_flops = \"400T\" (FLOP/s per worker) or tokens_per_second_per_worker = "
             "... (measured)");
    t.sites.push_back(site);
  });
  if (t.sites.empty()) throw ConfigError(str_cat(file, ": key 'sites': a topology needs at least one [[sites]]"));
  // A memory key on some sites only would check those and wave the others through.
  for (auto [key, member] : {std::pair{"worker_memory", &SitePlan::worker_memory}, std::pair{"host_memory", &SitePlan::host_memory}}) {
    size_t given = 0;
    for (const auto& site : t.sites) given += site.*member > 0;
    for (size_t i = 0; i < t.sites.size(); ++i)
      if (given > 0 && given < t.sites.size() && t.sites[i].*member == 0)
        throw ConfigError(str_cat(file, ": key 'sites[", i, "].", key, "': missing: site '", t.sites[i].name,
                                  "' has none while other sites have one; give it to every site or to none"));
  }

  if (const toml::table* wan = top.table("wan")) {
    Section s(*wan, "wan", file);
    read_rate(s, "bandwidth", t.wan.bandwidth_bits);
    read_duration(s, "rtt", t.wan.rtt_s);
    s.boolean("shared_uplink", t.shared_uplink);
    read_rate(s, "host_bandwidth", t.host_bandwidth_bits);
    s.tables("pairs", [&](Section& p, const toml::table& pt) {
      WanPairPlan pair;
      pair.path = t.wan;
      std::vector<std::string> ends;
      std::vector<std::string> site_names(names.begin(), names.end());
      p.require("sites", "sites = [\"alpha\", \"beta\"]");
      p.strings("sites", ends, site_names);
      if (ends.size() != 2 || ends[0] == ends[1])
        p.fail(pt, "sites", "expected two different site names, e.g. sites = [\"alpha\", \"beta\"]");
      pair.a = ends[0];
      pair.b = ends[1];
      read_rate(p, "bandwidth", pair.path.bandwidth_bits);
      read_duration(p, "rtt", pair.path.rtt_s);
      t.pairs.push_back(pair);
    });
    s.finish();
  }

  if (const toml::table* cand = top.table("candidates")) {
    Section s(*cand, "candidates", file);
    s.strings("strategies", t.strategies, {"sync", "diloco", "streaming"});
    s.strings("codecs", t.codecs, known_codecs());
    s.integers("inner_steps", t.inner_steps, 1, 1 << 20);
    s.integers("fragments", t.fragments, 1, 1 << 16);
    s.integers("delay", t.delays, 0, 1 << 20);
    s.strings("shard", t.shards, shard_modes());
    s.strings("wan_modes", t.wan_modes, {"gateway", "every_worker"});
    s.integers("pipeline", t.pipelines, 1, 1 << 20);
    s.integers("tensor", t.tensors, 1, 1 << 20);
    if (const toml::node* n = s.find("recompute")) {
      const toml::array* a = n->as_array();
      if (!a || a->empty()) s.fail(*n, "recompute", "expected a non-empty array of booleans, e.g. recompute = [false, true]");
      t.recomputes.clear();
      for (const toml::node& v : *a) {
        if (!v.is_boolean()) s.fail(v, "recompute", "expected true or false, e.g. recompute = [false, true]");
        t.recomputes.push_back(*v.value<bool>());
      }
    }
    s.integer("codec_block", t.codec.block, 2, 1 << 24);
    s.number("codec_density", t.codec.density, 1e-6, 1.0);
    s.number("powersgd_ratio", t.codec.powersgd_ratio, 1.0, 1e9);
    s.number("sparseloco_density", t.codec.sparseloco_density, 1e-6, 1.0);
    s.integer("sparseloco_chunk", t.codec.sparseloco_chunk, 2, 1 << 24);
    s.string("sparseloco_indices", t.codec.sparseloco_indices, {"fixed", "rice"});
    s.integer("sparseloco_value_bits", t.codec.sparseloco_value_bits, 1, 2);
    s.finish();
    // Stages cut the layers, slices the heads; both are costed from the model's shape.
    const bool layouts = std::any_of(t.pipelines.begin(), t.pipelines.end(), [](int64_t p) { return p > 1; }) ||
                         std::any_of(t.tensors.begin(), t.tensors.end(), [](int64_t v) { return v > 1; });
    if (layouts && !t.has_shape())
      s.fail(*cand, "pipeline",
             "pipeline stages and tensor slices are costed from the model's shape: give [model] layers, hidden, heads "
             "and sequence, or leave pipeline = [1] and tensor = [1]");
    for (int64_t p : t.pipelines)
      if (t.has_shape() && p > t.layers)
        s.fail(*s.find("pipeline"), "pipeline", str_cat(p, " stages for a model of ", t.layers, " layers ([model] layers): each stage runs at least one layer"));
    for (int64_t v : t.tensors)
      if (t.has_shape() && t.heads % v != 0)
        s.fail(*s.find("tensor"), "tensor", str_cat(v, " slices do not divide [model] heads = ", t.heads, " (each slice computes whole heads)"));
  }

  if (const toml::table* planner = top.table("planner")) {
    Section s(*planner, "planner", file);
    s.number("overlap", t.overlap, 0.0, 1.0);
    s.number("tolerance", t.tolerance, 0.0, 0.5);
    s.boolean("heterogeneous", t.heterogeneous);
    s.finish();
  }
  top.finish();
  return t;
}

// ─── The cost model (formulas in plan.h) ────────────────────────────────────────────────────

int strategy_order(const std::string& s) { return s == "sync" ? 0 : s == "diloco" ? 1 : 2; }

// Bits over a rate that may be unlimited (x / inf = 0; 0 / inf = 0).
double transfer_s(double bytes, double bits_per_s) { return bytes * 8 / bits_per_s; }

struct SiteCost {
  double compute = 0, allreduce = 0, broadcast = 0, gather = 0;  // gather: ZeRO-1/2's all-gather (t_ag)
  double useful = 0;  // t_c: the step's compute without recomputation, bubble or tensor all-reduces
};

// Ring all-reduce of `bytes` among `w` workers and the broadcast half of it.
std::pair<double, double> lan_costs(const SitePlan& s, double bytes) {
  if (s.workers <= 1) return {0.0, 0.0};
  const double w = static_cast<double>(s.workers);
  const double half = (w - 1) / w * transfer_s(bytes, s.lan_bandwidth_bits) + (w - 1) * s.lan_latency_s;
  return {2 * half, half};
}

// One all-gather of `payload` bytes per site among all sites; `latency` false gives only the
// time the uplinks are busy. Each host's egress bounds its site's term: the gateway sends the
// whole payload to each other site, with every_worker each of the site's w workers 1/w of it.
double exchange_s(const Topology& t, double payload, bool latency, const std::string& wan_mode) {
  const size_t S = t.sites.size();
  double worst = 0;
  for (size_t i = 0; i < S; ++i) {
    const double per_host = wan_mode == "every_worker" ? payload / static_cast<double>(t.sites[i].workers) : payload;
    const double host = static_cast<double>(S - 1) * transfer_s(per_host, t.host_bandwidth_bits);
    double lat = 0, serial = 0;
    for (size_t j = 0; j < S; ++j) {
      if (j == i) continue;
      const WanPath p = t.path_between(i, j);
      const double one_way = latency ? p.rtt_s / 2 : 0.0;
      const double x = transfer_s(payload, p.bandwidth_bits);
      if (t.shared_uplink) {
        lat = std::max(lat, one_way);
        serial += x;
      } else {
        worst = std::max(worst, one_way + std::max(x, host));
      }
    }
    if (t.shared_uplink && S > 1) worst = std::max(worst, lat + std::max(serial, host));
  }
  return worst;
}

double site_compute_s(const Topology& t, const SitePlan& s) {
  return s.tokens_per_second_per_worker > 0 ? t.tokens_per_step_per_worker / s.tokens_per_second_per_worker
                                            : t.tokens_per_step_per_worker * t.flops_per_token / s.worker_flops;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

std::string seconds(double s) {
  if (!std::isfinite(s)) return "inf";
  if (s == 0) return "0";
  if (s >= 3600) return fmt("%.1f h", s / 3600);
  return format_duration(std::chrono::nanoseconds(static_cast<int64_t>(std::llround(s * 1e9))));
}

// 70e9 → "70B", 16384 → "16.4K".
std::string count(double v) {
  const char* names[] = {"", "K", "M", "B", "T"};
  int i = 0;
  while (std::fabs(v) >= 1000 && i < 4) {
    v /= 1000;
    ++i;
  }
  return fmt(i == 0 ? "%.0f" : "%.3g", v) + names[i];
}

std::string label(const Candidate& c) {
  const std::string layout = layout_label(c);
  const std::string shard = str_cat(c.shard == "none" ? "" : str_cat(" shard=", c.shard),
                                    c.wan_mode == "gateway" ? "" : str_cat(" ", c.wan_mode),
                                    layout.empty() ? "" : str_cat(" ", layout));
  if (c.strategy == "sync") return str_cat("sync/", c.codec, shard);
  if (c.strategy == "diloco") return str_cat("diloco/", c.codec, " H=", c.inner_steps, shard);
  return str_cat("streaming/", c.codec, " H=", c.inner_steps, " F=", c.fragments, " delay=", c.delay, shard);
}

std::string percent(double u) { return fmt("%.1f%%", 100 * u); }

std::string pad(const std::string& s, size_t width) { return s.size() >= width ? s : s + std::string(width - s.size(), ' '); }

// none/fp16/bf16 are plain casts; the others keep what they did not send (codec.h).
bool keeps_residual(const std::string& codec) { return codec != "none" && codec != "fp16" && codec != "bf16"; }

const char* zero_name(const std::string& shard) {
  return shard == "optimizer" ? "ZeRO-1" : shard == "gradients" ? "ZeRO-2" : shard == "full" ? "ZeRO-3" : "";
}

// The gateway memory of the site that needs the most device memory, and why the candidate
// does not fit (empty when it does, or nothing is given to check against).
struct Need {
  Memory memory;
  std::string misfit;
};

Need need(const Topology& t, const Candidate& c) {
  Need out;
  double worst = -1;
  for (size_t i = 0; i < t.sites.size(); ++i) {
    const SitePlan& s = t.sites[i];
    const Memory m = gateway_memory(t, i, c);
    if (m.device() > worst) {
      worst = m.device();
      out.memory = m;
    }
    if (!out.misfit.empty()) continue;
    if (s.worker_memory > 0 && m.device() > s.worker_memory)
      out.misfit = str_cat("needs ", format_bytes(m.device()), " of device memory per worker at site ", s.name,
                           ", has ", format_bytes(s.worker_memory));
    else if (s.host_memory > 0 && m.host() > s.host_memory)
      out.misfit = str_cat("the gateway needs ", format_bytes(m.host()), " of host memory at site ", s.name, ", has ",
                           format_bytes(s.host_memory));
  }
  return out;
}

bool eligible(const Prediction& p) { return p.runnable && p.fits; }

// Quality risk, lowest first: least compression, fewest inner steps, simplest strategy.
bool less_risky(const Prediction& a, const Prediction& b) {
  const double ra = a.compression, rb = b.compression;
  if (std::fabs(ra - rb) > 1e-9 * std::max(ra, rb)) return ra < rb;
  if (a.candidate.inner_steps != b.candidate.inner_steps) return a.candidate.inner_steps < b.candidate.inner_steps;
  if (a.candidate.strategy != b.candidate.strategy)
    return strategy_order(a.candidate.strategy) < strategy_order(b.candidate.strategy);
  if (a.candidate.delay != b.candidate.delay) return a.candidate.delay < b.candidate.delay;
  return a.candidate.fragments < b.candidate.fragments;
}

}  // namespace

WanPath Topology::path_between(size_t i, size_t j) const {
  for (const auto& p : pairs)
    if ((p.a == sites[i].name && p.b == sites[j].name) || (p.a == sites[j].name && p.b == sites[i].name))
      return p.path;
  return wan;
}

Topology parse_topology(const std::string& text, const std::string& name, const std::vector<std::string>& overrides) {
  toml::table root = toml_reader::parse(text, name);
  for (const auto& o : overrides) toml_reader::apply_override(root, o, "wan.bandwidth=\"10Gbit\"");
  return build(root, name);
}

Topology load_topology(const std::string& path, const std::vector<std::string>& overrides) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError(str_cat(path, ": cannot open topology file"));
  std::stringstream buf;
  buf << in.rdbuf();
  return parse_topology(buf.str(), path, overrides);
}

const std::vector<std::string>& known_codecs() {
  static const std::vector<std::string> codecs = {"none", "fp16", "bf16", "int8", "int4", "powersgd", "topk", "sparseloco"};
  return codecs;
}

double payload_bytes(const std::string& codec, double m, const CodecParams& p) {
  // What nebula's codecs put on the wire per value (src/codec/codec.h), headers left out.
  const double blocks = std::ceil(m / static_cast<double>(p.block));
  if (codec == "none") return 4 * m;
  if (codec == "fp16" || codec == "bf16") return 2 * m;
  if (codec == "int8") return m + 8 * blocks;                  // u8 code; f32 min + scale per block
  if (codec == "int4") return std::ceil(m / 2) + 8 * blocks;   // 4-bit code; f32 min + scale per block
  if (codec == "topk") return 8 * std::ceil(p.density * m);    // u32 index + f32 value per kept value
  if (codec == "powersgd") return 4 * m / p.powersgd_ratio;    // P and Q factors: ratio from shapes
  if (codec == "sparseloco") {  // 2- or 1-bit values + in-chunk index bits, 8 or 4 bytes of levels per chunk
    const double kept = std::ceil(p.sparseloco_density * m);
    const auto vb = static_cast<double>(p.sparseloco_value_bits);
    const double chunk = static_cast<double>(p.sparseloco_chunk);
    double index_bits = std::ceil(std::log2(chunk));           // whole bits per in-chunk index
    if (p.sparseloco_indices == "rice") {  // expected Rice bits of a gap between random positions
      const double k = std::max(1.0, std::round(p.sparseloco_density * chunk));
      const int r = std::bit_width(static_cast<uint64_t>(chunk / k)) - 1;
      const double a = std::pow(1 - k / chunk, std::ldexp(1.0, r));
      index_bits = a < 1 ? 1 + r + a / (1 - a) : 1 + r;
    }
    return kept * (vb + index_bits) / 8 + 4 * vb * std::ceil(m / chunk);
  }
  throw Error(str_cat("plan: unknown codec '", codec, "'"));
}

const std::vector<std::string>& shard_modes() {
  static const std::vector<std::string> modes = {"none", "optimizer", "gradients", "full"};
  return modes;
}

std::string layout_label(const Candidate& c) {
  std::string out;
  if (c.pipeline > 1) out = str_cat("p", c.pipeline, " m", c.micro_batches);
  if (c.tensor > 1) out += str_cat(out.empty() ? "" : " ", "t", c.tensor);
  if (c.recompute) out += str_cat(out.empty() ? "" : " ", "recompute");
  return out;
}

std::vector<std::string> job_settings(const Topology& t, const Candidate& c) {
  auto quoted = [](const std::string& v) { return str_cat("\"", v, "\""); };
  std::vector<std::string> out = {str_cat("strategy.kind=", quoted(c.strategy)), str_cat("strategy.codec=", quoted(c.codec))};
  if (c.strategy != "sync") out.push_back(str_cat("strategy.inner_steps=", c.inner_steps));
  if (c.strategy == "streaming") {
    out.push_back(str_cat("strategy.fragments=", c.fragments));
    out.push_back(str_cat("strategy.delay=", c.delay));
  }
  out.push_back(str_cat("parallel.shard=", quoted(c.shard)));
  if (c.pipeline > 1) {  // one sequence per micro-batch: a replica's batch is M sequences
    out.push_back(str_cat("parallel.pipeline=", c.pipeline));
    out.push_back(str_cat("parallel.micro_batches=", c.micro_batches));
    out.push_back(str_cat("data.batch_size=", c.micro_batches));
  }
  if (c.tensor > 1) out.push_back(str_cat("parallel.tensor=", c.tensor));
  if (c.recompute) out.push_back("parallel.recompute=true");
  if (t.sites.size() > 1) out.push_back(str_cat("wan.mode=", quoted(c.wan_mode)));
  return out;
}

bool runnable(const Candidate& c, size_t sites) {
  if (c.wan_mode == "every_worker" && (c.strategy == "sync" || c.codec == "powersgd")) return false;
  if (c.pipeline > 1 && (c.shard == "full" || (sites > 1 && c.strategy == "sync"))) return false;
  if (c.tensor > 1 && (c.pipeline > 1 || c.shard == "full")) return false;
  if (c.tensor > 1 && sites > 1 && c.strategy == "sync") return false;
  return c.shard == "none" || c.shard == "optimizer" || c.strategy != "sync";
}

namespace {

// A site's workers as the candidate's grid, and what its largest stage holds and computes.
struct Grid {
  double P = 1, T = 1, D = 1;  // stages, slices, data replicas (D = workers / (P · T))
  double share = 1;            // the largest stage's share of the layers: ⌈L/P⌉ / L (1 without stages)
  double M = 1;                // micro-batches per step
  double replica_tokens = 0;   // tokens a replica (P · T workers) computes per step
  double micro_tokens = 0;     // tokens per micro-batch
  double bubble = 0;           // (P − 1) / (M + P − 1)
};

Grid grid_of(const Topology& t, const SitePlan& site, const Candidate& c) {
  Grid g;
  g.P = static_cast<double>(c.pipeline);
  g.T = static_cast<double>(c.tensor);
  g.D = static_cast<double>(site.workers) / (g.P * g.T);
  if (c.pipeline > 1)
    g.share = std::ceil(static_cast<double>(t.layers) / g.P) / static_cast<double>(t.layers);
  g.M = static_cast<double>(c.micro_batches);
  g.replica_tokens = t.tokens_per_step_per_worker * g.P * g.T;
  g.micro_tokens = g.replica_tokens / g.M;
  g.bubble = (g.P - 1) / (g.M + g.P - 1);
  return g;
}

// Float32 activation bytes one worker keeps per token for one layer (Korthikanti et al. 2022,
// eq. 2, with tensor parallelism t: s·b·h·(10 + 24/t + 5·a·s/(h·t)) in 16 bits → float32:
// 18·h + (48·h + 9·a·s) / t).
double layer_bytes_per_token(const Topology& t, double slices) {
  const double h = static_cast<double>(t.hidden), a = static_cast<double>(t.heads), seq = static_cast<double>(t.sequence);
  return 18 * h + (48 * h + 9 * a * seq) / slices;
}

}  // namespace

Memory gateway_memory(const Topology& t, size_t site, const Candidate& c) {
  NEBULA_CHECK(site < t.sites.size(), "site ", site, " of ", t.sites.size());
  const auto mode = std::find(shard_modes().begin(), shard_modes().end(), c.shard);
  if (mode == shard_modes().end()) throw Error(str_cat("plan: unknown shard mode '", c.shard, "'"));
  const bool sync = c.strategy == "sync", streaming = c.strategy == "streaming";
  if (!sync && !streaming && c.strategy != "diloco") throw Error(str_cat("plan: unknown strategy '", c.strategy, "'"));
  const size_t level = static_cast<size_t>(mode - shard_modes().begin());
  const double S = static_cast<double>(t.sites.size());
  const Grid g = grid_of(t, t.sites[site], c);
  // "gradients" (ZeRO-2) reduce-scatters the gradients bucket by bucket while backward runs
  // and keeps its shard (a few buckets in flight, small next to the rest); "full" (ZeRO-3)
  // shards the parameters too (a layer's are gathered while it runs). Along the data
  // dimension: over the D replicas of a stage's slice.
  const double d_opt = level >= 1 ? g.D : 1, d_grad = level >= 2 ? g.D : 1, d_param = level >= 3 ? g.D : 1;
  // What one worker holds of the model: its stage's share, its slice of it.
  const double part = g.share / g.T;
  const double n = t.parameters * part, tr = t.trainable * part;
  const double F = streaming ? static_cast<double>(c.fragments) : 1;
  const double whole = t.trainable;
  // Streaming sends a fragment every H/F steps and merges it τ steps later.
  const double in_flight =
      streaming ? std::min(F, std::floor(static_cast<double>(c.delay) * F / static_cast<double>(c.inner_steps)) + 1) : 1;

  Memory mem;
  mem.parameters = 4 * n / d_param;
  mem.gradients = (sync ? 2 : 1) * 4 * tr / d_grad;
  mem.optimizer = 8 * tr / d_opt;
  if (t.has_shape()) {
    const double L = static_cast<double>(t.layers), h = static_cast<double>(t.hidden);
    const double layer = layer_bytes_per_token(t, g.T);
    if (c.pipeline > 1) {
      // Stage s keeps min(P − s, M) micro-batches between forward and backward (1F1B), each
      // through its ⌈L/P⌉ layers; with recompute only their inputs (4·h per token; none on
      // stage 0, whose inputs are token ids), and one micro-batch's activations at a time, as
      // the last stage (which does not recompute) always holds. The worst stage: 0 without
      // recompute, 1 with it.
      const double layers = g.share * L;
      mem.activations = c.recompute ? std::min(g.P - 1, g.M) * g.micro_tokens * 4 * h + layers * g.micro_tokens * layer
                                    : std::min(g.P, g.M) * layers * g.micro_tokens * layer;
    } else if (c.recompute) {
      // ZeRO-3 with recompute: every layer's input is kept, one layer's activations at a time.
      mem.activations = L * g.replica_tokens * 4 * h + g.replica_tokens * layer;
    } else {
      mem.activations = L * g.replica_tokens * layer;
    }
  }
  // The data-parallel all-reduce stages the gradients in one flat buffer; ZeRO-2 reduces them bucket by bucket.
  // (ZeRO-3's whole-model gather on the gateway for evaluation and the model file is not a training step's: not counted.)
  if (sync || (g.D > 1 && c.shard != "gradients")) mem.buffers = 4 * tr / d_grad;
  // Fragments are cut by position in the whole model's flat vector, so with stages a fragment
  // lies within one stage or across two: the worst worker holds min(whole/F, its stage's part)
  // of one, over its stage slice's D replicas (without stages: 1/N of every fragment).
  const double fragment_part = std::min(whole / F, whole * g.share) / g.T;
  // The outer state (θ_global, outer momentum, θ_local at a send) shards with the optimizer:
  // each worker keeps its part of every fragment.
  if (!sync) mem.outer = 8 * tr / d_opt + in_flight * 4 * fragment_part / d_opt;
  if (S > 1) {  // the gateway encodes the whole site's update; with every_worker each worker its own cut
    if (c.wan_mode == "every_worker") {
      // Hierarchy::run_exchange_parts, per worker: the pseudo-gradient, the codec's encode
      // temporary (coded), its payload and a copy for each other site, the other sites'
      // payloads, every site's decoded contribution and one decode temporary (coded).
      const double values = fragment_part / g.D, payload = payload_bytes(c.codec, values, t.codec);
      const double coded = c.codec == "none" ? 0 : 1;
      if (keeps_residual(c.codec)) mem.codec_state = 4 * whole * g.share / (g.T * g.D);
      mem.exchange = in_flight * (4 * values * (S + 1 + 2 * coded) + (2 * S - 1) * payload);
    } else {
      const double values = whole / F, payload = payload_bytes(c.codec, values, t.codec);
      if (keeps_residual(c.codec)) mem.codec_state = 4 * whole;
      mem.exchange = in_flight * ((sync ? 0 : 4 * values) + S * payload + 4 * values);
    }
  }
  return mem;
}

namespace {

// The layouts of [candidates] pipeline × tensor × recompute that every site's workers divide
// into, each with its micro-batches: one sequence each, a replica's sequences per step (at least 1).
std::vector<Candidate> layouts(const Topology& t, const std::string& shard) {
  std::vector<Candidate> out;
  for (int64_t p : t.pipelines)
    for (int64_t v : t.tensors)
      for (bool recompute : t.recomputes) {
        if (recompute && p == 1 && shard != "full") continue;  // nothing to recompute
        if (std::any_of(t.sites.begin(), t.sites.end(), [&](const SitePlan& s) { return s.workers % (p * v) != 0; }))
          continue;
        Candidate c;
        c.pipeline = p;
        c.tensor = v;
        c.recompute = recompute;
        if (p > 1)
          c.micro_batches = std::max<int64_t>(
              1, static_cast<int64_t>(std::floor(t.tokens_per_step_per_worker * static_cast<double>(p * v) /
                                                 static_cast<double>(t.sequence))));
        out.push_back(c);
      }
  return out;
}

}  // namespace

std::vector<Candidate> enumerate_candidates(const Topology& t) {
  std::vector<Candidate> out;
  for (const auto& mode : t.wan_modes)
  for (const auto& shard : t.shards)
  for (const Candidate& layout : layouts(t, shard)) {
    const auto add = [&](const std::string& strategy, const std::string& codec, int64_t h, int64_t f, int64_t d) {
      Candidate c = layout;
      c.strategy = strategy;
      c.codec = codec;
      c.inner_steps = h;
      c.fragments = f;
      c.delay = d;
      c.shard = shard;
      c.wan_mode = mode;
      out.push_back(c);
    };
    for (const auto& strategy : t.strategies) {
      for (const auto& codec : t.codecs) {
        if (strategy == "sync") {
          if (codec != "sparseloco") add(strategy, codec, 1, 1, 0);
          continue;
        }
        for (int64_t h : t.inner_steps) {
          if (strategy == "diloco") {
            add(strategy, codec, h, 1, 0);
            continue;
          }
          for (int64_t f : t.fragments)
            for (int64_t d : t.delays)
              if (f <= h && d < h) add(strategy, codec, h, f, d);
        }
      }
    }
  }
  return out;
}

Prediction predict(const Topology& t, const Candidate& c) {
  NEBULA_CHECK(!t.sites.empty(), "a topology without sites");
  NEBULA_CHECK(c.inner_steps >= 1 && c.fragments >= 1 && c.delay >= 0, label(c));
  const double n = t.trainable;
  const double grad_bytes = 4 * n;
  const double S = static_cast<double>(t.sites.size());
  const double o = t.overlap;
  const double H = static_cast<double>(c.inner_steps);
  const double F = static_cast<double>(c.fragments);

  std::vector<SiteCost> site(t.sites.size());
  double workers = 0, tc = 0, tar = 0, tbc = 0, tag = 0, bubble = 0;
  for (size_t s = 0; s < t.sites.size(); ++s) {
    const SitePlan& sp = t.sites[s];
    const Grid g = grid_of(t, sp, c);
    bubble = std::max(bubble, g.bubble);
    site[s].useful = site_compute_s(t, sp);
    // The data-parallel collectives run among the D replicas of this worker's slice of its stage.
    SitePlan replicas = sp;
    replicas.workers = static_cast<int64_t>(g.D);
    std::tie(site[s].allreduce, site[s].broadcast) = lan_costs(replicas, grad_bytes * g.share / g.T);
    if (c.shard == "optimizer") site[s].gather = site[s].broadcast;
    if (c.shard == "gradients") {  // a reduce-scatter (a ring all-reduce's first half), then the all-gather
      site[s].allreduce /= 2;
      site[s].gather = site[s].broadcast;
    }
    if (c.shard == "full" && replicas.workers > 1) {
      // ZeRO-3: the layers' reduce-scatter, and their all-gather twice (forward, and again in backward).
      site[s].allreduce /= 2;
      site[s].gather = 2 * site[s].broadcast;
    }
    // recompute: one more forward (a third more compute).
    double compute = site[s].useful * (c.recompute ? 4.0 / 3.0 : 1.0);
    const double h = static_cast<double>(t.hidden);
    if (c.pipeline > 1) {
      // 1F1B's idle (P − 1)/(M + P − 1), and the first micro-batch's activations (forward) and
      // the last's gradients (backward) crossing the P − 1 stage boundaries, not overlapped.
      const double hop = transfer_s(g.micro_tokens * 4 * h, sp.lan_bandwidth_bits) + sp.lan_latency_s;
      compute = compute * (g.M + g.P - 1) / g.M + 2 * (g.P - 1) * hop;
    }
    if (c.tensor > 1) {
      // Megatron's two all-reduces of a micro-batch's hidden states per layer forward and two
      // in backward (two more with recompute), among the T slices, not overlapped.
      SitePlan slices = sp;
      slices.workers = c.tensor;
      const double per_layer = (c.recompute ? 6 : 4) * lan_costs(slices, g.micro_tokens * 4 * h).first;
      compute += g.share * static_cast<double>(t.layers) * g.M * per_layer;
    }
    site[s].compute = compute;
    tag = std::max(tag, site[s].gather);
    workers += static_cast<double>(t.sites[s].workers);
    tc = std::max(tc, site[s].compute);
    tar = std::max(tar, site[s].allreduce);
    tbc = std::max(tbc, site[s].broadcast);
  }

  Prediction p;
  p.candidate = c;
  p.compute_s = tc;
  p.lan_s = tar;
  p.bubble = bubble;
  const double payload = payload_bytes(c.codec, n, t.codec);
  p.compression = grad_bytes / payload;

  // busy[s]: compute seconds per worker of site s per step of the slowest site.
  std::vector<double> steps_per_step(t.sites.size(), 1.0);
  if (c.strategy == "sync") {
    p.wan_exchange_s = exchange_s(t, payload, true, c.wan_mode);
    p.step_s = tc + std::max(0.0, tar + p.wan_exchange_s - o * tc) + tag;
    p.wan_bytes_per_step = S * (S - 1) * payload;
  } else if (c.strategy == "diloco" || c.strategy == "streaming") {
    std::vector<double> tb(t.sites.size());
    double tb_max = 0;
    for (size_t s = 0; s < site.size(); ++s) {
      tb[s] = site[s].compute + std::max(0.0, site[s].allreduce - o * site[s].compute) + site[s].gather;
      tb_max = std::max(tb_max, tb[s]);
    }
    if (c.strategy == "diloco") {
      p.wan_exchange_s = exchange_s(t, payload, true, c.wan_mode);
      p.step_s = tb_max + (p.wan_exchange_s + tbc) / H;
      p.wan_bytes_per_step = S * (S - 1) * payload / H;
    } else {
      const double fragment = payload_bytes(c.codec, n / F, t.codec);
      double tbc_fragment = 0;
      for (const auto& s : t.sites) tbc_fragment = std::max(tbc_fragment, lan_costs(s, grad_bytes / F).second);
      p.wan_exchange_s = exchange_s(t, fragment, true, c.wan_mode);
      const double stall = std::max(0.0, p.wan_exchange_s - static_cast<double>(c.delay) * tb_max);
      p.step_s = std::max(tb_max + (F * stall + F * tbc_fragment) / H, F * exchange_s(t, fragment, false, c.wan_mode) / H);
      p.wan_bytes_per_step = S * (S - 1) * F * fragment / H;
    }
    if (t.heterogeneous)
      for (size_t s = 0; s < site.size(); ++s) steps_per_step[s] = tb_max / tb[s];
  } else {
    throw Error(str_cat("plan: unknown strategy '", c.strategy, "'"));
  }

  double busy = 0, tokens = 0;
  for (size_t s = 0; s < site.size(); ++s) {
    const double w = static_cast<double>(t.sites[s].workers);
    busy += w * steps_per_step[s] * site[s].useful;
    tokens += w * steps_per_step[s] * t.tokens_per_step_per_worker;
  }
  p.utilization = busy / (workers * p.step_s);
  p.tokens_per_s = tokens / p.step_s;
  Need nd = need(t, c);
  p.memory = nd.memory;
  p.runnable = runnable(c, t.sites.size());
  p.fits = nd.misfit.empty();
  p.misfit = std::move(nd.misfit);
  return p;
}

Plan make_plan(const Topology& t) {
  Plan plan;
  for (const auto& c : enumerate_candidates(t)) plan.predictions.push_back(predict(t, c));
  NEBULA_CHECK(!plan.predictions.empty(), t.source, ": [candidates] leaves nothing to compare");
  for (const auto& s : t.sites)
    plan.ideal_tokens_per_s += static_cast<double>(s.workers) * t.tokens_per_step_per_worker / site_compute_s(t, s);

  // What nebula can run and what fits comes first: a candidate that cannot run is no answer,
  // however fast it would be.
  std::stable_sort(plan.predictions.begin(), plan.predictions.end(), [](const Prediction& a, const Prediction& b) {
    if (eligible(a) != eligible(b)) return eligible(a);
    if (a.utilization != b.utilization) return a.utilization > b.utilization;
    return less_risky(a, b);
  });
  if (!eligible(plan.predictions.front())) {
    // Nothing to recommend: say what the smallest runnable candidate needs, and whether a
    // shard mode (not yet runnable) would fit.
    const Prediction* smallest = nullptr;
    const Prediction* sharded = nullptr;
    for (const auto& p : plan.predictions) {
      const auto bytes = [](const Prediction& q) { return std::pair{q.memory.device(), q.memory.host()}; };
      if (p.runnable && (!smallest || bytes(p) < bytes(*smallest))) smallest = &p;
      if (!p.runnable && p.fits && !sharded) sharded = &p;  // the best utilization among them
    }
    if (smallest)
      plan.reason = str_cat("nothing nebula can run today (shard = \"none\", \"optimizer\", or \"gradients\" or \"full\" without sync; "
                            "pipeline stages without \"full\"; tensor slices without \"full\" or stages) fits: the smallest, ",
                            label(smallest->candidate),
                            ", ", smallest->misfit);
    else
      plan.reason = "nothing: [candidates] shard has neither \"none\" nor \"optimizer\", the modes nebula runs today";
    // Sharding cannot help when the activations alone are too big.
    double least_device = kUnlimited;
    for (const auto& s : t.sites)
      if (s.worker_memory > 0) least_device = std::min(least_device, s.worker_memory);
    double activations = kUnlimited;  // the least any candidate keeps
    for (const auto& p : plan.predictions) activations = std::min(activations, p.memory.activations);
    if (activations > least_device)
      plan.reason += str_cat(". The activations alone (at least ", format_bytes(activations),
                             " per worker-step) exceed ", format_bytes(least_device),
                             ": sharding does not shrink them; fewer tokens_per_step_per_worker, pipeline stages "
                             "with recompute ([candidates] pipeline = [1, 8, 16], recompute = [false, true]) "
                             "or tensor slices would");
    if (sharded)
      plan.reason += str_cat(". With shard = \"", sharded->candidate.shard, "\" (", zero_name(sharded->candidate.shard),
                             ", not runnable) ", label(sharded->candidate), " would fit");
    else if (std::find(t.shards.begin(), t.shards.end(), "full") == t.shards.end())
      plan.reason += ". The memory table shows what sharding would need (add \"optimizer\", \"gradients\" or "
                     "\"full\" to [candidates] shard)";
    else
      plan.reason += ". No shard mode fits either";
    return plan;
  }

  const Prediction& best = plan.predictions.front();
  const double floor = best.utilization * (1 - t.tolerance);
  size_t pick = 0, close = 0, left_out = 0;
  for (size_t i = 0; i < plan.predictions.size(); ++i) {
    const Prediction& p = plan.predictions[i];
    if (!eligible(p)) {
      left_out += p.runnable;
      continue;
    }
    if (p.utilization < floor) continue;
    ++close;
    if (less_risky(p, plan.predictions[pick])) pick = i;
  }
  plan.recommended = pick;
  const Prediction& r = plan.predictions[pick];
  const std::string sync_every =
      r.candidate.strategy == "sync" ? "synchronizes every step" : str_cat("synchronizes every ", r.candidate.inner_steps, " steps");
  if (close == 1) {
    plan.reason = str_cat(label(r.candidate), ": the highest compute utilization (", percent(r.utilization),
                          "); nothing else comes within ", percent(t.tolerance), " of it");
  } else if (pick == 0) {
    plan.reason = str_cat(label(r.candidate), ": the highest compute utilization (", percent(r.utilization), "), and of the ",
                          close, " candidates within ", percent(t.tolerance), " of it the one that compresses least (",
                          fmt("%.1fx", r.compression), ") and ", sync_every);
  } else {
    plan.reason = str_cat(label(r.candidate), ": ", percent(r.utilization), " compute utilization, within ",
                          percent(t.tolerance), " of the best (", percent(best.utilization), ", ", label(best.candidate),
                          "); of the ", close, " candidates that close it compresses least (",
                          fmt("%.1fx", r.compression), ") and ", sync_every, ", the lowest risk to the loss");
  }
  if (best.utilization < 0.5)
    plan.reason += str_cat(". Even the best keeps workers busy only ", percent(best.utilization),
                           " of the time: communication dominates");
  if (left_out > 0) plan.reason += str_cat(". ", left_out, " candidate(s) that do not fit in memory were left out");
  return plan;
}

namespace {

// Per strategy, the candidate (shard none) that needs the least memory, then each shard mode
// of it: what sharding would buy.
std::vector<std::pair<Candidate, Need>> memory_rows(const Topology& t) {
  std::vector<std::pair<Candidate, Need>> rows;
  for (const auto& strategy : t.strategies) {
    std::optional<Candidate> least;
    double least_bytes = 0;
    Topology one = t;
    one.strategies = {strategy};
    one.shards = {"none"};
    // The least hungry layout nebula runs (with some shard mode), else the least hungry of all.
    bool least_runs = false;
    for (const auto& c : enumerate_candidates(one)) {
      const Memory m = need(t, c).memory;
      const bool runs = std::any_of(shard_modes().begin(), shard_modes().end(), [&](const std::string& shard) {
        Candidate sharded = c;
        sharded.shard = shard;
        return runnable(sharded, t.sites.size());
      });
      if (!least || (runs && !least_runs) || (runs == least_runs && m.device() + m.host() < least_bytes)) {
        least = c;
        least_bytes = m.device() + m.host();
        least_runs = runs;
      }
    }
    if (!least) continue;
    for (const auto& shard : shard_modes()) {
      Candidate c = *least;
      c.shard = shard;
      rows.emplace_back(c, need(t, c));
    }
  }
  return rows;
}

std::string fits_word(const Topology& t, const std::string& misfit) {
  bool checked = false;
  for (const auto& s : t.sites) checked |= s.worker_memory > 0 || s.host_memory > 0;
  return !checked ? "-" : misfit.empty() ? "yes" : "no";
}

}  // namespace

std::string format_table(const Topology& t, const Plan& plan, size_t top) {
  std::ostringstream out;
  double workers = 0;
  for (const auto& s : t.sites) workers += static_cast<double>(s.workers);
  // The step's compute and the whole model's all-reduce at the slowest site, whatever the layout.
  double compute = 0, allreduce = 0;
  for (const auto& s : t.sites) {
    compute = std::max(compute, site_compute_s(t, s));
    allreduce = std::max(allreduce, lan_costs(s, 4 * t.trainable).first);
  }
  auto rate = [](double bits) { return std::isinf(bits) ? std::string("unlimited") : format_rate_bits(bits); };
  out << t.source << ": " << t.sites.size() << " sites, " << fmt("%.0f", workers) << " workers, "
      << count(t.parameters) << " parameters (" << count(t.trainable) << " trainable), "
      << count(t.tokens_per_step_per_worker) << " tokens per worker-step\n";
  out << "  compute " << seconds(compute) << " per step (slowest site), LAN all-reduce " << seconds(allreduce)
      << "; WAN " << rate(t.wan.bandwidth_bits) << ", RTT " << seconds(t.wan.rtt_s)
      << (t.pairs.empty() ? "" : str_cat(" (", t.pairs.size(), " pair override(s))"))
      << (t.sites.size() > 2 ? (t.shared_uplink ? ", shared gateway uplink" : ", independent pairs") : "")
      << "; overlap " << fmt("%.2f", t.overlap) << "\n";
  std::set<double> device, host;
  for (const auto& s : t.sites) {
    if (s.worker_memory > 0) device.insert(s.worker_memory);
    if (s.host_memory > 0) host.insert(s.host_memory);
  }
  auto sizes = [](const std::set<double>& v) {
    std::string o;
    for (double b : v) o += (o.empty() ? "" : " / ") + format_bytes(b);
    return o;
  };
  out << "  memory per worker: "
      << (device.empty() ? "worker_memory not given (device fit not checked)" : str_cat(sizes(device), " device"))
      << (host.empty() ? "" : str_cat(", ", sizes(host), " host (gateway)"))
      << (t.has_shape() ? str_cat("; activations for ", t.layers, " layers x ", t.hidden, " wide, ", t.heads,
                                  " heads, sequence ", t.sequence)
                        : "; activations not estimated (give [model] layers, hidden, heads, sequence)")
      << "\n\n";
  const bool sharded = t.shards.size() != 1 || t.shards[0] != "none";
  char line[320];
  // The shard column only when shard modes are candidates.
  auto shard_col = [&](const std::string& v) { return sharded ? pad(v, 10) + " " : std::string(); };
  // The WAN mode column only when every_worker is a candidate.
  const bool modes = t.wan_modes.size() != 1 || t.wan_modes[0] != "gateway";
  auto mode_col = [&](const std::string& v) { return modes ? pad(v, 13) + " " : std::string(); };
  // The layout column (stages, slices, recompute) and the bubble only when layouts are candidates.
  const bool laid = t.pipelines.size() != 1 || t.pipelines[0] != 1 || t.tensors.size() != 1 || t.tensors[0] != 1 ||
                    std::find(t.recomputes.begin(), t.recomputes.end(), true) != t.recomputes.end();
  auto layout_col = [&](const std::string& v) { return laid ? pad(v, 22) + " " : std::string(); };
  std::snprintf(line, sizeof line, "  %-10s %-10s %5s %4s %5s %s%s%s%11s %12s %14s %7s %6s %11s %11s %4s\n", "strategy",
                "codec", "H", "F", "delay", shard_col("shard").c_str(), mode_col("wan mode").c_str(),
                layout_col("layout (bubble)").c_str(), "step", "WAN/step",
                "WAN/1000 steps", "util", "ratio", "device/wkr", "host/gw", "fits");
  out << line;
  auto row = [&](size_t i) {
    const Prediction& p = plan.predictions[i];
    const Candidate& c = p.candidate;
    const bool streaming = c.strategy == "streaming";
    const std::string shard = p.runnable ? c.shard : c.shard + "*";
    const std::string layout = layout_label(c).empty() ? "data only" : layout_label(c);
    const std::string layout_text =
        str_cat(!p.runnable && (c.pipeline > 1 || c.tensor > 1) ? layout + "*" : layout,
                c.pipeline > 1 ? str_cat(" (", percent(p.bubble), ")") : "");
    std::snprintf(line, sizeof line, "%s %-10s %-10s %5s %4s %5s %s%s%s%11s %12s %14s %7s %5.1fx %11s %11s %4s\n",
                  plan.recommended == i ? "*" : " ", c.strategy.c_str(), c.codec.c_str(),
                  c.strategy == "sync" ? "-" : std::to_string(c.inner_steps).c_str(),
                  streaming ? std::to_string(c.fragments).c_str() : "-",
                  streaming ? std::to_string(c.delay).c_str() : "-", shard_col(shard).c_str(),
                  mode_col(p.runnable ? c.wan_mode : c.wan_mode + "*").c_str(), layout_col(layout_text).c_str(),
                  seconds(p.step_s).c_str(),
                  format_bytes(p.wan_bytes_per_step).c_str(), format_bytes(1000 * p.wan_bytes_per_step).c_str(),
                  percent(p.utilization).c_str(), p.compression, format_bytes(p.memory.device()).c_str(),
                  format_bytes(p.memory.host()).c_str(), fits_word(t, p.misfit).c_str());
    out << line;
  };
  const size_t shown = top == 0 ? plan.predictions.size() : std::min(top, plan.predictions.size());
  for (size_t i = 0; i < shown; ++i) row(i);
  if (shown < plan.predictions.size()) {
    if (plan.recommended && *plan.recommended >= shown) {
      out << "  ...\n";
      row(*plan.recommended);
    }
    out << "  (" << plan.predictions.size() - shown << " more; --top 0 shows all)\n";
  }
  if (sharded)
    out << "  * not runnable: \"gradients\" (ZeRO-2) and \"full\" (ZeRO-3) do not run with sync\n";
  if (laid)
    out << "  layout: pN = N pipeline stages, mM = M micro-batches (1F1B; its idle fraction in brackets), tN = N tensor "
           "slices, recompute = activations recomputed in backward; * = not runnable (stages with \"full\" or with sync "
           "across sites; slices with stages, with \"full\" or with sync across sites)\n";

  // Memory by strategy and shard mode: where the bytes go.
  out << "\nmemory per worker, the gateway (it holds the most) of the site that needs the most; the least hungry "
         "candidate of each strategy\n";
  std::snprintf(line, sizeof line, "  %-58s %-10s %10s %10s %10s %10s %10s | %10s %10s %10s %10s %10s %4s\n", "candidate",
                "shard", "params", "grads", "AdamW", "activ.", "device", "buffers", "outer", "codec EF", "exchange",
                "host", "fits");
  out << line;
  for (const auto& [c, nd] : memory_rows(t)) {
    const Memory& m = nd.memory;
    Candidate plain = c;
    plain.shard = "none";
    const std::string shard = runnable(c, t.sites.size()) ? c.shard : str_cat(c.shard, "*");
    std::snprintf(line, sizeof line, "  %-58s %-10s %10s %10s %10s %10s %10s | %10s %10s %10s %10s %10s %4s\n",
                  label(plain).c_str(), shard.c_str(), format_bytes(m.parameters).c_str(),
                  format_bytes(m.gradients).c_str(), format_bytes(m.optimizer).c_str(),
                  format_bytes(m.activations).c_str(), format_bytes(m.device()).c_str(), format_bytes(m.buffers).c_str(),
                  format_bytes(m.outer).c_str(), format_bytes(m.codec_state).c_str(), format_bytes(m.exchange).c_str(),
                  format_bytes(m.host()).c_str(), fits_word(t, nd.misfit).c_str());
    out << line;
  }
  out << "  ZeRO-1/2/3 inside a site (optimizer / +gradients / +parameters) along the data dimension; * = not runnable "
         "(ZeRO-2/3 with sync; layouts as above). Device: GPU; host: nebula keeps communication and outer state there\n";

  if (plan.recommended) {
    const Prediction& r = plan.predictions[*plan.recommended];
    out << "\nrecommended: " << label(r.candidate) << " (" << seconds(r.step_s) << " per step, "
        << format_bytes(r.wan_bytes_per_step) << " WAN per step, " << count(r.tokens_per_s) << " tokens/s of "
        << count(plan.ideal_tokens_per_s) << " ideal; " << format_bytes(r.memory.device()) << " device, "
        << format_bytes(r.memory.host()) << " host per worker)\n  why: " << plan.reason << "\n  as a job: nebula run JOB.toml";
    for (const auto& setting : job_settings(t, r.candidate)) out << " --set '" << setting << "'";
    out << "\n";
  } else {
    out << "\nrecommended: nothing\n  why: " << plan.reason << "\n";
  }
  return out.str();
}

std::string format_json(const Topology& t, const Plan& plan) {
  auto finite = [](double v) { return std::isfinite(v) ? nlohmann::ordered_json(v) : nlohmann::ordered_json(nullptr); };
  auto memory = [](const Memory& m) {
    return nlohmann::ordered_json{{"parameters", m.parameters},   {"gradients", m.gradients},
                                  {"optimizer", m.optimizer},     {"activations", m.activations},
                                  {"device", m.device()},         {"buffers", m.buffers},
                                  {"outer", m.outer},             {"codec_state", m.codec_state},
                                  {"exchange", m.exchange},       {"host", m.host()}};
  };
  auto one = [&](const Prediction& p, bool recommended) {
    return nlohmann::ordered_json{{"strategy", p.candidate.strategy},
                          {"codec", p.candidate.codec},
                          {"inner_steps", p.candidate.inner_steps},
                          {"fragments", p.candidate.fragments},
                          {"delay", p.candidate.delay},
                          {"shard", p.candidate.shard},
                          {"wan_mode", p.candidate.wan_mode},
                          {"pipeline", p.candidate.pipeline},
                          {"tensor", p.candidate.tensor},
                          {"micro_batches", p.candidate.micro_batches},
                          {"recompute", p.candidate.recompute},
                          {"bubble", p.bubble},
                          {"step_seconds", p.step_s},
                          {"compute_seconds", p.compute_s},
                          {"lan_allreduce_seconds", p.lan_s},
                          {"wan_exchange_seconds", p.wan_exchange_s},
                          {"wan_bytes_per_step", p.wan_bytes_per_step},
                          {"wan_bytes_per_1000_steps", 1000 * p.wan_bytes_per_step},
                          {"compression", p.compression},
                          {"utilization", p.utilization},
                          {"tokens_per_second", p.tokens_per_s},
                          {"memory_bytes_per_worker", memory(p.memory)},
                          {"runnable", p.runnable},
                          {"fits", p.fits},
                          {"misfit", p.misfit.empty() ? nlohmann::ordered_json(nullptr) : nlohmann::ordered_json(p.misfit)},
                          {"recommended", recommended}};
  };
  nlohmann::ordered_json sites = nlohmann::ordered_json::array();
  for (const auto& s : t.sites)
    sites.push_back({{"name", s.name},
                     {"workers", s.workers},
                     {"compute_seconds", site_compute_s(t, s)},
                     {"lan_bandwidth_bits_per_s", finite(s.lan_bandwidth_bits)},
                     {"lan_latency_seconds", s.lan_latency_s},
                     {"worker_memory_bytes", s.worker_memory > 0 ? nlohmann::ordered_json(s.worker_memory) : nullptr},
                     {"host_memory_bytes", s.host_memory > 0 ? nlohmann::ordered_json(s.host_memory) : nullptr}});
  nlohmann::ordered_json rows = nlohmann::ordered_json::array();
  for (size_t i = 0; i < plan.predictions.size(); ++i) rows.push_back(one(plan.predictions[i], plan.recommended == i));
  nlohmann::ordered_json rec = nullptr;
  if (plan.recommended) {
    rec = one(plan.predictions[*plan.recommended], true);
    rec["reason"] = plan.reason;
    rec["job_settings"] = job_settings(t, plan.predictions[*plan.recommended].candidate);
  }
  nlohmann::ordered_json by_strategy = nlohmann::ordered_json::array();
  for (const auto& [c, nd] : memory_rows(t))
    by_strategy.push_back({{"strategy", c.strategy},
                           {"codec", c.codec},
                           {"inner_steps", c.inner_steps},
                           {"fragments", c.fragments},
                           {"delay", c.delay},
                           {"shard", c.shard},
                           {"pipeline", c.pipeline},
                           {"tensor", c.tensor},
                           {"micro_batches", c.micro_batches},
                           {"recompute", c.recompute},
                           {"runnable", runnable(c, t.sites.size())},
                           {"fits", nd.misfit.empty()},
                           {"memory_bytes_per_worker", memory(nd.memory)}});
  nlohmann::ordered_json j = {{"topology",
                       {{"source", t.source},
                        {"parameters", t.parameters},
                        {"trainable", t.trainable},
                        {"tokens_per_step_per_worker", t.tokens_per_step_per_worker},
                        {"flops_per_token", t.flops_per_token},
                        {"layers", t.layers},
                        {"hidden", t.hidden},
                        {"heads", t.heads},
                        {"sequence", t.sequence},
                        {"sites", sites},
                        {"wan_bandwidth_bits_per_s", finite(t.wan.bandwidth_bits)},
                        {"wan_rtt_seconds", t.wan.rtt_s},
                        {"shared_uplink", t.shared_uplink},
                        {"host_bandwidth_bits_per_s", finite(t.host_bandwidth_bits)},
                        {"overlap", t.overlap},
                        {"tolerance", t.tolerance},
                        {"heterogeneous", t.heterogeneous}}},
                      {"ideal_tokens_per_second", plan.ideal_tokens_per_s},
                      {"recommended", rec},
                      {"reason", plan.reason},
                      {"memory_by_strategy", by_strategy},
                      {"candidates", rows}};
  return j.dump(2) + "\n";
}

}  // namespace nebula::plan
