// The job configuration: one TOML file per job (see examples/). Loaded and validated in one
// place (config.cc): unknown keys, wrong types and bad units are ConfigErrors naming the file,
// line, column and key. Every default lives in the structs below.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace nebula {

struct JobConfig {
  std::string name = "nebula";
  std::string run_dir;              // default: runs/<name>
  uint64_t seed = 1;
  int64_t steps = 100;              // optimizer steps per worker
  int64_t log_every = 10;           // steps between metrics lines
  int64_t eval_batches = 8;         // validation batches per worker at the end
  std::chrono::nanoseconds timeout = std::chrono::seconds(120);  // deadline of every collective
  // A site lost for good (its link down past wan.reconnect_timeout, or no answer within
  // `timeout`) is left out and the others go on; local mode then stops only that site.
  bool elastic = false;
  // Local mode with elastic diloco/streaming: a lost site is started again (--rejoin) up to
  // this many times; it resumes from its checkpoint and takes the others' global state.
  int64_t restarts = 0;
  // A Python (or any) program to run as every worker instead of `nebula worker`, e.g.
  // ["python3", "train.py"]: local mode starts one process per worker of every site with
  // its placement in the environment (docs/python.md); it trains through the `nebula` Python
  // package. Empty: the built-in training loop.
  std::vector<std::string> command;
};

// What a job measures besides its loss ([eval]).
struct EvalConfig {
  // mlm_encoder: steps between each site's cross-lingual evaluation on its own held-out pairs
  // (MLM accuracy and parallel-sentence retrieval per language); 0 = at the start and the end only.
  int64_t every = 0;
  int64_t pairs = 200;               // held-out pairs per language used by each evaluation (0 = all)
  int64_t beam = 4;                  // seq2seq: beam width of the BLEU evaluation (1 = greedy)
  // seq2seq: α of the beam's length normalisation, score = Σ log p / ((5 + n) / 6)^α (GNMT);
  // 0 = plain sums (short hypotheses win), larger = longer translations.
  double length_penalty = 0.6;
};

struct ModelConfig {
  // mlm_encoder (pre-training) | seq2seq (English→X translation) | classifier (zero-shot
  // cross-lingual transfer: which of data.packages a message belongs to, trained on English
  // messages, evaluated on their translations in data.languages) | torchscript (the user's own
  // module: model.script, fed from data.source = "tensors"; dim ... decoder_layers do not apply)
  std::string kind = "mlm_encoder";
  int64_t dim = 64;
  int64_t layers = 2;
  int64_t heads = 4;
  int64_t ffn = 256;
  int64_t max_len = 32;              // tokens per sequence, including BOS/EOS
  double dropout = 0.0;
  double lr = 1e-3;                  // AdamW's peak learning rate
  double weight_decay = 0.01;
  // The learning rate over the job's steps (parallel/inner_optimizer.h, scheduled_lr): a linear
  // warmup over the first warmup_steps, then "constant", or a "cosine" / "linear" decay to
  // lr_floor·lr at job.steps. diloco's inner optimizer follows it too.
  std::string lr_schedule = "constant";
  int64_t warmup_steps = 0;
  double lr_floor = 0.1;
  // Gradient clipping: before each optimizer step the site's averaged gradient is scaled to
  // global L2 norm at most clip_norm; 0 = off.
  double clip_norm = 0;
  // seq2seq: label smoothing of the translation cross-entropy (0 = none).
  double label_smoothing = 0;
  // classifier: train the head alone on the (pre-trained) encoder, a linear probe; the
  // encoder's weights stay as loaded.
  bool freeze_encoder = false;
  int64_t decoder_layers = 2;        // seq2seq: decoder layers (`layers` is the encoder's)
  // A trained model's model.safetensors to start from (its dims and vocabulary must match): a
  // model of this kind, whole (e.g. a seq2seq fine-tuned further, with [peft] on top of it), or
  // a pre-trained mlm_encoder: the whole of an mlm_encoder job, the encoder of a seq2seq or a
  // classifier. Empty = random.
  std::string init;
  // torchscript: the module saved by torch.jit.save, and how its forward gives the loss:
  // "output" (forward(inputs, targets) returns it) | "cross_entropy" | "mse" (forward(inputs)
  // returns logits / predictions). See src/model/script_model.h.
  std::string script;
  std::string loss = "output";
};

