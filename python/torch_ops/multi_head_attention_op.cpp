// mha::multi_head_attention: torch 1.13's nn.MultiheadAttention forward computed by mha's C++ layer
// (mha/multi_head_attention.hpp), with its autograd, for every caller of the dispatcher (mha.torch's
// module in eager mode, TorchScript, libtorch).
//
// Legend: B batch, h heads, L queries, S keys, E = embed_dim, d_k / d_v per-head widths, kdim / vdim the
// key / value input widths, S' = S + add_bias_kv + add_zero_attn.
//
// The layer holds its parameters as its own tensors (set_parameter copies), so each call copies the
// module's current parameter tensors into a layer (load_state_dict: one memcpy per parameter, about
// (3 E^2 + E^2) elements at kdim = vdim = E), which is what lets an optimiser's in-place updates, or any
// other change, be seen without tracking them. Layers are not created per call (the constructor
// initialises every parameter with random numbers, tens of milliseconds at E = 1024): a process-wide pool
// keeps idle layers by configuration, and a layer is checked out for one forward and, when autograd
// differentiates that forward, stays with its graph (in the autograd context) until the graph is freed.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <ATen/core/Generator.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "mha/error.hpp"
#include "mha/multi_head_attention.hpp"
#include "tensor_views.hpp"

namespace mha::torch_ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kOperator = "mha.multi_head_attention";

// Runs `call`, turning mha::Error (a bad argument the layer found) into torch's error type.
template <class Call>
auto torch_errors(Call&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const Error& e) {
    TORCH_CHECK(false, kOperator, ": ", e.what());
  }
}

// The layer's constructor arguments, as a pool key: E, h, kdim, vdim, d_k, d_v, bias, add_bias_kv,
// add_zero_attn, batch_first, dropout, dtype.
using LayerKey = std::tuple<std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, std::int64_t, bool,
                            bool, bool, bool, double, int>;

MultiHeadAttentionConfig config_of(const LayerKey& key) {
  MultiHeadAttentionConfig c;
  std::tie(c.d_model, c.num_heads, c.kdim, c.vdim, c.d_k, c.d_v, c.bias, c.add_bias_kv, c.add_zero_attn, c.batch_first,
           c.dropout, std::ignore) = key;
  c.dtype = static_cast<DType>(std::get<11>(key));
  return c;
}

// A seed from torch's default CPU generator, so that torch.manual_seed governs each call's dropout.
std::uint64_t draw_layer_seed() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get<at::CPUGeneratorImpl>()->random64();
}

// Idle layers by configuration; two per configuration cover a training loop, where the graph of step n
// (one layer checked out) is still alive during the forward of step n + 1 (a second one).
class LayerPool {
 public:
  static constexpr std::size_t kMaxIdle = 2;

  std::unique_ptr<MultiHeadAttention> checkout(const LayerKey& key) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& idle = idle_[key];
      if (!idle.empty()) {
        std::unique_ptr<MultiHeadAttention> layer = std::move(idle.back());
        idle.pop_back();
        return layer;
      }
    }
    const MultiHeadAttentionConfig config = config_of(key);
    // Seed 0: the parameters are loaded at every call, and dropout takes a seed from torch's generator at every
    // call (run_forward), so a new layer draws nothing: whether the pool had one does not move torch's stream.
    return torch_errors([&] { return std::make_unique<MultiHeadAttention>(config, 0); });
  }

  void give_back(const LayerKey& key, std::unique_ptr<MultiHeadAttention> layer) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& idle = idle_[key];
    if (idle.size() < kMaxIdle) idle.push_back(std::move(layer));
  }

 private:
  std::mutex mutex_;
  std::map<LayerKey, std::vector<std::unique_ptr<MultiHeadAttention>>> idle_;
};

LayerPool& layer_pool() {
  static LayerPool* pool = new LayerPool();  // never destroyed: layers may go back during exit
  return *pool;
}

