// Test helpers for TOML readers (the job config, the plan topology): an error must name
// things, and test inputs are variations of one valid text.
#pragma once

#include <gtest/gtest.h>

#include <initializer_list>
#include <string>

#include "nebula/error.h"

namespace nebula::testing {

// Expects `parse()` to throw a ConfigError whose message contains every fragment; `text`
// is what was parsed, for the failure message.
template <typename Parse>
void expect_config_error(Parse parse, const std::string& text, std::initializer_list<const char*> fragments) {
  try {
    parse();
    ADD_FAILURE() << "no error for:\n" << text;
  } catch (const ConfigError& e) {
    for (const char* f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
  }
}

// `text` with the first `from` replaced by `to` (a test failure if `from` is absent).
inline std::string replace_once(std::string text, const std::string& from, const std::string& to) {
  auto pos = text.find(from);
  EXPECT_NE(pos, std::string::npos) << from;
  return text.replace(pos, from.size(), to);
}

}  // namespace nebula::testing
