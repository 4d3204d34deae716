// MultiHeadAttention's configuration and parameters: defaults resolved and checked, parameters
// created with PyTorch's names, layouts and initial distributions, access by name, state_dict.
//
// Legend: E = d_model, h heads, d_k, d_v per-head widths, kdim / vdim the key / value input widths.
#include <cmath>
#include <string>

#include "checked_arithmetic.hpp"
#include "dtype_dispatch.hpp"
#include "layer/random_init.hpp"
#include "mha/error.hpp"
#include "mha/multi_head_attention.hpp"
#include "splitmix64.hpp"

namespace mha {

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

// a * b, the element count of `what`: an mha::Error naming `product` (e.g. "num_heads * d_k") and the
// values when it overflows or exceeds what a tensor may hold (detail::kMaxElements).
std::int64_t size_product(std::int64_t a, std::int64_t b, const std::string& product, const std::string& what) {
  const auto n = detail::checked_mul(a, b);
  if (!n || *n > detail::kMaxElements)
    fail(product + " = " + str(a) + " * " + str(b) + " is too large for " + what + ": a tensor holds at most " +
         str(detail::kMaxElements) + " elements (2^60 - 1)");
  return *n;
}

// The sizes of the parameters (and of the projections' widths), checked before anything is allocated,
// so that num_heads = d_k = 2^32 is an error rather than a wrapped (zero or negative) shape. The
// packed in_proj_weight's size [2 h d_k + h d_v, E] is checked whether the layer packs it or not: it
// bounds in_proj_bias, q_proj_weight and out_proj.weight ([E, h d_v]).
void check_parameter_sizes(const MultiHeadAttentionConfig& c) {
  for (auto [value, name] :
       {std::pair{c.d_model, "d_model"}, std::pair{c.num_heads, "num_heads"}, std::pair{c.d_k, "d_k"},
        std::pair{c.d_v, "d_v"}, std::pair{c.kdim, "kdim"}, std::pair{c.vdim, "vdim"}})
    if (value > detail::kMaxElements)
      fail(std::string(name) + ": " + str(value) + " is too large: a tensor holds at most " +
           str(detail::kMaxElements) + " elements (2^60 - 1)");
  const std::int64_t qk = size_product(c.num_heads, c.d_k, "num_heads * d_k", "the query/key projections");
  const std::int64_t vw = size_product(c.num_heads, c.d_v, "num_heads * d_v", "the value projection");
  const std::int64_t qkv = 2 * qk + vw;  // below 3 * 2^60: no overflow
  size_product(qkv, c.d_model, "(2 * num_heads * d_k + num_heads * d_v) * d_model", "the input projections");
  size_product(qk, c.kdim, "num_heads * d_k * kdim", "k_proj_weight");
  size_product(vw, c.vdim, "num_heads * d_v * vdim", "v_proj_weight");
}

// The rotary embedding's settings (rotary_heads.hpp): refused by name, with the reason.
void check_rotary(const MultiHeadAttentionConfig& c) {
  if (c.rotary_dim < 0 || c.rotary_dim % 2 != 0 || c.rotary_dim > c.d_k)
    fail("rotary_dim: expected 0 (none) or an even number of components in [2, d_k = " + str(c.d_k) + "], got " +
         str(c.rotary_dim));
  if (c.rotary_dim == 0) return;
  const double largest_inv_freq = std::pow(c.rotary_base, -(c.rotary_dim - 2.0) / static_cast<double>(c.rotary_dim));
  if (!(std::isfinite(c.rotary_base) && c.rotary_base > 0 && std::isfinite(largest_inv_freq)))
    fail("rotary_base: expected a finite base > 0 whose frequencies base^(-2i / rotary_dim) are finite, got " +
         std::to_string(c.rotary_base));
  if (c.add_bias_kv || c.add_zero_attn)
    fail(std::string("rotary_dim: not available with ") + (c.add_bias_kv ? "add_bias_kv" : "add_zero_attn") +
         " (the appended key positions have no place in the sequence)");
}

MultiHeadAttentionConfig resolve(MultiHeadAttentionConfig c) {
  if (c.num_heads <= 0) fail("num_heads: expected a positive number of heads, got " + str(c.num_heads));
  if (c.d_model <= 0) fail("d_model: expected a positive width, got " + str(c.d_model));
  for (auto [value, name] : {std::pair{&c.d_k, "d_k"}, std::pair{&c.d_v, "d_v"}}) {
    if (*value < 0)
      fail(std::string(name) + ": expected a positive width or 0 for d_model / num_heads, got " + str(*value));
    if (*value == 0) {
      if (c.d_model % c.num_heads != 0)
        fail("d_model: expected a multiple of num_heads = " + str(c.num_heads) + " when " + name + " is not set, got " +
             str(c.d_model));
      *value = c.d_model / c.num_heads;
    }
  }
  for (auto [value, name] : {std::pair{&c.kdim, "kdim"}, std::pair{&c.vdim, "vdim"}}) {
    if (*value < 0) fail(std::string(name) + ": expected a positive width or 0 for d_model, got " + str(*value));
    if (*value == 0) *value = c.d_model;
  }
  if (c.num_kv_heads < 0 || c.num_kv_heads > c.num_heads || (c.num_kv_heads > 0 && c.num_heads % c.num_kv_heads != 0))
    fail("num_kv_heads: expected a divisor of num_heads = " + str(c.num_heads) +
         " (or 0 for num_heads: one key/value head per query head), got " + str(c.num_kv_heads));
  if (c.num_kv_heads == 0) c.num_kv_heads = c.num_heads;
  check_parameter_sizes(c);
  if (!(c.dropout >= 0.0 && c.dropout < 1.0))
    fail("dropout: expected a probability in [0, 1), got " + std::to_string(c.dropout));
  check_rotary(c);
  if (!detail::is_floating(c.dtype))
    fail(std::string("dtype: expected ") + detail::floating_dtype_names() + ", got " + dtype_name(c.dtype));
  return c;
}

// Fills t with f() converted to its dtype.
template <class F>
void fill(Tensor& t, F f) {
  detail::dispatch_floating(t.dtype(), [&]<class T>(T) {
    for (std::int64_t i = 0; i < t.numel(); ++i) t.data_as<T>()[i] = static_cast<T>(f());
  });
}

// xavier_uniform_ for a [fan_out, fan_in] weight: U(-a, a), a = sqrt(6 / (fan_in + fan_out)).
void xavier_uniform(Tensor& w, detail::InitRng& rng) {
  const double bound = std::sqrt(6.0 / static_cast<double>(w.size(0) + w.size(1)));
  fill(w, [&] { return rng.uniform(-bound, bound); });
}

}  // namespace

