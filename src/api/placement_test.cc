#include "nebula/placement.h"

#include <gtest/gtest.h>

#include <map>

#include "nebula/error.h"
#include "nebula/session.h"
#include "util/config_testing.h"

namespace nebula {
namespace {

const char* kJob = R"(
[job]
name = "t"
[[sites]]
name = "alpha"
workers = 4
store = "10.0.0.1:29400"
[[sites]]
name = "beta"
workers = 2
[security]
insecure = true
)";

struct FakeEnv {
  std::map<std::string, std::string> vars;
  Environment get() const {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

Placement place(const std::map<std::string, std::string>& vars, const std::string& site = "",
                const std::string& rank = "") {
  static const Config c = parse_config(kJob, "job.toml");
  FakeEnv env{vars};
  return resolve_placement(c, site, rank, env.get());
}

void expect_error(const std::map<std::string, std::string>& vars, std::initializer_list<const char*> fragments,
                  const std::string& site = "", const std::string& rank = "") {
  try {
    place(vars, site, rank);
    FAIL() << "no error";
  } catch (const ConfigError& e) {
    for (const char* f : fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << f << " in " << e.what();
  }
}

TEST(Placement, EachLauncherMapsToItsSiteRankAndStore) {
  // Command line: the config's store, rank 0 hosts it.
  Placement p = place({}, "alpha", "3");
  EXPECT_EQ(p.site, 0u);
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.store, "10.0.0.1:29400");
  EXPECT_FALSE(p.external_store);
  EXPECT_EQ(p.launcher, "command line");

  // torchrun: RANK/WORLD_SIZE, and its MASTER_ADDR:MASTER_PORT is the site's store; its agent
  // hosts that store when TORCHELASTIC_USE_AGENT_STORE=True.
  p = place({{"NEBULA_SITE", "beta"}, {"RANK", "1"}, {"LOCAL_RANK", "0"}, {"WORLD_SIZE", "2"},
             {"MASTER_ADDR", "gpu-a-01"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(p.site, 1u);
  EXPECT_EQ(p.rank, 1);  // the rank in the site (RANK), not on the node (LOCAL_RANK)
  EXPECT_EQ(p.store, "gpu-a-01:29500");
  EXPECT_TRUE(p.external_store);
  EXPECT_EQ(p.launcher, "torchrun");
  EXPECT_FALSE(place({{"NEBULA_SITE", "beta"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "::1"},
                      {"MASTER_PORT", "29500"}})
                   .external_store);
  EXPECT_EQ(place({{"NEBULA_SITE", "beta"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "::1"},
                   {"MASTER_PORT", "29500"}})
                .store,
            "[::1]:29500");

  // Open MPI and Slurm: the rank in the launch, the config's store.
  p = place({{"NEBULA_SITE", "alpha"}, {"OMPI_COMM_WORLD_RANK", "2"}, {"OMPI_COMM_WORLD_SIZE", "4"},
             {"OMPI_COMM_WORLD_LOCAL_RANK", "0"}});
  EXPECT_EQ(p.rank, 2);
  EXPECT_EQ(p.launcher, "open mpi");
  EXPECT_EQ(p.store, "10.0.0.1:29400");
  p = place({{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "1"}}, "alpha");
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.launcher, "slurm");

  // torchrun inside a Slurm allocation: torchrun's variables are the worker's.
  p = place({{"NEBULA_SITE", "beta"}, {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}});
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.launcher, "torchrun");
  // --rank wins over any launcher.
  EXPECT_EQ(place({{"RANK", "1"}, {"WORLD_SIZE", "2"}}, "beta", "0").rank, 0);
}

TEST(Placement, MissingOrInconsistentVariablesAreNamed) {
  expect_error({{"RANK", "0"}}, {"no --site", "$NEBULA_SITE", "alpha, beta"});
  expect_error({{"NEBULA_SITE", "gamma"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}}, {"gamma", "alpha", "beta"});
  expect_error({{"NEBULA_SITE", "beta"}}, {"no --rank", "$RANK", "$SLURM_PROCID"});
  expect_error({{"NEBULA_SITE", "beta"}, {"RANK", "1"}}, {"$RANK = 1", "$WORLD_SIZE", "incomplete"});
  expect_error({{"NEBULA_SITE", "beta"}, {"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "8"}},
               {"$SLURM_NTASKS = 8", "'beta'", "workers = 2", "job.toml"});
  expect_error({{"NEBULA_SITE", "alpha"}, {"OMPI_COMM_WORLD_RANK", "x"}, {"OMPI_COMM_WORLD_SIZE", "4"}},
               {"$OMPI_COMM_WORLD_RANK", "\"x\""});
  expect_error({{"NEBULA_SITE", "beta"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}},
               {"$MASTER_PORT is missing"});
  expect_error({{"NEBULA_SITE", "beta"}, {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"},
                {"MASTER_PORT", "70000"}},
               {"$MASTER_PORT = 70000"});
  expect_error({{"WORLD_SIZE", "3"}}, {"$WORLD_SIZE = 3", "workers = 2"}, "beta", "1");
  expect_error({}, {"--rank = 5", "ranks 0..1"}, "beta", "5");
}

// A session trains the caller's own model: [parallel] pipeline / tensor, which cut nebula's
// built-in models, are refused naming the keys (before anything connects), not ignored.
TEST(Session, PipelineOrTensorLayoutsAreRefused) {
  for (const char* layout : {"pipeline = 2", "tensor = 2"}) {
    const Config c = parse_config(std::string("[job]\nname = \"t\"\n[[sites]]\nname = \"alpha\"\nworkers = 4\n"
                                              "[security]\ninsecure = true\n[parallel]\n") + layout + "\n",
                                  "job.toml");
    try {
      Session s(c, "alpha", 0);
      ADD_FAILURE() << layout << ": a session was made";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("parallel.tensor"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("set both to 1"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace nebula
