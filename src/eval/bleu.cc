#include "eval/bleu.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <unordered_map>

#include "nebula/error.h"

namespace nebula::eval {
namespace {

constexpr size_t kMaxOrder = 4;

// Byte length of the whitespace character at s[i] (as Python's str.isspace() sees it), or 0.
size_t space_length(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return i + k < s.size() ? static_cast<unsigned char>(s[i + k]) : 0; };
  const unsigned char c = b(0);
  if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return 1;
  if (c == 0xc2 && (b(1) == 0x85 || b(1) == 0xa0)) return 2;  // U+0085, U+00A0
  if (c == 0xe1 && b(1) == 0x9a && b(2) == 0x80) return 3;     // U+1680
  if (c == 0xe2 && b(1) == 0x80 && ((b(2) >= 0x80 && b(2) <= 0x8a) || b(2) == 0xa8 || b(2) == 0xa9 || b(2) == 0xaf))
    return 3;                                                           // U+2000..200A, U+2028, U+2029, U+202F
  if (c == 0xe2 && b(1) == 0x81 && b(2) == 0x9f) return 3;  // U+205F
  if (c == 0xe3 && b(1) == 0x80 && b(2) == 0x80) return 3;  // U+3000
  return 0;
}

// Python's str.split(): the tokens between whitespace runs, as views into s.
std::vector<std::string_view> split_whitespace(std::string_view s) {
  std::vector<std::string_view> tokens;
  size_t start = 0, i = 0;
  while (i < s.size()) {
    if (size_t len = space_length(s, i)) {
      if (i > start) tokens.push_back(s.substr(start, i - start));
      i += len;
      start = i;
    } else {
      ++i;
    }
  }
  if (i > start) tokens.push_back(s.substr(start, i - start));
  return tokens;
}

// Python's str.rstrip().
std::string_view rstrip(std::string_view s) {
  size_t end = 0;
  for (size_t i = 0; i < s.size();) {
    if (size_t len = space_length(s, i)) {
      i += len;
    } else {
      end = ++i;
    }
  }
  return s.substr(0, end);
}

void replace_all(std::string& s, std::string_view from, std::string_view to) {
  std::string out;
  out.reserve(s.size());
  size_t pos = 0;
  for (size_t hit; (hit = s.find(from, pos)) != std::string::npos; pos = hit + from.size()) {
    out.append(s, pos, hit - pos);
    out += to;
  }
  out.append(s, pos);
  s = std::move(out);
}

bool is_digit(char c) { return c >= '0' && c <= '9'; }

// Rule 2's symbols: the ASCII ranges { - ~, [ - `, space - &, ( - +, : - @, and '/'.
bool is_split_symbol(char c) {
  return (c >= '{' && c <= '~') || (c >= '[' && c <= '`') || (c >= ' ' && c <= '&') || (c >= '(' && c <= '+') ||
         (c >= ':' && c <= '@') || c == '/';
}

std::string join(const std::vector<std::string_view>& tokens) {
  std::string out;
  for (std::string_view t : tokens) {
    if (!out.empty()) out += ' ';
    out += t;
  }
  return out;
}

// A segment as its canonical token string: tokens joined by single spaces, so that every
// n-gram is a substring of it (tokens contain no ASCII space).
std::string prepare(std::string_view segment, const BleuOptions& o) {
  return o.tokenize ? tokenize_13a(segment) : join(split_whitespace(segment));
}

using NgramCounts = std::unordered_map<std::string_view, size_t>;

// Counts of every n-gram (n = 1..4) of a canonical token string, keyed by views into it.
// Returns the number of tokens.
size_t count_ngrams(std::string_view text, NgramCounts& counts) {
  std::vector<size_t> starts;  // byte offset of each token, then a sentinel one past the end
  if (!text.empty()) {
    starts.push_back(0);
    for (size_t sp = text.find(' '); sp != std::string_view::npos; sp = text.find(' ', sp + 1))
      starts.push_back(sp + 1);
  }
  const size_t tokens = starts.size();
  starts.push_back(text.size() + 1);
  for (size_t n = 1; n <= kMaxOrder; ++n) {
    for (size_t i = 0; i + n <= tokens; ++i) ++counts[text.substr(starts[i], starts[i + n] - 1 - starts[i])];
  }
  return tokens;
}

size_t order_of(std::string_view ngram) { return static_cast<size_t>(std::count(ngram.begin(), ngram.end(), ' ')) + 1; }

std::string fixed(double x, int decimals) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", decimals, x);
  return buf;
}

}  // namespace

