#include "strategy/replica_check.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::strategy {

uint32_t crc_of_values(uint32_t crc, const at::Tensor& values) {
  const at::Tensor g = values.contiguous();
  return wire::crc32(crc, {static_cast<const uint8_t*>(g.data_ptr()), static_cast<size_t>(g.numel()) * sizeof(float)});
}

uint32_t combine_part_crcs(uint32_t crc, const double* part_crcs, const std::vector<int64_t>& counts) {
  for (size_t q = 0; q < counts.size(); ++q)
    crc = wire::crc32_combine(crc, static_cast<uint32_t>(part_crcs[q]), static_cast<uint64_t>(counts[q]) * sizeof(float));
  return crc;
}

double global_hash(collective::Hierarchy& comm, const std::vector<at::Tensor>& globals,
                   const std::vector<std::vector<std::vector<parallel::ShardRun>>>& parts) {
  if (parts.empty()) {
    if (!comm.is_gateway()) return 0;
    uint32_t crc = 0;
    for (const auto& g : globals) crc = crc_of_values(crc, g);
    return static_cast<double>(crc);
  }
  // Sharded: each worker's CRC of each of its runs, summed to the gateway (one slot per run of
  // every worker: exact in double), combined there in flat order.
  collective::SiteGroup& site = comm.site();
  struct Slot {
    int64_t flat, len;
    size_t rank, index;  // the rank's index-th run of the part
  };
  std::vector<std::vector<Slot>> slots(globals.size());
  size_t total = 0;
  for (size_t j = 0; j < globals.size(); ++j) {
    const auto& by_rank = parts.at(j);
    for (size_t q = 0; q < by_rank.size(); ++q)
      for (size_t k = 0; k < by_rank[q].size(); ++k) slots[j].push_back({by_rank[q][k].flat, by_rank[q][k].len, q, k});
    std::sort(slots[j].begin(), slots[j].end(), [](const Slot& a, const Slot& b) { return a.flat < b.flat; });
    total += slots[j].size();
  }
  at::Tensor crcs = at::zeros({static_cast<int64_t>(total)}, at::kDouble);
  const auto me = static_cast<size_t>(site.rank());
  size_t base = 0;
  for (size_t j = 0; j < globals.size(); ++j) {
    std::vector<int64_t> at{0};  // where this rank's runs start in its globals[j]
    for (const auto& r : parts[j].at(me)) at.push_back(at.back() + r.len);
    for (size_t i = 0; i < slots[j].size(); ++i)
      if (slots[j][i].rank == me)
        crcs[static_cast<int64_t>(base + i)] =
            static_cast<double>(crc_of_values(0, globals[j].narrow(0, at[slots[j][i].index], slots[j][i].len)));
    base += slots[j].size();
  }
  site.reduce_sum_to_root(crcs);
  if (!comm.is_gateway()) return 0;
  uint32_t crc = 0;
  const double* c = crcs.data_ptr<double>();
  for (const auto& part : slots) {
    std::vector<int64_t> lens;
    for (const Slot& s : part) lens.push_back(s.len);
    crc = combine_part_crcs(crc, c, lens);
    c += part.size();
  }
  return static_cast<double>(crc);
}

std::vector<std::vector<double>> exchange_positions(collective::Hierarchy& comm, uint64_t next_seq, double hash,
                                                    std::chrono::milliseconds timeout) {
  collective::AllreduceOptions o;
  o.site_info = {static_cast<double>(next_seq), hash};
  auto work = comm.exchange_async({at::empty({0}, at::kFloat)}, std::move(o));
  work->wait(Deadline::after(timeout));
  return work->site_info();
}

void check_agreement(const std::vector<std::vector<double>>& info, double seq, double hash, const std::string& what) {
  for (size_t s = 0; s < info.size(); ++s) {
    const auto& i = info[s];
    if (i.empty()) continue;  // a lost site (elastic)
    if (i.size() < 2) throw Error(str_cat(what, ": site #", s, " sent no outer step id and hash"));
    const double their_seq = i[i.size() - 2], their_hash = i[i.size() - 1];
    if (their_seq != seq)
      throw Error(str_cat(what, ": site #", s, " contributed its outer step ", static_cast<int64_t>(their_seq),
                          " to this site's outer step ", static_cast<int64_t>(seq),
                          ": the sites are out of step; restart them with nebula run --resume"));
    if (their_hash != hash)
      throw Error(str_cat(what, ": site #", s, " holds other global weights than this site (CRC-32 ",
                          static_cast<uint32_t>(their_hash), " there, ", static_cast<uint32_t>(hash),
                          " here): the sites diverged; restart them with nebula run --resume"));
  }
}

}  // namespace nebula::strategy
