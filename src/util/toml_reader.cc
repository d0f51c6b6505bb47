#include "util/toml_reader.h"

#include <algorithm>
#include <sstream>

namespace nebula::toml_reader {
namespace {

// `"a", "b", "c"`: the allowed values, for "... is not one of" errors.
template <typename List>
std::string quoted_list(const List& allowed) {
  std::string list;
  for (const auto& a : allowed) list += str_cat(list.empty() ? "" : ", ", "\"", a, "\"");
  return list;
}

// The strings of the array at `key`, each checked against `allowed` when it is given.
void read_strings(Section& s, const std::string& key, std::vector<std::string>& out,
                  const std::vector<std::string>* allowed) {
  const toml::node* n = s.find(key);
  if (!n) return;
  const toml::array* arr = n->as_array();
  if (!arr) s.fail(*n, key, str_cat("expected an array of strings, got ", Section::type_name(*n)));
  out.clear();
  for (const toml::node& item : *arr) {
    if (!item.is_string())
      s.fail(item, key, str_cat("expected an array of strings, found ", Section::type_name(item)));
    std::string v = *item.value<std::string>();
    if (allowed && std::find(allowed->begin(), allowed->end(), v) == allowed->end())
      s.fail(item, key, str_cat("\"", v, "\" is not one of ", quoted_list(*allowed)));
    out.push_back(v);
  }
  if (allowed && out.empty()) s.fail(*n, key, "must not be empty");
}

}  // namespace

std::string where(const toml::node& node, const std::string& fallback) {
  const auto& src = node.source();
  std::string file = src.path ? *src.path : fallback;
  if (src.begin.line == 0) return file;
  return str_cat(file, ":", src.begin.line, ":", src.begin.column);
}

toml::table parse(const std::string& text, const std::string& name) {
  try {
    return toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    throw ConfigError(str_cat(name, ":", e.source().begin.line, ":", e.source().begin.column, ": ", e.description()));
  }
}

void apply_override(toml::table& root, const std::string& text, const std::string& example) {
  auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0)
    throw ConfigError(str_cat("--set ", text, ": expected KEY=VALUE, e.g. --set ", example));
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
  if (parts.empty() || std::find(parts.begin(), parts.end(), "") != parts.end())
    throw ConfigError(str_cat(origin, ": bad key '", key, "'"));
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

void Section::fail(const toml::node& node, const std::string& key, const std::string& msg) const {
  throw ConfigError(str_cat(where(node, file_), ": key '", key_name(key), "': ", msg));
}

void Section::require(const std::string& key, const char* example) const {
  if (!has(key)) fail(table_, key, str_cat("missing (e.g. ", example, ")"));
}

void Section::string(const std::string& key, std::string& out, std::initializer_list<const char*> allowed) {
  const toml::node* n = find(key);
  if (!n) return;
  auto v = n->value<std::string>();
  if (!n->is_string() || !v) fail(*n, key, str_cat("expected a string, got ", type_name(*n)));
  if (allowed.size() && std::none_of(allowed.begin(), allowed.end(), [&](const char* a) { return *v == a; }))
    fail(*n, key, str_cat("\"", *v, "\" is not one of ", quoted_list(allowed)));
  out = *v;
}

void Section::boolean(const std::string& key, bool& out) {
  const toml::node* n = find(key);
  if (!n) return;
  if (!n->is_boolean()) fail(*n, key, str_cat("expected true or false, got ", type_name(*n)));
  out = *n->value<bool>();
}

double Section::check_range(const toml::node& node, const std::string& key, double v, double min, double max) const {
  if (!(v >= min && v <= max)) fail(node, key, str_cat(v, " is out of range [", min, ", ", max, "]"));
  return v;
}

void Section::number(const std::string& key, double& out, double min, double max) {
  const toml::node* n = find(key);
  if (!n) return;
  if (!n->is_number()) fail(*n, key, str_cat("expected a number, got ", type_name(*n)));
  out = check_range(*n, key, *n->value<double>(), min, max);
}

void Section::integer(const std::string& key, int64_t& out, int64_t min, int64_t max) {
  const toml::node* n = find(key);
  if (!n) return;
  if (!n->is_integer()) fail(*n, key, str_cat("expected an integer, got ", type_name(*n)));
  int64_t v = *n->value<int64_t>();
  if (v < min || v > max) fail(*n, key, str_cat(v, " is out of range [", min, ", ", max, "]"));
  out = v;
}

void Section::unsigned_integer(const std::string& key, uint64_t& out) {
  int64_t v = static_cast<int64_t>(out);
  integer(key, v, 0, INT64_MAX);
  out = static_cast<uint64_t>(v);
}

void Section::strings(const std::string& key, std::vector<std::string>& out) { read_strings(*this, key, out, nullptr); }

void Section::strings(const std::string& key, std::vector<std::string>& out, const std::vector<std::string>& allowed) {
  read_strings(*this, key, out, &allowed);
}

void Section::integers(const std::string& key, std::vector<int64_t>& out, int64_t min, int64_t max) {
  const toml::node* n = find(key);
  if (!n) return;
  std::vector<const toml::node*> items;
  if (const toml::array* arr = n->as_array()) {
    for (const toml::node& item : *arr) items.push_back(&item);
    if (items.empty()) fail(*n, key, "must not be empty");
  } else {
    items.push_back(n);
  }
  out.clear();
  for (const toml::node* item : items) {
    if (!item->is_integer())
      fail(*item, key, str_cat("expected an integer or an array of integers, found ", type_name(*item)));
    int64_t v = *item->value<int64_t>();
    if (v < min || v > max) fail(*item, key, str_cat(v, " is out of range [", min, ", ", max, "]"));
    out.push_back(v);
  }
}

const toml::table* Section::table(const std::string& key) {
  const toml::node* n = find(key);
  if (!n) return nullptr;
  if (!n->is_table()) fail(*n, key, str_cat("expected a table [", key_name(key), "], got ", type_name(*n)));
  return n->as_table();
}

void Section::finish() const {
  for (auto&& [k, v] : table_) {
    std::string key(k.str());
    if (used_.count(key)) continue;
    std::string known;
    for (const auto& u : used_) known += str_cat(known.empty() ? "" : ", ", u);
    fail(v, key, str_cat("unknown key (known keys here: ", known, ")"));
  }
}

std::string Section::type_name(const toml::node& n) {
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

}  // namespace nebula::toml_reader