MultiHeadAttention::MultiHeadAttention(const MultiHeadAttentionConfig& config, std::uint64_t seed)
    : config_(resolve(config)), dropout_seed_(detail::mix64(seed ^ 0x6d68612d64726f70ULL)) {
  const auto& c = config_;
  const std::int64_t E = c.d_model, qk = c.num_heads * c.d_k, vw = c.num_heads * c.d_v;
  const std::int64_t kk = c.num_kv_heads * c.d_k, kv = c.num_kv_heads * c.d_v;  // key and value widths
  detail::InitRng rng(seed);
  auto add = [&](const std::string& name, Shape shape) -> Tensor& {
    return parameters_[name] = Tensor(c.dtype, std::move(shape));
  };
  // Created and initialised in PyTorch's state_dict order.
  if (packed_in_proj()) {
    xavier_uniform(add("in_proj_weight", {2 * qk + vw, E}), rng);
  } else {
    xavier_uniform(add("q_proj_weight", {qk, E}), rng);
    xavier_uniform(add("k_proj_weight", {kk, c.kdim}), rng);
    xavier_uniform(add("v_proj_weight", {kv, c.vdim}), rng);
  }
  if (c.bias) add("in_proj_bias", {qk + kk + kv});  // zeros
  if (c.add_bias_kv) {
    // xavier_normal_ of a [1, 1, n] tensor: fan_in = fan_out = n, so std = sqrt(2 / 2n).
    for (auto [name, n] : {std::pair{"bias_k", kk}, std::pair{"bias_v", kv}}) {
      const double std_dev = std::sqrt(1.0 / static_cast<double>(n));
      fill(add(name, {1, 1, n}), [&] { return std_dev * rng.normal(); });
    }
  }
  // nn.Linear's kaiming_uniform_(a = sqrt(5)) reduces to U(-1/sqrt(fan_in), 1/sqrt(fan_in)).
  const double out_bound = 1.0 / std::sqrt(static_cast<double>(vw));
  fill(add("out_proj.weight", {E, vw}), [&] { return rng.uniform(-out_bound, out_bound); });
  if (c.bias) add("out_proj.bias", {E});     // zeros, as PyTorch's _reset_parameters sets it
  if (c.sinks) add("sinks", {c.num_heads});  // zeros: each sink starts as a logit of 0
}

