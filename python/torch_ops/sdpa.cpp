// mha::scaled_dot_product_attention: PyTorch 2.5's torch.nn.functional.scaled_dot_product_attention on
// mha's kernels, with its autograd, for every caller of the dispatcher (Python, TorchScript, libtorch).
//
// Registered as CompositeImplicitAutograd: the argument handling below is made of torch ops (expand,
// reshape, logical_not, a cast of the sinks), which autograd differentiates as usual, and the attention
// itself is one torch::autograd::Function (AttentionFunction) around attention_forward / _backward.
//
// Legend: N... the leading (batch) dims, B their product, h query heads, h_kv key/value heads, L queries,
// S keys, E query/key width, E_v value width.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Functions.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <mutex>
#include <utility>
#include <vector>

#include "attention_ops.hpp"

namespace mha::torch_ops {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The autograd of attention_forward: gradients for q, k, v and the sinks (the masks and ALiBi slopes
// get none; the function refuses them when they require one).
struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  // q: [B, h, L, E], k: [B, h_kv, S, E], v: [B, h_kv, S, E_v], sinks: [h] or none. Returns out [B, h, L, E_v].
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const c10::optional<at::Tensor>& sinks, ScoreArguments score) {
    score.sinks = sinks;
    auto [out, lse] = attention_forward(q, k, v, score);
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["attn_mask"] = score.attn_mask;
    ctx->saved_data["key_padding_mask"] = score.key_padding_mask;
    ctx->saved_data["causal"] = score.causal;
    ctx->saved_data["scale"] = score.scale;
    ctx->saved_data["window_left"] = score.window_left;
    ctx->saved_data["window_right"] = score.window_right;
    ctx->saved_data["alibi_slopes"] = score.alibi_slopes;
    ctx->saved_data["softcap"] = score.softcap;
    ctx->saved_data["sinks"] = score.sinks;
    ctx->saved_data["dropout_p"] = score.dropout_p;
    ctx->saved_data["dropout_seed"] = score.dropout_seed;
    return out;
  }

  // grads: {dout [B, h, L, E_v]}. Returns one gradient per forward argument: dq, dk, dv, dsinks, none.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "mha.scaled_dot_product_attention does not support double backward (create_graph=True): its "
                "backward is mha's fused kernel, whose own derivative is not implemented");
    const variable_list saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    ScoreArguments score;
    score.attn_mask = data["attn_mask"].toOptional<at::Tensor>();
    score.key_padding_mask = data["key_padding_mask"].toOptional<at::Tensor>();
    score.causal = data["causal"].toBool();
    score.scale = data["scale"].toOptional<double>();
    score.window_left = data["window_left"].toInt();
    score.window_right = data["window_right"].toInt();
    score.alibi_slopes = data["alibi_slopes"].toOptional<at::Tensor>();
    score.softcap = data["softcap"].toDouble();
    score.sinks = data["sinks"].toOptional<at::Tensor>();
    score.dropout_p = data["dropout_p"].toDouble();
    score.dropout_seed = data["dropout_seed"].toInt();
    auto [dq, dk, dv, dsinks] = attention_backward(grads[0], saved[0], saved[1], saved[2], saved[3], saved[4], score);
    if (!score.sinks) dsinks = at::Tensor();
    return {dq, dk, dv, dsinks, at::Tensor()};
  }
};

constexpr const char* kFunction = "mha.scaled_dot_product_attention";

// Leading (batch) dims of a [N..., h, L, E] tensor; none for a 2-D [L, E] one.
std::vector<std::int64_t> batch_dims(const at::Tensor& t) {
  const auto sizes = t.sizes();
  return {sizes.begin(), sizes.end() - std::min<std::int64_t>(t.dim(), 3)};
}
std::int64_t heads(const at::Tensor& t) { return t.dim() >= 3 ? t.size(-3) : 1; }

void check_input(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), kFunction, ": ", name, " is on ", t.device(),
              "; mha runs on the CPU only (move it with .cpu())");
  TORCH_CHECK(t.layout() == c10::kStrided, kFunction, ": ", name, " must be a dense (strided) tensor, got ",
              t.layout());
}