struct DataConfig {
  // gettext | tsv | text | corpus (a directory written by `nebula corpus build`: its own
  // train/valid/test.tsv splits are used as they are) | tensors (model.kind = "torchscript":
  // PATH/<site>.safetensors or PATH/<site>/*.safetensors with "inputs" (or "inputs.0",
  // "inputs.1", ...) and "targets")
  std::string source = "gettext";
  std::string path = "/usr/share/locale";  // locale dir (gettext), a file (tsv, text) or a directory (corpus)
  std::vector<std::string> languages;      // gettext: the languages of the whole job
  int64_t max_pairs_per_language = 2000;   // gettext: pairs read per language; 0 = all
  double valid_fraction = 0.05;      // gettext/tsv/text/tensors: hash-chosen held-out shares
  double test_fraction = 0.05;
  int64_t vocab_size = 1000;
  std::string tokenizer;             // an existing SentencePiece .model; empty = train one
  // What nebula trains the job's vocabulary on (`nebula run` without data.tokenizer, `nebula
  // tokenizer`), never the text of several sites: the training split of one site's own data,
  // `tokenizer_site` ("" = the first site with shareable = true, else the first site), or a
  // file of sentences (one per line) that may be given to every site, `tokenizer_corpus`.
  // The vocabulary goes to every site: its pieces reveal frequent substrings of that text.
  std::string tokenizer_site;
  std::string tokenizer_corpus;
  int64_t batch_size = 16;           // sentences per worker per step
  double mask_prob = 0.15;
  // mlm_encoder: "mlm" trains on single sentences; "mlm+tlm" adds every training pair as one
  // translation-LM sequence "<s> en </s> other </s>" (XLM), masked the same way.
  std::string objective = "mlm";
  // mlm_encoder: cross-lingual alignment, a translation-ranking loss (InfoXLM / LaBSE style)
  // added to MLM with this weight (0 = off): each step the worker embeds contrastive_batch of
  // its own site's training pairs (mean-pooled, unit length), and each English sentence must
  // pick its own translation among the batch's (and back), at temperature
  // contrastive_temperature. The pairs are the site's; no batch element comes from elsewhere.
  double contrastive_weight = 0;
  // classifier: the gettext domains whose messages are classified (label = index; package
  // "git" is LC_MESSAGES/git.mo), at least 2, each with a catalog in every data.languages.
  std::vector<std::string> packages;
  int64_t contrastive_batch = 32;
  double contrastive_temperature = 0.05;
};

struct SiteConfig {
  std::string name;
  int64_t workers = 1;
  // cpu | cuda (worker r takes GPU r mod the GPUs it sees) | cuda:N. A GPU site trains on the
  // GPU; its site reduce and WAN traffic go through pinned host memory (Gloo, not NCCL, so far).
  std::string device = "cpu";
  std::string gateway = "127.0.0.1:0";  // WAN listen address of the site's gateway (rank 0)
  std::string store = "127.0.0.1:0";    // intra-site rendezvous (c10d TCPStore on rank 0)
  // wan.mode = "every_worker": the WAN listen addresses of ranks 1 .. workers-1, in rank order
  // (rank 0 listens at `gateway`). Local mode picks them; a deployment must set them.
  std::vector<std::string> worker_addresses;
  std::vector<std::string> languages;   // this site's shard; empty = a slice of the whole corpus
  double slowdown = 1.0;                // emulated slower hardware: each step takes this many times longer
  int64_t max_pairs_per_language = 0;   // this site holds at most this many training pairs per language (0 = data's)
  // Whether this site's training pairs may leave it: required to send them to another
  // site's teacher ([distill]). Everything else a site shares is model updates.
  bool shareable = false;
  // [[sites]] parallel = { pipeline = P }: this site's pipeline stages, overriding [parallel]
  // pipeline (0: the job's). Sites of different layouts train one model together (diloco and
  // streaming exchange by position in the flat parameter vector, not by rank).
  int64_t pipeline = 0;
  // [[sites]] parallel = { tensor = T }: this site's tensor slices per replica, overriding
  // [parallel] tensor (0: the job's).
  int64_t tensor = 0;
};

// [distill]: cross-site knowledge distillation for seq2seq. The teacher serves on
// `teacher_site`; every other site's student asks it for its top-k distribution per target token.
struct DistillConfig {
  std::string teacher_site;          // empty = no distillation
  std::string teacher;               // the teacher's model.safetensors, on the teacher site
  int64_t top_k = 8;                 // entries of the teacher distribution sent per token
  double temperature = 1.0;
  double alpha = 0.5;                // loss = (1 - alpha)·CE + alpha·KD
  int64_t prefetch = 4;              // batches requested ahead of the one being trained on
  bool enabled() const { return !teacher_site.empty(); }
};

