#include "nebula/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "nebula/error.h"
#include "util/config_testing.h"

namespace nebula {
namespace {

const char* kValid = R"(
[job]
name = "t"
steps = 7
timeout = "5s"

[model]
dim = 32
heads = 4

[data]
languages = ["de"]

[[sites]]
name = "a"
workers = 2

[[sites]]
name = "b"

[wan]
bandwidth = "50Mbit"
rtt = "80ms"

[security]
insecure = true
)";

// Expects parse_config(text) to throw a ConfigError whose message contains every fragment.
void expect_error(const std::string& text, std::initializer_list<const char*> fragments,
                  const std::vector<std::string>& overrides = {}) {
  nebula::testing::expect_config_error([&] { parse_config(text, "job.toml", overrides); }, text, fragments);
}

using nebula::testing::replace_once;

TEST(Config, ValidLoads) {
  Config c = parse_config(kValid, "job.toml");
  EXPECT_EQ(c.job.steps, 7);
  EXPECT_EQ(c.job.timeout, std::chrono::seconds(5));
  EXPECT_EQ(c.job.run_dir, "runs/t");
  ASSERT_EQ(c.sites.size(), 2u);
  EXPECT_EQ(c.sites[0].workers, 2);
  EXPECT_EQ(c.sites[1].workers, 1);
  EXPECT_EQ(c.total_workers(), 3);
  EXPECT_DOUBLE_EQ(c.wan.path.bandwidth_bits, 50e6);
  EXPECT_EQ(c.wan.path.rtt, std::chrono::milliseconds(80));
  EXPECT_TRUE(c.wan.emulated());
  EXPECT_TRUE(c.security.insecure);
  EXPECT_EQ(c.site_index("b"), 1u);
  EXPECT_THROW(c.site_index("zeta"), ConfigError);
}

TEST(Config, CheckpointKeys) {
  Config c = parse_config(kValid, "job.toml");
  EXPECT_EQ(c.checkpoint.every, 0);
  EXPECT_EQ(c.checkpoint.keep, 2);
  EXPECT_EQ(c.checkpoint.dir, "runs/t/checkpoints");
  Config d = parse_config(std::string(kValid) + "\n[checkpoint]\nevery = 50\nkeep = 3\ndir = \"/ck\"\n", "job.toml");
  EXPECT_EQ(d.checkpoint.every, 50);
  EXPECT_EQ(d.checkpoint.keep, 3);
  EXPECT_EQ(d.checkpoint.dir, "/ck");
  EXPECT_EQ(parse_config(to_toml(d), "again").checkpoint.dir, "/ck");
  expect_error(std::string(kValid) + "\n[checkpoint]\nkeep = 1\n", {"job.toml", "checkpoint.keep"});
  expect_error(std::string(kValid) + "\n[checkpoint]\nevery = -5\n", {"checkpoint.every"});
  expect_error(std::string(kValid) + "\n[checkpoint]\nevry = 5\n", {"evry"});
}

// The fingerprint checkpoints carry changes with what shapes training, not with where or how long it runs.
TEST(Config, TrainingFingerprintIgnoresAddressesStepsEmulationAndLayout) {
  const Config c = parse_config(kValid, "job.toml");
  const std::string h = training_fingerprint(c);
  EXPECT_EQ(h.size(), 16u);
  // A site's workers and [parallel] shard may change too: the resume reshards (train/worker.cc).
  for (const char* same : {"sites.0.gateway=\"127.0.0.1:4000\"", "job.steps=70", "wan.rtt=\"5ms\"",
                           "job.timeout=\"9s\"", "checkpoint.every=5", "eval.every=3", "sites.0.workers=3",
                           "parallel.shard=\"optimizer\""})
    EXPECT_EQ(training_fingerprint(parse_config(kValid, "job.toml", {same})), h) << same;
  for (const char* other : {"model.dim=64", "job.seed=2", "strategy.kind=\"diloco\"", "data.batch_size=8",
                            "sites.1.name=\"gamma\""})
    EXPECT_NE(training_fingerprint(parse_config(kValid, "job.toml", {other})), h) << other;
  // A site's own layout ([[sites]] parallel) is checked by the resume itself (train/worker_checkpoint.cc).
  const std::vector<std::string> diloco = {"model.layers=4", "strategy.kind=\"diloco\""};
  EXPECT_EQ(training_fingerprint(parse_config(replace_once(kValid, "workers = 2\n", "workers = 2\nparallel = { pipeline = 2 }\n"),
                                              "job.toml", diloco)),
            training_fingerprint(parse_config(kValid, "job.toml", diloco)));
}

TEST(Config, ParallelShard) {
  EXPECT_EQ(parse_config(kValid, "job.toml").parallel.shard, "none");
  const Config z = parse_config(kValid, "job.toml", {"parallel.shard=\"optimizer\""});
  EXPECT_EQ(z.parallel.shard, "optimizer");
  EXPECT_EQ(parse_config(to_toml(z), "again").parallel.shard, "optimizer");
  // ZeRO-2: with diloco and streaming (inside the site), not with sync.
  EXPECT_EQ(parse_config(kValid, "job.toml", {"parallel.shard=\"gradients\"", "strategy.kind=\"diloco\""}).parallel.shard,
            "gradients");
  expect_error(std::string(kValid) + "\n[parallel]\nshard = \"gradients\"\n",
               {"job.toml", "parallel.shard", "ZeRO-2", "sync", "\"optimizer\""}, {"strategy.kind=\"sync\""});
  // GPU sites shard too (their shards on the device; the site's collectives through host copies).
  EXPECT_EQ(parse_config(kValid, "job.toml", {"parallel.shard=\"gradients\"", "strategy.kind=\"diloco\"",
                                             "sites.1.device=\"cuda\""}).parallel.shard,
            "gradients");
  // ZeRO-3: the built-in models with diloco and streaming; not with sync, not a TorchScript module.
  EXPECT_EQ(parse_config(kValid, "job.toml", {"parallel.shard=\"full\"", "strategy.kind=\"diloco\""}).parallel.shard,
            "full");
  expect_error(std::string(kValid) + "\n[parallel]\nshard = \"full\"\n", {"job.toml", "parallel.shard", "ZeRO-3", "sync"},
               {"strategy.kind=\"sync\""});
  expect_error(std::string(kValid) + "\n[parallel]\nshard = \"full\"\n", {"parallel.shard", "TorchScript"},
               {"strategy.kind=\"diloco\"", "model.kind=torchscript", "model.script=\"m.pt\"", "data.source=tensors",
                "data.path=\"shards\""});
  // recompute: ZeRO-3's layers run again in backward; nothing to recompute otherwise.
  const Config r = parse_config(kValid, "job.toml", {"parallel.shard=\"full\"", "parallel.recompute=true", "strategy.kind=\"diloco\""});
  EXPECT_TRUE(r.parallel.recompute);
  EXPECT_TRUE(parse_config(to_toml(r), "again").parallel.recompute);
  EXPECT_FALSE(parse_config(kValid, "job.toml").parallel.recompute);
  expect_error(std::string(kValid) + "\n[parallel]\nshard = \"gradients\"\nrecompute = true\n",
               {"job.toml", "parallel.recompute", "shard = \"full\" or pipeline > 1"}, {"strategy.kind=\"diloco\""});
  const Config f = parse_config(kValid, "job.toml", {"parallel.shard=\"full\"", "parallel.prefetch=true", "strategy.kind=\"diloco\""});
  EXPECT_TRUE(parse_config(to_toml(f), "again").parallel.prefetch);
  expect_error(std::string(kValid) + "\n[parallel]\nshard = \"optimizer\"\nprefetch = true\n",
               {"job.toml", "parallel.prefetch", "shard = \"full\""});
  // bucket: ZeRO-2's gradient buckets, a size, at least 1KiB.
  EXPECT_EQ(parse_config(kValid, "job.toml").parallel.bucket_bytes, 4u << 20);
  const Config b = parse_config(kValid, "job.toml", {"parallel.shard=\"gradients\"", "parallel.bucket=\"256KiB\"", "strategy.kind=\"diloco\""});
  EXPECT_EQ(b.parallel.bucket_bytes, 256u << 10);
  EXPECT_EQ(parse_config(to_toml(b), "again").parallel.bucket_bytes, 256u << 10);
  expect_error(std::string(kValid) + "\n[parallel]\nbucket = \"100B\"\n", {"job.toml", "parallel.bucket", "1KiB"});
  // staging: diloco's gateway stages the outer step's exchange in fragments of this size.
  EXPECT_EQ(parse_config(kValid, "job.toml").strategy.staging_bytes, 64u << 20);
  const Config g = parse_config(kValid, "job.toml", {"strategy.kind=\"diloco\"", "strategy.staging=\"8MiB\""});
  EXPECT_EQ(parse_config(to_toml(g), "again").strategy.staging_bytes, 8u << 20);
  expect_error(std::string(kValid) + "\n[strategy]\nkind = \"diloco\"\nstaging = \"1KiB\"\n",
               {"job.toml", "strategy.staging", "64KiB"});
  expect_error(std::string(kValid) + "\n[parallel]\nshard = \"zero1\"\n", {"parallel.shard", "zero1"});
  expect_error(std::string(kValid) + "\n[parallel]\nshards = \"none\"\n", {"shards"});
}

TEST(Config, ParallelPipeline) {
  // One site of 2 workers, a model of 4 layers.
  const std::string one = replace_once(replace_once(kValid, "[[sites]]\nname = \"b\"\n", ""), "heads = 4\n",
                                       "heads = 4\nlayers = 4\n");
  const Config p = parse_config(one + "\n[parallel]\npipeline = 2\nmicro_batches = 2\n", "job.toml");
  EXPECT_EQ(p.parallel.pipeline, 2);
  EXPECT_EQ(p.parallel.micro_batches, 2);
  EXPECT_EQ(parse_config(to_toml(p), "again").parallel.micro_batches, 2);
  EXPECT_EQ(parse_config(kValid, "job.toml").parallel.pipeline, 1);
  const std::string piped = one + "\n[parallel]\npipeline = 2\n";
  expect_error(one + "\n[parallel]\npipeline = 3\n",
               {"job.toml:", "parallel.pipeline", "3 stages for a model of 2 layers"}, {"model.layers=2"});
  expect_error(one + "\n[parallel]\npipeline = 3\n",
               {"job.toml:", "parallel.pipeline", "site 'a' has 2 workers", "multiple of pipeline = 3"});
  expect_error(piped, {"parallel.micro_batches", "data.batch_size"}, {"data.batch_size=3"});
  expect_error(piped, {"job.toml:", "parallel.pipeline", "mlm_encoder", "seq2seq"}, {"model.kind=\"seq2seq\""});
  EXPECT_EQ(parse_config(piped, "job.toml", {"parallel.shard=\"optimizer\""}).parallel.shard, "optimizer");
  // recompute: a stage's forward runs again in backward, with any shard mode the stages run.
  EXPECT_TRUE(parse_config(piped, "job.toml", {"parallel.recompute=true", "parallel.shard=\"gradients\"",
                                               "strategy.kind=\"diloco\""}).parallel.recompute);
  expect_error(one + "\n[parallel]\nrecompute = true\n", {"job.toml:", "parallel.recompute", "pipeline > 1"});
  expect_error(piped, {"job.toml:", "parallel.pipeline", "ZeRO-3"}, {"parallel.shard=\"full\"", "strategy.kind=\"diloco\""});
  expect_error(piped, {"parallel.pipeline", "contrastive_weight"}, {"data.contrastive_weight=0.5"});
  expect_error(piped, {"parallel.pipeline", "[privacy]"}, {"strategy.kind=\"diloco\"", "privacy.clip=1"});
  EXPECT_EQ(parse_config(piped, "job.toml", {"checkpoint.every=10"}).checkpoint.every, 10);
  expect_error(std::string(kValid) + "\n[parallel]\npipeline = 2\n", {"parallel.pipeline", "diloco", "2 sites"},
               {"model.layers=4", "sites.1.workers=2"});
  expect_error(std::string(kValid) + "\n[parallel]\npipeline = 2\n", {"parallel.pipeline", "site 'b' has 1 workers"},
               {"model.layers=4", "strategy.kind=\"diloco\""});
  expect_error(piped, {"parallel.pipeline"}, {"parallel.pipeline=0"});
}

// [[sites]] parallel: a site's own layout, its errors naming its key and line.
TEST(Config, SiteLayouts) {
  const std::string mixed = replace_once(replace_once(kValid, "workers = 2\n", "workers = 2\nparallel = { pipeline = 2 }\n"),
                                         "heads = 4\n", "heads = 4\nlayers = 4\n");
  const Config m = parse_config(mixed, "job.toml", {"strategy.kind=\"diloco\""});
  EXPECT_EQ(m.sites[0].pipeline, 2);
  EXPECT_EQ(m.sites[1].pipeline, 0);
  EXPECT_EQ(m.parallel.pipeline, 1);
  EXPECT_EQ(parse_config(to_toml(m), "again").sites[0].pipeline, 2);
  EXPECT_EQ(parse_config(to_toml(m), "again").sites[1].pipeline, 0);
  // The site's line, not the job's [parallel].
  expect_error(mixed, {"job.toml:18:", "sites[0].parallel.pipeline", "diloco"});
  expect_error(replace_once(mixed, "pipeline = 2 }", "pipeline = 3 }"),
               {"job.toml:18:", "sites[0].parallel.pipeline", "site 'a' has 2 workers", "multiple of pipeline = 3"},
               {"strategy.kind=\"diloco\""});
  expect_error(mixed, {"sites[0].parallel.pipeline", "2 stages for a model of 1 layers"},
               {"strategy.kind=\"diloco\"", "model.layers=1"});
  expect_error(mixed, {"sites[0].parallel.pipeline", "job.elastic"}, {"strategy.kind=\"diloco\"", "job.elastic=true"});
  // A site's own tensor slices: read, written back, and refused where not built, naming its key.
  const std::string sliced = replace_once(mixed, "pipeline = 2 }", "tensor = 2 }");
  const Config sl = parse_config(sliced, "job.toml", {"strategy.kind=\"diloco\""});
  EXPECT_EQ(sl.sites[0].tensor, 2);
  EXPECT_EQ(sl.tensor_of(sl.sites[1]), 1);
  EXPECT_EQ(parse_config(to_toml(sl), "again").sites[0].tensor, 2);
  expect_error(sliced, {"job.toml:18:", "sites[0].parallel.tensor", "diloco"});  // sync across sites
  EXPECT_EQ(parse_config(sliced, "job.toml", {"strategy.kind=\"diloco\"", "parallel.shard=\"gradients\""}).parallel.shard,
            "gradients");
  expect_error(sliced, {"job.toml:18:", "sites[0].parallel.tensor", "ZeRO-3"},
               {"strategy.kind=\"diloco\"", "parallel.shard=\"full\""});
  expect_error(sliced, {"sites[0].parallel.tensor", "must divide model.heads"},
               {"strategy.kind=\"diloco\"", "model.ffn=33"});
  expect_error(replace_once(sliced, "tensor = 2 }", "tensor = 2, pipeline = 2 }"),
               {"sites[0].parallel.tensor", "pipeline stages and tensor slices"},
               {"strategy.kind=\"diloco\"", "sites.0.workers=4"});
  expect_error(replace_once(mixed, "pipeline = 2 }", "pipeline = 0 }"), {"sites[0].parallel.pipeline"});
  // A site of one stage beside a job of two: the job's key still asks the other site for stages.
  const Config one = parse_config(replace_once(mixed, "pipeline = 2 }", "pipeline = 1 }"), "job.toml",
                                  {"strategy.kind=\"diloco\""});
  EXPECT_EQ(one.sites[0].pipeline, 1);
}

TEST(Config, WanModeEveryWorker) {
  EXPECT_EQ(parse_config(kValid, "job.toml").wan.mode, "gateway");
  const Config e = parse_config(kValid, "job.toml",
                                {"wan.mode=\"every_worker\"", "strategy.kind=\"diloco\"", "wan.host_bandwidth=\"25Mbit\"",
                                 "sites.0.worker_addresses=[\"10.0.0.2:7000\"]"});
  EXPECT_TRUE(e.wan.every_worker());
  EXPECT_DOUBLE_EQ(e.wan.host_bandwidth_bits, 25e6);
  EXPECT_EQ(e.sites[0].worker_addresses, std::vector<std::string>{"10.0.0.2:7000"});
  const Config again = parse_config(to_toml(e), "again");
  EXPECT_EQ(again.wan.mode, "every_worker");
  EXPECT_DOUBLE_EQ(again.wan.host_bandwidth_bits, 25e6);
  EXPECT_EQ(again.sites[0].worker_addresses, e.sites[0].worker_addresses);
  // What it does not run, by key; addresses that do not fit the workers; an unknown mode.
  const std::string every = std::string(kValid) + "\n[strategy]\nkind = \"diloco\"\n";
  expect_error(std::string(kValid), {"wan.mode", "every_worker", "sync"}, {"wan.mode=\"every_worker\""});
  expect_error(every, {"wan.mode", "job.elastic"}, {"wan.mode=\"every_worker\"", "job.elastic=true"});
  expect_error(every, {"wan.mode", "powersgd"}, {"wan.mode=\"every_worker\"", "strategy.codec=\"powersgd\""});
  expect_error(every, {"wan.mode", "auto"}, {"wan.mode=\"every_worker\"", "strategy.codec=\"auto\""});
  expect_error(every, {"wan.mode", "[privacy]"}, {"wan.mode=\"every_worker\"", "privacy.clip=1.0"});
  expect_error(every, {"sites[0].worker_addresses", "2 workers and 2 worker addresses", "ranks 1 .. 1"},
               {"wan.mode=\"every_worker\"", "sites.0.worker_addresses=[\"a:1\", \"a:2\"]"});
  expect_error(every, {"sites[0].worker_addresses", "every_worker"}, {"sites.0.worker_addresses=[\"a:1\"]"});
  expect_error(every, {"wan.mode", "all_workers"}, {"wan.mode=\"all_workers\""});
  // One certificate per host: with every_worker only, and read from `certs`.
  EXPECT_TRUE(parse_config(every, "job.toml", {"wan.mode=\"every_worker\"", "security.host_certs=true"}).security.host_certs);
  expect_error(every, {"security.host_certs", "every_worker"}, {"security.host_certs=true"});
}

// Every job config shipped under examples/ (found by walking the tree, so a new one is
// covered without being listed here) loads. The planner's inputs (plan_*.toml, read by
// `nebula plan`, not `nebula run`) are another format: plan_test.cc loads them.
TEST(Config, ExamplesLoad) {
  const std::filesystem::path root = std::filesystem::path(NEBULA_SOURCE_DIR) / "examples";
  std::vector<std::string> loaded;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(root)) {
    if (!entry.is_regular_file() || entry.path().extension() != ".toml") continue;
    const std::string name = std::filesystem::relative(entry.path(), root).string();
    if (entry.path().filename().string().rfind("plan_", 0) == 0) continue;
    try {
      Config c = load_config(entry.path().string());
      EXPECT_GE(c.sites.size(), 1u) << name;
      loaded.push_back(name);
    } catch (const std::exception& e) {
      ADD_FAILURE() << "examples/" << name << " does not load: " << e.what();
    }
  }
  std::sort(loaded.begin(), loaded.end());
  // The walk found the examples (not an empty or wrong directory): the two the README starts with, at least.
  EXPECT_TRUE(std::binary_search(loaded.begin(), loaded.end(), "smoke.toml"));
  EXPECT_TRUE(std::binary_search(loaded.begin(), loaded.end(), "demo.toml"));
  EXPECT_GE(loaded.size(), 8u);
}