// query, key, value: devices, dtypes, ranks and sizes as torch checks them.
void check_qkv(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  check_input(query, "query"), check_input(key, "key"), check_input(value, "value");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16, kFunction,
              ": query must be torch.float32, torch.float64 or torch.bfloat16, got ", dtype);
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype, kFunction,
              ": expected query, key, and value to have the same dtype, but got query.dtype: ", dtype,
              " key.dtype: ", key.scalar_type(), " and value.dtype: ", value.scalar_type(), " instead.");
  TORCH_CHECK(query.dim() >= 2 && key.dim() == query.dim() && value.dim() == query.dim(), kFunction,
              ": expected query (N..., h, L, E), key (N..., h_kv, S, E) and value (N..., h_kv, S, E_v) of one "
              "rank >= 2, got query ",
              query.sizes(), ", key ", key.sizes(), ", value ", value.sizes());
  TORCH_CHECK(key.size(-1) == query.size(-1), kFunction, ": key's last dim (E) must match query's, got query ",
              query.sizes(), " and key ", key.sizes());
  TORCH_CHECK(value.size(-2) == key.size(-2) && heads(value) == heads(key), kFunction,
              ": value (N..., h_kv, S, E_v) must have key's h_kv and S, got key ", key.sizes(), " and value ",
              value.sizes());
}

// The leading dims of query, key and value broadcast together (torch's rule: equal, or 1).
std::vector<std::int64_t> broadcast_batch(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value) {
  std::vector<std::int64_t> batch = batch_dims(query);
  for (const at::Tensor* t : {&key, &value}) {
    const std::vector<std::int64_t> other = batch_dims(*t);
    for (std::size_t i = 0; i < batch.size(); ++i) {
      TORCH_CHECK(batch[i] == other[i] || batch[i] == 1 || other[i] == 1, kFunction,
                  ": the leading (batch) dims of query, key and value must broadcast, got query ", query.sizes(),
                  ", key ", key.sizes(), ", value ", value.sizes());
      if (batch[i] == 1) batch[i] = other[i];
    }
  }
  return batch;
}

// t [N'..., heads, rows, width] as [B, heads, rows, width] over the broadcast batch (a view when strides allow).
at::Tensor as_4d(const at::Tensor& t, const std::vector<std::int64_t>& batch, std::int64_t B) {
  std::vector<std::int64_t> full = batch;
  for (std::int64_t d : {heads(t), t.size(-2), t.size(-1)}) full.push_back(d);
  const at::Tensor expanded = batch_dims(t) == batch ? t : t.expand(full);
  return expanded.reshape({B, heads(t), t.size(-2), t.size(-1)});
}

// The user's attn_mask (broadcastable to [N..., h, L, S]; bool True = takes part, or float added) put
// into mha's score (bool True = may not attend): as attn_mask [L, S] when it is the same for every batch
// entry and head (strides 0 where it broadcasts), as key_padding_mask [B, S] when it varies only per
// batch entry and key (a padding mask (N..., 1, 1, S): O(B S), not O(B h L S)), else as attn_mask
// [B*h, L, S] (a view where strides allow).
void add_mask(ScoreArguments& score, const at::Tensor& mask, const at::Tensor& query,
              const std::vector<std::int64_t>& batch, std::int64_t B, std::int64_t h, std::int64_t L, std::int64_t S) {
  check_input(mask, "attn_mask");
  const auto q_dtype = query.scalar_type(), dtype = mask.scalar_type();
  TORCH_CHECK(dtype == at::kBool || dtype == q_dtype || (q_dtype == at::kBFloat16 && dtype == at::kFloat), kFunction,
              ": expected attn_mask dtype to be bool or to match query dtype (", q_dtype,
              q_dtype == at::kBFloat16 ? ", or torch.float32" : "", "), but got attn_mask.dtype: ", dtype);
  TORCH_CHECK(!mask.requires_grad(), kFunction,
              ": attn_mask requires grad, but mha computes no gradient for the mask; pass attn_mask.detach()");
  std::vector<std::int64_t> full = batch;
  for (std::int64_t d : {h, L, S}) full.push_back(d);
  const auto sizes = mask.sizes();
  bool broadcasts = mask.dim() <= static_cast<std::int64_t>(full.size());
  bool same_for_batch_and_heads = true;  // size 1 in every dim before the last two
  bool keys_only = true;                 // size 1 in the heads' and the queries' dims
  for (std::int64_t i = 1; broadcasts && i <= mask.dim(); ++i) {
    const std::int64_t m = sizes[sizes.size() - i], f = full[full.size() - i];
    broadcasts = m == f || m == 1;
    if (i > 2 && m != 1) same_for_batch_and_heads = false;
    if ((i == 2 || i == 3) && m != 1) keys_only = false;
  }
  TORCH_CHECK(broadcasts, kFunction, ": attn_mask must broadcast to (N..., h, L, S) = ", c10::IntArrayRef(full),
              ", got ", sizes);
  const at::Tensor forbidden = dtype == at::kBool ? mask.logical_not() : mask;
  if (same_for_batch_and_heads) {
    const std::int64_t rows = mask.dim() >= 2 ? sizes[sizes.size() - 2] : 1;
    const std::int64_t cols = mask.dim() >= 1 ? sizes[sizes.size() - 1] : 1;
    score.attn_mask = forbidden.reshape({rows, cols}).expand({L, S});
  } else if (keys_only) {
    std::vector<std::int64_t> per_key = batch;
    for (std::int64_t d : {std::int64_t{1}, std::int64_t{1}, S}) per_key.push_back(d);
    score.key_padding_mask = forbidden.expand(per_key).reshape({B, S});
  } else {
    score.attn_mask = forbidden.expand(full).reshape({B * h, L, S});
  }
}