// What the WAN between two sites looks like. In local mode nebula emulates it in process
// (there is no real WAN on one machine); in a deployment leave it at zero.
struct WanPathConfig {
  double bandwidth_bits = 0;            // bottleneck of the site pair; 0 = unlimited
  std::chrono::nanoseconds rtt{0};      // round trip (half each way)
  std::chrono::nanoseconds jitter{0};   // extra one-way delay, uniform in [0, jitter]
};

struct WanPairConfig {                  // [[wan.pairs]]: overrides for one pair of sites
  std::string a, b;
  WanPathConfig path;
};

struct WanFaultConfig {                 // [[wan.faults]]: scheduled faults (emulation only)
  std::string kind;                     // cut | stall | corrupt | blackhole
  std::string a, b;                     // the pair; empty = every pair
  std::optional<std::chrono::nanoseconds> at;  // since the link was set up
  std::optional<uint64_t> after_bytes;         // or once this many bytes were sent
  std::chrono::nanoseconds duration{0};        // stall length
  // cut only: fire again `every` after each reconnection (at/after then only place the
  // first cut; without them it comes `every` after the link is set up)
  std::optional<std::chrono::nanoseconds> every;
};

struct WanConfig {
  // Who carries a site's WAN traffic: "gateway" (local rank 0 holds the site's links) or
  // "every_worker" (each worker links to every worker of the other sites and exchanges its
  // own part of the model state itself; diloco/streaming only).
  std::string mode = "gateway";
  WanPathConfig path;                   // every pair not named in `pairs`
  // Emulation: each host's (worker process's) own egress limit, shared by all of its links,
  // in front of the site pair's `bandwidth`; 0 = unlimited.
  double host_bandwidth_bits = 0;
  std::vector<WanPairConfig> pairs;
  std::vector<WanFaultConfig> faults;
  int64_t streams = 1;                  // parallel TCP connections per site pair (striping)
  uint64_t window_bytes = 4ull << 20;   // emulated per-connection TCP window; 0 = unlimited
  // Largest frame on the wire; a peer sending a larger one is disconnected. Messages of any
  // size cross it: they travel in pieces of piece_bytes().
  uint64_t max_frame = 4ull << 20;
  uint64_t max_pending = 1ull << 30;    // unacknowledged bytes kept per peer for resending
  std::chrono::nanoseconds handshake_timeout = std::chrono::seconds(10);
  std::chrono::nanoseconds reconnect_timeout = std::chrono::seconds(30);  // then PeerLost
  // A connection on which nothing arrives for this long is dead (a black hole, a NAT that
  // forgot it, a hung peer): it is replaced as after a cut. Each side writes at least every
  // quarter of it (heartbeats when idle). Also the TCP_USER_TIMEOUT of WAN sockets. 0 = off.
  std::chrono::nanoseconds liveness_timeout = std::chrono::seconds(20);
  // If not empty, the only addresses a gateway accepts connections from: IPv4 or IPv6
  // addresses or CIDR ranges ("10.0.0.0/8", "2001:db8::/32", "192.0.2.7"). Others are refused
  // before any handshake (audited).
  std::vector<std::string> allow;

  // Payload bytes per piece of a message on the wire: min(256 KiB, max_frame / 2).
  uint64_t piece_bytes() const { return std::min<uint64_t>(256 * 1024, max_frame / 2); }

  // The path between sites a and b (order does not matter).
  WanPathConfig path_between(const std::string& a, const std::string& b) const;
  bool emulated() const;                // any bandwidth, delay or fault configured
  bool every_worker() const { return mode == "every_worker"; }
};

