// The JSON API of `mha explore` (explore_api.hpp).
#include "explore/explore_api.hpp"

#include <string>
#include <vector>

#include <fmt/core.h>

#include "commands/translate_checks.hpp"
#include "explore/held_out.hpp"
#include "explore/input_analysis.hpp"
#include "explore/request_error.hpp"
#include "mha/attention.hpp"
#include "transformer/attention_kind.hpp"

namespace mha_cli::explore {

namespace tf = transformer;

namespace {

// Where the parser is in a JSON text, for a message: each container open, with the key or the index of
// the element being read. Written as the other messages name a field: "text", heads_off[0][2].
class JsonPosition {
 public:
  bool track(nlohmann::json::parse_event_t event, const nlohmann::json& parsed) {
    using Event = nlohmann::json::parse_event_t;
    switch (event) {
      case Event::object_start: levels_.push_back({false, {}, 0}); break;
      case Event::array_start: levels_.push_back({true, {}, 0}); break;
      case Event::key: levels_.back().key = parsed.get<std::string>(); break;
      case Event::object_end:
      case Event::array_end: levels_.pop_back(), element_read(); break;
      case Event::value: element_read(); break;
    }
    return true;  // keep every value
  }
  std::string where() const {
    if (levels_.size() == 1 && !levels_[0].array) return fmt::format("\"{}\"", levels_[0].key);
    std::string out = levels_.empty() || levels_[0].array ? "the request's body" : "";
    for (const Level& level : levels_)
      out += level.array ? fmt::format("[{}]", level.index) : (out.empty() ? "" : ".") + level.key;
    return out;
  }

 private:
  struct Level {
    bool array;
    std::string key;    // an object's: the last key read
    std::size_t index;  // an array's: the elements read
  };
  void element_read() {
    if (!levels_.empty() && levels_.back().array) ++levels_.back().index;
  }
  std::vector<Level> levels_;
};

// The request's body as a JSON object.
nlohmann::json body_object(const std::string& body) {
  nlohmann::json j;
  JsonPosition position;
  try {
    j = nlohmann::json::parse(body, [&](int, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
      return position.track(event, parsed);
    });
  } catch (const nlohmann::json::parse_error& e) {
    throw RequestError(fmt::format("the request's body is not JSON: {}", e.what()));
  } catch (const nlohmann::json::out_of_range& e) {
    // A number beyond a double's range (1e400): the library's message, "number overflow parsing '1e400'".
    const std::string what = e.what();
    const std::size_t open = what.find('\''), close = what.rfind('\'');
    const std::string number = open < close ? what.substr(open + 1, close - open - 1) : what;
    throw RequestError(
        fmt::format("{}: the number {} is out of range (a number must be within +-1.8e308)", position.where(), number));
  } catch (const nlohmann::json::exception& e) {
    throw RequestError(fmt::format("the request's body is not usable JSON: {}", e.what()));
  }
  if (!j.is_object()) throw RequestError("the request's body must be a JSON object, e.g. {\"text\": \"5 March 2021\"}");
  return j;
}

const nlohmann::json* field(const nlohmann::json& object, const char* name) {
  const auto it = object.find(name);
  return it == object.end() ? nullptr : &*it;
}

}  // namespace

ExploreApi::ExploreApi(ModelPool& pool, const std::string& checkpoint, int threads)
    : pool_(pool), threads_(threads), held_out_(held_out_examples(pool.metadata())) {
  if (const auto it = pool.metadata().find("unsure_below"); it != pool.metadata().end())
    unsure_below_ = confidence_threshold(it->second, checkpoint);
}

nlohmann::json ExploreApi::model() const {
  const ModelShape& shape = pool_.shape();
  nlohmann::json kinds = nlohmann::json::array();
  for (tf::AttentionKind kind : tf::kAttentionKinds)
    kinds.push_back({{"kind", tf::kind_slug(kind)}, {"name", tf::kind_name(kind)}, {"layers", shape.layers_of(kind)}});
  return {{"encoder_layers", shape.encoder_layers},
          {"decoder_layers", shape.decoder_layers},
          {"heads", shape.heads},
          {"kinds", std::move(kinds)},
          {"unsure_below", unsure_below_},
          {"held_out_examples", held_out_.size()},
          {"max_input_length", kMaxInputLength}};
}

nlohmann::json ExploreApi::translate(const std::string& body) {
  const nlohmann::json request = body_object(body);
  const nlohmann::json* text = field(request, "text");
  if (text == nullptr || !text->is_string())
    throw RequestError("\"text\": expected a string, the date to translate, e.g. {\"text\": \"5 March 2021\"}");
  const std::string normalized = readable_input(text->get<std::string>(), vocab_);
  const HeadSet off = parse_heads_off(field(request, "heads_off"), pool_.shape());
  mha::set_num_threads(threads_);  // this thread's count (OpenMP's is per thread)
  nlohmann::json answer;
  {
    const ModelPool::Lease model = pool_.lease();
    answer = analyse_input(*model, vocab_, normalized, off, unsure_below_);
  }
  answer["input"] = *text;
  answer["heads_off"] = heads_json(off);
  return answer;
}

nlohmann::json ExploreApi::accuracy(const std::string& body) {
  const nlohmann::json request = body_object(body);
  const HeadSet off = parse_heads_off(field(request, "heads_off"), pool_.shape());
  bool cached = false;
  const HeldOutAccuracy result = cache_.get(
      head_set_key(off),
      [&] {
        mha::set_num_threads(threads_);
        const ModelPool::Lease model = pool_.lease();
        return held_out_accuracy(*model, vocab_, held_out_, off);
      },
      cached);
  return {{"heads_off", heads_json(off)},
          {"correct", result.correct},
          {"examples", result.examples},
          {"accuracy", result.accuracy()},
          {"cached", cached}};
}

}  // namespace mha_cli::explore
