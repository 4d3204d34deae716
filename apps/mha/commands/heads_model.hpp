// The hand-built model of `mha heads`: a text read as one token per character, its embedding, and
// attention parameters CONSTRUCTED (not learned, not random) so that each head attends by one rule.
//
// Legend: L queries = S keys = the text's length, E = d_model, V token slots, P position slots,
// h heads, d_k, d_v per-head widths. Weights use PyTorch's layout [out, in] (y = x W^T).
//
// The embedding, one row per token, is two one-hot codes side by side (E = V + P = 64):
//
//     x_i = [ onehot_V(symbol of token i) | onehot_P(i) ]                  X: [L, E]
//
// Each head h reads X through its own projections (section 3.2.2):
//
//     k_j = x_j                      W_h^K = I_E               [d_k = E, E]   (keys: the tokens as they are)
//     q_i = g * code_h(i)            W_h^Q                     [d_k = E, E]   (queries: the code to look for)
//     v_j = onehot_V(symbol of j)    W_h^V = [I_V | 0]         [d_v = V, E]   (values: the symbol)
//     W^O = I_E                                                [E, h*d_v = E] (Concat(head_1..head_4) as is)
//
// so the logit of query i for key j is q_i . x_j / sqrt(d_k) = (g / sqrt(d_k)) * code_h(i) . x_j, and
// with g = kLogitGap * sqrt(d_k) every allowed logit is a multiple of kLogitGap:
//
//     head 0, previous token: code(i) = onehot_P(max(i - 1, 0))          logit 12 at key i-1, else 0
//     head 1, next token:     code(i) = onehot_P(min(i + 1, L - 1))      logit 12 at key i+1, else 0
//     head 2, same symbol:    code(i) = 2 onehot_V(sym i) - onehot_P(i)  24 at other keys with the same
//                                                                         symbol, 12 at i itself, else 0
//     head 3, first token:    code(i) = onehot_P(0)                      logit 12 at key 0, else 0
//
// (The first query has no previous token and attends to itself; likewise the last query for "next";
// a symbol that occurs once attends to itself.) A gap of 12 leaves exp(-12) = 6e-6 of the weight to
// each other key. Heads 0, 1 and 3 look only at the position subspace, head 2 mostly at the symbol
// subspace: the same tokens, four different representation subspaces.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <vector>

#include "mha/multi_head_attention.hpp"
#include "mha/tensor.hpp"

namespace mha_cli::heads {

inline constexpr std::int64_t kTokenSlots = 16;                            // V: at most 16 distinct symbols
inline constexpr std::int64_t kPositionSlots = 48;                         // P: at most 48 tokens
inline constexpr std::int64_t kModelWidth = kTokenSlots + kPositionSlots;  // E = 64
inline constexpr std::int64_t kHeads = 4;                                  // h
inline constexpr double kLogitGap = 12.0;                                  // logit of a designated key above the others

enum class Rule { PreviousToken, NextToken, SameSymbol, FirstToken };
inline constexpr std::array<Rule, kHeads> kHeadRules = {Rule::PreviousToken, Rule::NextToken, Rule::SameSymbol,
                                                        Rule::FirstToken};  // head h follows kHeadRules[h]

const char* rule_name(Rule rule);  // "previous token"
const char* rule_slug(Rule rule);  // "previous_token", for file names

// A text as a sequence of tokens, one per character.
struct Sequence {
  std::string text;               // [L] the tokens
  std::string symbols;            // the distinct characters, in order of first appearance
  std::vector<std::int64_t> ids;  // [L] index of each token's character in `symbols`
  std::int64_t length() const { return static_cast<std::int64_t>(text.size()); }
};

// "" when `text` can be the input of `mha heads`, else the reason it cannot (for the command line).
std::string check_text(const std::string& text);
// Throws mha::Error when check_text fails.
Sequence make_sequence(const std::string& text);

// X: [L, E] float32, the embedding above.
mha::Tensor embed(const Sequence& seq);

// The keys rule `rule` designates for query i (ascending): where the rule says the weight should go.
std::vector<std::int64_t> rule_targets(Rule rule, const Sequence& seq, std::int64_t i);

// A layer's four projection matrices, PyTorch layout [out, in].
struct Projections {
  mha::Tensor query;   // [h*d_k, E]
  mha::Tensor key;     // [h*d_k, E]
  mha::Tensor value;   // [h*d_v, E]
  mha::Tensor output;  // [E, h*d_v]
};

// The four-head layer: h = 4, d_k = E, d_v = V, no biases.
mha::MultiHeadAttentionConfig multi_head_config();
Projections multi_head_projections(const Sequence& seq);

// The comparison: ONE head, d_k = E, d_v = h*V = E, whose query map is the sum of the four heads'
// (keys are shared, so its logits are the sums of theirs) and whose value map repeats W^V four
// times, so its output has the same layout as the four-head layer's.
mha::MultiHeadAttentionConfig single_head_config();
Projections single_head_projections(const Sequence& seq);

// Puts `p` into `layer` through load_state_dict (packed in_proj_weight or separate q/k/v weights,
// whichever the layer's config uses). Throws mha::Error on a shape mismatch.
void load_projections(mha::MultiHeadAttention& layer, const Projections& p);

}  // namespace mha_cli::heads
