#include "nebula/config.h"

#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <toml++/toml.h>

#include "nebula/error.h"
#include "nebula/units.h"

namespace nebula {
namespace {

std::string where(const toml::node& node, const std::string& fallback) {
  const auto& src = node.source();
  std::string file = src.path ? *src.path : fallback;
  if (src.begin.line == 0) return file;
  return str_cat(file, ":", src.begin.line, ":", src.begin.column);
}

// Reads one TOML table, remembering which keys were consumed so that unknown keys can be
// reported by finish(). Every accessor throws ConfigError naming file:line:col and the key.
class Section {
 public:
  Section(const toml::table& table, std::string prefix, std::string file)
      : table_(table), prefix_(std::move(prefix)), file_(std::move(file)) {}

  std::string key_name(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "." + key; }

  [[noreturn]] void fail(const toml::node& node, const std::string& key, const std::string& msg) const {
    throw ConfigError(str_cat(where(node, file_), ": key '", key_name(key), "': ", msg));
  }

  const toml::node* find(const std::string& key) {
    used_.insert(key);
    return table_.get(key);
  }

  void string(const std::string& key, std::string& out, std::initializer_list<const char*> allowed = {}) {
    const toml::node* n = find(key);
    if (!n) return;
    auto v = n->value<std::string>();
    if (!n->is_string() || !v) fail(*n, key, str_cat("expected a string, got ", type_name(*n)));
    if (allowed.size()) {
      bool ok = false;
      std::string list;
      for (const char* a : allowed) {
        ok |= (*v == a);
        list += str_cat(list.empty() ? "" : ", ", "\"", a, "\"");
      }
      if (!ok) fail(*n, key, str_cat("\"", *v, "\" is not one of ", list));
    }
    out = *v;
  }

  void integer(const std::string& key, int64_t& out, int64_t min, int64_t max) {
    const toml::node* n = find(key);
    if (!n) return;
    if (!n->is_integer()) fail(*n, key, str_cat("expected an integer, got ", type_name(*n)));
    int64_t v = *n->value<int64_t>();
    if (v < min || v > max) fail(*n, key, str_cat(v, " is out of range [", min, ", ", max, "]"));
    out = v;
  }

  void unsigned_integer(const std::string& key, uint64_t& out) {
    int64_t v = static_cast<int64_t>(out);
    integer(key, v, 0, INT64_MAX);
    out = static_cast<uint64_t>(v);
  }

  void number(const std::string& key, double& out, double min, double max) {
    const toml::node* n = find(key);
    if (!n) return;
    if (!n->is_number()) fail(*n, key, str_cat("expected a number, got ", type_name(*n)));
    double v = *n->value<double>();
    if (!(v >= min && v <= max)) fail(*n, key, str_cat(v, " is out of range [", min, ", ", max, "]"));
    out = v;
  }

  void boolean(const std::string& key, bool& out) {
    const toml::node* n = find(key);
    if (!n) return;
    if (!n->is_boolean()) fail(*n, key, str_cat("expected true or false, got ", type_name(*n)));
    out = *n->value<bool>();
  }

  void strings(const std::string& key, std::vector<std::string>& out) {
    const toml::node* n = find(key);
    if (!n) return;
    const toml::array* arr = n->as_array();
    if (!arr) fail(*n, key, str_cat("expected an array of strings, got ", type_name(*n)));
    out.clear();
    for (const toml::node& item : *arr) {
      if (!item.is_string()) fail(item, key, str_cat("expected an array of strings, found ", type_name(item)));
      out.push_back(*item.value<std::string>());
    }
  }

  // A unit-bearing string: "80ms", "50Mbit". `parse` throws ConfigError without a location.
  template <typename T, typename Parse>
  void unit(const std::string& key, T& out, Parse parse) {
    const toml::node* n = find(key);
    if (!n) return;
    std::string text;
    if (n->is_string()) text = *n->value<std::string>();
    else if (n->is_integer() && *n->value<int64_t>() == 0) text = "0";
    else fail(*n, key, str_cat("expected a string with a unit (e.g. \"80ms\", \"50Mbit\"), got ", type_name(*n)));
    try {
      out = parse(text);
    } catch (const ConfigError& e) {
      fail(*n, key, e.what());
    }
  }

  bool has(const std::string& key) const { return table_.get(key) != nullptr; }

