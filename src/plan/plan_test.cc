#include "plan/plan.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <set>

#include "nebula/error.h"
#include "nebula/units.h"
#include "util/config_testing.h"

namespace nebula::plan {
namespace {

// Two sites of one worker; each worker computes a step in exactly 1 s; 1e6 parameters (4 MB of
// gradient); the WAN moves 1e6 bytes/s with a 100 ms round trip; nothing overlaps.
const char* kTwo = R"(
[model]
parameters = 1000000
tokens_per_step_per_worker = 1000

[[sites]]
name = "a"
tokens_per_second_per_worker = 1000

[[sites]]
name = "b"
tokens_per_second_per_worker = 1000

[wan]
bandwidth = "8Mbit"
rtt = "100ms"

[planner]
overlap = 0
)";

Topology two(const std::vector<std::string>& overrides = {}) { return parse_topology(kTwo, "two.toml", overrides); }

Prediction run(const Topology& t, const std::string& strategy, const std::string& codec, int64_t h = 1,
               int64_t f = 1, int64_t delay = 0) {
  return predict(t, Candidate{strategy, codec, h, f, delay});
}

void expect_error(const std::string& text, std::initializer_list<const char*> fragments,
                  const std::vector<std::string>& overrides = {}) {
  nebula::testing::expect_config_error([&] { parse_topology(text, "topo.toml", overrides); }, text, fragments);
}

using nebula::testing::replace_once;

TEST(Plan, OneSiteFreeCommunicationIsExactlyCompute) {
  // One site of 64 workers, infinite LAN bandwidth, zero latency: nothing to wait for.
  Topology t = parse_topology(R"(
[model]
parameters = 1e9
tokens_per_step_per_worker = 2048
[[sites]]
name = "only"
workers = 64
worker_flops = "100T"
lan_bandwidth = "0"
lan_latency = "0s"
[wan]
bandwidth = "1Mbit"
rtt = "300ms"
)",
                              "one.toml");
  const double compute = 2048 * 6e9 / 1e14;  // tokens × 6·parameters / FLOP/s
  auto candidates = enumerate_candidates(t);
  ASSERT_EQ(candidates.size(), 6u + 7 * 4 + 7 * 4);
  for (const auto& c : candidates) {
    Prediction p = predict(t, c);
    EXPECT_DOUBLE_EQ(p.compute_s, compute);
    EXPECT_EQ(p.step_s, p.compute_s) << c.strategy << "/" << c.codec;
    EXPECT_EQ(p.utilization, 1.0) << c.strategy << "/" << c.codec;
    EXPECT_EQ(p.wan_bytes_per_step, 0.0) << c.strategy << "/" << c.codec;
    EXPECT_EQ(p.lan_s, 0.0);
    EXPECT_DOUBLE_EQ(p.tokens_per_s, 64 * 2048 / compute);
  }
  Plan plan = make_plan(t);
  EXPECT_EQ(plan.predictions[*plan.recommended].candidate.strategy, "sync");  // all tie: least risk
  EXPECT_EQ(plan.predictions[*plan.recommended].candidate.codec, "none");
}

TEST(Plan, TwoSitesFreeWanIsExactlyCompute) {
  Topology t = two({"wan.bandwidth=\"0\"", "wan.rtt=\"0s\""});
  for (const auto& c : enumerate_candidates(t)) {
    Prediction p = predict(t, c);
    EXPECT_EQ(p.step_s, 1.0) << c.strategy << "/" << c.codec;
    EXPECT_EQ(p.utilization, 1.0);
    EXPECT_GT(p.wan_bytes_per_step, 0.0);  // the bytes still cross, they just take no time
  }
}

TEST(Plan, PayloadTable) {
  CodecParams p;
  EXPECT_EQ(payload_bytes("none", 1e6, p), 4e6);
  EXPECT_EQ(payload_bytes("fp16", 1e6, p), 2e6);
  EXPECT_EQ(payload_bytes("bf16", 1e6, p), 2e6);
  EXPECT_EQ(payload_bytes("int8", 1e6, p), 1e6 + 8 * 3907);     // ⌈1e6/256⌉ = 3907 blocks
  EXPECT_EQ(payload_bytes("int4", 1e6, p), 5e5 + 8 * 3907);
  EXPECT_EQ(payload_bytes("topk", 1e6, p), 8 * 10000);          // 1 %: u32 index + f32 value
  EXPECT_EQ(payload_bytes("powersgd", 1e6, p), 4e6 / 8);
  EXPECT_EQ(payload_bytes("sparseloco", 4096 * 1000, p), 64000 * 14 / 8 + 8 * 1000);  // 2 + 12 bits
  // Rice-coded indices: the expected gap code of random positions, 7.57 bits at 64 of 4096 (the
  // codec measures 7.56 on random data: CodecSparseLoco.RiceIndicesSendTheSameValuesInFewerBits).
  p.sparseloco_indices = "rice";
  const double rice_bits = (payload_bytes("sparseloco", 4096 * 1000, p) - 8 * 1000) * 8 / 64000 - 2;
  EXPECT_NEAR(rice_bits, 7.57, 0.01);
  p.sparseloco_density = 1.0;  // every value kept: r = 0, every gap 0, one bit each
  EXPECT_DOUBLE_EQ(payload_bytes("sparseloco", 4096 * 1000, p), 4096000 * 3 / 8.0 + 8 * 1000);
  p.sparseloco_density = 64.0 / 4096;
  p.sparseloco_indices = "fixed";
  p.sparseloco_value_bits = 1;  // 1-bit values: one level (4 bytes) a chunk, 1 + 12 bits a value
  EXPECT_EQ(payload_bytes("sparseloco", 4096 * 1000, p), 64000 * 13 / 8 + 4 * 1000);
  p.sparseloco_value_bits = 2;
  EXPECT_THROW(payload_bytes("int9", 1, p), Error);
}

TEST(Plan, TwoSitesSyncNone) {
  Topology t = two();
  Prediction p = run(t, "sync", "none");
  // 4e6 bytes at 1e6 B/s plus half the round trip, after 1 s of compute.
  EXPECT_DOUBLE_EQ(p.wan_exchange_s, 0.05 + 4.0);
  EXPECT_DOUBLE_EQ(p.step_s, 1 + 4.05);
  EXPECT_DOUBLE_EQ(p.wan_bytes_per_step, 2 * 1 * 4e6);
  EXPECT_DOUBLE_EQ(p.utilization, 1 / 5.05);
  EXPECT_DOUBLE_EQ(p.compression, 1.0);
  EXPECT_DOUBLE_EQ(p.tokens_per_s, 2 * 1000 / 5.05);
  // With two thirds of the compute hiding communication.
  Prediction o = run(two({"planner.overlap=0.6"}), "sync", "none");
  EXPECT_DOUBLE_EQ(o.step_s, 1 + (4.05 - 0.6));
}

