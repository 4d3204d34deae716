// The trained model, once per concurrent request: Transformer::forward keeps state for its backward
// (the batch, each block's key lengths and kept weights) and pushes its parameters into the library's
// layers on every call, so one model must not run on two threads at once. The pool holds `copies`
// models read from the same checkpoint; a request leases one for its whole computation and gives it
// back (with its head gates removed) when the lease ends.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "explore/head_set.hpp"
#include "transformer/transformer.hpp"

namespace mha_cli::explore {

class ModelPool {
 public:
  // Reads the checkpoint `copies` (>= 1) times. Throws std::runtime_error as load_checkpoint does.
  ModelPool(const std::string& checkpoint, std::size_t copies);

  // A model for the caller alone until the lease is destroyed; waits while every copy is leased.
  class Lease {
   public:
    Lease(ModelPool& pool, std::unique_ptr<transformer::Transformer<float>> model)
        : pool_(&pool), model_(std::move(model)) {}
    Lease(Lease&&) = default;
    Lease& operator=(Lease&&) = delete;
    ~Lease();
    transformer::Transformer<float>& operator*() const { return *model_; }

   private:
    ModelPool* pool_;
    std::unique_ptr<transformer::Transformer<float>> model_;
  };
  Lease lease();

  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const ModelShape& shape() const { return shape_; }
  std::size_t copies() const { return copies_; }

 private:
  std::mutex mutex_;
  std::condition_variable returned_;
  std::vector<std::unique_ptr<transformer::Transformer<float>>> idle_;
  std::map<std::string, std::string> metadata_;
  ModelShape shape_;
  std::size_t copies_;
};

}  // namespace mha_cli::explore