TEST(Config, UnknownKeyNamesFileLineAndKey) {
  expect_error(replace_once(kValid, "steps = 7", "stepz = 7"), {"job.toml:4:", "job.stepz", "unknown key"});
  expect_error(std::string(kValid) + "\n[extra]\nx = 1\n", {"'extra'", "unknown key"});
}

TEST(Config, WrongTypeNamesKey) {
  expect_error(replace_once(kValid, "steps = 7", "steps = \"7\""), {"job.toml:4:9", "job.steps", "expected an integer"});
  expect_error(replace_once(kValid, "languages = [\"de\"]", "languages = \"de\""), {"data.languages", "array of strings"});
  expect_error(replace_once(kValid, "dim = 32", "dim = 33"), {"divisible by heads"});
  expect_error(replace_once(kValid, "workers = 2", "workers = 0"), {"sites[0].workers", "out of range"});
}

TEST(Config, BadUnitsNameKeyAndText) {
  expect_error(replace_once(kValid, "\"50Mbit\"", "\"50Mbits\""), {"job.toml:22:", "wan.bandwidth", "\"50Mbits\""});
  expect_error(replace_once(kValid, "\"80ms\"", "\"80\""), {"wan.rtt", "\"80\""});
  expect_error(replace_once(kValid, "\"5s\"", "5"), {"job.timeout", "expected a string with a unit"});
}