TEST(Plan, TwoSitesDilocoInt4) {
  Prediction p = run(two(), "diloco", "int4", 50);
  const double payload = 500000 + 8 * 3907;  // 531,256 bytes
  EXPECT_DOUBLE_EQ(p.wan_exchange_s, 0.05 + payload / 1e6);
  EXPECT_DOUBLE_EQ(p.step_s, 1 + (0.05 + 0.531256) / 50);
  EXPECT_DOUBLE_EQ(p.wan_bytes_per_step, 2 * payload / 50);
  EXPECT_DOUBLE_EQ(p.utilization, 1 / 1.01162512);
  EXPECT_DOUBLE_EQ(p.compression, 4e6 / payload);
}

TEST(Plan, TwoSitesStreaming) {
  Topology t = two();
  // H=100, F=4, delay 5: a fragment (1e6 bytes) takes 1.05 s, hidden behind 5 s of steps.
  Prediction hidden = run(t, "streaming", "none", 100, 4, 5);
  EXPECT_DOUBLE_EQ(hidden.wan_exchange_s, 1.05);
  EXPECT_EQ(hidden.step_s, 1.0);
  EXPECT_EQ(hidden.utilization, 1.0);
  EXPECT_DOUBLE_EQ(hidden.wan_bytes_per_step, 2 * 4 * 1e6 / 100);
  // H=10, F=2, delay 1: a fragment (2e6 bytes) takes 2.05 s, 1 s hidden, 1.05 s stalls, twice
  // per 10 steps.
  Prediction stalls = run(t, "streaming", "none", 10, 2, 1);
  EXPECT_DOUBLE_EQ(stalls.step_s, 1 + 2 * 1.05 / 10);
  EXPECT_DOUBLE_EQ(stalls.wan_bytes_per_step, 2 * 2 * 2e6 / 10);
  // Bandwidth-bound: at 5e5 B/s, H=F=4, delay 3: each fragment hides (2.05 s <= 3 s), but the
  // uplink must carry 4 fragments of 2 s per 4 steps.
  Prediction bound = run(two({"wan.bandwidth=\"4Mbit\""}), "streaming", "none", 4, 4, 3);
  EXPECT_DOUBLE_EQ(bound.step_s, 2.0);
  EXPECT_DOUBLE_EQ(bound.utilization, 0.5);
  // F = 1 and no delay is exactly diloco.
  Prediction as_diloco = run(t, "streaming", "int8", 50, 1, 0);
  Prediction diloco = run(t, "diloco", "int8", 50);
  EXPECT_EQ(as_diloco.step_s, diloco.step_s);
  EXPECT_EQ(as_diloco.wan_bytes_per_step, diloco.wan_bytes_per_step);
}

TEST(Plan, LanAllReduceAndBroadcast) {
  // Four workers per site, 1e9 B/s and 10 us per ring hop.
  Topology t = two({"sites.0.workers=4", "sites.1.workers=4", "sites.0.lan_bandwidth=\"8Gbit\"",
                    "sites.1.lan_bandwidth=\"8Gbit\"", "sites.0.lan_latency=\"10us\"", "sites.1.lan_latency=\"10us\""});
  const double allreduce = 2 * 0.75 * 4e6 / 1e9 + 2 * 3 * 10e-6;
  const double broadcast = allreduce / 2;
  Prediction sync = run(t, "sync", "none");
  EXPECT_DOUBLE_EQ(sync.lan_s, allreduce);
  EXPECT_DOUBLE_EQ(sync.step_s, 1 + allreduce + 4.05);
  Prediction diloco = run(t, "diloco", "none", 10);
  EXPECT_DOUBLE_EQ(diloco.step_s, 1 + allreduce + (4.05 + broadcast) / 10);
  EXPECT_DOUBLE_EQ(diloco.utilization, 1 / diloco.step_s);
}

TEST(Plan, ThreeSitesSharedUplinkOrIndependentPairs) {
  std::string three = std::string(kTwo) + "\n[[sites]]\nname = \"c\"\ntokens_per_second_per_worker = 1000\n";
  Topology shared = parse_topology(three, "three.toml");
  Prediction p = run(shared, "sync", "none");
  EXPECT_DOUBLE_EQ(p.wan_exchange_s, 0.05 + 2 * 4.0);  // two copies through one uplink
  EXPECT_DOUBLE_EQ(p.wan_bytes_per_step, 3 * 2 * 4e6);
  Topology pairs = parse_topology(three, "three.toml", {"wan.shared_uplink=false"});
  EXPECT_DOUBLE_EQ(run(pairs, "sync", "none").wan_exchange_s, 0.05 + 4.0);
  // A slow pair paces the exchange.
  Topology slow = parse_topology(three + "[[wan.pairs]]\nsites = [\"a\", \"c\"]\nbandwidth = \"4Mbit\"\nrtt = \"300ms\"\n",
                                 "three.toml", {"wan.shared_uplink=false"});
  EXPECT_DOUBLE_EQ(run(slow, "sync", "none").wan_exchange_s, 0.15 + 8.0);
}

TEST(Plan, PeftSendsOnlyTrainable) {
  Prediction p = run(two({"model.trainable=1e5"}), "sync", "none");
  EXPECT_DOUBLE_EQ(p.wan_bytes_per_step, 2 * 4e5);
  EXPECT_DOUBLE_EQ(p.step_s, 1 + 0.05 + 0.4);
}

TEST(Plan, HeterogeneousSites) {
  // Site b computes twice as fast; communication is free.
  std::vector<std::string> o = {"sites.1.tokens_per_second_per_worker=2000", "wan.bandwidth=\"0\"", "wan.rtt=\"0s\""};
  Topology t = two(o);
  Prediction sync = run(t, "sync", "none");
  EXPECT_EQ(sync.step_s, 1.0);
  EXPECT_DOUBLE_EQ(sync.utilization, (1 + 0.5) / 2);  // b waits half of every step
  Prediction diloco = run(t, "diloco", "none", 10);
  EXPECT_DOUBLE_EQ(diloco.utilization, 1.0);          // b runs 20 inner steps per round
  EXPECT_DOUBLE_EQ(diloco.tokens_per_s, 1000 + 2000);
  o.push_back("planner.heterogeneous=false");
  EXPECT_DOUBLE_EQ(run(two(o), "diloco", "none", 10).utilization, 0.75);
}

