#pragma once
// Internal to nebula: the TOML reading shared by the job config (src/util/config.cc) and the
// planner's topology (src/plan/plan.cc). Every error is a ConfigError naming file:line:col
// and the key; unknown keys are errors. Includes toml++, so keep it out of public headers.

#include <cstdint>
#include <initializer_list>
#include <set>
#include <string>
#include <toml++/toml.h>
#include <vector>

#include "nebula/error.h"

namespace nebula::toml_reader {

// "file:line:col" of `node` (its own source path if it has one, else `fallback`).
std::string where(const toml::node& node, const std::string& fallback);

// toml::parse, with a parse error turned into a ConfigError "name:line:col: description".
toml::table parse(const std::string& text, const std::string& name);

// "a.b.c=value" → root[a][b][c] = value. The value is parsed as TOML; if that fails it is
// taken as a bare string, so `--set data.source=tsv` works without quotes. "sites.0.key"
// indexes into an array of tables. `example` completes "expected KEY=VALUE, e.g. --set ...".
void apply_override(toml::table& root, const std::string& text, const std::string& example);

// Reads one TOML table, remembering which keys were consumed so that unknown keys can be
// reported by finish(). Every accessor leaves `out` alone when the key is absent and throws
// ConfigError naming file:line:col and the key when it is malformed.
class Section {
 public:
  Section(const toml::table& table, std::string prefix, std::string file)
      : table_(table), prefix_(std::move(prefix)), file_(std::move(file)) {}

  std::string key_name(const std::string& key) const { return prefix_.empty() ? key : prefix_ + "." + key; }

  [[noreturn]] void fail(const toml::node& node, const std::string& key, const std::string& msg) const;

  // The node of `key` (nullptr if absent), marking the key as known.
  const toml::node* find(const std::string& key) {
    used_.insert(key);
    return table_.get(key);
  }

  bool has(const std::string& key) const { return table_.get(key) != nullptr; }

  // A key that cannot be done without: the error points at the table's header.
  void require(const std::string& key, const char* example) const;

  // A string, optionally one of `allowed`.
  void string(const std::string& key, std::string& out, std::initializer_list<const char*> allowed = {});
  void boolean(const std::string& key, bool& out);
  void number(const std::string& key, double& out, double min, double max);
  void integer(const std::string& key, int64_t& out, int64_t min, int64_t max);
  void unsigned_integer(const std::string& key, uint64_t& out);

  // An array of strings.
  void strings(const std::string& key, std::vector<std::string>& out);
  // A non-empty array of strings, each one of `allowed`.
  void strings(const std::string& key, std::vector<std::string>& out, const std::vector<std::string>& allowed);

  // An integer or a non-empty array of integers, each in [min, max].
  void integers(const std::string& key, std::vector<int64_t>& out, int64_t min, int64_t max);

  // `v` if it lies in [min, max], else a "... is out of range" error at `node`.
  double check_range(const toml::node& node, const std::string& key, double v, double min, double max) const;

  // A unit-bearing string: "80ms", "50Mbit" (or the integer 0). `parse` throws ConfigError
  // without a location; `examples` goes into the type error, "(e.g. <examples>)".
  template <typename T, typename Parse>
  void unit(const std::string& key, T& out, Parse parse, const char* examples = "\"80ms\", \"50Mbit\"") {
    const toml::node* n = find(key);
    if (!n) return;
    std::string text;
    if (n->is_string()) text = *n->value<std::string>();
    else if (n->is_integer() && *n->value<int64_t>() == 0) text = "0";
    else fail(*n, key, str_cat("expected a string with a unit (e.g. ", examples, "), got ", type_name(*n)));
    try {
      out = parse(text);
    } catch (const ConfigError& e) {
      fail(*n, key, e.what());
    }
  }

  // An array of tables ([[prefix.key]]): calls each(section, table) for every element, then
  // the element's section's finish().
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

  // A sub-table ([wan] inside the root); nullptr if absent.
  const toml::table* table(const std::string& key);

  // Reports the first key that no accessor asked for.
  void finish() const;

  // "a string", "an integer", ...: for error messages.
  static std::string type_name(const toml::node& n);

 private:
  const toml::table& table_;
  std::string prefix_;
  std::string file_;
  std::set<std::string> used_;
};

}  // namespace nebula::toml_reader
