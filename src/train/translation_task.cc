// TranslationTask (English→X, optionally distilled from a teacher on another site) and the
// teacher site's service (task.h).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <spdlog/spdlog.h>

#include <deque>
#include <fstream>

#include "distill/kd_loss.h"
#include "distill/teacher_service.h"
#include "eval/bleu.h"
#include "model/mlm_encoder.h"
#include "model/peft.h"
#include "model/seq2seq.h"
#include "model/seq2seq_batch.h"
#include "nebula/error.h"
#include "site/gateway.h"
#include "train/metrics.h"
#include "train/site_data.h"
#include "train/task.h"
#include "train/translate.h"

namespace nebula::train {
namespace {

using Pairs = std::vector<model::Seq2SeqBatcher::Pair>;

Pairs encode_pairs(const data::Tokenizer& tok, const std::vector<data::SentencePair>& pairs, int64_t max_len) {
  Pairs out;
  for (const auto& p : pairs) {
    if (p.en.empty() || p.other.empty()) continue;
    auto src = encode_all(tok, {p.en}, max_len), tgt = encode_all(tok, {p.other}, max_len);
    out.emplace_back(std::move(src[0]), std::move(tgt[0]));
  }
  return out;
}

// The rows of a padded [batch, T] id tensor without their padding.
distill::Sequences unpad(const at::Tensor& ids, int64_t pad) {
  distill::Sequences out;
  auto a = ids.accessor<int64_t, 2>();
  for (int64_t i = 0; i < ids.size(0); ++i) {
    std::vector<int> row;
    for (int64_t j = 0; j < ids.size(1) && a[i][j] != pad; ++j) row.push_back(static_cast<int>(a[i][j]));
    out.push_back(std::move(row));
  }
  return out;
}

constexpr size_t kBleuCounts = 11;  // matches 1..4, totals 1..4, hypothesis length, reference length, sentences

class TranslationTask : public Task {
 public:
  TranslationTask(const TaskContext& ctx, transport::Link* teacher) : ctx_(ctx), c_(ctx.config) {
    const SiteConfig& site = c_.sites[ctx.who.site];
    SiteText text = site_text(ctx);
    Pairs train = encode_pairs(*ctx.tokenizer, text.train_pairs, c_.model.max_len);
    if (train.empty())
      throw DataError(str_cat("site '", site.name, "': no sentence pairs to train a translation model on (a text "
                              "source has no translations: use gettext, tsv or corpus)"));
    const uint64_t stream = batch_seed(c_, ctx.who);
    train_pairs_ = train.size();
    batches_ = std::make_unique<model::Seq2SeqBatcher>(std::move(train), ctx.ids, c_.data.batch_size, stream);
    Pairs valid = encode_pairs(*ctx.tokenizer, text.valid_pairs, c_.model.max_len);
    if (!valid.empty())
      valid_ = std::make_unique<model::Seq2SeqBatcher>(std::move(valid), ctx.ids, c_.data.batch_size, c_.job.seed);
    if (ctx.who.local_rank == 0) {  // the site's own test pairs, for BLEU
      auto test = load_pairs(c_, &site, data::Split::kTest);
      data::cap_per_language(test, static_cast<size_t>(c_.eval.pairs));
      for (auto& p : test)
        if (!p.en.empty() && !p.other.empty()) test_.push_back(std::move(p));
    }
    spdlog::info("{} training / {} validation / {} test pairs on this worker", train_pairs_,
                 valid_ ? valid_->size() : 0, test_.size());

    at::manual_seed(c_.job.seed);  // the same initial weights on every worker
    model_ = model::Seq2Seq(c_.model, c_.model.decoder_layers, ctx.tokenizer->vocab_size(), ctx.ids);
    if (!c_.model.init.empty()) load_pretrained(ctx, *model_, *model_->encoder());
    // [peft] (LoRA): the loaded encoder and the decoder frozen, low-rank updates in every layer.
    params_ = model::apply_peft(*model_, c_.peft);
    if (c_.peft.kind != "none")
      spdlog::info("{} trainable of {} parameters (peft: {})", model::numel(params_), model::numel(model_->parameters()),
                   c_.peft.kind);
    if (teacher) {
      client_ = std::make_unique<distill::TeacherClient>(*teacher);
      teacher_link_ = teacher;
      spdlog::info("distilling from the teacher on site '{}' (top-{}, alpha {}, {} batches prefetched)",
                   c_.distill.teacher_site, c_.distill.top_k, c_.distill.alpha, c_.distill.prefetch);
    }
  }