TEST(Config, StructuralMistakes) {
  expect_error("[job]\nname = \"x\"\n[security]\ninsecure = true\n", {"no [[sites]]"});
  expect_error(replace_once(kValid, "name = \"b\"", "name = \"a\""), {"'a' is used twice"});
  expect_error("[job\n", {"job.toml:1"});  // TOML syntax error
}

TEST(Config, WanPairsAndFaults) {
  std::string text = std::string(kValid) + R"(
[[wan.pairs]]
sites = ["b", "a"]
bandwidth = "10Mbit"
rtt = "200ms"
jitter = "5ms"

[[wan.faults]]
kind = "cut"
after = "10MiB"

[[wan.faults]]
kind = "stall"
sites = ["a", "b"]
at = "3s"
duration = "500ms"
)";
  Config c = parse_config(text, "job.toml");
  EXPECT_DOUBLE_EQ(c.wan.path_between("a", "b").bandwidth_bits, 10e6);
  EXPECT_EQ(c.wan.path_between("a", "b").rtt, std::chrono::milliseconds(200));
  EXPECT_EQ(c.wan.path_between("a", "b").jitter, std::chrono::milliseconds(5));
  ASSERT_EQ(c.wan.faults.size(), 2u);
  EXPECT_EQ(*c.wan.faults[0].after_bytes, 10u << 20);
  EXPECT_EQ(c.wan.faults[1].duration, std::chrono::milliseconds(500));
  Config round = parse_config(to_toml(c), "resolved.toml");
  EXPECT_EQ(round.wan.faults.size(), 2u);
  EXPECT_EQ(round.wan.pairs.size(), 1u);

  expect_error(std::string(kValid) + "[[wan.pairs]]\nsites = [\"a\", \"zeta\"]\n", {"wan.pairs[0].sites", "'zeta'"});
  expect_error(std::string(kValid) + "[[wan.faults]]\nkind = \"cut\"\n", {"exactly one of at"});
  expect_error(std::string(kValid) + "[[wan.faults]]\nkind = \"melt\"\nat = \"1s\"\n", {"wan.faults[0].kind", "melt"});
  expect_error(std::string(kValid) + "[[wan.faults]]\nkind = \"stall\"\nat = \"1s\"\n", {"needs duration"});
  // A repeating cut: `every` alone places the first one too.
  Config rep = parse_config(std::string(kValid) + "[[wan.faults]]\nkind = \"cut\"\nevery = \"2s\"\n", "job.toml");
  ASSERT_EQ(rep.wan.faults.size(), 1u);
  EXPECT_EQ(*rep.wan.faults[0].every, std::chrono::seconds(2));
  EXPECT_EQ(*rep.wan.faults[0].at, std::chrono::seconds(2));
  EXPECT_EQ(*parse_config(to_toml(rep), "again").wan.faults[0].every, std::chrono::seconds(2));
  expect_error(std::string(kValid) + "[[wan.faults]]\nkind = \"stall\"\nevery = \"2s\"\nduration = \"1s\"\n",
               {"wan.faults[0].every", "only a cut repeats"});
  expect_error(std::string(kValid) + "[[wan.faults]]\nkind = \"cut\"\nevery = \"0s\"\n", {"every", "positive"});
}