  // An array of tables ([[prefix.key]]): calls each(section, table) for every element.
  template <typename Each>
  void tables(const std::string& key, Each each) {
    const toml::node* n = find(key);
    if (!n) return;
    const toml::array* arr = n->as_array();
    if (!arr || !arr->is_array_of_tables())
      fail(*n, key, str_cat("expected an array of tables ([[", key_name(key), "]] blocks)"));
    for (size_t i = 0; i < arr->size(); ++i) {
      const toml::table& t = *arr->get(i)->as_table();
      Section s(t, str_cat(key_name(key), "[", i, "]"), file_);
      each(s, t);
      s.finish();
    }
  }

  // Reports the first key that no accessor asked for.
  void finish() const {
    for (auto&& [k, v] : table_) {
      std::string key(k.str());
      if (used_.count(key)) continue;
      std::string known;
      for (const auto& u : used_) known += str_cat(known.empty() ? "" : ", ", u);
      fail(v, key, str_cat("unknown key (known keys here: ", known, ")"));
    }
  }

  static std::string type_name(const toml::node& n) {
    switch (n.type()) {
      case toml::node_type::string: return "a string";
      case toml::node_type::integer: return "an integer";
      case toml::node_type::floating_point: return "a float";
      case toml::node_type::boolean: return "a boolean";
      case toml::node_type::array: return "an array";
      case toml::node_type::table: return "a table";
      default: return "a date/time";
    }
  }

 private:
  const toml::table& table_;
  std::string prefix_;
  std::string file_;
  std::set<std::string> used_;
};

// "a.b.c=value" → sets table[a][b][c]. The value is parsed as TOML; if that fails it is
// taken as a bare string, so `--set data.source=tsv` works without quotes.
void apply_override(toml::table& root, const std::string& text) {
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(str_cat("--set ", text, ": expected KEY=VALUE, e.g. --set job.steps=20"));
  std::string key = text.substr(0, eq), value = text.substr(eq + 1);
  std::string origin = "--set " + text;
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value, origin);
  } catch (const toml::parse_error&) {
    parsed = toml::parse("v = \"\"\"" + value + "\"\"\"", origin);
  }
  std::vector<std::string> parts;
  std::stringstream ss(key);
  for (std::string p; std::getline(ss, p, '.');) parts.push_back(p);
  toml::table* t = &root;
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    toml::node* next = t->get(parts[i]);
    if (!next) {
      t->insert(parts[i], toml::table{});
      next = t->get(parts[i]);
    }
    if (auto* arr = next->as_array()) {
      // sites.0.workers: index into an array of tables.
      if (parts[i + 1].find_first_not_of("0123456789") != std::string::npos)
        throw ConfigError(str_cat(origin, ": '", parts[i], "' is an array; name an index, e.g. ", parts[i], ".0.key"));
      size_t idx = std::stoul(parts[++i]);
      if (idx >= arr->size() || !arr->get(idx)->is_table())
        throw ConfigError(str_cat(origin, ": index ", idx, " out of range for '", parts[i - 1], "' (size ", arr->size(), ")"));
      if (i + 1 >= parts.size()) throw ConfigError(str_cat(origin, ": expected a key after the index"));
      t = arr->get(idx)->as_table();
      continue;
    }
    t = next->as_table();
    if (!t) throw ConfigError(str_cat(origin, ": '", parts[i], "' is not a table"));
  }
  t->insert_or_assign(parts.back(), std::move(*parsed.get("v")));
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