  torch::nn::Module& module() override { return *model_; }
  std::vector<at::Tensor> trainable() override { return params_; }
  std::vector<torch::nn::Module*> layers() override { return model_->units(); }
  void set_layer_gather(model::LayerGather* gather) override { model_->set_layer_gather(gather); }
  parallel::TensorSplit* split_for_tensor(parallel::SiteTensorGroup& group) override {
    NEBULA_CHECK(!client_, "tensor slices of a distilled student are not built");
    return split_built_in(model_, group, c_.model);
  }
  std::vector<int> tensor_dims() override { return tensor_dims_built_in(model_); }

  Step forward(int64_t) override {
    if (!client_) {
      model::Seq2SeqBatch b = batches_->next();
      return {model_->loss(b.src, b.tgt_in, b.tgt_out, c_.model.label_smoothing), static_cast<double>(b.target_tokens),
              b.src.numel()};
    }
    // Keep `prefetch` batches requested ahead of this one, so the teacher's answers (a WAN
    // round trip plus its compute away) are already here when they are needed.
    while (queue_.size() <= static_cast<size_t>(c_.distill.prefetch)) request(batches_->next_indices());
    auto [id, indices, b] = std::move(queue_.front());
    queue_.pop_front();
    distill::TopK teacher = client_->wait(id, Deadline::after(c_.job.timeout));
    // The teacher's rows are the target positions, sequence by sequence: target_logits' rows.
    at::Tensor rows = model_->target_logits(b.src, b.tgt_in, b.tgt_out);  // [N, V]
    at::Tensor targets = b.tgt_out.index({b.tgt_out.ne(model::kIgnoreIndex)});
    at::Tensor ce = at::cross_entropy_loss(rows, targets, {}, at::Reduction::Mean, model::kIgnoreIndex,
                                           c_.model.label_smoothing);
    at::Tensor kd = distill::kd_loss(rows, teacher, c_.distill.temperature);
    kd_sum_ += kd.item<double>() * static_cast<double>(b.target_tokens);
    kd_tokens_ += static_cast<double>(b.target_tokens);
    const double alpha = c_.distill.alpha;
    return {ce * (1 - alpha) + kd * alpha, static_cast<double>(b.target_tokens), b.src.numel()};
  }

  bool has_validation() const override { return valid_ != nullptr; }
  std::pair<double, double> validate(int64_t batches) override {
    if (!valid_) return {0.0, 0.0};
    at::NoGradGuard no_grad;
    model_->eval();
    double loss_sum = 0, weight = 0;
    for (int64_t i = 0; i < batches; ++i) {
      model::Seq2SeqBatch b = valid_->next();
      loss_sum += model_->loss(b.src, b.tgt_in, b.tgt_out).item<double>() * static_cast<double>(b.target_tokens);
      weight += static_cast<double>(b.target_tokens);
    }
    model_->train();
    return {loss_sum, weight};
  }

  // The batcher has already drawn the batches requested ahead: they are saved as their pairs
  // and requested again after a resume, in the same order.
  void save_state(parallel::Checkpoint& checkpoint) const override {
    parallel::put_batcher(checkpoint, "train", batches_->state());
    nlohmann::json queued = nlohmann::json::array();
    for (const auto& p : queue_) queued.push_back(p.indices);
    checkpoint.state["data"]["queued"] = queued;
  }
  void load_state(const parallel::Checkpoint& checkpoint) override {
    batches_->restore(parallel::get_batcher(checkpoint, "train"));
    const auto& data = checkpoint.state["data"];
    if (!client_) return;
    NEBULA_CHECK(queue_.empty(), "load_state after training started");
    if (data.contains("queued") && data["queued"].is_array())
      for (const auto& q : data["queued"]) {
        std::vector<size_t> indices = q.get<std::vector<size_t>>();
        for (size_t i : indices)
          if (i >= batches_->size())
            throw DataError(str_cat("checkpoint of step ", checkpoint.step, ": a queued batch names pair ", i,
                                    " of ", batches_->size(), ": the data changed since the checkpoint"));
        request(std::move(indices));
      }
  }