TEST(Plan, RecommendsLeastRiskWithinTolerance) {
  Topology t = two({"candidates.strategies=[\"diloco\"]", "candidates.codecs=[\"none\", \"int4\"]",
                    "candidates.inner_steps=[50, 500]"});
  // U: none/50 0.925, none/500 0.9920, int4/50 0.9885, int4/500 0.9988 (the best). Within
  // 1 % of the best: none/500 and int4/500; none compresses less.
  Plan plan = make_plan(t);
  ASSERT_EQ(plan.predictions.size(), 4u);
  EXPECT_EQ(plan.predictions[0].candidate.codec, "int4");
  EXPECT_EQ(plan.predictions[0].candidate.inner_steps, 500);
  const Candidate& r = plan.predictions[*plan.recommended].candidate;
  EXPECT_EQ(r.codec, "none");
  EXPECT_EQ(r.inner_steps, 500);
  EXPECT_NE(plan.reason.find("within 1.0%"), std::string::npos) << plan.reason;
  // With no tolerance the best wins.
  Plan strict = make_plan(two({"candidates.strategies=[\"diloco\"]", "candidates.codecs=[\"none\", \"int4\"]",
                               "candidates.inner_steps=[50, 500]", "planner.tolerance=0.0"}));
  ASSERT_TRUE(strict.recommended);
  EXPECT_EQ(*strict.recommended, 0u);
  EXPECT_NE(format_table(t, plan).find("recommended: diloco/none H=500"), std::string::npos) << format_table(t, plan);
  auto j = nlohmann::json::parse(format_json(t, plan));
  EXPECT_EQ(j["recommended"]["codec"], "none");
  EXPECT_EQ(j["candidates"].size(), 4u);
}

TEST(Plan, CandidatesFollowTheJobConfigRules) {
  Topology t = two({"candidates.inner_steps=[4]", "candidates.fragments=[2, 8]", "candidates.delay=[0, 4]"});
  for (const auto& c : enumerate_candidates(t)) {
    EXPECT_FALSE(c.strategy == "sync" && c.codec == "sparseloco");
    if (c.strategy == "streaming") {
      EXPECT_EQ(c.fragments, 2);  // F = 8 > H and delay 4 >= H are left out
      EXPECT_EQ(c.delay, 0);
    }
  }
}

// (How long it takes is not asserted: tests do not depend on timing. ~0.2 s for its ~8,800
// candidates on this machine.)
TEST(Plan, Big8x512x70BIsFinite) {
  Topology t = load_topology(std::string(NEBULA_SOURCE_DIR) + "/examples/plan_8x512_70b.toml");
  Plan plan = make_plan(t);
  std::string table = format_table(t, plan);
  ASSERT_EQ(t.sites.size(), 8u);
  EXPECT_EQ(t.sites[0].workers, 512);
  EXPECT_EQ(t.parameters, 70e9);
  ASSERT_FALSE(plan.predictions.empty());
  for (const auto& p : plan.predictions) {
    EXPECT_TRUE(std::isfinite(p.step_s) && p.step_s > 0);
    EXPECT_TRUE(std::isfinite(p.wan_bytes_per_step) && p.wan_bytes_per_step > 0);
    EXPECT_TRUE(p.utilization > 0 && p.utilization <= 1);
  }
  
  EXPECT_NE(table.find("recommended: "), std::string::npos);
  // The demo's topology loads too.
  EXPECT_NO_THROW(make_plan(load_topology(std::string(NEBULA_SOURCE_DIR) + "/examples/plan_demo.toml")));
}

// One site of one worker, 1e6 parameters: nothing crosses a WAN and nothing is sharded.
const char* kOne = R"(
[model]
parameters = 1000000
tokens_per_step_per_worker = 1000
[[sites]]
name = "a"
tokens_per_second_per_worker = 1000
)";

TEST(PlanMemory, OneWorkerAdamW) {
  Topology t = parse_topology(kOne, "one.toml");
  // diloco: fp32 parameters 4 + gradients 4 + AdamW's two moments 8 bytes per parameter.
  Memory d = gateway_memory(t, 0, Candidate{"diloco", "none", 10});
  EXPECT_EQ(d.parameters, 4e6);
  EXPECT_EQ(d.gradients, 4e6);
  EXPECT_EQ(d.optimizer, 8e6);
  EXPECT_EQ(d.activations, 0);  // no shape given
  EXPECT_EQ(d.device(), 16e6);
  // Host: θ_global + outer momentum (8) + θ_local at send (4); no all-reduce buffer for one
  // worker, no codec state or exchange for one site.
  EXPECT_EQ(d.buffers, 0);
  EXPECT_EQ(d.outer, 12e6);
  EXPECT_EQ(d.codec_state, 0);
  EXPECT_EQ(d.exchange, 0);
  // sync: its hooks copy the gradients (4 more on the device) into a host buffer (4).
  Memory s = gateway_memory(t, 0, Candidate{"sync", "int8"});
  EXPECT_EQ(s.device(), 20e6);
  EXPECT_EQ(s.host(), 4e6);
  // PEFT: the frozen parameters need no gradients or optimizer state.
  Memory peft = gateway_memory(parse_topology(kOne, "one.toml", {"model.trainable=1e5"}), 0, Candidate{"diloco", "none", 10});
  EXPECT_EQ(peft.device(), 4e6 + 4e5 + 8e5);
  EXPECT_THROW(gateway_memory(t, 0, Candidate{"diloco", "none", 10, 1, 0, "zero4"}), Error);
}