bool MultiHeadAttention::packed_in_proj() const {
  return config_.kdim == config_.d_model && config_.vdim == config_.d_model && config_.d_k == config_.d_v &&
         config_.num_kv_heads == config_.num_heads;
}

std::vector<std::string> MultiHeadAttention::parameter_names() const {
  std::vector<std::string> names;
  for (const char* name : {"in_proj_weight", "q_proj_weight", "k_proj_weight", "v_proj_weight", "in_proj_bias",
                           "bias_k", "bias_v", "out_proj.weight", "out_proj.bias", "sinks"})
    if (parameters_.count(name)) names.emplace_back(name);
  return names;
}

const Tensor& MultiHeadAttention::parameter(const std::string& name) const {
  auto it = parameters_.find(name);
  if (it == parameters_.end()) {
    std::string known;
    for (const auto& n : parameter_names()) known += (known.empty() ? "" : ", ") + n;
    fail("parameter: no parameter named '" + name + "' in this layer; it has " + known);
  }
  return it->second;
}

Tensor& MultiHeadAttention::mutable_parameter(const std::string& name) { return const_cast<Tensor&>(parameter(name)); }

void MultiHeadAttention::set_parameter(const std::string& name, const TensorView& value) {
  Tensor& p = mutable_parameter(name);
  if (!detail::is_floating(value.dtype()))
    fail(name + ": expected a " + detail::floating_dtype_names() + " array, got " + dtype_name(value.dtype()));
  if (value.shape() != p.shape())
    fail(name + ": expected shape " + shape_str(p.shape()) + ", got " + shape_str(value.shape()));
  p = Tensor::copy_of(value, config_.dtype);
  ++parameters_version_;  // a training-mode forward before this no longer matches the parameters
}

void MultiHeadAttention::load_state_dict(const std::map<std::string, TensorView>& state) {
  // Check everything first, so a failed load changes nothing.
  for (const auto& [name, value] : state) {
    const Tensor& p = parameter(name);
    if (!detail::is_floating(value.dtype()))
      fail(name + ": expected a " + detail::floating_dtype_names() + " array, got " + dtype_name(value.dtype()));
    if (value.shape() != p.shape())
      fail(name + ": expected shape " + shape_str(p.shape()) + ", got " + shape_str(value.shape()));
  }
  for (const auto& name : parameter_names())
    if (!state.count(name)) fail("state_dict: missing parameter '" + name + "'");
  for (const auto& [name, value] : state) set_parameter(name, value);
}

std::map<std::string, TensorView> MultiHeadAttention::state_dict() const {
  std::map<std::string, TensorView> views;
  for (const auto& [name, tensor] : parameters_) views.emplace(name, tensor.view());
  return views;
}

}  // namespace mha