  // BLEU statistics of the site's test pairs (beam search), and the translations as a file.
  size_t eval_size() const override { return kBleuCounts; }
  std::vector<double> evaluate() override {
    std::vector<double> out(kBleuCounts, 0.0);
    if (test_.empty()) return out;
    std::vector<std::string> sources, refs;
    for (const auto& p : test_) {
      sources.push_back(p.en);
      refs.push_back(p.other);
    }
    const auto hyps = translate(*model_, *ctx_.tokenizer, sources, c_.eval.beam, c_.eval.length_penalty);
    const eval::BleuScore s = eval::corpus_bleu(hyps, refs);
    for (int n = 0; n < 4; ++n) {
      out[static_cast<size_t>(n)] = static_cast<double>(s.counts[static_cast<size_t>(n)]);
      out[4 + static_cast<size_t>(n)] = static_cast<double>(s.totals[static_cast<size_t>(n)]);
    }
    out[8] = static_cast<double>(s.sys_len);
    out[9] = static_cast<double>(s.ref_len);
    out[10] = static_cast<double>(hyps.size());
    std::ofstream tsv(str_cat(c_.job.run_dir, "/translations-", c_.sites[ctx_.who.site].name, ".tsv"));
    tsv << "# source\treference\ttranslation\n";
    for (size_t i = 0; i < hyps.size(); ++i) tsv << sources[i] << '\t' << refs[i] << '\t' << hyps[i] << '\n';
    return out;
  }
  nlohmann::json eval_json(const std::vector<double>& c) const override {
    if (c.size() < kBleuCounts || c[10] == 0) return nlohmann::json::object();
    std::array<size_t, 4> counts{}, totals{};
    for (size_t n = 0; n < 4; ++n) {
      counts[n] = static_cast<size_t>(c[n]);
      totals[n] = static_cast<size_t>(c[4 + n]);
    }
    // sacreBLEU's default smoothing (exp): a short or weak system's missing 4-gram matches do
    // not zero the whole score.
    eval::BleuOptions o;
    o.smoothing = eval::BleuSmoothing::kExp;
    const eval::BleuScore s =
        eval::compute_bleu(counts, totals, static_cast<size_t>(c[8]), static_cast<size_t>(c[9]), o);
    return {{"bleu", s.score}, {"sentences", c[10]}, {"beam", c_.eval.beam},
            {"length_penalty", c_.eval.length_penalty}, {"bleu_line", s.format()}};
  }

  void finish() override {
    if (client_) client_->close();  // bye: the teacher's service ends
  }

  nlohmann::json summary() const override {
    nlohmann::json s = {{"train_pairs", train_pairs_}};  // the writer's (the first site's gateway's) share
    if (!client_) return s;
    const auto st = client_->stats();
    const auto link = teacher_link_->stats();
    const double tokens = static_cast<double>(std::max<uint64_t>(1, st.tokens));
    const double logits_bytes = 4.0 * static_cast<double>(ctx_.tokenizer->vocab_size());
    s["distill"] = {{"teacher_site", c_.distill.teacher_site},
                    {"top_k", c_.distill.top_k},
                    {"alpha", c_.distill.alpha},
                    {"temperature", c_.distill.temperature},
                    {"prefetch", c_.distill.prefetch},
                    {"requests", st.requests},
                    {"tokens", st.tokens},
                    {"response_bytes", st.bytes_received},
                    {"request_bytes", st.bytes_sent},
                    {"link_bytes_received", link.bytes_received},
                    {"link_bytes_sent", link.bytes_sent},
                    {"bytes_per_token", static_cast<double>(st.bytes_received) / tokens},
                    {"fp32_logits_bytes_per_token", logits_bytes},
                    {"reduction_vs_fp32_logits", logits_bytes / (static_cast<double>(st.bytes_received) / tokens)},
                    {"wait_seconds", st.wait_seconds},
                    {"final_kd_loss", kd_tokens_ > 0 ? kd_sum_ / kd_tokens_ : 0.0}};
    return s;
  }