TEST(PlanMemory, ZeroShardsInsideASite) {
  Topology t = parse_topology(kOne, "one.toml", {"sites.0.workers=4"});
  auto mem = [&](const std::string& shard) { return gateway_memory(t, 0, Candidate{"diloco", "none", 10, 1, 0, shard}); };
  EXPECT_EQ(mem("none").device(), 16e6);
  EXPECT_EQ(mem("optimizer").device(), 4e6 + 4e6 + 8e6 / 4);     // ZeRO-1
  EXPECT_EQ(mem("gradients").device(), 4e6 + 4e6 / 4 + 8e6 / 4);  // ZeRO-2: the gradients reduce-scattered in buckets
  EXPECT_EQ(mem("full").device(), 16e6 / 4);                      // ZeRO-3
  // Host: the flat all-reduce buffer (4 workers now) and the outer state shard along.
  EXPECT_EQ(mem("none").buffers, 4e6);
  EXPECT_EQ(mem("none").outer, 12e6);
  EXPECT_EQ(mem("optimizer").outer, 3e6);  // each worker keeps its part of the outer state
  EXPECT_EQ(mem("gradients").outer, 3e6);
  EXPECT_EQ(mem("gradients").buffers, 0);  // reduce-scattered bucket by bucket
  EXPECT_EQ(mem("optimizer").buffers, 4e6);
  EXPECT_EQ(mem("full").buffers, 1e6);
  EXPECT_EQ(mem("full").outer, 3e6);
  EXPECT_TRUE(runnable(Candidate{"diloco", "none", 10}));
  EXPECT_TRUE(runnable(Candidate{"diloco", "none", 10, 1, 0, "optimizer"}));
  EXPECT_TRUE(runnable(Candidate{"diloco", "none", 10, 1, 0, "gradients"}));
  EXPECT_FALSE(runnable(Candidate{"sync", "none", 1, 1, 0, "gradients"}));
  EXPECT_TRUE(runnable(Candidate{"diloco", "none", 10, 1, 0, "full"}));
  EXPECT_FALSE(runnable(Candidate{"sync", "none", 1, 1, 0, "full"}));
}

// ZeRO-2's reduce-scatter is the first half of the all-reduce ZeRO-1 runs whole, and both
// then all-gather: ZeRO-2 moves what shard = "none" moves inside the site, ZeRO-1 half more.
TEST(PlanMemory, ZeroTwoMovesLessInsideTheSiteThanZeroOne) {
  Topology t = two({"sites.0.workers=4", "sites.1.workers=4", "sites.0.lan_bandwidth=\"1Gbit\"",
                    "sites.1.lan_bandwidth=\"1Gbit\""});
  auto step = [&](const std::string& shard) { return predict(t, Candidate{"diloco", "none", 10, 1, 0, shard}).step_s; };
  EXPECT_GT(step("optimizer"), step("gradients"));
  EXPECT_GE(step("gradients"), step("none"));
}

TEST(PlanMemory, GatewayCodecStateAndExchange) {
  Topology t = two();
  // diloco/int4: the residual (4 per value), the pseudo-gradient (4), both sites' payloads
  // (the all-gather holds them) and one decoded part (4).
  Memory d = gateway_memory(t, 0, Candidate{"diloco", "int4", 50});
  const double payload = 500000 + 8 * 3907;
  EXPECT_EQ(d.codec_state, 4e6);
  EXPECT_EQ(d.exchange, 4e6 + 2 * payload + 4e6);
  EXPECT_EQ(gateway_memory(t, 0, Candidate{"diloco", "fp16", 50}).codec_state, 0);  // a cast keeps nothing
  // sync/none: no pseudo-gradient, no residual.
  Memory s = gateway_memory(t, 0, Candidate{"sync", "none"});
  EXPECT_EQ(s.codec_state, 0);
  EXPECT_EQ(s.exchange, 2 * 4e6 + 4e6);
  // streaming H=100, F=4, delay 5: one fragment (2.5e5 values) in flight at a time.
  Memory one = gateway_memory(t, 0, Candidate{"streaming", "int4", 100, 4, 5});
  const double fragment = 125000 + 8 * 977;  // ⌈250000/256⌉ = 977 blocks
  EXPECT_EQ(one.exchange, 1e6 + 2 * fragment + 1e6);
  EXPECT_EQ(one.outer, 8e6 + 1e6);
  EXPECT_EQ(one.codec_state, 4e6);  // the residuals of all fragments together
  // H=10, F=2, delay 9: a fragment every 5 steps, merged 9 later: two in flight.
  Memory two_in_flight = gateway_memory(t, 0, Candidate{"streaming", "none", 10, 2, 9});
  EXPECT_EQ(two_in_flight.outer, 8e6 + 2 * 2e6);
  EXPECT_EQ(two_in_flight.exchange, 2 * (2e6 + 2 * 2e6 + 2e6));
}

TEST(PlanMemory, Activations) {
  // 2 layers × 1000 tokens × (66·64 + 9·4·32) bytes.
  Topology t = parse_topology(kOne, "one.toml", {"model.layers=2", "model.hidden=64", "model.heads=4", "model.sequence=32"});
  Memory m = gateway_memory(t, 0, Candidate{"diloco", "none", 10});
  EXPECT_EQ(m.activations, 2 * 1000 * (66 * 64 + 9 * 4 * 32));
  EXPECT_EQ(m.device(), 16e6 + 10752000);
  expect_error(kOne, {"model.heads", "missing", "layers, hidden, heads and sequence"},
               {"model.layers=2", "model.hidden=64", "model.sequence=32"});
}

// Every recommendation is runnable and fits; nothing runnable that fits is better than it by
// more than the tolerance; and with nothing runnable that fits there is no recommendation.
void expect_sound(const Plan& plan, double tolerance) {
  const Prediction* best = nullptr;
  for (const auto& p : plan.predictions)
    if (p.runnable && p.fits && (!best || p.utilization > best->utilization)) best = &p;
  if (!best) {
    EXPECT_FALSE(plan.recommended) << plan.reason;
    return;
  }
  ASSERT_TRUE(plan.recommended) << plan.reason;
  const Prediction& r = plan.predictions[*plan.recommended];
  EXPECT_TRUE(r.runnable) << plan.reason;
  EXPECT_TRUE(r.fits) << plan.reason;
  EXPECT_GE(r.utilization, best->utilization * (1 - tolerance));
}