// [4/5]: liveness and the wire's frame limit. The liveness timeout must let a piece of a
// message cross the slowest emulated path four times over; the error says how long it must be.
TEST(Config, LivenessTimeoutAndMaxFrameAreValidated) {
  Config c = parse_config(kValid, "job.toml");
  EXPECT_EQ(c.wan.liveness_timeout, std::chrono::seconds(20));
  EXPECT_EQ(c.wan.max_frame, 4u << 20);
  EXPECT_EQ(c.wan.piece_bytes(), 256u * 1024);
  Config off = parse_config(kValid, "job.toml", {"wan.liveness_timeout=0s", "wan.max_frame=128KiB"});
  EXPECT_EQ(off.wan.liveness_timeout.count(), 0);
  EXPECT_EQ(off.wan.piece_bytes(), 64u * 1024);
  EXPECT_EQ(parse_config(to_toml(off), "again").wan.liveness_timeout.count(), 0);
  Config blackhole = parse_config(std::string(kValid) + "[[wan.faults]]\nkind = \"blackhole\"\nat = \"2s\"\n", "job.toml");
  EXPECT_EQ(blackhole.wan.faults.at(0).kind, "blackhole");
  expect_error(kValid, {"wan.max_frame", "at least 64KiB"}, {"wan.max_frame=1KiB"});
  expect_error(kValid, {"wan.liveness_timeout", "at least \"100ms\""}, {"wan.liveness_timeout=10ms"});
  // 256 KiB over 1 Mbit/s is 2.1 s: 20 s is too short for four of them plus the round trips.
  expect_error(kValid, {"wan.liveness_timeout", "too short for the default path", "at least 9s"},
               {"wan.bandwidth=1Mbit", "wan.liveness_timeout=5s"});
  EXPECT_NO_THROW(parse_config(kValid, "job.toml", {"wan.bandwidth=1Mbit", "wan.liveness_timeout=10s"}));
  Config allow = parse_config(kValid, "job.toml", {"wan.allow=[\"10.0.0.0/8\", \"2001:db8::/32\"]"});
  EXPECT_EQ(allow.wan.allow, (std::vector<std::string>{"10.0.0.0/8", "2001:db8::/32"}));
  EXPECT_EQ(parse_config(to_toml(allow), "again").wan.allow, allow.wan.allow);
}

