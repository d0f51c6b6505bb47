// What every task shares: the model file, model.init, the model file's metadata, the batch seed.
#include "train/task.h"

#include <spdlog/spdlog.h>

#include <filesystem>

#include "model/safetensors.h"
#include "nebula/error.h"
#include "wire/frame.h"

namespace nebula::train {

void Task::save_model(const std::string& run_dir, const std::map<std::string, std::string>& metadata) {
  model::save_module(module(), run_dir + "/model.safetensors", metadata);
}

std::string load_pretrained(const TaskContext& ctx, torch::nn::Module& whole, model::MlmEncoderImpl& encoder) {
  const std::string& path = ctx.config.model.init;
  const model::TensorFile init = model::load_safetensors(path);
  const auto kind_of = init.metadata.find("kind");
  const std::string kind = kind_of == init.metadata.end() ? "mlm_encoder" : kind_of->second;
  if (kind != "mlm_encoder" && kind != ctx.config.model.kind)
    throw DataError(str_cat(path, " (model.init): a ", kind, " model; a ", ctx.config.model.kind,
                            " starts from a pre-trained mlm_encoder or from a ", ctx.config.model.kind, " model"));
  if (auto vocab = init.metadata.find("vocab");
      ctx.tokenizer && vocab != init.metadata.end() && vocab->second != std::to_string(ctx.tokenizer->vocab_size()))
    throw DataError(str_cat(path, " (model.init): trained with a vocabulary of ", vocab->second, " pieces, but ",
                            ctx.tokenizer_path, " has ", ctx.tokenizer->vocab_size(),
                            "; set data.tokenizer to that run's tokenizer.model"));
  if (kind == ctx.config.model.kind)
    model::load_module(whole, init, path);
  else
    model::load_module(encoder, init, path);
  spdlog::info("{} initialised from {} (a {} model)", kind == ctx.config.model.kind ? "model" : "encoder", path, kind);
  return kind;
}

std::map<std::string, std::string> text_model_metadata(const TaskContext& ctx, const std::string& kind) {
  const ModelConfig& m = ctx.config.model;
  return {{"format", "nebula"},
          {"kind", kind},
          {"dim", std::to_string(m.dim)},
          {"layers", std::to_string(m.layers)},
          {"heads", std::to_string(m.heads)},
          {"ffn", std::to_string(m.ffn)},
          {"max_len", std::to_string(m.max_len)},
          {"vocab", std::to_string(ctx.tokenizer->vocab_size())},
          {"tokenizer", std::filesystem::absolute(ctx.tokenizer_path).string()}};
}

std::pair<int64_t, int64_t> Task::model_numel() {
  if (tensor_split_) return tensor_split_->whole_numel();
  int64_t all = 0, trained = 0;
  for (const auto& p : module().parameters()) all += p.numel();
  for (const auto& p : trainable()) trained += p.numel();
  return {all, trained};
}

SiteText site_text(const TaskContext& ctx) {
  NEBULA_CHECK(ctx.text, "site_text: no site text in the task context (task_context reads it for the text tasks, "
               "and one task takes it)");
  return std::move(*ctx.text);
}

uint64_t batch_seed(const Config& c, const WorkerIdentity& who) {
  const std::string& name = c.sites.at(who.site).name;
  const uint32_t site = wire::crc32(0, {reinterpret_cast<const uint8_t*>(name.data()), name.size()});
  return c.job.seed * 1000003 + uint64_t{site} * 1009 + static_cast<uint64_t>(data_replica(c, who).local_rank);
}

void Task::log_tensor_slice(const ModelConfig& m, const model::TensorGroup& group, const std::vector<at::Tensor>& held,
                            int64_t whole_trainable) {
  int64_t here = 0;
  for (const at::Tensor& p : held) here += p.numel();
  spdlog::info("tensor slice {} of {}: {} of {} heads per layer, {} of {} MLP units, {} of {} trainable parameters here",
               group.rank(), group.size(), m.heads / group.size(), m.heads, m.ffn / group.size(), m.ffn, here,
               whole_trainable);
}

parallel::SiteGrid site_grid(const Config& c, const SiteConfig& site) {
  const auto pipeline = static_cast<int>(c.pipeline_of(site)), tensor = static_cast<int>(c.tensor_of(site));
  return {static_cast<int>(site.workers) / (pipeline * tensor), pipeline, tensor};
}

WorkerIdentity data_replica(const Config& c, const WorkerIdentity& who) {
  WorkerIdentity out = who;
  out.local_rank = site_grid(c, c.sites.at(who.site)).replica(who.local_rank);
  return out;
}

}  // namespace nebula::train