// A layer checked out of the pool for one forward (and its backward); back to the pool when freed.
struct CheckedOutLayer : torch::CustomClassHolder {
  CheckedOutLayer(LayerKey k, std::vector<std::string> names)
      : key(std::move(k)), parameter_names(std::move(names)), layer(layer_pool().checkout(key)) {}
  ~CheckedOutLayer() override { layer_pool().give_back(key, std::move(layer)); }

  LayerKey key;
  std::vector<std::string> parameter_names;  // state_dict names, in the order of the parameter tensors
  std::unique_ptr<MultiHeadAttention> layer;
};

// One call's arguments besides the differentiable tensors.
struct LayerCall {
  LayerKey key;
  std::vector<std::string> parameter_names;
  c10::optional<at::Tensor> key_padding_mask;  // bool (True = padding) or float, [B, S] ([S] unbatched)
  c10::optional<at::Tensor> attn_mask;         // bool (True = forbidden) or float, [L, S] or [B*h, L, S]
  bool need_weights = true;
  bool average_attn_weights = true;
  bool is_causal = false;
};

// Copies the parameter tensors into the layer, sets its mode and runs its forward (the inputs borrowed,
// not copied, with `borrow_inputs`: the caller then keeps them alive until the backward).
MultiHeadAttentionOutput run_forward(CheckedOutLayer& checked_out, const LayerCall& call, const at::Tensor& query,
                                     const at::Tensor& key, const at::Tensor& value,
                                     const c10::optional<at::Tensor>& head_gate, at::TensorList parameters,
                                     bool training, bool borrow_inputs) {
  TORCH_CHECK(parameters.size() == call.parameter_names.size(), kOperator, ": got ", parameters.size(),
              " parameters and ", call.parameter_names.size(), " parameter_names");
  std::map<std::string, TensorView> state;
  for (std::size_t i = 0; i < parameters.size(); ++i) {
    const std::string& name = call.parameter_names[i];
    state.emplace(name, view_of(parameters[i], name.c_str()));
  }
  MultiHeadAttentionInputs inputs;
  inputs.key_padding_mask = optional_view_of(call.key_padding_mask, "key_padding_mask");
  inputs.attn_mask = optional_view_of(call.attn_mask, "attn_mask");
  inputs.causal = call.is_causal;
  inputs.need_weights = call.need_weights;
  inputs.average_attn_weights = call.average_attn_weights;
  inputs.head_gate = optional_view_of(head_gate, "head_gate");
  inputs.borrow_inputs = borrow_inputs;
  // Dropout keyed by torch's generator at every call, not by the pooled layer's own stream: torch.manual_seed
  // then repeats the masks, eager and scripted alike.
  if (training && checked_out.layer->config().dropout > 0.0) inputs.dropout_seed = draw_layer_seed();
  const TensorView q = view_of(query, "query"), k = view_of(key, "key"), v = view_of(value, "value");
  MultiHeadAttention& layer = *checked_out.layer;
  return torch_errors([&] {
    layer.load_state_dict(state);
    layer.train(training);
    return layer.forward(q, k, v, inputs);
  });
}

// (out, weights) as torch tensors; weights is an empty tensor [0] when not need_weights.
std::tuple<at::Tensor, at::Tensor> tensors_of(MultiHeadAttentionOutput&& result, const at::Tensor& query) {
  at::Tensor weights =
      result.weights.defined() ? tensor_of(std::move(result.weights)) : at::empty({0}, query.options());
  return {tensor_of(std::move(result.out)), std::move(weights)};
}