TEST(Config, OverridesApplyAndAreValidated) {
  Config c = parse_config(kValid, "job.toml", {"job.steps=3", "data.source=tsv", "sites.1.workers=4"});
  EXPECT_EQ(c.job.steps, 3);
  EXPECT_EQ(c.data.source, "tsv");
  EXPECT_EQ(c.sites[1].workers, 4);
  expect_error(kValid, {"--set job.steps=many", "job.steps"}, {"job.steps=many"});
  expect_error(kValid, {"--set nonsense"}, {"nonsense"});
  expect_error(kValid, {"sites.9.workers", "out of range"}, {"sites.9.workers=1"});
}

// The [strategy] keys of issue [4/7] and [peft]: ranges, combinations, and PEFT checked
// against the model at load time (not only when a worker starts).
TEST(Config, StrategyAndPeftKeysAreValidated) {
  Config c = parse_config(kValid, "job.toml",
                          {"strategy.kind=diloco", "strategy.codec=sparseloco", "strategy.inner_steps=20",
                           "peft.kind=lora", "peft.rank=4"});
  EXPECT_EQ(c.strategy.kind, "diloco");
  EXPECT_EQ(c.strategy.inner_steps, 20);
  EXPECT_EQ(c.peft.rank, 4);
  auto error_of = [](std::vector<std::string> sets) {
    try {
      parse_config(kValid, "job.toml", sets);
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of({"strategy.codec=auto"}).find("needs kind = \"diloco\" or \"streaming\""), std::string::npos);
  EXPECT_NE(error_of({"strategy.kind=streaming", "strategy.inner_steps=10", "strategy.delay=10"}).find("'strategy.delay'"),
            std::string::npos);
  EXPECT_NE(error_of({"strategy.kind=gossip"}).find("'strategy.kind'"), std::string::npos);
  const std::string rank = error_of({"peft.kind=lora", "peft.rank=200"});
  EXPECT_NE(rank.find("job.toml"), std::string::npos) << rank;
  EXPECT_NE(rank.find("'peft.rank'"), std::string::npos) << rank;
  EXPECT_NE(error_of({"sites.0.slowdown=0.5"}).find("slowdown"), std::string::npos);
  EXPECT_NE(error_of({"strategy.max_update_norm=-1"}).find("'strategy.max_update_norm'"), std::string::npos);
  EXPECT_EQ(parse_config(to_toml(parse_config(kValid, "job.toml", {"strategy.max_update_norm=50"})), "r.toml")
                .strategy.max_update_norm,
            50);
  EXPECT_NE(error_of({"strategy.codec_value_bits=3"}).find("'strategy.codec_value_bits'"), std::string::npos);
  EXPECT_EQ(parse_config(to_toml(parse_config(kValid, "job.toml", {"strategy.codec_value_bits=1"})), "r.toml")
                .strategy.codec_value_bits,
            1);
  // Watching quality: diloco only, with something left to choose, and kept by the dump.
  const std::string streaming = error_of({"strategy.kind=streaming", "strategy.codec=auto", "strategy.max_loss_penalty=0.02"});
  EXPECT_NE(streaming.find("'strategy.max_loss_penalty'"), std::string::npos) << streaming;
  EXPECT_NE(streaming.find("needs kind = \"diloco\""), std::string::npos) << streaming;
  const std::string pinned = error_of({"strategy.kind=diloco", "strategy.codec=int4", "strategy.max_loss_penalty=0.02"});
  EXPECT_NE(pinned.find("nothing to choose"), std::string::npos) << pinned;
  EXPECT_NE(error_of({"strategy.kind=diloco", "strategy.codec=auto", "strategy.max_loss_penalty=1.5"}).find(
                "'strategy.max_loss_penalty'"),
            std::string::npos);
  EXPECT_EQ(error_of({"strategy.kind=diloco", "strategy.inner_steps=0", "strategy.max_loss_penalty=0.02"}), "no error");
  EXPECT_EQ(parse_config(to_toml(parse_config(kValid, "job.toml",
                                              {"strategy.kind=diloco", "strategy.codec=auto", "strategy.max_loss_penalty=0.02"})),
                         "r.toml")
                .strategy.max_loss_penalty,
            0.02);
}

// Issue [5/7]: the translation model, distillation and evaluation keys.
TEST(Config, TranslationAndDistillKeysAreValidated) {
  const std::vector<std::string> mt = {"model.kind=seq2seq", "sites.0.workers=1", "sites.1.shareable=true",
                                       "distill.teacher_site=a", "distill.teacher=t.safetensors"};
  Config c = parse_config(kValid, "job.toml", mt);
  EXPECT_TRUE(c.distill.enabled());
  EXPECT_EQ(c.distill.top_k, 8);
  EXPECT_TRUE(c.sites[1].shareable);
  Config round = parse_config(to_toml(c), "resolved.toml");
  EXPECT_EQ(round.distill.teacher, "t.safetensors");
  EXPECT_TRUE(round.sites[1].shareable);
  EXPECT_EQ(round.model.kind, "seq2seq");

  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> all = mt;
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  };
  expect_error(kValid, {"student site 'b'", "shareable = true"},
               with({"sites.1.shareable=false"}));
  expect_error(kValid, {"'distill.teacher_site'", "no site named 'zeta'"}, with({"distill.teacher_site=zeta"}));
  expect_error(kValid, {"'distill.teacher'", "safetensors"}, with({"distill.teacher=\"\""}));
  expect_error(kValid, {"workers = 2", "one worker"}, with({"sites.0.workers=2"}));
  expect_error(kValid, {"seq2seq"}, {"distill.teacher_site=a", "distill.teacher=t"});
  expect_error(kValid, {"'distill.top_k'", "vocab_size"}, with({"distill.top_k=5000"}));
  expect_error(kValid, {"'distill.alpha'"}, with({"distill.alpha=1.5"}));
  // A translation model has one target language.
  expect_error(kValid, {"one language", "de", "fr"}, {"model.kind=seq2seq", "sites.1.languages=[\"fr\"]"});
  // A pre-trained encoder starts an mlm_encoder, a seq2seq or a classifier; not a TorchScript module.
  EXPECT_EQ(parse_config(kValid, "job.toml", {"model.init=\"m.safetensors\""}).model.init, "m.safetensors");
  expect_error(kValid, {"'model.init'", "TorchScript"}, {"model.kind=torchscript", "model.script=\"m.pt\"",
                                                         "data.source=tensors", "model.init=\"m.safetensors\""});
  // PEFT on a translation model: LoRA or adapters (in the encoder and the decoder); not on a
  // classifier.
  EXPECT_EQ(parse_config(kValid, "job.toml", with({"peft.kind=lora", "peft.rank=4"})).peft.kind, "lora");
  EXPECT_EQ(parse_config(kValid, "job.toml", with({"peft.kind=adapter"})).peft.kind, "adapter");
  expect_error(kValid, {"'data.objective'"}, {"data.objective=\"clm\""});
  expect_error(kValid, {"leaves nothing to train on"}, {"data.valid_fraction=0.5", "data.test_fraction=0.5"});
  expect_error(kValid, {"'eval.beam'"}, {"eval.beam=0"});
  expect_error(kValid, {"'eval.length_penalty'"}, {"eval.length_penalty=-1"});
  EXPECT_EQ(parse_config(to_toml(parse_config(kValid, "job.toml", {"eval.length_penalty=1.2"})), "resolved.toml")
                .eval.length_penalty,
            1.2);
}

