#include "strategy/round_position.h"

#include <algorithm>
#include <cstdio>
#include <iterator>

#include "nebula/error.h"

namespace nebula::strategy {

namespace {
// The codecs' indices in reconcile's vector (0: none given). Append only.
constexpr const char* kCodecKinds[] = {"", "none", "fp16", "bf16", "int8", "int4", "topk", "powersgd", "sparseloco"};
double codec_index(const std::string& kind) {
  for (size_t i = 0; i < std::size(kCodecKinds); ++i)
    if (kind == kCodecKinds[i]) return static_cast<double>(i);
  throw Error(str_cat("codec '", kind, "' has no index for checkpoints"));
}
}  // namespace

double state_number(const StrategyState& in, const std::string& name) {
  auto it = in.numbers.find(name);
  if (it == in.numbers.end()) throw DataError(str_cat("the checkpoint's strategy state has no '", name, "'"));
  return it->second;
}

void RoundPosition::save(StrategyState& out) const {
  auto& n = out.numbers;
  for (size_t j = 0; j < fragment_rounds.size(); ++j) n[str_cat("f", j, "/round")] = static_cast<double>(fragment_rounds[j]);
  n["rounds"] = static_cast<double>(rounds);
  n["outer_steps"] = static_cast<double>(outer_steps);
  n["nominal_done"] = static_cast<double>(nominal_done);
  n["next_seq"] = static_cast<double>(next_seq);
  n["round_open"] = round_open ? 1 : 0;
  n["nominal_h"] = static_cast<double>(nominal_h);
  n["round_steps"] = static_cast<double>(round_steps);
  n["in_round"] = static_cast<double>(in_round);
  n["next_fragment"] = static_cast<double>(next_fragment);
  n["controller_h"] = static_cast<double>(controller.h);
  n["decided"] = controller.decided ? 1 : 0;
  n["decided_measured"] = controller.decided_measured ? 1 : 0;
  if (controller.ceiling > 0) n["controller_ceiling"] = controller.ceiling;
  // What the next rounds' decisions rest on (known_info looks at most two rounds back).
  for (int64_t r = std::max<int64_t>(0, rounds - 2); r < static_cast<int64_t>(info_of_round.size()); ++r)
    for (size_t k = 0; k < info_of_round[static_cast<size_t>(r)].size(); ++k)
      n[str_cat("info/", r, "/", k)] = info_of_round[static_cast<size_t>(r)][k];
  out.strings["codec"] = codec;
}

RoundPosition RoundPosition::load(const StrategyState& in, size_t fragments) {
  auto integer = [&](const std::string& name) { return static_cast<int64_t>(state_number(in, name)); };
  RoundPosition p;
  for (size_t j = 0; j < fragments; ++j) p.fragment_rounds.push_back(integer(str_cat("f", j, "/round")));
  p.rounds = integer("rounds");
  p.outer_steps = integer("outer_steps");
  p.nominal_done = integer("nominal_done");
  p.next_seq = static_cast<uint64_t>(integer("next_seq"));
  p.round_open = integer("round_open") != 0;
  p.nominal_h = integer("nominal_h");
  p.round_steps = integer("round_steps");
  p.in_round = integer("in_round");
  p.next_fragment = static_cast<size_t>(integer("next_fragment"));
  p.controller.h = integer("controller_h");
  p.controller.decided = integer("decided") != 0;
  p.controller.decided_measured = integer("decided_measured") != 0;
  if (auto it = in.numbers.find("controller_ceiling"); it != in.numbers.end()) p.controller.ceiling = it->second;
  p.info_of_round.assign(static_cast<size_t>(p.rounds), {});
  for (const auto& [name, value] : in.numbers) {
    long long r = 0, k = 0;
    if (std::sscanf(name.c_str(), "info/%lld/%lld", &r, &k) != 2 || r < 0 || r >= p.rounds) continue;
    auto& row = p.info_of_round[static_cast<size_t>(r)];
    if (row.size() <= static_cast<size_t>(k)) row.resize(static_cast<size_t>(k) + 1);
    row[static_cast<size_t>(k)] = static_cast<float>(value);
  }
  auto codec = in.strings.find("codec");
  if (codec != in.strings.end()) p.codec = codec->second;
  return p;
}

std::vector<double> RoundPosition::to_vector() const {
  std::vector<double> v = {static_cast<double>(next_seq),     static_cast<double>(rounds),
                           static_cast<double>(outer_steps),  static_cast<double>(nominal_done),
                           round_open ? 1.0 : 0.0,            static_cast<double>(nominal_h),
                           static_cast<double>(in_round),     static_cast<double>(next_fragment),
                           static_cast<double>(controller.h), controller.decided ? 1.0 : 0.0,
                           controller.decided_measured ? 1.0 : 0.0, codec_index(codec)};
  for (int64_t r : fragment_rounds) v.push_back(static_cast<double>(r));
  for (int64_t r = std::max<int64_t>(0, rounds - 2); r < rounds; ++r) {
    const auto& row = static_cast<size_t>(r) < info_of_round.size() ? info_of_round[static_cast<size_t>(r)]
                                                                    : std::vector<float>{};
    v.push_back(static_cast<double>(row.size()));
    v.insert(v.end(), row.begin(), row.end());
  }
  v.push_back(controller.ceiling);  // last: a reader of an older build stops before it
  return v;
}

RoundPosition RoundPosition::from_vector(const double* p, size_t fragments) {
  RoundPosition pos;
  pos.next_seq = static_cast<uint64_t>(p[0]);
  pos.rounds = static_cast<int64_t>(p[1]);
  pos.outer_steps = static_cast<int64_t>(p[2]);
  pos.nominal_done = static_cast<int64_t>(p[3]);
  pos.round_open = p[4] != 0;
  pos.nominal_h = static_cast<int64_t>(p[5]);
  pos.round_steps = pos.nominal_h;  // this round without the heterogeneous scaling
  pos.in_round = static_cast<int64_t>(p[6]);
  pos.next_fragment = static_cast<size_t>(p[7]);
  pos.controller.h = static_cast<int64_t>(p[8]);
  pos.controller.decided = p[9] != 0;
  pos.controller.decided_measured = p[10] != 0;
  pos.codec = kCodecKinds[static_cast<size_t>(p[11])];
  for (size_t j = 0; j < fragments; ++j) pos.fragment_rounds.push_back(static_cast<int64_t>(p[12 + j]));
  size_t k = 12 + fragments;
  pos.info_of_round.assign(static_cast<size_t>(pos.rounds), {});
  for (int64_t r = std::max<int64_t>(0, pos.rounds - 2); r < pos.rounds; ++r) {
    const auto len = static_cast<size_t>(p[k++]);
    pos.info_of_round[static_cast<size_t>(r)].assign(p + k, p + k + len);
    k += len;
  }
  pos.controller.ceiling = p[k];  // 0 from an older build's shorter vector (the reader pads with zeros)
  return pos;
}

ReconcileVerdict reconcile_verdict(const std::vector<std::vector<double>>& info, size_t me) {
  ReconcileVerdict v;
  size_t leader = me;
  for (size_t s = 0; s < info.size(); ++s)  // lost sites (elastic) sent nothing
    if (!info[s].empty() && (info[s][0] > info[leader].at(0) || (info[s][0] == info[leader][0] && s < leader)))
      leader = s;
  bool any = false;
  for (size_t s = 0; s < info.size(); ++s) any = any || (!info[s].empty() && info[s] != info[leader]);
  v.leader = leader;
  v.any = any;
  v.adopt = info[me] != info[leader];
  return v;
}

}  // namespace nebula::strategy