Config build(const toml::table& root, const std::string& file) {
  Config c;
  c.source_path = file;
  Section top(root, "", file);
  auto table = [&](const char* name) -> const toml::table* {
    const toml::node* n = top.find(name);
    if (!n) return nullptr;
    if (!n->is_table()) top.fail(*n, name, str_cat("expected a table [", name, "], got ", Section::type_name(*n)));
    return n->as_table();
  };

  if (auto* t = table("job")) {
    Section s(*t, "job", file);
    s.string("name", c.job.name);
    s.string("run_dir", c.job.run_dir);
    s.unsigned_integer("seed", c.job.seed);
    s.integer("steps", c.job.steps, 0, 1'000'000'000);
    s.integer("log_every", c.job.log_every, 1, 1'000'000'000);
    s.integer("eval_batches", c.job.eval_batches, 0, 1'000'000);
    s.unit("timeout", c.job.timeout, parse_duration);
    s.finish();
  }
  if (c.job.run_dir.empty()) c.job.run_dir = "runs/" + c.job.name;

  if (auto* t = table("model")) {
    Section s(*t, "model", file);
    s.string("kind", c.model.kind, {"mlm_encoder"});
    s.integer("dim", c.model.dim, 8, 65536);
    s.integer("layers", c.model.layers, 1, 1024);
    s.integer("heads", c.model.heads, 1, 1024);
    s.integer("ffn", c.model.ffn, 1, 1 << 20);
    s.integer("max_len", c.model.max_len, 4, 1 << 16);
    s.number("dropout", c.model.dropout, 0.0, 0.99);
    s.number("lr", c.model.lr, 0.0, 10.0);
    s.number("weight_decay", c.model.weight_decay, 0.0, 10.0);
    s.finish();
    if (c.model.dim % c.model.heads != 0) {
      throw ConfigError(str_cat(where(*t, file), ": [model] dim (", c.model.dim, ") must be divisible by heads (",
                                c.model.heads, ")"));
    }
  }

  if (auto* t = table("data")) {
    Section s(*t, "data", file);
    s.string("source", c.data.source, {"gettext", "tsv", "text"});
    s.string("path", c.data.path);
    s.strings("languages", c.data.languages);
    s.integer("max_pairs_per_language", c.data.max_pairs_per_language, 0, INT64_MAX);
    s.number("valid_fraction", c.data.valid_fraction, 0.0, 0.5);
    s.integer("vocab_size", c.data.vocab_size, 16, 1 << 20);
    s.string("tokenizer", c.data.tokenizer);
    s.integer("batch_size", c.data.batch_size, 1, 1 << 20);
    s.number("mask_prob", c.data.mask_prob, 0.01, 0.9);
    s.finish();
  }

  if (const toml::node* n = top.find("sites")) {
    const toml::array* arr = n->as_array();
    if (!arr || !arr->is_array_of_tables())
      top.fail(*n, "sites", "expected an array of tables ([[sites]] blocks)");
    std::set<std::string> names;
    for (size_t i = 0; i < arr->size(); ++i) {
      const toml::table& st = *arr->get(i)->as_table();
      Section s(st, str_cat("sites[", i, "]"), file);
      SiteConfig site;
      s.string("name", site.name);
      s.integer("workers", site.workers, 1, 1 << 16);
      s.string("device", site.device, {"cpu"});
      s.string("gateway", site.gateway);
      s.string("store", site.store);
      s.strings("languages", site.languages);
      s.number("slowdown", site.slowdown, 1.0, 1000.0);
      s.finish();
      if (site.name.empty()) throw ConfigError(str_cat(where(st, file), ": [[sites]] #", i + 1, " needs a name"));
      if (!names.insert(site.name).second)
        throw ConfigError(str_cat(where(st, file), ": site name '", site.name, "' is used twice"));
      c.sites.push_back(site);
    }
  }
  if (c.sites.empty()) throw ConfigError(str_cat(file, ": no [[sites]]: a job needs at least one site"));

  if (auto* t = table("wan")) {
    Section s(*t, "wan", file);
    read_path(s, c.wan.path);
    s.integer("streams", c.wan.streams, 1, 256);
    s.unit("window", c.wan.window_bytes, parse_size);
    s.unit("max_frame", c.wan.max_frame, parse_size);
    s.unit("max_pending", c.wan.max_pending, parse_size);
    s.unit("handshake_timeout", c.wan.handshake_timeout, parse_duration);
    s.unit("reconnect_timeout", c.wan.reconnect_timeout, parse_duration);
    s.tables("pairs", [&](Section& p, const toml::table& pt) {
      WanPairConfig pair;
      read_pair_names(p, pt, c, pair.a, pair.b, /*required=*/true);
      read_path(p, pair.path);
      c.wan.pairs.push_back(pair);
    });
    s.tables("faults", [&](Section& f, const toml::table& ft) {
      WanFaultConfig fault;
      f.string("kind", fault.kind, {"cut", "stall", "corrupt"});
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
      if (fault.kind.empty()) f.fail(ft, "kind", "each [[wan.faults]] needs kind = \"cut\" | \"stall\" | \"corrupt\"");
      if (fault.at.has_value() == fault.after_bytes.has_value())
        f.fail(ft, "at", "give exactly one of at = \"5s\" (time) or after = \"10MiB\" (bytes sent)");
      if (fault.kind == "stall" && fault.duration.count() <= 0)
        f.fail(ft, "duration", "a stall needs duration = \"...\" (e.g. \"2s\")");
      c.wan.faults.push_back(fault);
    });
    s.finish();
  }
  if (auto* t = table("strategy")) {
    Section s(*t, "strategy", file);
    s.string("kind", c.strategy.kind, {"sync", "diloco", "streaming"});
    s.string("codec", c.strategy.codec,
             {"none", "fp16", "bf16", "int8", "int4", "topk", "powersgd", "sparseloco", "auto"});
    s.integer("codec_block", c.strategy.codec_block, 2, 1 << 24);
    s.boolean("codec_stochastic", c.strategy.codec_stochastic);
    s.number("codec_density", c.strategy.codec_density, 1e-6, 1.0);
    s.integer("codec_rank", c.strategy.codec_rank, 1, 1024);
    s.boolean("codec_error_feedback", c.strategy.codec_error_feedback);
    s.unit("bucket", c.strategy.bucket_bytes, parse_size);
    if (c.strategy.bucket_bytes < 1024) s.fail(*t, "bucket", "must be at least 1KiB");
    s.integer("inner_steps", c.strategy.inner_steps, 0, 1 << 20);
    s.number("outer_lr", c.strategy.outer_lr, 1e-6, 100.0);
    s.number("outer_momentum", c.strategy.outer_momentum, 0.0, 0.999);
    s.boolean("outer_nesterov", c.strategy.outer_nesterov);
    s.integer("fragments", c.strategy.fragments, 1, 1 << 16);
    s.integer("delay", c.strategy.delay, 0, 1 << 20);
    s.boolean("adaptive", c.strategy.adaptive);
    s.boolean("heterogeneous", c.strategy.heterogeneous);
    if (c.strategy.kind == "sync" && (c.strategy.codec == "auto" || c.strategy.codec == "sparseloco"))
      s.fail(*t, "codec", str_cat("codec = \"", c.strategy.codec,
                                  "\" needs kind = \"diloco\" or \"streaming\" (sync sends every gradient)"));
    if (c.strategy.kind == "streaming" && c.strategy.inner_steps > 0 &&
        c.strategy.delay >= c.strategy.inner_steps)
      s.fail(*t, "delay", str_cat("delay = ", c.strategy.delay, " must be below inner_steps = ",
                                  c.strategy.inner_steps, " (a fragment must be merged before it is sent again)"));
    s.finish();
  }
  if (auto* t = table("peft")) {
    Section s(*t, "peft", file);
    s.string("kind", c.peft.kind, {"none", "lora", "adapter"});
    s.integer("rank", c.peft.rank, 1, 4096);
    s.number("alpha", c.peft.alpha, 1e-6, 1e6);
    s.integer("adapter_dim", c.peft.adapter_dim, 1, 1 << 16);
    s.finish();
  }
  if (auto* t = table("security")) {
    Section s(*t, "security", file);
    s.boolean("insecure", c.security.insecure);
    s.string("certs", c.security.certs);
    s.string("ca", c.security.ca);
    s.string("cert", c.security.cert);
    s.string("key", c.security.key);
    s.string("audit_log", c.security.audit_log);
    s.finish();
  }
  if (auto* t = table("metrics")) {
    Section s(*t, "metrics", file);
    s.string("progress", c.metrics.progress, {"auto", "plain", "off"});
    s.finish();
  }
  top.finish();

  return c;
}

toml::table parse_toml(const std::string& text, const std::string& name) {
  try {
    return toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    throw ConfigError(str_cat(name, ":", e.source().begin.line, ":", e.source().begin.column, ": ", e.description()));
  }
}

}  // namespace

WanPathConfig WanConfig::path_between(const std::string& a, const std::string& b) const {
  for (const auto& p : pairs)
    if ((p.a == a && p.b == b) || (p.a == b && p.b == a)) return p.path;
  return path;
}

bool WanConfig::emulated() const {
  auto any = [](const WanPathConfig& p) { return p.bandwidth_bits > 0 || p.rtt.count() > 0 || p.jitter.count() > 0; };
  if (any(path) || !faults.empty()) return true;
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
  toml::table root = parse_toml(text, name);
  for (const auto& o : overrides) apply_override(root, o);
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
                                 {"timeout", dur(c.job.timeout)}});
  root.insert("model", toml::table{{"kind", c.model.kind},
                                   {"dim", c.model.dim},
                                   {"layers", c.model.layers},
                                   {"heads", c.model.heads},
                                   {"ffn", c.model.ffn},
                                   {"max_len", c.model.max_len},
                                   {"dropout", c.model.dropout},
                                   {"lr", c.model.lr},
                                   {"weight_decay", c.model.weight_decay}});
  root.insert("data", toml::table{{"source", c.data.source},
                                  {"path", c.data.path},
                                  {"languages", strs(c.data.languages)},
                                  {"max_pairs_per_language", c.data.max_pairs_per_language},
                                  {"valid_fraction", c.data.valid_fraction},
                                  {"vocab_size", c.data.vocab_size},
                                  {"tokenizer", c.data.tokenizer},
                                  {"batch_size", c.data.batch_size},
                                  {"mask_prob", c.data.mask_prob}});
  toml::array sites;
  for (const auto& s : c.sites) {
    sites.push_back(toml::table{{"name", s.name},
                                {"workers", s.workers},
                                {"device", s.device},
                                {"gateway", s.gateway},
                                {"store", s.store},
                                {"languages", strs(s.languages)},
                                {"slowdown", s.slowdown}});
  }
  root.insert("sites", std::move(sites));
  auto path = [&](toml::table t, const WanPathConfig& p) {
    t.insert("bandwidth", str_cat(static_cast<int64_t>(p.bandwidth_bits), "bit"));
    t.insert("rtt", dur(p.rtt));
    t.insert("jitter", dur(p.jitter));
    return t;
  };
  auto bytes = [](uint64_t b) { return str_cat(b, "B"); };
  toml::table wan = path(toml::table{{"streams", c.wan.streams},
                                     {"window", bytes(c.wan.window_bytes)},
                                     {"max_frame", bytes(c.wan.max_frame)},
                                     {"max_pending", bytes(c.wan.max_pending)},
                                     {"handshake_timeout", dur(c.wan.handshake_timeout)},
                                     {"reconnect_timeout", dur(c.wan.reconnect_timeout)}},
                         c.wan.path);
  toml::array pairs, faults;
  for (const auto& p : c.wan.pairs) pairs.push_back(path(toml::table{{"sites", strs({p.a, p.b})}}, p.path));
  for (const auto& f : c.wan.faults) {
    toml::table t{{"kind", f.kind}, {"duration", dur(f.duration)}};
    if (!f.a.empty()) t.insert("sites", strs({f.a, f.b}));
    if (f.at) t.insert("at", dur(*f.at));
    if (f.after_bytes) t.insert("after", bytes(*f.after_bytes));
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
                                      {"bucket", bytes(c.strategy.bucket_bytes)},
                                      {"inner_steps", c.strategy.inner_steps},
                                      {"outer_lr", c.strategy.outer_lr},
                                      {"outer_momentum", c.strategy.outer_momentum},
                                      {"outer_nesterov", c.strategy.outer_nesterov},
                                      {"fragments", c.strategy.fragments},
                                      {"delay", c.strategy.delay},
                                      {"adaptive", c.strategy.adaptive},
                                      {"heterogeneous", c.strategy.heterogeneous}});
  root.insert("peft", toml::table{{"kind", c.peft.kind},
                                  {"rank", c.peft.rank},
                                  {"alpha", c.peft.alpha},
                                  {"adapter_dim", c.peft.adapter_dim}});
  root.insert("security", toml::table{{"insecure", c.security.insecure},
                                      {"certs", c.security.certs},
                                      {"ca", c.security.ca},
                                      {"cert", c.security.cert},
                                      {"key", c.security.key},
                                      {"audit_log", c.security.audit_log}});
  root.insert("metrics", toml::table{{"progress", c.metrics.progress}});
  std::ostringstream out;
  out << "# written by nebula from " << c.source_path << "\n" << root << "\n";
  return out.str();
}

}  // namespace nebula
