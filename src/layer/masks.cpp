// The layer's masks in kernel terms (see masks.hpp).
//
// Legend: B batch, h heads, L queries, S keys, S' = S + extra appended key positions.
#include "layer/masks.hpp"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

#include "attention/attention_core.hpp"
#include "dtype_dispatch.hpp"
#include "layer/inputs.hpp"
#include "mha/error.hpp"

namespace mha::detail {

void KernelMasks::own_views() {
  for (auto [view, storage] :
       {std::pair{&options.key_padding_mask, &key_padding_mask}, std::pair{&options.attn_mask, &attn_mask},
        std::pair{&options.alibi_slopes, &alibi_slopes}, std::pair{&options.sinks, &sinks}}) {
    if (*view && (*view)->data() != storage->data()) {
      *storage = Tensor::copy_of(**view);
      *view = storage->view();
    }
  }
}

namespace {

[[noreturn]] void fail(const std::string& message) { throw Error(message); }

std::string str(std::int64_t v) { return std::to_string(v); }

// Pads masks for `extra` appended key positions, which every query may attend to (as PyTorch pads
// attn_mask and key_padding_mask with zeros). Causal is folded into attn_mask, since it concerns the
// S input keys only. options: validated, in terms of the S input keys.
template <class T>
void pad_masks_for_extra_keys(KernelMasks& m, std::int64_t B, std::int64_t h, std::int64_t L, std::int64_t S,
                              std::int64_t extra) {
  AttentionOptions& o = m.options;
  const std::int64_t S2 = S + extra;
  if (o.key_padding_mask || !o.key_lengths.empty()) {
    // [B, S'], the extra columns allowed; a float key_padding_mask stays additive (key_lengths -> -inf).
    const bool additive = o.key_padding_mask && o.key_padding_mask->dtype() != DType::Bool;
    Tensor padding(additive ? dtype_of<T>() : DType::Bool, {B, S2});
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t j = 0; j < S; ++j) {
        const bool beyond_length = !o.key_lengths.empty() && j >= o.key_lengths[static_cast<std::size_t>(b)];
        const std::int64_t src =
            o.key_padding_mask ? b * o.key_padding_mask->stride(0) + j * o.key_padding_mask->stride(1) : 0;
        if (additive) {
          padding.data_as<T>()[b * S2 + j] =
              beyond_length ? -std::numeric_limits<T>::infinity() : o.key_padding_mask->data_as<T>()[src];
        } else {
          const bool padded = o.key_padding_mask && o.key_padding_mask->data_as<std::uint8_t>()[src] != 0;
          padding.data_as<std::uint8_t>()[b * S2 + j] = beyond_length || padded;
        }
      }
    m.key_padding_mask = std::move(padding);
    o.key_padding_mask = m.key_padding_mask.view();
    o.key_lengths.clear();
  }
  if (o.attn_mask || o.causal) {
    const bool additive = o.attn_mask && o.attn_mask->dtype() != DType::Bool;
    const std::int64_t N = o.attn_mask && o.attn_mask->rank() == 3 ? B * h : 0;  // 0: a 2-D mask
    Tensor mask(additive ? dtype_of<T>() : DType::Bool, N ? Shape{N, L, S2} : Shape{L, S2});
    for (std::int64_t n = 0; n < std::max<std::int64_t>(N, 1); ++n)
      for (std::int64_t i = 0; i < L; ++i)
        for (std::int64_t j = 0; j < S; ++j) {
          const std::int64_t at = (n * L + i) * S2 + j;
          const bool hidden_by_causal = o.causal && j > i + S - L;
          if (additive) {
            const auto& a = *o.attn_mask;
            const std::int64_t src =
                (N ? n * a.stride(0) : 0) + i * a.stride(a.rank() - 2) + j * a.stride(a.rank() - 1);
            mask.data_as<T>()[at] = hidden_by_causal ? -std::numeric_limits<T>::infinity() : a.data_as<T>()[src];
          } else {
            bool hidden = hidden_by_causal;
            if (o.attn_mask) {
              const auto& a = *o.attn_mask;
              const std::int64_t src =
                  (N ? n * a.stride(0) : 0) + i * a.stride(a.rank() - 2) + j * a.stride(a.rank() - 1);
              hidden = hidden || a.data_as<std::uint8_t>()[src] != 0;
            }
            mask.data_as<std::uint8_t>()[at] = hidden;
          }
        }
    m.attn_mask = std::move(mask);
    o.attn_mask = m.attn_mask.view();
    o.causal = false;
  }
}

}  // namespace

KernelMasks kernel_masks(const MultiHeadAttentionInputs& in, const MultiHeadAttentionConfig& c, bool batched,
                         std::int64_t B, std::int64_t L, std::int64_t S, const Tensor* sinks) {
  const std::int64_t h = c.num_heads;
  // Float masks are added to the logits, which a bfloat16 layer computes in float32: its masks are
  // kept (or made) float32, not rounded to bfloat16.
  const DType mask_dtype = c.dtype == DType::BFloat16 ? DType::Float32 : c.dtype;
  KernelMasks masks;
  masks.packed = packed_rows(in, c, batched, L, S);  // checked first: it refuses the masks below
  AttentionOptions& o = masks.options;
  static_cast<ScoreSpec&>(o) = in;  // the score as given; then what the layer's terms change
  if (in.key_padding_mask) {
    const TensorView& kpm = *in.key_padding_mask;
    if (!batched) {
      if (kpm.rank() != 1 || kpm.size(0) != S)
        fail("key_padding_mask: expected shape [S] = [" + str(S) + "] for unbatched input, got " +
             shape_str(kpm.shape()));
      o.key_padding_mask = TensorView(kpm.data(), kpm.dtype(), {1, S}, {0, kpm.stride(0)});
    } else {
      o.key_padding_mask = kpm;
    }
    if (kpm.dtype() != DType::Bool && kpm.dtype() != mask_dtype) {  // another float dtype: convert
      masks.key_padding_mask = Tensor::copy_of(*o.key_padding_mask, mask_dtype);
      o.key_padding_mask = masks.key_padding_mask.view();
    }
  }
  if (in.attn_mask && in.attn_mask->dtype() != DType::Bool && in.attn_mask->dtype() != mask_dtype) {
    masks.attn_mask = Tensor::copy_of(*in.attn_mask, mask_dtype);  // another float dtype: convert
    o.attn_mask = masks.attn_mask.view();
  }
  if (extra_positions(c) && (in.window_left >= 0 || in.window_right >= 0 || in.alibi_slopes))
    fail(std::string(in.alibi_slopes ? "alibi_slopes" : "window") +
         ": not available with add_bias_kv / add_zero_attn (the appended key positions have no place in the "
         "sequence)");
  if (in.sinks)
    fail("sinks: a layer's sinks are its parameter `sinks` (MultiHeadAttentionConfig::sinks = true), not an input");
  if (sinks) {
    masks.sinks = Tensor::copy_of(*sinks, mask_dtype);
    o.sinks = masks.sinks.view();
  }
  validate_score(o, c.dtype, B, h, L, S);  // scale, softcap and slopes in the layer's logit dtype
  if (const std::int64_t extra = extra_positions(c)) {
    dispatch_float32_or_float64(mask_dtype, [&]<class T>(T) { pad_masks_for_extra_keys<T>(masks, B, h, L, S, extra); });
  }
  return masks;
}

}  // namespace mha::detail
