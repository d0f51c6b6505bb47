#include "strategy/replica_check.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "nebula/error.h"

namespace nebula::strategy {
namespace {

// The gateway's combination of the workers' CRCs of their parts is the CRC of the whole, for
// any cut (empty parts included), and continues over several fragments in order.
TEST(ReplicaCheck, CombinedCrcOfPartsEqualsTheCrcOfTheWhole) {
  const at::Tensor a = at::randn({100}), b = at::randn({37});
  const uint32_t whole = crc_of_values(crc_of_values(0, a), b);
  for (const std::vector<int64_t>& counts : {std::vector<int64_t>{100}, {30, 0, 45, 25}, {0, 0, 100}, {1, 99}}) {
    std::vector<double> crcs;
    int64_t at = 0;
    for (int64_t n : counts) {
      crcs.push_back(static_cast<double>(crc_of_values(0, a.narrow(0, at, n))));
      at += n;
    }
    uint32_t combined = combine_part_crcs(0, crcs.data(), counts);
    EXPECT_EQ(combined, crc_of_values(0, a));
    const std::vector<int64_t> b_counts = {20, 17};
    const double b_crcs[] = {static_cast<double>(crc_of_values(0, b.narrow(0, 0, 20))),
                             static_cast<double>(crc_of_values(0, b.narrow(0, 20, 17)))};
    EXPECT_EQ(combine_part_crcs(combined, b_crcs, b_counts), whole);
  }
}

TEST(ReplicaCheck, AgreementNamesTheSiteThatDiffers) {
  const double seq = 7, hash = 12345;
  // Each site's info ends in its outer step id and hash; a lost site sent nothing.
  EXPECT_NO_THROW(check_agreement({{0.1, 0, 0, 1, seq, hash}, {}, {0.2, 0, 0, 1, seq, hash}}, seq, hash, "x"));
  try {
    check_agreement({{seq, hash}, {seq, hash}, {seq, 999}}, seq, hash, "outer step 7");
    FAIL() << "no error for another hash";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outer step 7: site #2 holds other global weights"), std::string::npos)
        << e.what();
  }
  try {
    check_agreement({{seq, hash}, {seq - 1, hash}}, seq, hash, "the end");
    FAIL() << "no error for another outer step";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("site #1 contributed its outer step 6 to this site's outer step 7"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(check_agreement({{seq, hash}, {seq}}, seq, hash, "x"), Error);  // no id and hash
}

}  // namespace
}  // namespace nebula::strategy