std::string tokenize_13a(std::string_view segment) {
  std::string s(rstrip(segment));
  replace_all(s, "<skipped>", "");
  replace_all(s, "-\n", "");
  replace_all(s, "\n", " ");
  replace_all(s, "&quot;", "\"");
  replace_all(s, "&amp;", "&");
  replace_all(s, "&lt;", "<");
  replace_all(s, "&gt;", ">");
  s = " " + s + " ";

  // Each rule is one left-to-right pass that, like a regex substitution, resumes after
  // what it matched (so "a..b" splits only the first '.' in rule 3's first pattern).
  std::string out;
  out.reserve(s.size() * 2);
  for (char c : s) {
    if (is_split_symbol(c)) {
      out += ' ';
      out += c;
      out += ' ';
    } else {
      out += c;
    }
  }
  s.swap(out);
  out.clear();
  for (size_t i = 0; i < s.size(); ++i) {  // [^0-9][.,] -> "\1 \2 "
    if (i + 1 < s.size() && !is_digit(s[i]) && (s[i + 1] == '.' || s[i + 1] == ',')) {
      out += s[i];
      out += ' ';
      out += s[++i];
      out += ' ';
    } else {
      out += s[i];
    }
  }
  s.swap(out);
  out.clear();
  for (size_t i = 0; i < s.size(); ++i) {  // [.,][^0-9] -> " \1 \2"
    if (i + 1 < s.size() && (s[i] == '.' || s[i] == ',') && !is_digit(s[i + 1])) {
      out += ' ';
      out += s[i];
      out += ' ';
      out += s[++i];
    } else {
      out += s[i];
    }
  }
  s.swap(out);
  out.clear();
  for (size_t i = 0; i < s.size(); ++i) {  // [0-9]- -> "\1 - "
    if (i + 1 < s.size() && is_digit(s[i]) && s[i + 1] == '-') {
      out += s[i];
      out += " - ";
      ++i;
    } else {
      out += s[i];
    }
  }
  return join(split_whitespace(out));
}

BleuScore compute_bleu(const std::array<size_t, 4>& counts, const std::array<size_t, 4>& totals, size_t sys_len,
                       size_t ref_len, const BleuOptions& options) {
  BleuScore r;
  r.counts = counts;
  r.totals = totals;
  r.sys_len = sys_len;
  r.ref_len = ref_len;
  r.options = options;
  if (sys_len < ref_len) {
    r.bp = sys_len > 0 ? std::exp(1.0 - static_cast<double>(ref_len) / static_cast<double>(sys_len)) : 0.0;
  } else {
    r.bp = 1.0;
  }
  if (std::all_of(counts.begin(), counts.end(), [](size_t c) { return c == 0; })) return r;  // score 0

  double log_sum = 0;
  double exp_divisor = 1;
  bool zero = false;
  for (size_t n = 0; n < kMaxOrder; ++n) {
    if (totals[n] == 0) {  // no hypothesis has n+1 tokens: this and higher orders stay 0
      zero = true;
      break;
    }
    const double total = static_cast<double>(totals[n]);
    double& p = r.precisions[n];
    if (counts[n] > 0) {
      p = 100.0 * static_cast<double>(counts[n]) / total;
    } else if (options.smoothing == BleuSmoothing::kExp) {
      exp_divisor *= 2;
      p = 100.0 / (exp_divisor * total);
    } else if (options.smoothing == BleuSmoothing::kFloor) {
      p = 100.0 * options.floor_value / total;
    }
    if (p <= 0) {
      zero = true;
    } else {
      log_sum += std::log(p);
    }
  }
  // sacreBLEU takes log(0) as -9999999999, which makes the score exactly 0.
  r.score = zero ? 0.0 : r.bp * std::exp(log_sum / static_cast<double>(kMaxOrder));
  return r;
}