struct StrategyConfig {
  std::string kind = "sync";         // sync | diloco | streaming
  // The lossy codec of the inter-site leg (inside a site everything stays float32).
  // none | fp16 | bf16 | int8 | int4 | topk | powersgd | sparseloco | auto (the adaptive
  // controller chooses; diloco/streaming only)
  std::string codec = "none";
  int64_t codec_block = 256;         // int8/int4: values per scale
  bool codec_stochastic = false;     // int8/int4: stochastic rounding
  double codec_density = 0.01;       // topk: fraction of values kept
  int64_t codec_rank = 4;            // powersgd
  bool codec_error_feedback = true;  // topk/powersgd (int8/int4 optional)
  double codec_error_decay = 1.0;    // error feedback's beta: the residual is scaled by it each encode
                                     // (SparseLoCo decays it, e.g. 0.95; 1 = keep all)
  std::string codec_indices = "fixed";  // sparseloco: "fixed" bits per index or "rice"-coded gaps
  int64_t codec_value_bits = 2;      // sparseloco: 2 (sign, one of two levels) or 1 (sign; one level a chunk)
  uint64_t bucket_bytes = 4ull << 20;  // gradients are exchanged in buckets of about this size
  // diloco / streaming: the outer loop.
  int64_t inner_steps = 50;          // H: inner steps between synchronizations; 0 = auto (controller)
  double outer_lr = 0.7;             // outer optimizer: SGD with Nesterov momentum on pseudo-gradients
  double outer_momentum = 0.9;       // 0 = plain SGD (with sparseloco: error feedback replaces momentum)
  bool outer_nesterov = true;
  int64_t fragments = 4;             // streaming: model fragments, synchronized at staggered steps
  // diloco, gateway mode: the outer step's exchange goes in fragments of about this many bytes
  // of float32 values, one after another at the round's end, so a gateway stages two fragments'
  // pseudo-gradient and payloads at a time, not the whole model's.
  uint64_t staging_bytes = 64ull << 20;
  int64_t delay = 5;                 // streaming: inner steps between sending a fragment and merging it
  bool adaptive = true;              // re-decide codec / H every round (false: once, at the first measurements)
  bool heterogeneous = true;         // diloco/streaming: faster sites run more inner steps per round
  // diloco/streaming: the update guard. A site's pseudo-gradient with a NaN or infinity is
  // always rejected (left out of the round's mean); one whose L2 norm is above this too (0 = no bound).
  double max_update_norm = 0;
  // diloco with codec = "auto" or inner_steps = 0: the adaptive controller watches quality and
  // chooses the fewest WAN bytes whose measured merge gap stays within this fraction (e.g.
  // 0.02; src/strategy/controller.h). 0 = off: it hides the WAN with the least compression.
  double max_loss_penalty = 0;
};

// [privacy]: differential privacy of what leaves a site (diloco/streaming). Each site clips
// its pseudo-gradient to L2 norm `clip` and adds Gaussian noise of standard deviation
// noise_multiplier · clip to every value before it is encoded and sent; an RDP accountant
// reports the ε spent at `delta`. The unit protected is the site's whole dataset: any two
// datasets of a site are neighbours, and a release's L2 sensitivity is 2·clip (the accountant
// records noise multiplier noise_multiplier / 2).
struct PrivacyConfig {
  double clip = 0;                   // C; 0 = off
  double noise_multiplier = 0;       // σ; 0 = clipping only (no privacy guarantee: ε is infinite)
  double delta = 1e-5;
  bool enabled() const { return clip > 0; }
};

struct PeftConfig {
  std::string kind = "none";         // none | lora | adapter: freeze the backbone, train only these
  int64_t rank = 8;                  // lora: rank r of B·A
  double alpha = 16;                 // lora: scale alpha / r
  int64_t adapter_dim = 16;          // adapter: bottleneck width
};

// [parallel]: how the workers of a site split the training state (ZeRO stages).
//  shard = "none"       every worker holds the model, its gradients and AdamW's two moments;
//          "optimizer"  ZeRO-1: each worker keeps AdamW's moments for 1/N of the flattened
//                       parameters (N = the site's workers), steps only that shard, and the
//                       site all-gathers the parameters after every step;
//          "gradients"  ZeRO-2: as "optimizer", and the gradients are reduce-scattered (diloco,
//                       streaming);
//          "full"       ZeRO-3: the parameters are sharded too and gathered layer by layer,
//                       each layer cut evenly over the workers as FSDP cuts its units
//                       (parallel/full_shard.h; built-in models with diloco and streaming).
//  recompute            ZeRO-3 only: keep only each layer's inputs in forward and run the layer
//                       again in backward (activation checkpointing: about a third more compute
//                       for the activations' memory); off: keep the activations.
//  prefetch             ZeRO-3 only: the next layer's all-gather runs (on a second group of the
//                       site, its own thread) while a layer computes, one layer ahead.
//  pipeline = P         the model's layers in P stages over the site's workers, each stage on
//                       workers / P of them (data × pipeline = workers; parallel/pipeline.h);
//  micro_batches = M    each step's batch cut into M micro-batches that flow through the stages
//                       in a 1F1B schedule (idle fraction (P − 1) / (M + P − 1)).
//  tensor = T           every layer split over T workers that compute it together (Megatron's
//                       tensor parallelism: attention heads, MLP units and vocabulary rows
//                       sliced; parallel/tensor_parallel.h): data × pipeline × tensor = workers.
struct ParallelConfig {
  std::string shard = "none";
  bool recompute = false;
  bool prefetch = false;
  int64_t pipeline = 1;
  int64_t micro_batches = 4;
  int64_t tensor = 1;
  uint64_t bucket_bytes = 4ull << 20;  // ZeRO-2 reduce-scatters the gradients in buckets of about this size during backward
};

