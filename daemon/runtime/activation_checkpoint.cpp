#include "daemon/runtime/activation_checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>

namespace ferry::runtime {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Closure : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> fn;
  at::Tensor rng_state;
};

at::Generator DefaultGenerator() { return at::detail::getDefaultCPUGenerator(); }

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList params,
                               c10::intrusive_ptr<Closure> closure) {
    {
      at::Generator gen = DefaultGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      closure->rng_state = gen.get_state();
    }
    ctx->save_for_backward({x});
    ctx->saved_data["closure"] = at::IValue::make_capsule(closure);
    ctx->saved_data["params"] = static_cast<int64_t>(params.size());
    std::vector<at::Tensor> kept(params.begin(), params.end());
    ctx->saved_data["param_list"] = at::IValue(c10::List<at::Tensor>(kept));
    at::NoGradGuard no_grad;
    return {closure->fn(x)};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto closure = c10::static_intrusive_pointer_cast<Closure>(ctx->saved_data["closure"].toCapsule());
    const at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    std::vector<at::Tensor> params;
    const c10::List<at::Tensor> saved = ctx->saved_data["param_list"].toTensorList();
    for (size_t i = 0; i < saved.size(); ++i) params.push_back(saved.get(i));
    at::Tensor out;
    {
      at::Generator gen = DefaultGenerator();
      at::Tensor now;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        now = gen.get_state();
        gen.set_state(closure->rng_state);
      }
      at::AutoGradMode enable(true);
      out = closure->fn(x);
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(now);
    }
    variable_list inputs = {x};
    std::vector<size_t> needs;  // indices into params that require grad
    for (size_t i = 0; i < params.size(); ++i) {
      if (params[i].requires_grad()) {
        inputs.push_back(params[i]);
        needs.push_back(i);
      }
    }
    variable_list got = torch::autograd::grad({out}, inputs, {grads[0]}, /*retain_graph=*/false,
                                              /*create_graph=*/false, /*allow_unused=*/true);
    variable_list result(params.size() + 2);
    result[0] = got[0];
    for (size_t k = 0; k < needs.size(); ++k) result[1 + needs[k]] = got[1 + k];
    return result;  // the closure argument gets an undefined gradient
  }
};

}  // namespace

at::Tensor Checkpointed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x,
                        const std::vector<at::Tensor>& params) {
  bool records = at::GradMode::is_enabled() && x.requires_grad();
  for (const at::Tensor& p : params) records = records || (at::GradMode::is_enabled() && p.requires_grad());
  if (!records) return fn(x);
  auto closure = c10::make_intrusive<Closure>();
  closure->fn = std::move(fn);
  return CheckpointFunction::apply(x, at::TensorList(params), closure)[0];
}

}  // namespace ferry::runtime