TEST(PlanMemory, RecommendsOnlyWhatRunsAndFits) {
  const std::vector<std::string> all = {"candidates.shard=[\"none\", \"optimizer\", \"gradients\", \"full\"]",
                                        "sites.0.workers=4", "sites.1.workers=4"};
  for (const char* memory : {"1MB", "5MB", "15MB", "20MB", "30MB", "1GB"}) {
    std::vector<std::string> o = all;
    o.push_back(str_cat("sites.0.worker_memory=\"", memory, "\""));
    o.push_back(str_cat("sites.1.worker_memory=\"", memory, "\""));
    Topology t = two(o);
    Plan plan = make_plan(t);
    SCOPED_TRACE(memory);
    expect_sound(plan, t.tolerance);
    for (const auto& p : plan.predictions) {
      EXPECT_EQ(p.fits, p.memory.device() <= parse_size(memory)) << p.misfit;
      EXPECT_EQ(p.runnable, p.candidate.shard == "none" || p.candidate.shard == "optimizer" ||
                                p.candidate.strategy != "sync");
    }
  }
  // 15 MB: nothing unsharded fits (diloco and streaming need 16 MB, sync 20 MB); ZeRO-1
  // (4 + 4 + 8/4 = 10 MB) and ZeRO-2 (4 + 4/4 + 8/4 = 7 MB) do, nebula runs both, and one is the
  // recommendation (this topology's site links cost nothing, so they tie).
  Plan zero1 = make_plan(two({all[0], all[1], all[2], "sites.0.worker_memory=\"15MB\"", "sites.1.worker_memory=\"15MB\""}));
  ASSERT_TRUE(zero1.recommended) << zero1.reason;
  const std::string& pick = zero1.predictions[*zero1.recommended].candidate.shard;
  EXPECT_TRUE(pick == "optimizer" || pick == "gradients") << pick;
  // 8 MB: ZeRO-1 no longer fits, ZeRO-2 (its gradients sharded too) does.
  Plan two_fits = make_plan(two({all[0], all[1], all[2], "sites.0.worker_memory=\"8MB\"", "sites.1.worker_memory=\"8MB\""}));
  ASSERT_TRUE(two_fits.recommended) << two_fits.reason;
  EXPECT_EQ(two_fits.predictions[*two_fits.recommended].candidate.shard, "gradients");
  // 6 MB: only ZeRO-3 (16/4 = 4 MB) fits, and it is the recommendation (not with sync).
  Plan three = make_plan(two({all[0], all[1], all[2], "sites.0.worker_memory=\"6MB\"", "sites.1.worker_memory=\"6MB\""}));
  ASSERT_TRUE(three.recommended) << three.reason;
  EXPECT_EQ(three.predictions[*three.recommended].candidate.shard, "full");
  EXPECT_NE(three.predictions[*three.recommended].candidate.strategy, "sync");
  // Without "full" among the candidates nothing fits, and the plan says so.
  Topology tight = two({"candidates.shard=[\"none\", \"optimizer\", \"gradients\"]", all[1], all[2],
                        "sites.0.worker_memory=\"6MB\"", "sites.1.worker_memory=\"6MB\""});
  Plan none = make_plan(tight);
  EXPECT_FALSE(none.recommended);
  EXPECT_NE(none.reason.find("nothing nebula can run today (shard = \"none\", \"optimizer\", or \"gradients\" or \"full\" without sync; pipeline stages without \"full\"; tensor slices without \"full\" or stages) fits"),
            std::string::npos)
      << none.reason;
  EXPECT_NE(none.reason.find("needs 6.68 MiB of device memory per worker at site a, has 5.72 MiB"), std::string::npos)
      << none.reason;
  const std::string table = format_table(tight, none);
  EXPECT_NE(table.find("recommended: nothing"), std::string::npos) << table;
  EXPECT_EQ(table.find("\n* "), std::string::npos) << table;  // no row marked recommended
  EXPECT_TRUE(nlohmann::json::parse(format_json(tight, none))["recommended"].is_null());
  // Only sync misses at 16 MB: it is never the answer though it would be as good.
  Plan no_sync = make_plan(two({"sites.0.worker_memory=\"16MB\"", "sites.1.worker_memory=\"16MB\"", "wan.bandwidth=\"0\"",
                                "wan.rtt=\"0s\""}));
  ASSERT_TRUE(no_sync.recommended);
  EXPECT_NE(no_sync.predictions[*no_sync.recommended].candidate.strategy, "sync");
  EXPECT_NE(no_sync.reason.find("do not fit in memory were left out"), std::string::npos) << no_sync.reason;
  // The gateway's host memory is checked too: at 20 MB sync/none (4 + 12 MB) and streaming
  // with one of 4 fragments in flight (9 + 4 MB) fit; diloco's outer state (12 MB) with its
  // whole-model exchange (at least 12 MB) never does.
  Plan host = make_plan(two({"sites.0.host_memory=\"20MB\"", "sites.1.host_memory=\"20MB\""}));
  expect_sound(host, 0.01);
  size_t fitting = 0;
  for (const auto& p : host.predictions) {
    EXPECT_EQ(p.fits, p.memory.host() <= 20e6) << p.candidate.strategy << "/" << p.candidate.codec;
    if (p.candidate.strategy == "diloco") {
      EXPECT_FALSE(p.fits) << p.candidate.codec;
    }
    fitting += p.fits;
  }
  EXPECT_GT(fitting, 0u);
  EXPECT_LT(fitting, host.predictions.size());
  ASSERT_TRUE(host.recommended);
  EXPECT_NE(host.predictions[*host.recommended].candidate.strategy, "diloco");
}

// Layouts: one site of 8 workers, a model of 8 layers 64 wide with 4 heads over sequences of
// 32 tokens, 64 tokens per worker-step (2 sequences).
Topology laid(const std::vector<std::string>& more = {}) {
  std::vector<std::string> o = {"model.layers=8", "model.hidden=64", "model.heads=4", "model.sequence=32",
                                "model.tokens_per_step_per_worker=64", "sites.0.workers=8"};
  o.insert(o.end(), more.begin(), more.end());
  return parse_topology(kOne, "one.toml", o);
}

Candidate layout(int64_t p, int64_t t, bool recompute, const std::string& shard = "none") {
  Candidate c{"diloco", "none", 10, 1, 0, shard};
  c.pipeline = p;
  c.tensor = t;
  c.recompute = recompute;
  c.micro_batches = p > 1 ? 64 * p * t / 32 : 1;  // one sequence each
  return c;
}