struct SecurityConfig {
  bool insecure = false;   // plaintext inter-site links (warned at every start)
  std::string certs;       // dir with ca.pem, <site>.pem, <site>.key (`nebula certs`); local mode
                           // default: RUN_DIR/certs, created for the job
  std::string ca, cert, key;  // explicit PEM paths; override `certs`
  // wan.mode = "every_worker": each host presents its own certificate of the site,
  // <certs>/hosts/<site>/<rank>.pem and .key (`nebula certs issue DIR --site S --workers N`),
  // instead of every host holding the site's key. Local mode issues them.
  bool host_certs = false;
  std::string audit_log;   // default RUN_DIR/audit.jsonl
};

struct MetricsConfig {
  std::string progress = "auto";     // auto (in place on a terminal) | plain | off
};

// [checkpoint]: every worker writes its state (weights, optimizer moments, strategy and codec
// state, data position, RNG) into DIR/SITE/rank-R/step-N every `every` steps (0 = only when
// stopped by SIGINT/SIGTERM); `nebula run --resume` continues from the newest intact one.
struct CheckpointConfig {
  int64_t every = 0;
  int64_t keep = 2;                  // newest checkpoints kept per worker (>= 2: one may be torn)
  std::string dir;                   // default RUN_DIR/checkpoints
};

struct Config {
  std::string source_path;           // the file it came from
  JobConfig job;
  EvalConfig eval;
  ModelConfig model;
  DataConfig data;
  std::vector<SiteConfig> sites;
  WanConfig wan;
  StrategyConfig strategy;
  PeftConfig peft;
  DistillConfig distill;
  PrivacyConfig privacy;
  ParallelConfig parallel;
  SecurityConfig security;
  MetricsConfig metrics;
  CheckpointConfig checkpoint;

  int64_t total_workers() const;
  // Index of the site named `name`; ConfigError listing the known names if absent.
  size_t site_index(const std::string& name) const;
  // A site's pipeline stages: its own ([[sites]] parallel), else the job's ([parallel]).
  int64_t pipeline_of(const SiteConfig& site) const { return site.pipeline > 0 ? site.pipeline : parallel.pipeline; }
  // A site's tensor slices per replica: its own ([[sites]] parallel), else the job's.
  int64_t tensor_of(const SiteConfig& site) const { return site.tensor > 0 ? site.tensor : parallel.tensor; }
};

// Parses and validates `path`, after applying `overrides` ("section.key=value", the value in
// TOML syntax, or a bare string). Throws ConfigError.
// Throws ConfigError naming the offending key ("peft.kind", "peft.rank", ...) if `peft` cannot
// be applied to a model of configuration `model`. load_config calls it; so does apply_peft.
void check_peft(const ModelConfig& model, const PeftConfig& peft);

Config load_config(const std::string& path, const std::vector<std::string>& overrides = {});
// Same, from text; `name` is used in messages in place of a file name.
Config parse_config(const std::string& text, const std::string& name,
                    const std::vector<std::string>& overrides = {});
// Serialises back to TOML (what `nebula run` hands to its workers), so that
// parse_config(to_toml(c)) == c.
std::string to_toml(const Config& config);

// A fingerprint (hex) of everything that shapes the training math: model, data, strategy,
// PEFT, distillation, privacy, the seed and the sites' names and data. Not job.steps (a run
// may be extended), timeouts, addresses, WAN emulation, security, metrics or eval, nor a
// site's workers or [parallel] shard (a resume under another layout reshards the checkpoint).
// Checkpoints carry it; resuming under another one is refused.
std::string training_fingerprint(const Config& config);

}  // namespace nebula