// The autograd of one layer forward: gradients for query, key, value, head_gate and every parameter (the
// masks get none; mha.torch refuses masks that require grad). The layer that ran the forward stays in the
// context until the graph is freed, so several forwards may precede their backwards.
struct MultiHeadAttentionFunction : torch::autograd::Function<MultiHeadAttentionFunction> {
  // query: [B, L, E] (or [L, B, E], [L, E]), key: [.., S, kdim], value: [.., S, vdim], head_gate: [h] or
  // [B, h]; parameters in call.parameter_names' order. Returns {out (like query), weights or [0]}.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& query, const at::Tensor& key,
                               const at::Tensor& value, const c10::optional<at::Tensor>& head_gate,
                               at::TensorList parameters, const LayerCall& call) {
    auto checked_out = c10::make_intrusive<CheckedOutLayer>(call.key, call.parameter_names);
    auto [out, weights] =
        tensors_of(run_forward(*checked_out, call, query, key, value, head_gate, parameters, true, true), query);
    // The layer borrowed query, key and value: saving them keeps their memory alive until the backward,
    // and autograd's version check refuses a backward after an in-place change.
    ctx->save_for_backward({query, key, value});
    ctx->saved_data["layer"] = c10::IValue::make_capsule(checked_out);
    ctx->saved_data["has_head_gate"] = head_gate.has_value() && head_gate->defined();
    ctx->mark_non_differentiable({weights});
    return {out, weights};
  }

  // grads: {dout (like out), unused}. Returns dquery, dkey, dvalue, dhead_gate, one per parameter, none.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(), kOperator,
                " does not support double backward (backward with create_graph=True): its backward is mha's "
                "fused kernel, whose own derivative is not implemented");
    const at::Tensor& dout = grads[0];
    TORCH_CHECK(!dout.key_set().has(c10::DispatchKey::Batched), kOperator,
                "'s backward cannot run under torch's vmap (torch.autograd.grad(..., is_grads_batched=True), "
                "jacobian / hessian(..., vectorize=True)): pass the gradients one at a time, or use "
                "vectorize=False");
    const variable_list saved = ctx->get_saved_variables();  // checks the inputs' versions
    auto checked_out = c10::static_intrusive_pointer_cast<CheckedOutLayer>(ctx->saved_data["layer"].toCapsule());
    MultiHeadAttention& layer = *checked_out->layer;
    const at::Tensor dout_full = dout.defined() ? dout : at::zeros_like(saved[0]);  // out has query's shape
    const TensorView dout_view = view_of(dout_full, "grad_output");
    MultiHeadAttentionGradients g = torch_errors([&] { return layer.backward(dout_view); });
    variable_list result = {tensor_of(std::move(g.query)), tensor_of(std::move(g.key)), tensor_of(std::move(g.value))};
    result.push_back(ctx->saved_data["has_head_gate"].toBool() ? tensor_of(std::move(g.head_gate)) : at::Tensor());
    for (const std::string& name : checked_out->parameter_names) {
      result.push_back(tensor_of(std::move(g.parameters.at(name))));
    }
    result.emplace_back();  // call
    return result;
  }
};

bool defined(const c10::optional<at::Tensor>& t) { return t && t->defined(); }
bool requires_grad(const c10::optional<at::Tensor>& t) { return defined(t) && t->requires_grad(); }

}  // namespace

