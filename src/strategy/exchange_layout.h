// Who holds what of a fragment in an exchange: the fragment [offset, offset + numel) of the flat
// parameter vector cut by a site's layout (parallel/shard_layout.h, the one place that
// arithmetic lives) over its workers. A site of w workers cuts by its own layout at w, sharded
// or not (ZeRO-3's units in a job with shard = "full", else one unit), so every site knows every
// other site's cut (wan.mode = "every_worker": each worker exchanges its runs of a fragment with
// the workers of the other sites that hold the same values). Plain arithmetic, no tensors.
#pragma once

#include <cstdint>
#include <variant>
#include <vector>

#include "collective/hierarchical.h"
#include "parallel/shard_layout.h"
#include "parallel/tensor_parallel.h"

namespace nebula::strategy {

// A fragment's range [offset, offset + numel) of the flat vector.
struct FragmentRange {
  int64_t offset = 0, numel = 0;
};

// How one site holds the flat vector: ZeRO's cut of its workers, its pipeline stages', or its
// tensor slices'.
using SiteLayout = std::variant<parallel::ShardLayout, parallel::StageLayout, parallel::SliceLayout>;
int64_t workers_of(const SiteLayout& layout);
int64_t total_of(const SiteLayout& layout);  // the flat vector's values

// What worker `rank` holds of the whole flat vector [0, total): its trainable parameters' values
// (ZeRO's workers: all; a stage's or a slice's: theirs), `local` their positions in its own
// vector (the optimizer's, the checkpoint's). A resume onto another layout reads by them.
std::vector<parallel::ShardRun> held_of(const SiteLayout& layout, int64_t rank);
// Which part of the model worker `rank` holds (0 for ZeRO's workers; its stage; its slice), and
// its data-parallel replica: its rank among the workers that hold the same part (its optimizer's
// group) and the index of the data it reads.
int64_t holding_of(const SiteLayout& layout, int64_t rank);
int64_t replica_of(const SiteLayout& layout, int64_t rank);
// The number of data-parallel replicas.
int64_t replicas_of(const SiteLayout& layout);

// Every rank's runs of the fragment under `layout` (flat and shard-local indices absolute), in
// rank order; a rank's part is its runs' values one after another.
std::vector<std::vector<parallel::ShardRun>> parts_of(const FragmentRange& fr, const SiteLayout& layout);

// Σ len of each rank's runs.
std::vector<int64_t> counts_of(const std::vector<std::vector<parallel::ShardRun>>& parts);

// Whether the parts lie in rank order, each one run right after the last (one unit): then a
// rank-ordered gather of the parts is the fragment in flat order.
bool in_rank_order(const std::vector<std::vector<parallel::ShardRun>>& parts);

// Every site's holdings of the fragment (Hierarchy::exchange_parts_async), spans relative to the
// fragment: site s cut by layouts[s].
collective::Holdings wan_holdings(const FragmentRange& fr, const std::vector<SiteLayout>& layouts);

}  // namespace nebula::strategy