  std::map<std::string, std::string> model_metadata() const override {
    auto m = text_model_metadata(ctx_, "seq2seq");
    m["decoder_layers"] = std::to_string(c_.model.decoder_layers);
    return m;
  }


 private:
  // Asks the teacher for its distribution on the batch of these pairs; queued for forward().
  void request(std::vector<size_t> indices) {
    model::Seq2SeqBatch b = batches_->make(indices);
    client_->submit(next_id_, unpad(b.src, ctx_.ids.pad), unpad(b.tgt_in, ctx_.ids.pad));
    queue_.push_back({next_id_++, std::move(indices), std::move(b)});
  }

  struct Pending {
    uint64_t id;
    std::vector<size_t> indices;  // the batch's pairs (checkpoints save these, not the batch)
    model::Seq2SeqBatch batch;
  };
  const TaskContext& ctx_;
  const Config& c_;
  size_t train_pairs_ = 0;
  std::unique_ptr<model::Seq2SeqBatcher> batches_, valid_;
  std::vector<data::SentencePair> test_;
  model::Seq2Seq model_{nullptr};
  std::vector<at::Tensor> params_;  // what trains: every parameter, or PEFT's
  std::unique_ptr<distill::TeacherClient> client_;
  transport::Link* teacher_link_ = nullptr;
  std::deque<Pending> queue_;
  uint64_t next_id_ = 0;
  double kd_sum_ = 0, kd_tokens_ = 0;
};

}  // namespace

std::unique_ptr<Task> make_translation_task(const TaskContext& context, transport::Link* teacher) {
  return std::make_unique<TranslationTask>(context, teacher);
}

void run_teacher(const TaskContext& ctx) {
  const Config& c = ctx.config;
  LoadedTranslator teacher = load_translator(c.distill.teacher, *ctx.tokenizer);
  spdlog::info("teacher {}: dim {}, {}+{} layers; serving top-{} at temperature {}", c.distill.teacher,
               teacher.config.dim, teacher.config.layers, teacher.config.decoder_layers, c.distill.top_k,
               c.distill.temperature);
  site::GatewayLinks gateway = site::connect_gateway(c, ctx.who.site);
  transport::Link* student = nullptr;
  for (auto& l : gateway.links)
    if (l) student = l.get();  // [distill] jobs have exactly two sites
  NEBULA_CHECK(student, "the teacher site has no link to a student site");

  const int64_t pad = ctx.ids.pad;
  auto fn = [&](const distill::Sequences& src, const distill::Sequences& tgt_in) {
    at::NoGradGuard no_grad;
    at::Tensor tgt = model::pad_sequences(tgt_in, pad), src_ids = model::pad_sequences(src, pad);
    at::Tensor hidden = teacher.model->decode_hidden(teacher.model->encode(src_ids), src_ids, tgt);
    return teacher.model->project(hidden.index({tgt.ne(pad)}));  // [Σ len(tgt_in), V], sequence by sequence
  };
  distill::ServeOptions o;
  o.vocab = ctx.tokenizer->vocab_size();
  o.max_len = teacher.config.max_len;
  o.k = c.distill.top_k;
  o.temperature = c.distill.temperature;
  o.idle_timeout = std::chrono::duration_cast<std::chrono::milliseconds>(c.job.timeout);
  const distill::ServeStats s = distill::serve_teacher(*student, fn, o);
  spdlog::info("teacher done: {} requests ({} errors), {} tokens, {} bytes answered", s.requests, s.errors, s.tokens,
               s.bytes_sent);
  MetricsWriter(c.job.run_dir + "/metrics.jsonl")
      .write({{"time", unix_time()},
              {"site", c.sites[ctx.who.site].name},
              {"rank", 0},
              {"teacher", {{"requests", s.requests}, {"errors", s.errors}, {"tokens", s.tokens},
                           {"bytes_received", s.bytes_received}, {"bytes_sent", s.bytes_sent}}}});
}

}  // namespace nebula::train
