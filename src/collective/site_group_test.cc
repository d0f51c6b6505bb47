#include "collective/site_group.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <thread>

#include "collective/testing.h"
#include "nebula/error.h"

namespace nebula::collective {
namespace {

using namespace std::chrono_literals;

// Port 0 on rank 0: the store binds a port of the kernel's choosing, reports it before the
// rendezvous and through store_port(); the other ranks join on that port.
TEST(SiteGroup, PortZeroOnRankZeroBindsAndPublishesTheRealPort) {
  testing::StorePort port;
  uint16_t reported = 0;
  std::exception_ptr error;
  std::thread other([&] {
    try {
      SiteGroup g = testing::join_group("pair", 1, 2, 30s, port);
      EXPECT_NE(g.store_port(), 0);
      at::Tensor t = at::full({3}, 2.0f);
      g.allreduce_sum(t);
      EXPECT_TRUE(at::equal(t, at::full({3}, 3.0f)));
      g.barrier();
    } catch (...) {
      error = std::current_exception();
    }
  });
  {
    SiteGroup g("pair", "127.0.0.1", 0, 0, 2, 30s, [&](uint16_t p) {
      reported = p;
      port.publish(p);
    });
    EXPECT_NE(g.store_port(), 0);
    EXPECT_EQ(g.store_port(), reported);
    at::Tensor t = at::full({3}, 1.0f);
    g.allreduce_sum(t);
    EXPECT_TRUE(at::equal(t, at::full({3}, 3.0f)));
    g.barrier();
  }
  other.join();
  if (error) std::rethrow_exception(error);
}

TEST(SiteGroup, PortZeroOnAnotherRankIsAnError) {
  EXPECT_THROW(SiteGroup("s", "127.0.0.1", 0, 1, 2, 1s), Error);
}

// A rank waiting for a port that is never published gives up after its timeout, not never.
TEST(SiteGroup, WaitingForAnUnpublishedPortIsBounded) {
  testing::StorePort port;
  EXPECT_THROW(testing::join_group("s", 1, 2, 200ms, port), Timeout);
}

}  // namespace
}  // namespace nebula::collective