// [5/5]: the training recipe's keys (schedule, clipping, label smoothing, the contrastive
// objective) round-trip and bad values name the key.
TEST(Config, RecipeKeysAreValidated) {
  Config c = parse_config(kValid, "job.toml",
                          {"model.lr_schedule=\"cosine\"", "model.warmup_steps=100", "model.lr_floor=0.05",
                           "model.clip_norm=1.0", "data.contrastive_weight=0.5", "data.contrastive_batch=24",
                           "data.contrastive_temperature=0.1"});
  Config round = parse_config(to_toml(c), "resolved.toml");
  EXPECT_EQ(round.model.lr_schedule, "cosine");
  EXPECT_EQ(round.model.warmup_steps, 100);
  EXPECT_DOUBLE_EQ(round.model.lr_floor, 0.05);
  EXPECT_DOUBLE_EQ(round.model.clip_norm, 1.0);
  EXPECT_DOUBLE_EQ(round.data.contrastive_weight, 0.5);
  EXPECT_EQ(round.data.contrastive_batch, 24);
  EXPECT_DOUBLE_EQ(round.data.contrastive_temperature, 0.1);
  EXPECT_NE(training_fingerprint(c), training_fingerprint(parse_config(kValid, "job.toml")));
  Config mt = parse_config(kValid, "job.toml", {"model.kind=seq2seq", "model.label_smoothing=0.1"});
  EXPECT_DOUBLE_EQ(mt.model.label_smoothing, 0.1);

  expect_error(kValid, {"'model.lr_schedule'", "cosine"}, {"model.lr_schedule=\"step\""});
  expect_error(kValid, {"'model.lr_floor'"}, {"model.lr_floor=2"});
  expect_error(kValid, {"'model.clip_norm'"}, {"model.clip_norm=-1"});
  expect_error(kValid, {"'model.warmup_steps'"}, {"model.warmup_steps=-5"});
  expect_error(kValid, {"'model.label_smoothing'", "seq2seq"}, {"model.label_smoothing=0.1"});
  expect_error(kValid, {"'data.contrastive_weight'", "mlm_encoder"}, {"model.kind=seq2seq", "data.contrastive_weight=1"});
  expect_error(kValid, {"'data.contrastive_batch'"}, {"data.contrastive_batch=1"});
  expect_error(kValid, {"'data.contrastive_temperature'"}, {"data.contrastive_temperature=0"});
}

// [1/5] review: the vocabulary is trained on one site's data or a shareable file.
TEST(Config, TokenizerSiteNamesASiteOrTheCorpusIsGivenInstead) {
  Config c = parse_config(kValid, "job.toml", {"data.tokenizer_site=b"});
  EXPECT_EQ(c.data.tokenizer_site, "b");
  EXPECT_EQ(parse_config(to_toml(c), "resolved.toml").data.tokenizer_site, "b");
  c = parse_config(kValid, "job.toml", {"data.tokenizer_corpus=\"shared.txt\""});
  EXPECT_EQ(parse_config(to_toml(c), "resolved.toml").data.tokenizer_corpus, "shared.txt");
  EXPECT_TRUE(parse_config(kValid, "job.toml").data.tokenizer_site.empty());  // default: see site_data.h
  expect_error(kValid, {"--set data.tokenizer_site=zeta", "'data.tokenizer_site'", "no site named 'zeta'", "'a', 'b'"},
               {"data.tokenizer_site=zeta"});
  expect_error(replace_once(kValid, "languages = [\"de\"]", "languages = [\"de\"]\ntokenizer_site = \"c\""),
               {"job.toml:13:", "'data.tokenizer_site'", "'c'"});
  expect_error(kValid, {"'data.tokenizer_corpus'", "not both"},
               {"data.tokenizer_site=a", "data.tokenizer_corpus=\"shared.txt\""});
}

