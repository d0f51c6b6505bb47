#include "parallel/optimizer_state.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <sstream>
#include <string>
#include <type_traits>

#include "nebula/error.h"

namespace nebula::parallel {
namespace {

// The optimizer keeps per-parameter state in a map keyed by the parameter's TensorImpl: as
// its address printed to a string in LibTorch 1.x, as the address itself in 2.x. This is the
// one place that knows.
template <class Map>
typename Map::key_type state_key(const Map&, const at::Tensor& p) {
  using Key = typename Map::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << p.unsafeGetTensorImpl();
    return text.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

}  // namespace

void save_optimizer(const torch::optim::AdamW& optimizer, const std::vector<at::Tensor>& params, Checkpoint& out) {
  const auto& states = optimizer.state();
  nlohmann::json steps = nlohmann::json::array();
  for (size_t i = 0; i < params.size(); ++i) {
    auto it = states.find(state_key(states, params[i]));
    if (it == states.end()) {  // before the first step (or a parameter without gradients yet)
      steps.push_back(0);
      continue;
    }
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    steps.push_back(s.step());
    out.tensors[str_cat("optim/", i, "/exp_avg")] = s.exp_avg();
    out.tensors[str_cat("optim/", i, "/exp_avg_sq")] = s.exp_avg_sq();
    if (s.max_exp_avg_sq().defined()) out.tensors[str_cat("optim/", i, "/max_exp_avg_sq")] = s.max_exp_avg_sq();
  }
  out.state["optim"] = {{"steps", steps}};
}

void load_optimizer(torch::optim::AdamW& optimizer, const std::vector<at::Tensor>& params, const Checkpoint& in) {
  const nlohmann::json* steps = nullptr;
  if (in.state.contains("optim") && in.state["optim"].is_object() && in.state["optim"].contains("steps"))
    steps = &in.state["optim"]["steps"];
  if (!steps || !steps->is_array() || steps->size() != params.size())
    throw DataError(str_cat("checkpoint of step ", in.step, ": the optimizer state has ",
                            steps && steps->is_array() ? steps->size() : 0, " parameters, this model ",
                            params.size(), ": the model changed since the checkpoint"));
  auto& states = optimizer.state();
  for (size_t i = 0; i < params.size(); ++i) {
    const int64_t step = (*steps)[i].get<int64_t>();
    const auto key = state_key(states, params[i]);
    if (step == 0) {
      states.erase(key);
      continue;
    }
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(step);
    auto tensor = [&](const char* name, bool required) {
      auto it = in.tensors.find(str_cat("optim/", i, "/", name));
      if (it == in.tensors.end()) {
        if (required)
          throw DataError(str_cat("checkpoint of step ", in.step, ": no optimizer tensor optim/", i, "/", name));
        return at::Tensor();
      }
      if (!it->second.sizes().equals(params[i].sizes()))
        throw DataError(str_cat("checkpoint of step ", in.step, ": optim/", i, "/", name, " has shape ",
                                it->second.sizes(), ", parameter ", i, " has ", params[i].sizes()));
      return it->second.to(params[i].options(), /*non_blocking=*/false, /*copy=*/true);  // onto its device
    };
    state->exp_avg(tensor("exp_avg", true));
    state->exp_avg_sq(tensor("exp_avg_sq", true));
    if (at::Tensor m = tensor("max_exp_avg_sq", false); m.defined()) state->max_exp_avg_sq(m);
    states[key] = std::move(state);
  }
}

void save_torch_rng(Checkpoint& out) { out.tensors["rng/torch_cpu"] = at::detail::getDefaultCPUGenerator().get_state(); }

void load_torch_rng(const Checkpoint& in) {
  auto it = in.tensors.find("rng/torch_cpu");
  if (it == in.tensors.end()) throw DataError(str_cat("checkpoint of step ", in.step, ": no rng/torch_cpu"));
  at::Generator g = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(it->second);
}

}  // namespace nebula::parallel
