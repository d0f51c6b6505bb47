// `nebula plan`: a cost model that predicts, for a described topology (sites, workers, device
// throughput, model size, LAN and WAN bandwidth/latency), the step time, WAN bytes and compute
// utilization of every candidate strategy × codec × H, and recommends one. It is closed form,
// so topologies far beyond this machine (8 sites × 512 GPUs, 70B parameters) take
// microseconds a candidate. No torch here: this layer uses only nebula_util (and nlohmann_json, header
// only, for --json).
//
// ─── The model (all times in seconds, sizes in bytes, rates in bits/s) ──────────────────────
//  n        trainable parameters ([model] trainable, default parameters; PEFT trains fewer)
//  B = 4n   bytes of one float32 gradient / pseudo-gradient (inside a site nothing is lossy)
//  S        sites; per site s: w_s workers
//
//  compute   t_c(s) = tokens_per_step_per_worker · flops_per_token / worker_flops(s)
//            or       tokens_per_step_per_worker / tokens_per_second_per_worker(s)  (measured)
//            flops_per_token defaults to 6 · parameters (forward + backward, dense).
//  LAN       ring all-reduce of B among w workers, per hop bandwidth bw and latency l:
//              t_ar(s) = 2(w-1)/w · 8B/bw + 2(w-1)·l          (0 for w = 1)
//            broadcast (half of it): t_bc(s) = (w-1)/w · 8B/bw + (w-1)·l
//  payload   P(codec, m): bytes one gateway sends for m values; see payload_bytes() (the table).
//  WAN       one exchange = every gateway sends its payload to every other gateway (full-mesh
//            all-gather, what nebula's GatewayMesh does), all at once, over pairs with
//            bandwidth bw_ij and round trip rtt_ij:
//              shared uplink (default; a gateway's S-1 copies share one pipe):
//                t_x(P) = max_i [ max_{j≠i} rtt_ij/2 + Σ_{j≠i} 8P/bw_ij ]
//              independent pairs ([wan] shared_uplink = false; what the local emulator does):
//                t_x(P) = max_{i≠j} [ rtt_ij/2 + 8P/bw_ij ]
//            bytes on the WAN per exchange, all gateways together: S(S-1)·P
//            (both 0 for one site). Frame/TLS overhead (~70 B per exchange) is not modelled.
//            Each host's own egress ([wan] host_bandwidth, default unlimited) bounds the
//            sender too: site i's term is max(the pairs' term above, (S-1)·8P_i/host_bw), where
//            P_i = P when the gateway carries the site's traffic (wan_mode "gateway") and P/w_i
//            when every worker sends its own cut ("every_worker", diloco/streaming only).
//  overlap   a fraction `o` of the compute can hide communication that runs in the background
//            (gradient buckets go out during backward, which is ~2/3 of a step): a step with
//            compute t and overlappable communication x takes t + max(0, x - o·t).
//            [planner] overlap, default 2/3. Today's nebula sends one bucket for small models,
//            so a model that fits one bucket should use overlap = 0.
//  ZeRO-1    shard = "optimizer" adds, every step after the optimizer's, an all-gather of
//            the parameters inside the site, as long as the broadcast half and not
//            overlapped: t_ag(s) = t_bc(s). ZeRO-2 ("gradients") halves t_ar (a reduce-scatter)
//            and adds the same all-gather; ZeRO-3 ("full") halves t_ar and gathers twice
//            (forward and backward), t_ag = 2·t_bc.
//  Sites pace each other: t_c = max_s t_c(s), t_ar = max_s t_ar(s), t_bc = max_s t_bc(s).
//
//  sync       step = t_c + max(0, t_ar + t_x(P(n)) - o·t_c) + t_ag
//             WAN bytes/step = S(S-1)·P(n)
//  diloco H   inner step of site s: t_b(s) = t_c(s) + max(0, t_ar(s) - o·t_c(s)) + t_ag(s);
//             t_b = max_s t_b(s).
//             Every H steps a blocking exchange of the pseudo-gradient, then the gateway
//             broadcasts the outer update inside its site:
//             step = t_b + (t_x(P(n)) + t_bc) / H
//             WAN bytes/step = S(S-1)·P(n) / H
//  streaming H, F fragments, delay τ: each fragment (n/F values) is synchronized every H
//             steps, one fragment every H/F steps, sent in the background and merged τ steps
//             later, so only what τ inner steps cannot hide stalls:
//               stall = max(0, t_x(P(n/F)) - τ·t_b)
//               step = max( t_b + F·(stall + t_bc(B/F)) / H,  F·t_x0(P(n/F)) / H )
//             where t_bc(B/F) broadcasts one merged fragment inside the site and t_x0 is t_x
//             without the latency (the uplink must carry F fragments per H steps).
//             F = 1, τ = 0 gives exactly diloco.
//             WAN bytes/step = S(S-1)·F·P(n/F) / H
//  Heterogeneous sites (diloco/streaming, [planner] heterogeneous = true, like [strategy]
//  heterogeneous): "step" is a step of the slowest site; a faster site runs
//  H_s = H · t_b / t_b(s) inner steps in the same round instead of waiting. With false, and
//  for sync, every site runs one step per step and faster sites wait.
//
//  compute utilization U = worker-seconds spent computing / worker-seconds elapsed
//      sync: Σ_s w_s t_c(s) / (W · step);  diloco/streaming: Σ_s w_s H_s t_c(s) / (W · H · step)
//  (W = Σ w_s). With identical sites this is t_c / step: the time per token with free
//  communication divided by the time per token with this LAN and WAN.
//  tokens/s = Σ_s w_s (H_s/H) tokens_per_step_per_worker / step   (H_s = H = 1 for sync)
//
//  memory    bytes per worker, by where they live (nebula trains in float32: the parameters are
//            their own fp32 master copy; nothing is mixed precision). n = parameters, t =
//            trainable, N = workers of the site, S = sites, m = values per exchange (t; t/F
//            for streaming), k = exchanges in flight at once (1; streaming:
//            min(F, ⌊τ·F/H⌋ + 1)), P(m) the payload above. Sharding divides by N what it
//            shards: d_O = N from shard "optimizer" on, d_G = N from "gradients" on, d_P = N for
//            "full" (else 1).
//            device (GPU): parameters 4n/d_P; gradients 4t/d_G (+4t/d_G for sync: the copies its
//              backward hooks take); AdamW's two moments 8t/d_O; activations (below).
//            host, every worker: the flat all-reduce buffer 4t/d_G (sync: the pinned buffer
//              its buckets are gathered into; diloco/streaming: only when N > 1);
//              diloco/streaming outer state: θ_global + outer momentum 8t/d_O (summed over
//              fragments) + θ_local at send, k·4m/d_O (each worker keeps its shard's part).
//            host, the gateway only (S > 1), not sharded (one gateway encodes the whole site's
//              update): codec error-feedback residual 4t (int8, int4, topk, powersgd,
//              sparseloco; none/fp16/bf16 keep none); per exchange in flight, the
//              pseudo-gradient 4m (diloco/streaming), every site's payload S·P(m) (the
//              all-gather holds them all) and one decoded part 4m.
//            with wan_mode "every_worker", every worker: the residual of its cut, 4t/N, and
//              per exchange in flight what Hierarchy::run_exchange_parts holds for its cut of
//              m' = m/N values: 4m'·(S + 1 + 2c) + (2S − 1)·P(m') (c = 1 for a lossy codec:
//              the pseudo-gradient, the encode and decode temporaries, every site's decoded
//              contribution; its payload, a copy for each other site, the other sites').
//            The gateway holds the most, so it is what must fit.
//  activations  data parallelism alone, no recompute, per worker-step of T =
//            tokens_per_step_per_worker tokens, L layers of width h, a heads, sequence s:
//              L · T · (66·h + 9·a·s) bytes
//            Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
//            Models", eq. 2: s·b·h·(34 + 5·a·s/h) bytes with 16-bit activations and 1-byte
//            dropout masks) with float32 activations: of the 34 sbh, 32 are 2-byte tensors
//            (→ 64) and 2 are masks (→ 2); of the 5 as²b, 4 are 2-byte (→ 8) and 1 a mask (→ 1).
//            Embeddings, logits (T · vocab · 4) and allocator slack are left out, so it is a
//            lower bound. Without [model] layers/hidden/heads/sequence activations are not
//            estimated (0, and the output says so).
//  layouts  ([candidates] pipeline, tensor, recompute; the same at every site whose workers
//            P · T divides): each site's N workers as D = N / (P · T) data replicas of P stages
//            of T slices. tokens_per_step_per_worker stays the site's batch over its workers,
//            so a replica computes T_r = tokens_per_step_per_worker · P · T tokens a step, in M =
//            ⌊T_r / sequence⌋ micro-batches of one sequence (M = 1 without stages). A worker
//            holds its stage's share of the model, σ = ⌈L/P⌉ / L (the largest stage; parameters
//            spread evenly over the layers), and 1/T of that: n, t above become n·σ/T, t·σ/T for
//            parameters, gradients, AdamW and the outer state, and the shard modes divide by D
//            (ZeRO along the data dimension), not N. The gateway's codec state and exchange
//            stay the whole site's. With every_worker, fragments being cut by position in the
//            whole model's flat vector, a stage holds whole fragments: a worker's cut of one
//            is min(t/F, t·σ)/T over its D replicas (without stages: t/F/N), and its residual
//            4t·σ/(T·D).
//            activations per worker, with a(T) = 18·h + (48·h + 9·a·s)/T bytes a token and
//            layer (Korthikanti et al. with tensor parallelism: the norms' and the blocks'
//            inputs and the dropout masks stay whole), T_m = T_r / M:
//              data only                 L · T_r · a(T)
//              ZeRO-3 with recompute     L · T_r · 4h + T_r · a(T)   (every layer's input, one layer's activations)
//              P stages                  min(P, M) · ⌈L/P⌉ · T_m · a(T)   (1F1B: stage 0 keeps min(P, M) micro-batches)
//              P stages with recompute   min(P − 1, M) · T_m · 4h + ⌈L/P⌉ · T_m · a(T)   (stage 1: its
//                                        inputs, one micro-batch recomputed at a time; the last stage
//                                        does not recompute and holds one micro-batch)
//            time: recompute multiplies t_c by 4/3 (one more forward); stages by (M + P − 1)/M
//            (1F1B's bubble (P − 1)/(M + P − 1)) and add 2(P − 1) hops of a micro-batch's hidden
//            states (T_m · 4h bytes at lan_bandwidth, plus lan_latency); slices add, per layer
//            held, 4 ring all-reduces (6 with recompute) of T_m · 4h bytes among T workers per
//            micro-batch. The data-parallel all-reduce, ZeRO's gathers and the outer broadcast's
//            all-reduce part run among the D replicas on 4t·σ/T bytes. None of these overlap.
//            U counts only t_c as busy: bubble, recompute and the slices' all-reduces are idle.
//            Runnable: stages and slices not with "full", with each other, nor with sync
//            across sites (runnable()).
//  A candidate fits when, at every site, the device need is at most [[sites]] worker_memory
//  and the gateway's host need at most host_memory (each checked where given). nebula runs
//  [parallel] shard = "none", "optimizer" (ZeRO-1), "gradients" (ZeRO-2) and "full" (ZeRO-3),
//  the last two not with sync; what it does not run is shown (marked *) but never recommended.
//
//  Not modelled: encode/decode compute, stragglers, jitter, packet loss, TCP slow start, the
//  loss penalty of compression or staleness (the recommendation only orders candidates by
//  that risk, see make_plan()).
//
// Degenerate cases are exact: one site with infinite LAN bandwidth and zero latency gives
// step = t_c, U = 1 and 0 WAN bytes for every candidate.
//
// bench/plan_validate.sh compares predictions with demo runs over the emulated WAN. On the
// shared 2-core development machine, WAN bytes per step came within 0.1 %, and step time was
// over-predicted by 12 % (sync/none) and 40 % (sync/int8): the compute speed calibrated with
// an unlimited WAN is slower than the compute inside the emulated runs.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <vector>