TEST(PlanMemory, PipelineAndTensorLayouts) {
  const Topology t = laid();
  const double h = 64, a = 4, s = 32, L = 8;
  const double layer = 66 * h + 9 * a * s;  // float32 activation bytes per token and layer, unsliced
  // Data only: 1e6 parameters whole on every worker, 8 layers of 64 tokens.
  const Memory data = gateway_memory(t, 0, layout(1, 1, false));
  EXPECT_EQ(data.parameters, 4e6);
  EXPECT_EQ(data.activations, L * 64 * layer);
  // 4 stages × 2 replicas: a stage holds 2 of the 8 layers, a quarter of the model; a replica
  // computes 4 × 64 tokens in M = 8 micro-batches of 32; stage 0 keeps min(P, M) = 4 of them.
  const Memory pipe = gateway_memory(t, 0, layout(4, 1, false));
  EXPECT_EQ(pipe.parameters, 1e6);
  EXPECT_EQ(pipe.optimizer, 2e6);
  EXPECT_EQ(pipe.activations, 4 * 2 * 32 * layer);
  // With recompute: the inputs of min(P − 1, M) = 3 micro-batches (4·h bytes a token) and one
  // micro-batch's activations through the stage's 2 layers.
  const Memory rc = gateway_memory(t, 0, layout(4, 1, true));
  EXPECT_EQ(rc.activations, 3 * 32 * 4 * h + 2 * 32 * layer);
  // Uneven stages: 3 stages of 8 layers are cut 3/3/2; the largest holds 3/8 of the model.
  // (8 workers are no multiple of 3: an 8-layer model on 3 workers of a 3-worker site.)
  const Topology three = laid({"sites.0.workers=3"});
  EXPECT_DOUBLE_EQ(gateway_memory(three, 0, layout(3, 1, false)).parameters, 4e6 * 3 / 8);
  // ZeRO-2 along the data dimension: over the stage's 2 replicas.
  EXPECT_EQ(gateway_memory(t, 0, layout(4, 1, false, "gradients")).optimizer, 1e6);
  // 2 tensor slices: half of every weight; of the 66·h bytes 18·h stay whole (norms' and blocks'
  // inputs, dropout masks), the rest and the attention scores halve. A replica (2 workers)
  // computes 128 tokens.
  const Memory slices = gateway_memory(t, 0, layout(1, 2, false));
  EXPECT_EQ(slices.parameters, 2e6);
  EXPECT_EQ(slices.activations, L * 128 * (18 * h + (48 * h + 9 * a * s) / 2));
  // ZeRO-3 with recompute: every layer's input, one layer's activations.
  EXPECT_EQ(gateway_memory(t, 0, layout(1, 1, true, "full")).activations, L * 64 * 4 * h + 64 * layer);
  EXPECT_EQ(gateway_memory(t, 0, layout(1, 1, false, "full")).activations, data.activations);
}

// With stages a fragment (cut by position in the whole model's flat vector) lies within a stage:
// every_worker exchanges it among the stage's replicas, and each worker holds what
// Hierarchy::run_exchange_parts does.
TEST(PlanMemory, EveryWorkerExchangeOfStagedSites) {
  const Topology t = two({"model.layers=8", "model.hidden=64", "model.heads=4", "model.sequence=32",
                          "model.tokens_per_step_per_worker=64", "sites.0.workers=4", "sites.1.workers=4"});
  Candidate c{"streaming", "int8", 10, 4, 0, "none", "every_worker"};
  c.pipeline = 2;  // 2 replicas of 2 stages of 4 layers: half the model each
  c.micro_batches = 4;
  const Memory m = gateway_memory(t, 0, c);
  const double fragment = 1e6 / 4, values = fragment / 2;  // within a stage, over its 2 replicas
  const double payload = values + 8 * std::ceil(values / 256);
  EXPECT_EQ(m.exchange, 4 * values * (2 + 1 + 2) + 3 * payload);
  EXPECT_EQ(m.codec_state, 4 * 1e6 / 2 / 2);
  EXPECT_EQ(m.outer, 8 * 5e5 + 4 * fragment);
  // Through the gateway: the whole fragment, the pseudo-gradient, both sites' payloads, one decoded.
  c.wan_mode = "gateway";
  const Memory g = gateway_memory(t, 0, c);
  EXPECT_EQ(g.exchange, 4 * fragment + 2 * (fragment + 8 * std::ceil(fragment / 256)) + 4 * fragment);
  EXPECT_EQ(g.codec_state, 4e6);
}

TEST(Plan, PipelineBubbleAndRecomputeCostTime) {
  // Free LAN: a step of P stages and M micro-batches takes (M + P − 1)/M of the compute; the
  // useful share is M/(M + P − 1); recompute adds a third.
  Topology t = laid({"sites.0.lan_bandwidth=\"0\"", "sites.0.lan_latency=\"0s\""});
  const Prediction one = predict(t, layout(1, 1, false));
  EXPECT_DOUBLE_EQ(one.step_s, 64.0 / 1000);
  const Prediction pipe = predict(t, layout(4, 1, false));
  EXPECT_DOUBLE_EQ(pipe.bubble, 3.0 / 11);
  EXPECT_DOUBLE_EQ(pipe.step_s, 0.064 * 11 / 8);
  EXPECT_DOUBLE_EQ(pipe.utilization, 8.0 / 11);
  const Prediction rc = predict(t, layout(4, 1, true));
  EXPECT_DOUBLE_EQ(rc.step_s, 0.064 * 4 / 3 * 11 / 8);
  EXPECT_DOUBLE_EQ(rc.utilization, 8.0 / 11 * 3 / 4);
  // ZeRO-3 costs a third more compute only with recompute.
  EXPECT_DOUBLE_EQ(predict(t, layout(1, 1, false, "full")).step_s, 0.064);
  EXPECT_DOUBLE_EQ(predict(t, layout(1, 1, true, "full")).step_s, 0.064 * 4 / 3);
  // A slow LAN: tensor slices all-reduce a micro-batch's hidden states 4 times per layer.
  Topology slow = laid({"sites.0.lan_bandwidth=\"8Mbit\"", "sites.0.lan_latency=\"0s\""});
  const Prediction sliced = predict(slow, layout(1, 2, false));
  const double ring = 2 * 0.5 * 128 * 4 * 64 / 1e6;  // 2(T−1)/T of 32 KiB at 1 MB/s
  EXPECT_NEAR(sliced.compute_s, 0.064 + 8 * 4 * ring, 1e-12);
}

