// The checks that every site holds the same global model: at every exchange each site sends its
// outer step id and a CRC-32 of the θ_global it starts from, and every gateway compares them
// with its own (a divergence or a site out of step fails loudly instead of training on).
//
// The CRC is of θ_global's float32 bytes in flat-vector order. Sharded, each worker hashes its
// part and the gateway combines the parts' CRCs in order (wire::crc32_combine), so the value is
// the same for any number of workers, and a site of 3 workers agrees with a site of 2.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "collective/hierarchical.h"
#include "parallel/shard_layout.h"

namespace nebula::strategy {

// crc (wire::crc32) continued over the float32 bytes of `values` (float32, made contiguous).
uint32_t crc_of_values(uint32_t crc, const at::Tensor& values);

// crc continued by parts whose own CRCs (from 0) are part_crcs[q], of counts[q] float32 values
// each, in order: the CRC of the parts joined.
uint32_t combine_part_crcs(uint32_t crc, const double* part_crcs, const std::vector<int64_t>& counts);

// The CRC of θ_global parts `globals` (in order), as a double, valid on the gateway (0 elsewhere).
// `parts`: empty when the state is whole (each worker holds every part whole: the gateway hashes
// alone); sharded, parts[j][q] are rank q's runs of part j (exchange_layout.h: in flat order,
// held one after another in its globals[j]) and this is a site collective (every worker of the
// site calls it; one reduce to the gateway). The runs are combined in flat order, so the CRC is
// that of the whole part whatever the site's layout.
double global_hash(collective::Hierarchy& comm, const std::vector<at::Tensor>& globals,
                   const std::vector<std::vector<std::vector<parallel::ShardRun>>>& parts);

// Gateway: one small exchange of every site's (next outer step id, `hash`); lost sites
// (elastic) send nothing and show as empty.
std::vector<std::vector<double>> exchange_positions(collective::Hierarchy& comm, uint64_t next_seq, double hash,
                                                    std::chrono::milliseconds timeout);

// Every site's info must end in this site's outer step id `seq` and global hash `hash` (the last
// two values); empty entries (lost sites) are skipped. Throws Error naming `what` and the site
// otherwise.
void check_agreement(const std::vector<std::vector<double>>& info, double seq, double hash, const std::string& what);

}  // namespace nebula::strategy