namespace nebula::plan {

inline constexpr double kUnlimited = std::numeric_limits<double>::infinity();

struct SitePlan {
  std::string name;
  int64_t workers = 1;
  double worker_flops = 0;                  // effective FLOP/s per worker; 0 = not given
  double tokens_per_second_per_worker = 0;  // measured; 0 = not given (exactly one is given)
  double lan_bandwidth_bits = kUnlimited;   // per ring hop; "0" in the file = unlimited
  double lan_latency_s = 0;                 // per ring hop
  double worker_memory = 0;                 // device memory per worker, bytes; 0 = not given (not checked)
  double host_memory = 0;                   // host memory per worker process, bytes; 0 = not given
};

struct WanPath {
  double bandwidth_bits = kUnlimited;       // "0" in the file = unlimited
  double rtt_s = 0;
};

struct WanPairPlan {
  std::string a, b;
  WanPath path;
};

// Codec parameters, as in [strategy] of the job config.
struct CodecParams {
  int64_t block = 256;                       // int8/int4: values per (min, scale) pair
  double density = 0.01;                     // topk: fraction of values kept
  double powersgd_ratio = 8;                 // powersgd: compression ratio (depends on shapes)
  double sparseloco_density = 64.0 / 4096;   // sparseloco: fraction kept per chunk
  int64_t sparseloco_chunk = 4096;           // sparseloco: values per chunk
  std::string sparseloco_indices = "fixed";  // sparseloco: "fixed" or "rice" (strategy.codec_indices)
  int64_t sparseloco_value_bits = 2;         // sparseloco: 2 or 1 (strategy.codec_value_bits)
};

struct Topology {
  std::string source;                       // file name, for messages
  // [model]
  double parameters = 0;
  double trainable = 0;                     // defaults to parameters
  double tokens_per_step_per_worker = 0;
  double flops_per_token = 0;               // defaults to 6 · parameters
  // [model] shape, for the activation estimate: all four or none (0 = not given).
  int64_t layers = 0, hidden = 0, heads = 0, sequence = 0;
  bool has_shape() const { return layers > 0; }
  // [[sites]]
  std::vector<SitePlan> sites;
  // [wan]
  WanPath wan;
  std::vector<WanPairPlan> pairs;
  bool shared_uplink = true;
  double host_bandwidth_bits = kUnlimited;  // each host's egress; "0" in the file = unlimited
  // [candidates]
  std::vector<std::string> strategies = {"sync", "diloco", "streaming"};
  std::vector<std::string> codecs = {"none", "fp16", "int8", "int4", "topk", "powersgd", "sparseloco"};
  std::vector<int64_t> inner_steps = {10, 50, 100, 500};
  std::vector<int64_t> fragments = {4};
  std::vector<int64_t> delays = {5};
  std::vector<std::string> shards = {"none"};  // none | optimizer | gradients | full
  std::vector<std::string> wan_modes = {"gateway"};  // gateway | every_worker
  // Layouts inside a site (the same at every site): pipeline stages P, tensor slices T, and
  // whether activations are recomputed in backward ([parallel] pipeline, tensor, recompute).
  std::vector<int64_t> pipelines = {1};
  std::vector<int64_t> tensors = {1};
  std::vector<bool> recomputes = {false};
  CodecParams codec;
  // [planner]
  double overlap = 2.0 / 3.0;               // share of compute that can hide background comm
  double tolerance = 0.01;                  // "as good as the best": within this relative U
  bool heterogeneous = true;                // diloco/streaming: fast sites run more inner steps