TEST(Plan, LayoutsRunnableAndBadInput) {
  EXPECT_TRUE(runnable(layout(4, 1, true, "gradients"), 2));
  EXPECT_FALSE(runnable(layout(4, 1, false, "full"), 1));  // ZeRO-3 of stages: not built
  Candidate sync = layout(2, 1, false);
  sync.strategy = "sync";
  EXPECT_TRUE(runnable(sync, 1));
  EXPECT_FALSE(runnable(sync, 2));                      // stages across sites: diloco or streaming
  EXPECT_TRUE(runnable(layout(1, 2, false), 1));
  EXPECT_TRUE(runnable(layout(1, 2, false), 2));        // slices on several sites
  EXPECT_TRUE(runnable(layout(1, 2, false, "gradients"), 2));
  Candidate sliced_sync = layout(1, 2, false);
  sliced_sync.strategy = "sync";
  EXPECT_TRUE(runnable(sliced_sync, 1));
  EXPECT_FALSE(runnable(sliced_sync, 2));               // slices across sites: diloco or streaming
  EXPECT_FALSE(runnable(layout(2, 2, false), 1));       // stages × slices: not built
  EXPECT_FALSE(runnable(layout(1, 2, false, "full"), 1));
  // Candidates: only layouts the workers divide into; recompute only where something reruns.
  Topology t = laid({"candidates.pipeline=[1, 2, 3, 4]", "candidates.tensor=[1, 2]", "candidates.recompute=[false, true]",
                     "candidates.strategies=[\"diloco\"]", "candidates.codecs=[\"none\"]", "candidates.inner_steps=[10]"});
  std::set<std::string> seen;
  for (const Candidate& c : enumerate_candidates(t)) seen.insert(layout_label(c));
  EXPECT_EQ(seen, (std::set<std::string>{"", "t2", "p2 m4", "p2 m4 recompute", "p2 m8 t2", "p2 m8 t2 recompute",
                                         "p4 m8", "p4 m8 recompute", "p4 m16 t2", "p4 m16 t2 recompute"}));
  expect_error(kOne, {"candidates.pipeline", "layers, hidden, heads"}, {"candidates.pipeline=[1, 2]"});
  expect_error(kOne, {"candidates.pipeline", "9 stages for a model of 8 layers"},
               {"model.layers=8", "model.hidden=64", "model.heads=4", "model.sequence=32", "candidates.pipeline=[9]"});
  expect_error(kOne, {"candidates.tensor", "3 slices do not divide [model] heads = 4"},
               {"model.layers=8", "model.hidden=64", "model.heads=4", "model.sequence=32", "candidates.tensor=[3]"});
  expect_error(kOne, {"candidates.recompute", "true or false"}, {"candidates.recompute=[1]"});
}

TEST(PlanMemory, Big70BFitsWithStagesAndRecompute) {
  Topology t = load_topology(std::string(NEBULA_SOURCE_DIR) + "/examples/plan_8x512_70b.toml");
  ASSERT_EQ(t.sites[0].worker_memory, 80.0 * (1 << 30));
  Plan laid_out = make_plan(t);
  expect_sound(laid_out, t.tolerance);
  ASSERT_TRUE(laid_out.recommended) << laid_out.reason;
  const Prediction& r = laid_out.predictions[*laid_out.recommended];
  EXPECT_GT(r.candidate.pipeline, 1) << format_table(t, laid_out, 5);
  EXPECT_TRUE(r.candidate.recompute);
  EXPECT_EQ(r.candidate.tensor, 1);  // slices without recompute: their activations do not fit at 70B
  EXPECT_LE(r.memory.device(), t.sites[0].worker_memory);
  EXPECT_LE(r.memory.host(), t.sites[0].host_memory);
  EXPECT_NE(format_table(t, laid_out, 5).find("recommended: "), std::string::npos);
  // How to run it: the settings a job takes, the layout's included.
  const std::vector<std::string> settings = job_settings(t, r.candidate);
  for (const std::string& want : {str_cat("parallel.pipeline=", r.candidate.pipeline), std::string("parallel.recompute=true"),
                                  str_cat("parallel.micro_batches=", r.candidate.micro_batches),
                                  str_cat("data.batch_size=", r.candidate.micro_batches),
                                  str_cat("wan.mode=\"", r.candidate.wan_mode, "\"")})
    EXPECT_NE(std::find(settings.begin(), settings.end(), want), settings.end()) << want;
  EXPECT_NE(format_table(t, laid_out, 5).find("as a job: nebula run JOB.toml --set 'strategy.kind="), std::string::npos);
  EXPECT_NE(format_json(t, laid_out).find("\"job_settings\""), std::string::npos);
  // 7B on 2 × 64: 4 stages with recompute; data parallelism alone: ZeRO-3 with its recompute.
  const std::string seven = std::string(NEBULA_SOURCE_DIR) + "/examples/plan_2x64_7b.toml";
  const Plan staged7 = make_plan(load_topology(seven));
  ASSERT_TRUE(staged7.recommended) << staged7.reason;
  EXPECT_EQ(staged7.predictions[*staged7.recommended].candidate.pipeline, 4) << staged7.reason;
  EXPECT_TRUE(staged7.predictions[*staged7.recommended].candidate.recompute);
  const Plan data7 = make_plan(load_topology(seven, {"candidates.pipeline=[1]", "candidates.tensor=[1]"}));
  ASSERT_TRUE(data7.recommended) << data7.reason;
  const Candidate& z3 = data7.predictions[*data7.recommended].candidate;
  EXPECT_EQ(z3.shard, "full");
  EXPECT_TRUE(z3.recompute);
  EXPECT_LT(data7.predictions[*data7.recommended].utilization, staged7.predictions[*staged7.recommended].utilization);
  // Data parallelism alone (what the plan offered before stages): nothing fits.
  t = load_topology(std::string(NEBULA_SOURCE_DIR) + "/examples/plan_8x512_70b.toml",
                    {"candidates.pipeline=[1]", "candidates.tensor=[1]", "candidates.recompute=[false]",
                     "candidates.shard=[\"none\"]"});
  Plan plan = make_plan(t);
  for (const auto& p : plan.predictions) {
    EXPECT_FALSE(p.fits);
    EXPECT_EQ(p.memory.parameters, 4 * 70e9);
    EXPECT_EQ(p.memory.optimizer, 8 * 70e9);
    EXPECT_NE(p.misfit.find("of device memory per worker at site us-east, has 80.00 GiB"), std::string::npos) << p.misfit;
  }
  EXPECT_FALSE(plan.recommended);
  EXPECT_NE(format_table(t, plan).find("recommended: nothing\n  why: nothing nebula can run today"), std::string::npos)
      << format_table(t, plan);
  // With the shard modes as candidates, still nothing is recommended: the activations.
  Plan sharded = make_plan(load_topology(std::string(NEBULA_SOURCE_DIR) + "/examples/plan_8x512_70b.toml",
                                         {"candidates.pipeline=[1]", "candidates.tensor=[1]", "candidates.recompute=[false]"}));
  expect_sound(sharded, t.tolerance);
  EXPECT_FALSE(sharded.recommended);
  // The demo topology fits in its 4 GiB and gets a recommendation.
  Topology demo = load_topology(std::string(NEBULA_SOURCE_DIR) + "/examples/plan_demo.toml");
  Plan dp = make_plan(demo);
  ASSERT_TRUE(dp.recommended) << dp.reason;
  expect_sound(dp, demo.tolerance);
}