// A dropout seed from torch's default CPU generator, so that torch.manual_seed repeats the mask.
std::int64_t draw_dropout_seed() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return static_cast<std::int64_t>(generator.get<at::CPUGeneratorImpl>()->random64());
}

// Where is_causal (top-left aligned, as torch: query i sees key j <= i) goes in mha's score, whose
// positions are bottom-right aligned (query i at i + S - L): the causal flag when L == S, the window's
// right extent L - S when L > S, a bool [L, S] mask when L < S (mha's window cannot reach left of i').
void add_top_left_causal(ScoreArguments& score, std::int64_t L, std::int64_t S) {
  if (L == S) {
    score.causal = true;
  } else if (L > S) {
    score.window_right = score.window_right < 0 ? L - S : std::min(score.window_right, L - S);
  } else {
    score.attn_mask = at::ones({L, S}, at::TensorOptions().dtype(at::kBool)).triu(1);
  }
}

// A [h] per-head tensor (alibi_slopes, sinks) checked and in a float dtype mha takes.
at::Tensor per_head(const at::Tensor& t, const char* name, bool differentiable) {
  check_input(t, name);
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), kFunction, ": ", name, " must be a floating tensor [h], got ",
              t.scalar_type());
  TORCH_CHECK(differentiable || !t.requires_grad(), kFunction, ": ", name,
              " requires grad, but mha computes no gradient for it; pass ", name, ".detach()");
  const bool taken = t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
  return taken ? t : t.to(at::kFloat);
}

at::Tensor scaled_dot_product_attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                                        const c10::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                                        c10::optional<double> scale, bool enable_gqa,
                                        c10::optional<std::vector<std::int64_t>> window,
                                        const c10::optional<at::Tensor>& alibi_slopes, c10::optional<double> softcap,
                                        const c10::optional<at::Tensor>& sinks) {
  check_qkv(query, key, value);
  const std::int64_t h = heads(query), h_kv = heads(key), L = query.size(-2), S = key.size(-2);
  if (enable_gqa) {
    TORCH_CHECK(h_kv > 0 ? h % h_kv == 0 : h == 0, kFunction,
                ": with enable_gqa, query's heads must be a multiple of key's and value's, got query ", query.sizes(),
                " and key ", key.sizes());
  } else {
    TORCH_CHECK(h_kv == h || h_kv == 1, kFunction, ": key and value must have query's number of heads (", h,
                ") or 1, got key ", key.sizes(), "; pass enable_gqa=True for grouped-query attention");
  }
  const std::vector<std::int64_t> batch = broadcast_batch(query, key, value);
  const std::int64_t B = c10::multiply_integers(batch);

  ScoreArguments score;
  score.scale = scale;
  if (window) {
    TORCH_CHECK(window->size() == 2, kFunction, ": window must be (left, right), got ", window->size(), " numbers");
    score.window_left = (*window)[0], score.window_right = (*window)[1];
  }
  if (attn_mask) {
    TORCH_CHECK(!is_causal, kFunction, ": attn_mask and is_causal=True cannot both be set (as in torch)");
    add_mask(score, *attn_mask, query, batch, B, h, L, S);
  }
  if (is_causal) add_top_left_causal(score, L, S);
  if (alibi_slopes) score.alibi_slopes = per_head(*alibi_slopes, "alibi_slopes", false);
  score.softcap = softcap.value_or(0.0);
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, kFunction, ": dropout_p must be in [0, 1), got ", dropout_p);
  score.dropout_p = dropout_p;
  if (dropout_p > 0.0) score.dropout_seed = draw_dropout_seed();
  c10::optional<at::Tensor> head_sinks;
  if (sinks) head_sinks = per_head(*sinks, "sinks", true);

  at::Tensor out = AttentionFunction::apply(as_4d(query, batch, B), as_4d(key, batch, B), as_4d(value, batch, B),
                                            head_sinks, std::move(score));
  std::vector<std::int64_t> out_shape = batch;
  if (query.dim() >= 3) out_shape.push_back(h);
  out_shape.push_back(L), out_shape.push_back(value.size(-1));
  return out.view(out_shape);
}

}  // namespace

}  // namespace mha::torch_ops

TORCH_LIBRARY_IMPL(mha, CompositeImplicitAutograd, m) {
  m.impl("scaled_dot_product_attention", &mha::torch_ops::scaled_dot_product_attention);
}
