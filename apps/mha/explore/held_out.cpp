// The demo's held-out dates and the accuracy on them (held_out.hpp).
#include "explore/held_out.hpp"

#include <stdexcept>

#include <fmt/core.h>

#include "transformer/training.hpp"

namespace mha_cli::explore {

namespace tf = transformer;

namespace {

constexpr std::uint64_t kDemoHeldOutSeedOffset = 1000;  // demo.cpp: sample_dates(HeldOut, seed + 1000, ...)
constexpr std::uint64_t kDemoHeldOutCount = 1000;       // `mha demo --eval`'s default
constexpr std::uint64_t kMaxHeldOutCount = 100000;

std::uint64_t metadata_number(const std::map<std::string, std::string>& metadata, const std::string& key,
                              std::uint64_t fallback) {
  const auto it = metadata.find(key);
  if (it == metadata.end()) return fallback;
  std::size_t used = 0;
  std::uint64_t value = 0;
  try {
    value = std::stoull(it->second, &used);
  } catch (const std::exception&) {
  }
  if (used == 0 || used != it->second.size() || it->second[0] == '-')
    throw std::runtime_error(fmt::format("the checkpoint's metadata \"{}\" is not a number: \"{}\"", key, it->second));
  return value;
}

}  // namespace

std::vector<tf::DateExample> held_out_examples(const std::map<std::string, std::string>& metadata) {
  const std::uint64_t seed = metadata.contains("held_out_seed")
                                 ? metadata_number(metadata, "held_out_seed", 0)
                                 : metadata_number(metadata, "seed", 1) + kDemoHeldOutSeedOffset;
  const std::uint64_t count = metadata_number(metadata, "held_out_examples", kDemoHeldOutCount);
  if (count < 1 || count > kMaxHeldOutCount)
    throw std::runtime_error(
        fmt::format("the checkpoint's metadata \"held_out_examples\" is {}: expected 1..{}", count, kMaxHeldOutCount));
  return tf::sample_dates(tf::Split::HeldOut, seed, count);
}

HeldOutAccuracy held_out_accuracy(tf::Transformer<float>& model, const tf::Vocabulary& vocab,
                                  const std::vector<tf::DateExample>& examples, const HeadSet& off) {
  apply_head_set(model, off);
  std::vector<std::string> sources;
  for (const tf::DateExample& e : examples) sources.push_back(e.source);
  const std::vector<std::string> answers = tf::translate(model, vocab, sources);
  HeldOutAccuracy out{0, examples.size()};
  for (std::size_t i = 0; i < examples.size(); ++i) out.correct += answers[i] == examples[i].target;
  return out;
}

}  // namespace mha_cli::explore
