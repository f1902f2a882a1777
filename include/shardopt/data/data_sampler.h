// DataSampler: a BalancedSampler as a torch::data sampler, for torch::data::make_data_loader.
//
//   shardopt::DataSampler sampler(dataset.size().value(), group->rank(), group->size(),
//                                 shardopt::SamplerOptions(32).seed(7));
//   auto loader = torch::data::make_data_loader(dataset, sampler,
//                                               torch::data::DataLoaderOptions(32));
//   for (int64_t epoch = 0; epoch < epochs; ++epoch) {
//     sampler.set_epoch(epoch);               // reaches the loader's copy (see below)
//     int64_t step = sampler.first_step();
//     for (auto& examples : *loader) {
//       shardopt::Batch b = sampler.batch(step++);   // b.real, b.global_real for the loss
//       ...
//     }
//   }
//
// Copies share one state. make_data_loader takes its sampler by value, so the loader holds a
// copy; set_epoch(), restore() and load() on any copy (the one you kept) change what the loader
// yields from its next pass on.
//
// What the loader sees: each pass yields steps first_step() .. steps_per_epoch() - 1 of the
// current epoch, one request of exactly batch_size indices per step, on every rank the same
// number of requests. Padding entries (Tail::kPad, last step) arrive as ordinary indices of real
// samples, so the dataset can fetch them and the batch keeps its shape; they are told apart only
// by batch(step).real, which the training step must use to weight them by zero. The k-th batch
// a pass yields is step first_step() + k (the loader delivers batches in order; with workers it
// asks for requests ahead of time, so the sampler's own cursor runs ahead of the training loop).
//
// Resuming: restore(state) makes the next pass start at state.next_step of state.epoch;
// set_epoch() with that same epoch keeps the resume point, any other epoch drops it, and the
// pass after the resumed one starts at step 0 again.
#pragma once

#include <shardopt/data/sampler.h>

#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace shardopt {

class DataSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  DataSampler(int64_t dataset_size, int rank, int world_size, SamplerOptions options);
  // Collective: checks that every rank of `group` passed the same size and options.
  DataSampler(int64_t dataset_size, const ProcessGroup& group, SamplerOptions options);
  explicit DataSampler(BalancedSampler sampler);

  void set_epoch(int64_t epoch);
  int64_t epoch() const;
  int64_t steps_per_epoch() const;
  // The step the current pass started at (or the next pass will start at, once restored).
  int64_t first_step() const;
  // The full record of a step of the current epoch, with the real flags and global_real.
  Batch batch(int64_t step) const;
  // See BalancedSampler::state / restore.
  SamplerState state(int64_t next_step) const;
  void restore(const SamplerState& state);

  // ---- torch::data::samplers::Sampler ----
  // Starts a pass (the loader calls it at begin()). A new_size other than the dataset size is an
  // error: the sampler's dataset is fixed.
  void reset(std::optional<size_t> new_size = std::nullopt) override;
  // The next step's indices; batch_size must equal SamplerOptions::batch_size (set the
  // loader's DataLoaderOptions::batch_size to it). Empty when the pass is over.
  std::optional<std::vector<size_t>> next(size_t batch_size) override;
  // Saves the state that resumes at the step next() would return next; load() restores it.
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 private:
  struct Shared;
  std::shared_ptr<Shared> shared_;
};

}  // namespace shardopt