BleuScore corpus_bleu(const std::vector<std::string>& hypotheses, const std::vector<std::string>& references,
                      const BleuOptions& options) {
  return corpus_bleu_multi(hypotheses, {references}, options);
}

namespace {

// One segment's statistics against its references (already prepared), or a DataError.
SegmentStats segment_stats(const std::string& hypothesis, const std::vector<std::string>& refs, size_t segment,
                           const BleuOptions& options) {
  if (refs.empty()) {
    throw DataError(str_cat("segment ", segment + 1, ": the reference is empty (sacreBLEU refuses these too); an empty "
                            "reference line usually means the hypothesis and reference files are misaligned"));
  }
  NgramCounts ref_max;
  std::vector<size_t> ref_lens;
  for (const std::string& ref : refs) {
    NgramCounts c;
    ref_lens.push_back(count_ngrams(ref, c));
    for (const auto& [g, n] : c) ref_max[g] = std::max(ref_max[g], n);
  }
  const std::string hyp = prepare(hypothesis, options);
  NgramCounts hyp_counts;
  const size_t hyp_len = count_ngrams(hyp, hyp_counts);
  // The reference length closest to the hypothesis length; the shorter one on a tie.
  size_t closest = ref_lens[0];
  for (size_t len : ref_lens) {
    const size_t d = len > hyp_len ? len - hyp_len : hyp_len - len;
    const size_t best = closest > hyp_len ? closest - hyp_len : hyp_len - closest;
    if (d < best || (d == best && len < closest)) closest = len;
  }
  SegmentStats s;
  s.sys_len = hyp_len;
  s.ref_len = closest;
  for (size_t n = 0; n < kMaxOrder; ++n) s.totals[n] = hyp_len > n ? hyp_len - n : 0;
  for (const auto& [g, n] : hyp_counts) {
    auto it = ref_max.find(g);
    if (it != ref_max.end()) s.counts[order_of(g) - 1] += std::min(n, it->second);
  }
  return s;
}

void add(SegmentStats& sum, const SegmentStats& s) {
  for (size_t n = 0; n < kMaxOrder; ++n) {
    sum.counts[n] += s.counts[n];
    sum.totals[n] += s.totals[n];
  }
  sum.sys_len += s.sys_len;
  sum.ref_len += s.ref_len;
}

BleuScore score_of(const SegmentStats& s, const BleuOptions& options) {
  return compute_bleu(s.counts, s.totals, s.sys_len, s.ref_len, options);
}

}  // namespace

std::vector<SegmentStats> segment_stats(const std::vector<std::string>& hypotheses,
                                        const std::vector<std::string>& references, const BleuOptions& options) {
  NEBULA_CHECK(references.size() == hypotheses.size(), "the references have ", references.size(),
               " segments but there are ", hypotheses.size(), " hypotheses");
  std::vector<SegmentStats> out;
  out.reserve(hypotheses.size());
  for (size_t i = 0; i < hypotheses.size(); ++i) {
    std::vector<std::string> refs;
    if (!references[i].empty()) refs.push_back(prepare(references[i], options));
    out.push_back(segment_stats(hypotheses[i], refs, i, options));
  }
  return out;
}

BleuScore corpus_bleu_multi(const std::vector<std::string>& hypotheses,
                            const std::vector<std::vector<std::string>>& reference_sets, const BleuOptions& options) {
  NEBULA_CHECK(!reference_sets.empty(), "corpus BLEU needs at least one set of references");
  for (size_t k = 0; k < reference_sets.size(); ++k) {
    NEBULA_CHECK(reference_sets[k].size() == hypotheses.size(), "reference set ", k + 1, " has ",
                 reference_sets[k].size(), " segments but there are ", hypotheses.size(), " hypotheses");
  }
  SegmentStats sum;
  size_t num_refs = 0;  // per segment; 0 once it varies
  for (size_t i = 0; i < hypotheses.size(); ++i) {
    std::vector<std::string> refs;
    for (const auto& set : reference_sets) {
      if (!set[i].empty()) refs.push_back(prepare(set[i], options));
    }
    if (i == 0) num_refs = refs.size();
    if (num_refs != refs.size()) num_refs = 0;
    add(sum, segment_stats(hypotheses[i], refs, i, options));
  }
  BleuScore r = score_of(sum, options);
  r.num_refs = hypotheses.empty() ? reference_sets.size() : num_refs;
  return r;
}