// [wan] host_bandwidth bounds each host's egress; with wan_mode "every_worker" each of a
// site's workers sends 1/w of its payload, so where the hosts bind the exchange takes 1/w of the
// time, until the site pair's bandwidth binds. sync does not run every_worker.
TEST(Plan, HostBandwidthAndEveryWorker) {
  // 4 MB per exchange; pair 32 Mbit/s (1 s), hosts 8 Mbit/s (4 s for the whole payload).
  Topology t = two({"sites.0.workers=4", "sites.1.workers=4", "wan.bandwidth=\"32Mbit\"", "wan.rtt=\"0ms\"",
                    "wan.host_bandwidth=\"8Mbit\"", "candidates.wan_modes=[\"gateway\", \"every_worker\"]"});
  const Prediction gateway = predict(t, Candidate{"diloco", "none", 10, 1, 0, "none", "gateway"});
  const Prediction every = predict(t, Candidate{"diloco", "none", 10, 1, 0, "none", "every_worker"});
  EXPECT_NEAR(gateway.wan_exchange_s, 4.0, 1e-9);  // the gateway's host binds
  EXPECT_NEAR(every.wan_exchange_s, 1.0, 1e-9);    // 1 MB per host: the pair binds
  EXPECT_EQ(every.wan_bytes_per_step, gateway.wan_bytes_per_step);
  EXPECT_FALSE(predict(t, Candidate{"sync", "none", 1, 1, 0, "none", "every_worker"}).runnable);
  EXPECT_FALSE(predict(t, Candidate{"diloco", "powersgd", 10, 1, 0, "none", "every_worker"}).runnable);
  // Unlimited hosts: the modes are the same.
  Topology free = two({"sites.0.workers=4", "sites.1.workers=4", "wan.bandwidth=\"32Mbit\""});
  EXPECT_EQ(predict(free, Candidate{"diloco", "none", 10, 1, 0, "none", "every_worker"}).wan_exchange_s,
            predict(free, Candidate{"diloco", "none", 10, 1, 0, "none", "gateway"}).wan_exchange_s);
  // With the hosts binding, the recommendation spreads the traffic (diloco: streaming would
  // hide either exchange behind its delay).
  t.strategies = {"sync", "diloco"};
  const Plan plan = make_plan(t);
  ASSERT_TRUE(plan.recommended.has_value());
  EXPECT_EQ(plan.predictions[*plan.recommended].candidate.wan_mode, "every_worker") << plan.reason;
  EXPECT_NE(format_table(t, plan).find("every_worker"), std::string::npos);
  EXPECT_NE(format_json(t, plan).find("\"wan_mode\": \"every_worker\""), std::string::npos);
  expect_error(kTwo, {"candidates.wan_modes", "everyone"}, {"candidates.wan_modes=[\"everyone\"]"});
}

TEST(Plan, BadInputNamesFileLineAndKey) {
  expect_error(replace_once(kTwo, "parameters = 1000000\n", ""), {"topo.toml:2:1", "model.parameters", "missing"});
  expect_error(replace_once(kTwo, "bandwidth = \"8Mbit\"", "bandwidth = \"-1Gbit\""),
               {"topo.toml:15:13", "wan.bandwidth", "non-negative"});
  expect_error(std::string(kTwo) + "[candidates]\ncodecs = [\"none\", \"int9\"]\n",
               {"topo.toml:21:", "candidates.codecs", "\"int9\" is not one of"});
  expect_error(replace_once(kTwo, "rtt = \"100ms\"", "rtt = \"100\""), {"topo.toml:16:", "wan.rtt"});
  expect_error(replace_once(kTwo, "[planner]", "[planner]\nspeed = 3"), {"topo.toml:19:", "planner.speed", "unknown key"});
  expect_error(replace_once(kTwo, "name = \"b\"\ntokens_per_second_per_worker = 1000", "name = \"b\"\nworker_flops = \"1T\"\ntokens_per_second_per_worker = 1000"),
               {"topo.toml:10:", "sites[1].worker_flops", "exactly one"});
  expect_error(replace_once(kTwo, "name = \"b\"\ntokens_per_second_per_worker = 1000", "name = \"b\""),
               {"sites[1].worker_flops", "exactly one"});
  expect_error(replace_once(kTwo, "name = \"b\"", "name = \"a\""), {"sites[1].name", "used twice"});
  expect_error(replace_once(kTwo, "parameters = 1000000", "parameters = \"70Q\""), {"topo.toml:3:", "model.parameters", "70Q"});
  expect_error(replace_once(kTwo, "parameters = 1000000", "parameters = -5"), {"model.parameters", "out of range"});
  expect_error(kTwo, {"--set", "planner.overlap", "out of range"}, {"planner.overlap=2"});
  expect_error(std::string(kTwo) + "[[wan.pairs]]\nsites = [\"a\", \"zz\"]\n", {"wan.pairs[0].sites", "\"zz\""});
  expect_error("[model\n", {"topo.toml:1:"});
  expect_error(replace_once(kTwo, "name = \"a\"", "name = \"a\"\nworker_memory = \"80 GiBs\""),
               {"topo.toml:8:", "sites[0].worker_memory", "80 GiBs", "GiB"});
  expect_error(replace_once(kTwo, "name = \"a\"", "name = \"a\"\nworker_memory = \"0\""),
               {"sites[0].worker_memory", "more than 0"});
  expect_error(replace_once(kTwo, "name = \"a\"", "name = \"a\"\nworker_memory = \"80GiB\""),
               {"sites[1].worker_memory", "missing", "site 'b'"});
  expect_error(std::string(kTwo) + "[candidates]\nshard = [\"zero3\"]\n", {"candidates.shard", "\"zero3\" is not one of"});
}

TEST(Plan, UnitsForCountsAndFlops) {
  Topology t = parse_topology(R"(
[model]
parameters = "70B"
trainable = "1.5M"
tokens_per_step_per_worker = "4K"
flops_per_token = "420G"
[[sites]]
name = "x"
workers = 2
worker_flops = "400TFLOP/s"
lan_bandwidth = "400Gbit"
lan_latency = "5us"
)",
                              "units.toml");
  EXPECT_EQ(t.parameters, 70e9);
  EXPECT_EQ(t.trainable, 1.5e6);
  EXPECT_EQ(t.tokens_per_step_per_worker, 4000);
  EXPECT_EQ(t.flops_per_token, 420e9);
  EXPECT_EQ(t.sites[0].worker_flops, 400e12);
  EXPECT_EQ(t.sites[0].lan_bandwidth_bits, 400e9);
  EXPECT_DOUBLE_EQ(t.sites[0].lan_latency_s, 5e-6);
  EXPECT_TRUE(std::isinf(t.wan.bandwidth_bits));  // no [wan]: unlimited
}

}  // namespace
}  // namespace nebula::plan
