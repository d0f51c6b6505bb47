#include "train/worker.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <spdlog/spdlog.h>
#include <torch/optim/adamw.h>

#include <dlfcn.h>

#include <cmath>
#include <filesystem>
#include <thread>

#include "collective/gateway_mesh.h"
#include "collective/hierarchical.h"
#include "collective/site_group.h"
#include "data/tokenizer.h"
#include "model/mlm_batch.h"
#include "model/mlm_encoder.h"
#include "model/peft.h"
#include "model/safetensors.h"
#include "nebula/error.h"
#include "nebula/log.h"
#include "strategy/strategy.h"
#include "train/evaluation.h"
#include "train/metrics.h"
#include "train/site_data.h"
#include "train/gateway.h"
#include "transport/tcp_link.h"

namespace nebula::train {
namespace {


// Loss and predicted-token count, summed, over a fixed set of validation batches.
std::pair<double, double> evaluate(model::MlmEncoder& model, model::MlmBatcher& batcher, int64_t batches) {
  at::NoGradGuard no_grad;
  model->eval();
  double loss_sum = 0, predicted = 0;
  for (int64_t i = 0; i < batches; ++i) {
    model::MlmBatch b = batcher.next();
    loss_sum += model->loss(b.ids, b.labels).item<double>() * static_cast<double>(b.predicted);
    predicted += static_cast<double>(b.predicted);
  }
  model->train();
  return {loss_sum, predicted};
}

// Sums counters over every worker of the job. The hierarchy reduces float32, exact only up to
// 2^24, so each value travels as a high and a low part (exact for integers up to 2^44).
std::vector<double> sum_over_job(collective::Hierarchy& comm, const std::vector<double>& values) {
  constexpr double kSplit = 1 << 20;
  at::Tensor t = at::empty({static_cast<int64_t>(2 * values.size())}, at::kFloat);
  for (size_t i = 0; i < values.size(); ++i) {
    const double hi = std::floor(values[i] / kSplit);
    t[static_cast<int64_t>(2 * i)] = static_cast<float>(hi);
    t[static_cast<int64_t>(2 * i + 1)] = static_cast<float>(values[i] - hi * kSplit);
  }
  comm.allreduce(t, {collective::ReduceOp::kSum, 1.0});
  std::vector<double> out(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    out[i] = static_cast<double>(t[static_cast<int64_t>(2 * i)].item<float>()) * kSplit +
             static_cast<double>(t[static_cast<int64_t>(2 * i + 1)].item<float>());
  return out;
}

// The pre-trained encoder, as RUN_DIR/model.safetensors with its shape in the metadata (what a
// seq2seq job's model.init and other tools read). Site 0's copy: every site holds the same
// weights after a synchronous step or a final outer step.
void save_encoder(model::MlmEncoderImpl& model, const Config& c, const std::string& tokenizer, int64_t steps) {
  model::save_module(model, c.job.run_dir + "/model.safetensors",
                     {{"format", "nebula"},
                      {"kind", "mlm_encoder"},
                      {"dim", std::to_string(c.model.dim)},
                      {"layers", std::to_string(c.model.layers)},
                      {"heads", std::to_string(c.model.heads)},
                      {"ffn", std::to_string(c.model.ffn)},
                      {"max_len", std::to_string(c.model.max_len)},
                      {"peft", c.peft.kind},
                      {"tokenizer", std::filesystem::absolute(tokenizer).string()},
                      {"steps", std::to_string(steps)}});
}

}  // namespace

std::string default_tokenizer_path(const Config& c) { return c.job.run_dir + "/tokenizer.model"; }

void run_worker(const Config& c, const WorkerIdentity& who) {
  const SiteConfig& site = c.sites.at(who.site);
  const int workers = static_cast<int>(site.workers);
  NEBULA_CHECK(who.local_rank >= 0 && who.local_rank < workers, "site '", site.name, "' has ", workers,
               " workers; rank ", who.local_rank, " does not exist");
  init_logging(str_cat(site.name, "/", who.local_rank));
  // Several workers share the machine's cores: one intra-op thread each.
  at::set_num_threads(1);
  // OpenBLAS keeps its own pool (sized from the cores, not from at::set_num_threads).
  using SetThreads = void (*)(int);
  if (auto f = reinterpret_cast<SetThreads>(::dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) f(1);
  const auto start = Clock::now();
  const Millis timeout = std::chrono::duration_cast<Millis>(c.job.timeout);

  // Data: this site's own sentences, this worker's share of them.
  const std::string tokenizer_path = c.data.tokenizer.empty() ? default_tokenizer_path(c) : c.data.tokenizer;
  data::Tokenizer tok = data::Tokenizer::load(tokenizer_path);
  SiteText text = load_site_text(c, who.site, who.local_rank, workers);
  model::SpecialIds ids{tok.pad_id(), tok.unk_id(), tok.bos_id(), tok.eos_id(), tok.mask_id(), 5, tok.vocab_size()};
  NEBULA_CHECK(tok.mask_id() >= 0, tokenizer_path, " has no <mask> piece: train it with nebula");
  const uint64_t stream = c.job.seed * 1000003 + who.site * 1009 + static_cast<uint64_t>(who.local_rank);
  auto sequences = encode_all(tok, text.train, c.model.max_len);
  size_t tlm_sequences = 0;
  if (c.data.objective == "mlm+tlm") {  // XLM's translation LM: the pair in one sequence
    auto tlm = encode_tlm(tok, text.train_pairs, c.model.max_len);
    tlm_sequences = tlm.size();
    sequences.insert(sequences.end(), std::make_move_iterator(tlm.begin()), std::make_move_iterator(tlm.end()));
  }
  model::MlmBatcher batches(std::move(sequences), ids, c.data.mask_prob, c.data.batch_size, stream);
  std::unique_ptr<model::MlmBatcher> valid;
  if (!text.valid.empty())
    valid = std::make_unique<model::MlmBatcher>(encode_all(tok, text.valid, c.model.max_len), ids, c.data.mask_prob,
                                                c.data.batch_size, c.job.seed);
  spdlog::info("{} training sentences (+ {} translation-LM pairs) / {} validation sentences on this worker",
               text.train.size(), tlm_sequences, text.valid.size());
  // The gateway evaluates the site's own held-out pairs (cross-lingual accuracy, retrieval).
  std::unique_ptr<XlingualProbe> probe;
  if (who.local_rank == 0) probe = std::make_unique<XlingualProbe>(c, who.site, tok, ids);

  // Communication: the site's c10d group, and on the gateway the WAN mesh to the other sites.
  auto [store_host, store_port] = transport::parse_host_port(site.store);
  collective::SiteGroup group(site.name, store_host, store_port, who.local_rank, workers, timeout);
  GatewayLinks gateway;
  std::unique_ptr<collective::GatewayMesh> mesh;
  if (who.local_rank == 0) {
    gateway = connect_gateway(c, who.site);
    std::vector<std::string> names;
    for (const auto& s : c.sites) names.push_back(s.name);
    mesh = std::make_unique<collective::GatewayMesh>(collective::MeshOptions{who.site, names, timeout},
                                                     std::move(gateway.links));
  }
  collective::Hierarchy comm(group, mesh.get());

  at::manual_seed(c.job.seed);
  model::MlmEncoder model(c.model, tok.vocab_size(), tok.pad_id());
  // PEFT freezes the backbone (equal on every worker: same seed). Only the trainable
  // parameters are optimized and synchronized, so they alone cross the WAN.
  auto params = model::apply_peft(*model, c.peft);
  spdlog::info("{} trainable of {} parameters (peft: {})", model::numel(params), model::numel(model->parameters()),
               c.peft.kind);
  auto strategy = strategy::make_strategy(c.strategy, comm, timeout, c.sites.size(), who.site);
  strategy->init(params);
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(c.model.lr).weight_decay(c.model.weight_decay));

  MetricsWriter metrics(c.job.run_dir + "/metrics.jsonl");
  int64_t tokens = 0;
  double window_loss = 0, window_predicted = 0, last_loss = 0, last_predicted = 0;
  auto window_start = Clock::now();
  int64_t window_tokens = 0;

  // One metrics line per `log_every` steps (and one for the last, partial window).
  auto write_metrics = [&](int64_t steps_done) {
    const double seconds = std::chrono::duration<double>(Clock::now() - window_start).count();
    const auto stats = comm.stats();
    nlohmann::json links = nlohmann::json::object();
    for (size_t j = 0; j < stats.links.size(); ++j) {
      const auto& e = stats.links[j];
      if (j == who.site || (e.rtt_samples == 0 && e.bandwidth_samples == 0)) continue;
      links[c.sites[j].name] = {{"rtt_ms", e.rtt_s * 1e3},
                                {"rtt_smoothed_ms", e.rtt_smoothed_s * 1e3},
                                {"bandwidth_bits_per_s", e.bandwidth_bits_per_s}};
    }
    metrics.write({{"time", unix_time()},
                   {"elapsed", std::chrono::duration<double>(Clock::now() - start).count()},
                   {"site", site.name},
                   {"rank", who.local_rank},
                   {"step", steps_done},
                   {"steps", c.job.steps},
                   {"loss", window_loss / window_predicted},
                   {"tokens", tokens},
                   {"tokens_per_s", seconds > 0 ? static_cast<double>(window_tokens) / seconds : 0.0},
                   {"wan_bytes_sent", stats.wan_bytes_sent},
                   {"wan_bytes_received", stats.wan_bytes_received},
                   {"wan_links", links},
                   {"codec_bytes_in", stats.codec_bytes_in},
                   {"codec_bytes_out", stats.codec_bytes_out},
                   {"compression_ratio",
                    stats.codec_bytes_out ? double(stats.codec_bytes_in) / double(stats.codec_bytes_out) : 1.0},
                   {"encode_seconds", stats.encode_seconds},
                   {"decode_seconds", stats.decode_seconds}});
    last_loss = window_loss;
    last_predicted = window_predicted;
    window_loss = window_predicted = 0;
    window_tokens = 0;
    window_start = Clock::now();
  };

  // Cross-lingual evaluation on the gateway: a metrics line {"site", "step", "eval"}.
  auto probe_now = [&](int64_t steps_done) {
    std::vector<double> counts = probe->run(*model);
    metrics.write({{"time", unix_time()}, {"site", site.name}, {"rank", 0}, {"step", steps_done},
                   {"eval", probe->to_json(counts)}});
    return counts;
  };
  std::vector<double> eval_start = probe ? probe_now(0) : std::vector<double>{};

  int64_t step = 0;
  for (; strategy->keep_training(step, c.job.steps); ++step) {
    const auto step_start = Clock::now();
    model::MlmBatch batch = batches.next();
    at::Tensor loss = model->loss(batch.ids, batch.labels);
    optimizer.zero_grad();
    strategy->before_backward(static_cast<double>(batch.predicted));
    loss.backward();  // gradient buckets start crossing the WAN while this runs
    strategy->sync_gradients(params, static_cast<double>(batch.predicted));
    optimizer.step();
    strategy->after_step(step);
    if (site.slowdown > 1)  // emulated slower hardware: this step takes `slowdown` times as long
      std::this_thread::sleep_for((Clock::now() - step_start) * (site.slowdown - 1));

    tokens += batch.tokens;
    window_tokens += batch.tokens;
    window_loss += loss.item<double>() * static_cast<double>(batch.predicted);
    window_predicted += static_cast<double>(batch.predicted);
    if ((step + 1) % c.job.log_every == 0) write_metrics(step + 1);
    if (probe && c.eval.every > 0 && (step + 1) % c.eval.every == 0) probe_now(step + 1);
  }
  strategy->finish();  // exchanges still in flight
  if (window_predicted > 0) write_metrics(step);

  // End of run: validation loss, and job-wide totals for the summary, in one collective.
  const auto wan = comm.stats();  // before the totals exchange itself
  auto [val_sum, val_predicted] = valid ? evaluate(model, *valid, c.job.eval_batches) : std::pair{0.0, 0.0};
  // Every worker adds the same number of counters; the gateway's hold its site's evaluation.
  const size_t eval_size = XlingualProbe::size(c);
  std::vector<double> eval_end = probe ? probe_now(step) : std::vector<double>(eval_size, 0.0);
  if (!probe) eval_start.assign(eval_size, 0.0);
  std::vector<double> counters = {static_cast<double>(tokens), static_cast<double>(wan.wan_bytes_sent),
                                  static_cast<double>(wan.wan_bytes_received), last_loss,
                                  last_predicted, val_sum, val_predicted};
  counters.insert(counters.end(), eval_start.begin(), eval_start.end());
  counters.insert(counters.end(), eval_end.begin(), eval_end.end());
  std::vector<double> totals = sum_over_job(comm, counters);
  auto total = [&](int i) { return totals[static_cast<size_t>(i)]; };
  auto eval_part = [&](size_t k) {
    return std::vector<double>(totals.begin() + 7 + static_cast<std::ptrdiff_t>(k * eval_size),
                               totals.begin() + 7 + static_cast<std::ptrdiff_t>((k + 1) * eval_size));
  };
  if (mesh && who.site == 0) {
    nlohmann::json summary = {
        {"job", c.job.name},
        {"strategy", strategy->name()},
        {"decisions", strategy->decisions()},
        {"codec", c.strategy.codec},
        {"compression_ratio", wan.codec_bytes_out ? double(wan.codec_bytes_in) / double(wan.codec_bytes_out) : 1.0},
        {"sites", c.sites.size()},
        {"workers", c.total_workers()},
        {"steps", c.job.steps},
        {"local_steps_site0", step},
        {"tokens", total(0)},
        {"wall_seconds", std::chrono::duration<double>(Clock::now() - start).count()},
        {"final_train_loss", total(4) > 0 ? total(3) / total(4) : 0.0},
        {"final_val_loss", total(6) > 0 ? nlohmann::json(total(5) / total(6)) : nlohmann::json(nullptr)},
        {"objective", c.data.objective},
        {"eval_start", probe->to_json(eval_part(0))},
        {"eval", probe->to_json(eval_part(1))},
        {"model", c.job.run_dir + "/model.safetensors"},
        {"wan_bytes", total(1)},
        {"wan_bytes_sent", total(1)},
        {"wan_bytes_received", total(2)},
        {"security", c.security.insecure ? "plaintext" : "mutual TLS 1.3"},
        {"wan_streams", c.wan.streams},
        {"wan_links_seen_from_" + site.name, [&] {
           nlohmann::json links = nlohmann::json::object();
           for (size_t j = 0; j < wan.links.size(); ++j)
             if (j != who.site)
               links[c.sites[j].name] = {{"rtt_ms", wan.links[j].rtt_s * 1e3},
                                         {"bandwidth_bits_per_s", wan.links[j].bandwidth_bits_per_s}};
           return links;
         }()},
        {"wan_emulation", {{"bandwidth_bits_per_s", c.wan.path.bandwidth_bits},
                           {"rtt_ms", std::chrono::duration<double, std::milli>(c.wan.path.rtt).count()}}}};
    write_json_atomically(c.job.run_dir + "/summary.json", summary);
  }
  if (mesh && who.site == 0) save_encoder(*model, c, tokenizer_path, step);
  group.barrier();  // nobody closes its links while another still needs them
  spdlog::info("done: {} steps, {} tokens", step, tokens);
}

}  // namespace nebula::train
