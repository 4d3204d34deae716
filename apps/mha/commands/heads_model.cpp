// The hand-built heads of `mha heads`; the construction is explained in heads_model.hpp.
#include "commands/heads_model.hpp"

#include <algorithm>
#include <cmath>
#include <map>

#include "mha/error.hpp"

namespace mha_cli::heads {
namespace {

constexpr std::int64_t V = kTokenSlots;
constexpr std::int64_t E = kModelWidth;

// Element (r, c) of a contiguous float32 matrix.
float& at(mha::Tensor& m, std::int64_t r, std::int64_t c) { return m.data_as<float>()[r * m.size(1) + c]; }

// The query map W_h^Q of head h following `rule`: [d_k = E, E], so that q_i = g * code(i) (header).
// Column V + i reads the position code of token i; column s < V reads its symbol code.
void write_query_map(mha::Tensor& w, std::int64_t row0, Rule rule, const Sequence& seq) {
  const double g = kLogitGap * std::sqrt(double(E));  // undoes the 1 / sqrt(d_k) of the attention
  const auto L = seq.length();
  for (std::int64_t i = 0; i < L; ++i) {
    switch (rule) {
      case Rule::PreviousToken: at(w, row0 + V + std::max<std::int64_t>(i - 1, 0), V + i) += float(g); break;
      case Rule::NextToken: at(w, row0 + V + std::min<std::int64_t>(i + 1, L - 1), V + i) += float(g); break;
      case Rule::FirstToken: at(w, row0 + V + 0, V + i) += float(g); break;
      case Rule::SameSymbol: at(w, row0 + V + i, V + i) -= float(g); break;  // the self penalty
    }
  }
  if (rule == Rule::SameSymbol) {
    for (std::int64_t s = 0; s < V; ++s) at(w, row0 + s, s) += float(2 * g);
  }
}

// Identity blocks: rows [row0, row0 + n) of `w` copy input columns [0, n).
void write_identity(mha::Tensor& w, std::int64_t row0, std::int64_t n) {
  for (std::int64_t r = 0; r < n; ++r) at(w, row0 + r, r) = 1.0f;
}

}  // namespace

const char* rule_name(Rule rule) {
  switch (rule) {
    case Rule::PreviousToken: return "previous token";
    case Rule::NextToken: return "next token";
    case Rule::SameSymbol: return "same symbol";
    case Rule::FirstToken: return "first token";
  }
  return "?";
}

const char* rule_slug(Rule rule) {
  switch (rule) {
    case Rule::PreviousToken: return "previous_token";
    case Rule::NextToken: return "next_token";
    case Rule::SameSymbol: return "same_symbol";
    case Rule::FirstToken: return "first_token";
  }
  return "unknown";
}

std::string check_text(const std::string& text) {
  if (text.empty()) return "the text is empty";
  if (std::int64_t(text.size()) > kPositionSlots) {
    return "the text has " + std::to_string(text.size()) + " characters; the demo embeds at most " +
           std::to_string(kPositionSlots);
  }
  std::string symbols;
  for (char c : text) {
    if (c < 32 || c > 126) return "the text must be printable ASCII";
    if (symbols.find(c) == std::string::npos) symbols += c;
  }
  if (std::int64_t(symbols.size()) > kTokenSlots) {
    return "the text has " + std::to_string(symbols.size()) + " distinct characters; the demo embeds at most " +
           std::to_string(kTokenSlots);
  }
  return "";
}

Sequence make_sequence(const std::string& text) {
  if (std::string why = check_text(text); !why.empty()) throw mha::Error("demo text: " + why);
  Sequence seq;
  seq.text = text;
  for (char c : text) {
    auto s = seq.symbols.find(c);
    if (s == std::string::npos) {
      s = seq.symbols.size();
      seq.symbols += c;
    }
    seq.ids.push_back(std::int64_t(s));
  }
  return seq;
}

mha::Tensor embed(const Sequence& seq) {
  mha::Tensor x(mha::DType::Float32, {seq.length(), E});  // X: [L, E], zero-initialised
  for (std::int64_t i = 0; i < seq.length(); ++i) {
    at(x, i, seq.ids[std::size_t(i)]) = 1.0f;  // onehot_V(symbol)
    at(x, i, V + i) = 1.0f;                    // onehot_P(position)
  }
  return x;
}

std::vector<std::int64_t> rule_targets(Rule rule, const Sequence& seq, std::int64_t i) {
  const auto L = seq.length();
  switch (rule) {
    case Rule::PreviousToken: return {std::max<std::int64_t>(i - 1, 0)};
    case Rule::NextToken: return {std::min<std::int64_t>(i + 1, L - 1)};
    case Rule::FirstToken: return {0};
    case Rule::SameSymbol: {
      std::vector<std::int64_t> others;
      for (std::int64_t j = 0; j < L; ++j) {
        if (j != i && seq.ids[std::size_t(j)] == seq.ids[std::size_t(i)]) others.push_back(j);
      }
      if (others.empty()) others.push_back(i);
      return others;
    }
  }
  return {};
}

mha::MultiHeadAttentionConfig multi_head_config() {
  mha::MultiHeadAttentionConfig config;
  config.d_model = E;
  config.num_heads = kHeads;
  config.d_k = E;
  config.d_v = V;
  config.bias = false;
  return config;
}

Projections multi_head_projections(const Sequence& seq) {
  constexpr std::int64_t d_k = E, d_v = V;
  Projections p{mha::Tensor(mha::DType::Float32, {kHeads * d_k, E}),   // W^Q: head h in rows [h*d_k, (h+1)*d_k)
                mha::Tensor(mha::DType::Float32, {kHeads * d_k, E}),   // W^K
                mha::Tensor(mha::DType::Float32, {kHeads * d_v, E}),   // W^V
                mha::Tensor(mha::DType::Float32, {E, kHeads * d_v})};  // W^O
  for (std::int64_t h = 0; h < kHeads; ++h) {
    write_query_map(p.query, h * d_k, kHeadRules[std::size_t(h)], seq);
    write_identity(p.key, h * d_k, E);    // W_h^K = I_E
    write_identity(p.value, h * d_v, V);  // W_h^V = [I_V | 0]
  }
  write_identity(p.output, 0, E);  // W^O = I_E (E == h*d_v)
  return p;
}

mha::MultiHeadAttentionConfig single_head_config() {
  mha::MultiHeadAttentionConfig config;
  config.d_model = E;
  config.num_heads = 1;
  config.d_k = E;
  config.d_v = kHeads * V;
  config.bias = false;
  return config;
}

Projections single_head_projections(const Sequence& seq) {
  constexpr std::int64_t d_k = E, d_v = kHeads * V;
  Projections p{mha::Tensor(mha::DType::Float32, {d_k, E}), mha::Tensor(mha::DType::Float32, {d_k, E}),
                mha::Tensor(mha::DType::Float32, {d_v, E}), mha::Tensor(mha::DType::Float32, {E, d_v})};
  for (Rule rule : kHeadRules) write_query_map(p.query, 0, rule, seq);  // the sum of the four maps
  write_identity(p.key, 0, E);
  for (std::int64_t h = 0; h < kHeads; ++h) write_identity(p.value, h * V, V);  // four copies of [I_V | 0]
  write_identity(p.output, 0, E);
  return p;
}

void load_projections(mha::MultiHeadAttention& layer, const Projections& p) {
  std::map<std::string, mha::TensorView> state;
  mha::Tensor packed;  // in_proj_weight [q; k; v]: must outlive the load
  if (layer.packed_in_proj()) {
    const std::int64_t rows = p.query.size(0) + p.key.size(0) + p.value.size(0);
    packed = mha::Tensor(mha::DType::Float32, {rows, E});
    float* dst = packed.data_as<float>();
    for (const mha::Tensor* part : {&p.query, &p.key, &p.value}) {
      std::copy_n(part->data_as<float>(), part->numel(), dst);
      dst += part->numel();
    }
    state.emplace("in_proj_weight", packed.view());
  } else {
    state.emplace("q_proj_weight", p.query.view());
    state.emplace("k_proj_weight", p.key.view());
    state.emplace("v_proj_weight", p.value.view());
  }
  state.emplace("out_proj.weight", p.output.view());
  layer.load_state_dict(state);
}

}  // namespace mha_cli::heads