PairedBootstrap paired_bootstrap(const std::vector<std::string>& baseline, const std::vector<std::string>& system,
                                 const std::vector<std::string>& references, const BootstrapOptions& options) {
  NEBULA_CHECK(baseline.size() == system.size(), "paired bootstrap: the baseline has ", baseline.size(),
               " translations and the system ", system.size(), "; both must translate the same segments");
  NEBULA_CHECK(options.samples >= 1, "paired bootstrap: samples must be >= 1, not ", options.samples);
  const auto a = segment_stats(baseline, references, options.bleu);
  const auto b = segment_stats(system, references, options.bleu);
  PairedBootstrap r;
  r.segments = a.size();
  r.samples = options.samples;
  SegmentStats sum_a, sum_b;
  for (size_t i = 0; i < a.size(); ++i) {
    add(sum_a, a[i]);
    add(sum_b, b[i]);
  }
  r.baseline = score_of(sum_a, options.bleu).score;
  r.system = score_of(sum_b, options.bleu).score;
  r.delta = r.system - r.baseline;
  if (a.empty()) return r;
  // Koehn (2004): resample the test set with replacement, the same segments for both systems,
  // and take the middle 95% of the corpus-BLEU differences.
  std::mt19937_64 rng(options.seed);
  std::uniform_int_distribution<size_t> pick(0, a.size() - 1);
  std::vector<double> deltas;
  deltas.reserve(options.samples);
  size_t wins = 0;
  for (size_t k = 0; k < options.samples; ++k) {
    SegmentStats sa, sb;
    for (size_t i = 0; i < a.size(); ++i) {
      const size_t j = pick(rng);
      add(sa, a[j]);
      add(sb, b[j]);
    }
    const double d = score_of(sb, options.bleu).score - score_of(sa, options.bleu).score;
    deltas.push_back(d);
    if (d > 0) ++wins;
  }
  std::sort(deltas.begin(), deltas.end());
  auto quantile = [&](double q) {
    const double at = q * static_cast<double>(deltas.size() - 1);
    const auto lo = static_cast<size_t>(std::floor(at));
    const size_t hi = std::min(lo + 1, deltas.size() - 1);
    return deltas[lo] + (deltas[hi] - deltas[lo]) * (at - static_cast<double>(lo));
  };
  r.low = quantile(0.025);
  r.high = quantile(0.975);
  r.system_better = static_cast<double>(wins) / static_cast<double>(deltas.size());
  return r;
}

std::string BleuScore::signature() const {
  std::string smooth = "none";
  if (options.smoothing == BleuSmoothing::kExp) smooth = "exp";
  if (options.smoothing == BleuSmoothing::kFloor) smooth = "floor[" + fixed(options.floor_value, 2) + "]";
  return str_cat("nrefs:", num_refs ? std::to_string(num_refs) : std::string("var"), "|case:mixed|eff:no|tok:",
                 options.tokenize ? "13a" : "none", "|smooth:", smooth, "|version:nebula");
}

std::string BleuScore::format() const {
  std::string prec;
  for (size_t n = 0; n < kMaxOrder; ++n) prec += (n ? "/" : "") + fixed(precisions[n], 1);
  return str_cat("BLEU|", signature(), " = ", fixed(score, 2), " ", prec, " (BP = ", fixed(bp, 3),
                 " ratio = ", fixed(ratio(), 3), " hyp_len = ", sys_len, " ref_len = ", ref_len, ")");
}

}  // namespace nebula::eval