// [7/7]: a site's device.
TEST(Config, SiteDevicesAreCpuCudaOrCudaN) {
  for (const char* ok : {"cpu", "cuda", "cuda:0", "cuda:12"})
    EXPECT_EQ(parse_config(kValid, "job.toml", {str_cat("sites.1.device=\"", ok, "\"")}).sites[1].device, ok);
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:1a", "CUDA", "cuda:123456"}) {
    const std::string says = str_cat("\"", bad, "\" is not a device");
    expect_error(kValid, {"'sites[1].device'", says.c_str()}, {str_cat("sites.1.device=\"", bad, "\"")});
  }
  expect_error(kValid, {"'model.kind'", "site 'b' has device = \"cuda\"", "CPU only"},
               {"model.kind=seq2seq", "sites.1.device=\"cuda\""});
  // A device is not part of what a checkpoint must match: a CPU checkpoint resumes on a GPU.
  EXPECT_EQ(training_fingerprint(parse_config(kValid, "job.toml")),
            training_fingerprint(parse_config(kValid, "job.toml", {"sites.1.device=\"cuda\""})));
}

// [7/7]: a TorchScript model on tensor files; the two go together.
TEST(Config, TorchScriptKeysAreValidated) {
  const std::vector<std::string> ts = {"model.kind=torchscript", "model.script=\"m.pt\"", "data.source=tensors",
                                       "data.path=\"shards\""};
  Config c = parse_config(kValid, "job.toml", ts);
  EXPECT_EQ(c.model.loss, "output");
  Config round = parse_config(to_toml(c), "resolved.toml");
  EXPECT_EQ(round.model.script, "m.pt");
  EXPECT_EQ(round.data.source, "tensors");
  EXPECT_NE(training_fingerprint(c), training_fingerprint(parse_config(kValid, "job.toml", {
      "model.kind=torchscript", "model.script=\"m.pt\"", "data.source=tensors", "data.path=\"shards\"",
      "model.loss=cross_entropy"})));
  expect_error(kValid, {"'model.script'", "torch.jit.save"}, {"model.kind=torchscript", "data.source=tensors"});
  expect_error(kValid, {"'model.script'", "kind = \"torchscript\""}, {"model.script=\"m.pt\""});
  expect_error(kValid, {"'model.loss'", "cross_entropy"}, {"model.loss=\"nll\""});
  expect_error(kValid, {"'data.source'", "\"gettext\" with model.kind \"torchscript\""},
               {"model.kind=torchscript", "model.script=\"m.pt\""});
  expect_error(kValid, {"'data.source'", "\"tensors\" with model.kind \"mlm_encoder\""}, {"data.source=tensors"});
  expect_error(kValid, {"'peft.kind'", "torchscript"}, {"model.kind=torchscript", "model.script=\"m.pt\"",
                                                       "data.source=tensors", "peft.kind=lora"});
}

// [6/7]: differential privacy of the diloco/streaming updates.
TEST(Config, PrivacyKeysAreValidated) {
  Config c = parse_config(kValid, "job.toml",
                          {"strategy.kind=diloco", "privacy.clip=1.5", "privacy.noise_multiplier=0.8"});
  EXPECT_TRUE(c.privacy.enabled());
  Config round = parse_config(to_toml(c), "resolved.toml");
  EXPECT_DOUBLE_EQ(round.privacy.clip, 1.5);
  EXPECT_DOUBLE_EQ(round.privacy.noise_multiplier, 0.8);
  EXPECT_DOUBLE_EQ(round.privacy.delta, 1e-5);
  expect_error(kValid, {"'privacy.clip'", "diloco"}, {"privacy.clip=1"});
  expect_error(kValid, {"'privacy.noise_multiplier'", "clip > 0"}, {"strategy.kind=diloco", "privacy.noise_multiplier=1"});
  expect_error(kValid, {"'privacy.delta'"}, {"strategy.kind=diloco", "privacy.clip=1", "privacy.delta=1"});
}

// [6/7] hostile input: every config mistake is one ConfigError that names the file, the line
// of the offending key (or of its table when the key is absent) and the key itself. The line
// is found from `marker`, a fragment of the offending line, so the cases stay readable.
struct BadConfig {
  const char* what;
  std::string text;
  const char* marker;  // a fragment of the line the error must point at
  const char* key;     // the key the error must name, as written in messages: 'key'
  const char* says;    // a fragment of the explanation
};

std::string with_appended(const std::string& extra) { return std::string(kValid) + extra; }