// The parameters as torch's module names them (absent ones undefined or none): in_proj_weight
// [2*h*d_k + h*d_v, E] or q_proj_weight [h*d_k, E], k_proj_weight [h*d_k, kdim], v_proj_weight [h*d_v, vdim];
// in_proj_bias [2*h*d_k + h*d_v]; bias_k [1, 1, h*d_k], bias_v [1, 1, h*d_v]; out_proj.weight [E, h*d_v],
// out_proj.bias [E]. Differentiable when grad mode is on and any of query, key, value, head_gate or the
// parameters requires grad; else the layer runs in evaluation mode (training mode when dropout > 0) and
// keeps nothing for a backward.
std::tuple<at::Tensor, at::Tensor> multi_head_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& in_proj_weight, const c10::optional<at::Tensor>& q_proj_weight,
    const c10::optional<at::Tensor>& k_proj_weight, const c10::optional<at::Tensor>& v_proj_weight,
    const c10::optional<at::Tensor>& in_proj_bias, const c10::optional<at::Tensor>& bias_k,
    const c10::optional<at::Tensor>& bias_v, const at::Tensor& out_proj_weight,
    const c10::optional<at::Tensor>& out_proj_bias, std::int64_t num_heads, std::int64_t d_k, std::int64_t d_v,
    bool add_zero_attn, bool batch_first, double dropout, c10::optional<at::Tensor> key_padding_mask,
    c10::optional<at::Tensor> attn_mask, bool need_weights, bool average_attn_weights, bool is_causal,
    const c10::optional<at::Tensor>& head_gate) {
  const bool packed = defined(in_proj_weight);
  TORCH_CHECK(packed != (defined(q_proj_weight) && defined(k_proj_weight) && defined(v_proj_weight)), kOperator,
              ": expected in_proj_weight, or q_proj_weight, k_proj_weight and v_proj_weight");
  TORCH_CHECK(defined(bias_k) == defined(bias_v), kOperator, ": expected bias_k and bias_v together");
  TORCH_CHECK(out_proj_weight.defined() && out_proj_weight.dim() == 2, kOperator,
              ": out_proj.weight must be [embed_dim, num_heads * d_v]");
  const std::int64_t embed_dim = out_proj_weight.size(0);
  std::vector<std::string> names;
  std::vector<at::Tensor> parameters;
  const auto add = [&](const char* name, const c10::optional<at::Tensor>& t) {
    if (defined(t)) {
      names.emplace_back(name);
      parameters.push_back(*t);
    }
  };
  add("in_proj_weight", in_proj_weight);
  add("q_proj_weight", q_proj_weight);
  add("k_proj_weight", k_proj_weight);
  add("v_proj_weight", v_proj_weight);
  add("in_proj_bias", in_proj_bias);
  add("bias_k", bias_k);
  add("bias_v", bias_v);
  add("out_proj.weight", out_proj_weight);
  add("out_proj.bias", out_proj_bias);
  const auto width = [&](const c10::optional<at::Tensor>& w) {
    return packed || w->dim() != 2 ? embed_dim : w->size(1);  // a wrong rank is the layer's to name
  };
  const TensorView q = view_of(query, "query");  // checks device, layout and dtype before the dtype is read
  LayerCall call{
      LayerKey{embed_dim, num_heads, width(k_proj_weight), width(v_proj_weight), d_k, d_v, defined(in_proj_bias),
               defined(bias_k), add_zero_attn, batch_first, dropout, static_cast<int>(q.dtype())},
      std::move(names),
      std::move(key_padding_mask),
      std::move(attn_mask),
      need_weights,
      average_attn_weights,
      is_causal};
  bool differentiable =
      query.requires_grad() || key.requires_grad() || value.requires_grad() || requires_grad(head_gate);
  for (const at::Tensor& p : parameters) differentiable = differentiable || p.requires_grad();
  if (at::GradMode::is_enabled() && differentiable) {
    variable_list results =
        MultiHeadAttentionFunction::apply(query, key, value, head_gate, at::TensorList(parameters), call);
    return {results[0], results[1]};
  }
  CheckedOutLayer checked_out(call.key, call.parameter_names);
  return tensors_of(run_forward(checked_out, call, query, key, value, head_gate, parameters, dropout > 0.0, false),
                    query);
}

}  // namespace mha::torch_ops

TORCH_LIBRARY_FRAGMENT(mha, m) {
  m.def("multi_head_attention(Tensor query, Tensor key, Tensor value, Tensor? in_proj_weight, "
        "Tensor? q_proj_weight, Tensor? k_proj_weight, Tensor? v_proj_weight, Tensor? in_proj_bias, Tensor? bias_k, "
        "Tensor? bias_v, Tensor out_proj_weight, Tensor? out_proj_bias, int num_heads, int d_k, int d_v, "
        "bool add_zero_attn=False, bool batch_first=False, float dropout=0., Tensor? key_padding_mask=None, "
        "Tensor? attn_mask=None, bool need_weights=True, bool average_attn_weights=True, bool is_causal=False, "
        "Tensor? head_gate=None) -> (Tensor out, Tensor weights)");
}

TORCH_LIBRARY_IMPL(mha, CompositeImplicitAutograd, m) {
  m.impl("multi_head_attention", &mha::torch_ops::multi_head_attention);
}