  WanPath path_between(size_t i, size_t j) const;
};

// Parses and validates a topology file after applying `overrides` ("section.key=value", as in
// `nebula run --set`; sites.N.key reaches into [[sites]]). Throws ConfigError naming
// file:line:col and the key, like the job config.
Topology load_topology(const std::string& path, const std::vector<std::string>& overrides = {});
Topology parse_topology(const std::string& text, const std::string& name,
                        const std::vector<std::string>& overrides = {});

// Bytes one gateway sends for `values` float32 values with `codec`:
//   none        4m
//   fp16, bf16  2m
//   int8        m + 8·⌈m/block⌉                          (≈3.9× at block 256)
//   int4        ⌈m/2⌉ + 8·⌈m/block⌉                      (≈7.5×)
//   topk        8·⌈density·m⌉  (u32 index + f32 value)   (1/(2·density)×: 50× at 1 %)
//   powersgd    4m / powersgd_ratio                      (rank r factors; the ratio depends on
//                                                         the matrix shapes, so it is a parameter)
//   sparseloco  k·(2 + ⌈log2 chunk⌉)/8 + 8·⌈m/chunk⌉, k = ⌈density·m⌉ (2-bit values, in-chunk
//               indices, 8 bytes of scale per chunk)    (≈137× at 64 of 4096); with Rice-coded
//               indices ⌈log2 chunk⌉ becomes their expected length for positions drawn at random,
//               1 + r + a/(1 − a), a = (1 − k_c/chunk)^(2^r), r = ⌊log2(chunk/k_c)⌋ (7.57 bits at
//               64 of 4096, measured 7.56; codec_test)
// Payload headers (a few dozen bytes) and bit-stream padding are left out. The one table of
// payload sizes: the adaptive controller (strategy/controller.h) uses it too. Throws
// nebula::Error for an unknown codec.
double payload_bytes(const std::string& codec, double values, const CodecParams& params);
// Every codec payload_bytes() knows, least compressed first.
const std::vector<std::string>& known_codecs();

struct Candidate {
  std::string strategy;   // sync | diloco | streaming
  std::string codec;
  int64_t inner_steps = 1;  // H (1 for sync)
  int64_t fragments = 1;    // F (streaming)
  int64_t delay = 0;        // τ (streaming)
  std::string shard = "none";  // none | optimizer (what nebula runs) | gradients | full (ZeRO-1/2/3)
  std::string wan_mode = "gateway";  // gateway | every_worker ([wan] mode)
  // The layout inside every site: data × pipeline × tensor = the site's workers.
  int64_t pipeline = 1;        // P stages ([parallel] pipeline)
  int64_t tensor = 1;          // T slices ([parallel] tensor)
  int64_t micro_batches = 1;   // M: one sequence each, a replica's sequences per step (pipeline only)
  bool recompute = false;      // [parallel] recompute: ZeRO-3's layers or the stages run forward again in backward
};
// "p16 m64 recompute", "t8", "" for data parallelism alone: the layout part of a label.
std::string layout_label(const Candidate& c);
// The candidate as a job's settings, `nebula run --set` arguments ("strategy.kind=\"diloco\"",
// "parallel.pipeline=32", ...): the strategy, codec, H, F, delay, shard, WAN mode and layout;
// with stages also data.batch_size = M (one sequence per micro-batch).
std::vector<std::string> job_settings(const Topology& t, const Candidate& c);

// Sharding modes, least sharded first: "none", "optimizer", "gradients", "full".
const std::vector<std::string>& shard_modes();
// Whether nebula can run the candidate today on `sites` sites: sync only unsharded or with
// "optimizer" (ZeRO-1), and not with wan_mode "every_worker" (nor is powersgd with it);
// pipeline stages not with "full", nor with sync across sites; tensor slices likewise, and not
// with stages.
bool runnable(const Candidate& c, size_t sites = 1);

// Bytes one worker of a site holds (the formulas above). Device and host are apart: nebula
// keeps communication and outer state on the host even for GPU workers.
struct Memory {
  // device
  double parameters = 0, gradients = 0, optimizer = 0, activations = 0;
  // host, every worker
  double buffers = 0, outer = 0;
  // host, the gateway only
  double codec_state = 0, exchange = 0;
  double device() const { return parameters + gradients + optimizer + activations; }
  double host() const { return buffers + outer + codec_state + exchange; }
};
// The gateway of site `site` (it holds the most). Throws nebula::Error for an unknown
// strategy, codec or shard mode.
Memory gateway_memory(const Topology& t, size_t site, const Candidate& c);

struct Prediction {
  Candidate candidate;
  double compute_s = 0;            // t_c: compute of the slowest site per step
  double lan_s = 0;                // t_ar: intra-site all-reduce of the slowest site
  double bubble = 0;               // the pipeline's idle fraction (P − 1) / (M + P − 1)
  double wan_exchange_s = 0;       // t_x of one exchange (one fragment for streaming)
  double step_s = 0;               // predicted wall time per step
  double wan_bytes_per_step = 0;   // all gateways together
  double compression = 1;          // 4n / P(n)
  double utilization = 0;          // compute utilization U in [0, 1]
  double tokens_per_s = 0;         // the whole job
  Memory memory;                   // the gateway of the site with the largest device need
  bool runnable = true;            // shard = "none" or "optimizer"
  bool fits = true;                // every given worker_memory / host_memory suffices
  std::string misfit;              // why not, e.g. "needs 1.27 TiB of device memory per worker at
                                   // site us-east, has 80.00 GiB"; empty when it fits
};

// Every candidate of [candidates]: sync × codecs (sparseloco needs diloco/streaming),
// diloco × codecs × inner_steps, streaming × codecs × inner_steps × fragments × delays (only
// F <= H and τ < H, as the job config requires).
std::vector<Candidate> enumerate_candidates(const Topology& t);
// The formulas above for one candidate. Throws nebula::Error for an unknown codec or strategy.
Prediction predict(const Topology& t, const Candidate& c);

struct Plan {
  std::vector<Prediction> predictions;  // runnable and fitting first, then best utilization first
  std::optional<size_t> recommended;    // index into predictions; empty when nothing nebula can
                                        // run today (shard = none) fits
  std::string reason;                   // one line: why that one, or why none
  double ideal_tokens_per_s = 0;        // every worker computing all the time
};

// Predicts every candidate and recommends one among those nebula can run (shard = none) that
// fit in memory: the highest utilization; among the candidates within `tolerance` (relative) of
// the best, the one with the lowest quality risk: least compression first, then the fewest
// inner steps H (least staleness), then sync over diloco over streaming (no delayed merges).
// When none is runnable and fits, recommends nothing and says so in `reason`.
Plan make_plan(const Topology& t);

// A readable table (at most `top` rows, 0 = all, plus the recommended row if it is below),
// the memory per worker by strategy and shard mode, and the recommendation; and the same as
// JSON.
std::string format_table(const Topology& t, const Plan& p, size_t top = 0);
std::string format_json(const Topology& t, const Plan& p);

}  // namespace nebula::plan