std::vector<BadConfig> bad_configs() {
  const std::string seq2seq = replace_once(replace_once(kValid, "dim = 32", "kind = \"seq2seq\"\ndim = 32"),
                                           "workers = 2", "workers = 1");
  return {
      {"unknown key", replace_once(kValid, "steps = 7", "stepz = 7"), "stepz", "job.stepz", "unknown key"},
      {"unknown key in a site", replace_once(kValid, "workers = 2", "gpus = 2"), "gpus", "sites[0].gpus",
       "unknown key"},
      {"unknown table", with_appended("[extra]\nx = 1\n"), "[extra]", "extra", "unknown key"},
      {"wrong type", replace_once(kValid, "steps = 7", "steps = \"7\""), "steps", "job.steps", "expected an integer"},
      {"wrong type (bool)", replace_once(kValid, "insecure = true", "insecure = \"yes\""), "insecure",
       "security.insecure", "expected true or false"},
      {"negative steps", replace_once(kValid, "steps = 7", "steps = -5"), "steps", "job.steps", "out of range"},
      {"zero workers", replace_once(kValid, "workers = 2", "workers = 0"), "workers", "sites[0].workers",
       "out of range"},
      {"zero streams", replace_once(kValid, "rtt = \"80ms\"", "rtt = \"80ms\"\nstreams = 0"),
       "streams", "wan.streams", "out of range"},
      {"bandwidth unit", replace_once(kValid, "\"50Mbit\"", "\"50Mbits\""), "bandwidth", "wan.bandwidth",
       "\"50Mbits\""},
      {"bandwidth without unit", replace_once(kValid, "\"50Mbit\"", "50"), "bandwidth", "wan.bandwidth",
       "expected a string with a unit"},
      {"bandwidth negative", replace_once(kValid, "\"50Mbit\"", "\"-5Mbit\""), "bandwidth", "wan.bandwidth",
       "-5Mbit"},
      {"max_frame unit", replace_once(kValid, "rtt = \"80ms\"", "rtt = \"80ms\"\nmax_frame = \"4 parsecs\""),
       "max_frame", "wan.max_frame", "4 parsecs"},
      {"duplicate site", replace_once(kValid, "name = \"b\"", "name = \"a\""), "name = \"a\"\n\n[wan", "sites[1].name",
       "used twice"},
      {"site without a name", replace_once(kValid, "name = \"b\"", "workers = 1"), "[[sites]]\nworkers = 1",
       "sites[1].name",
       "needs a name"},
      {"site name with a slash", replace_once(kValid, "name = \"b\"", "name = \"../b\""), "../b", "sites[1].name",
       "not a valid site name"},
      {"unknown strategy kind", with_appended("[strategy]\nkind = \"gossip\"\n"), "gossip", "strategy.kind",
       "\"gossip\" is not one of"},
      {"unknown codec", with_appended("[strategy]\ncodec = \"int9\"\n"), "int9", "strategy.codec",
       "\"int9\" is not one of"},
      {"distill names a missing site", seq2seq + "[distill]\nteacher_site = \"zeta\"\nteacher = \"t.safetensors\"\n",
       "zeta", "distill.teacher_site", "no site named 'zeta'"},
      {"unknown fault kind", with_appended("[[wan.faults]]\nkind = \"melt\"\nat = \"1s\"\n"), "melt",
       "wan.faults[0].kind", "\"melt\" is not one of"},
      {"fault without kind", with_appended("[[wan.faults]]\nat = \"1s\"\n"), "[[wan.faults]]", "wan.faults[0].kind",
       "needs kind"},
      {"fault names a missing site", with_appended("[[wan.faults]]\nkind = \"cut\"\nat = \"1s\"\nsites = [\"a\", \"q\"]\n"),
       "[[wan.faults]]", "wan.faults[0].sites", "no site named 'q'"},
      {"dim not divisible by heads", replace_once(kValid, "dim = 32", "dim = 33"), "dim = 33", "model.dim",
       "divisible by heads"},
      {"fractions leave nothing", replace_once(kValid, "languages = [\"de\"]",
                                               "languages = [\"de\"]\nvalid_fraction = 0.5\ntest_fraction = 0.5"),
       "test_fraction", "data.test_fraction", "nothing to train on"},
      {"lora rank above the model", with_appended("[peft]\nkind = \"lora\"\nrank = 64\n"), "[peft]", "peft.rank",
       "out of range"},
      {"privacy with sync", with_appended("[privacy]\nclip = 1.0\n"), "[privacy]", "privacy.clip", "diloco"},
  };
}

// 1-based line of the first occurrence of `marker` in `text`.
int line_of(const std::string& text, const std::string& marker) {
  const size_t pos = text.find(marker);
  EXPECT_NE(pos, std::string::npos) << marker;
  return 1 + static_cast<int>(std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(pos), '\n'));
}

TEST(Config, EveryMistakeNamesFileLineAndKey) {
  for (const BadConfig& b : bad_configs()) {
    SCOPED_TRACE(b.what);
    const std::string where = "job.toml:" + std::to_string(line_of(b.text, b.marker)) + ":";
    const std::string key = std::string("'") + b.key + "'";
    try {
      parse_config(b.text, "job.toml");
      ADD_FAILURE() << "no ConfigError for:\n" << b.text;
    } catch (const ConfigError& e) {
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind(where, 0), 0u) << "does not start with " << where << ": " << msg;
      EXPECT_NE(msg.find(key), std::string::npos) << "does not name " << key << ": " << msg;
      EXPECT_NE(msg.find(b.says), std::string::npos) << "does not say " << b.says << ": " << msg;
      EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
    }
  }
}

// The same mistakes made with --set name the override instead of a line of the file.
TEST(Config, MistakesInOverridesNameTheOverrideAndKey) {
  const std::vector<std::pair<std::string, const char*>> cases = {
      {"job.steps=-1", "'job.steps'"},
      {"sites.0.workers=0", "'sites[0].workers'"},
      {"wan.bandwidth=\"9 furlongs\"", "'wan.bandwidth'"},
      {"strategy.codec=int9", "'strategy.codec'"},
      {"sites.1.name=a", "'sites[1].name'"},
  };
  for (const auto& [set, key] : cases) {
    try {
      parse_config(kValid, "job.toml", {set});
      ADD_FAILURE() << "no ConfigError for --set " << set;
    } catch (const ConfigError& e) {
      EXPECT_EQ(std::string(e.what()).rfind("--set " + set, 0), 0u) << e.what();
      EXPECT_NE(std::string(e.what()).find(key), std::string::npos) << e.what();
    }
  }
}

TEST(Config, RoundTripsThroughToml) {
  Config a = parse_config(kValid, "job.toml");
  Config b = parse_config(to_toml(a), "resolved.toml");
  EXPECT_EQ(b.job.steps, a.job.steps);
  EXPECT_EQ(b.job.timeout, a.job.timeout);
  EXPECT_EQ(b.wan.path.rtt, a.wan.path.rtt);
  EXPECT_DOUBLE_EQ(b.wan.path.bandwidth_bits, a.wan.path.bandwidth_bits);
  EXPECT_EQ(b.sites.size(), a.sites.size());
  EXPECT_EQ(b.data.languages, a.data.languages);
  EXPECT_EQ(b.model.dim, a.model.dim);
  EXPECT_EQ(b.data.test_fraction, a.data.test_fraction);
  EXPECT_EQ(b.data.objective, a.data.objective);
  EXPECT_EQ(b.eval.pairs, a.eval.pairs);
}

}  // namespace
}  // namespace nebula
