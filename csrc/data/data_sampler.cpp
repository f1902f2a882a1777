#include <shardopt/data/data_sampler.h>
#include <shardopt/check.h>

#include <c10/util/Exception.h>
#include <torch/serialize/input-archive.h>
#include <torch/serialize/output-archive.h>

#include <iterator>
#include <mutex>
#include <string>

namespace shardopt {

// The state every copy of a DataSampler shares (the loader holds one copy, the user another).
struct DataSampler::Shared {
  explicit Shared(BalancedSampler s) : sampler(std::move(s)) {}

  std::mutex mutex;
  BalancedSampler sampler;
  int64_t first_step = 0;       // where the current pass started (or the next one starts)
  int64_t cursor = 0;           // the step next() returns next
  bool resume_pending = false;  // restore() chose first_step for the next pass
};

namespace {

const char* const kFields[] = {"version", "fingerprint", "dataset_size", "global_batch_size", "epoch", "next_step"};

std::string key(const char* field) {
  return std::string("shardopt.data_sampler.") + field;
}

}  // namespace

DataSampler::DataSampler(int64_t dataset_size, int rank, int world_size, SamplerOptions options)
    : DataSampler(BalancedSampler(dataset_size, rank, world_size, std::move(options))) {}

DataSampler::DataSampler(int64_t dataset_size, const ProcessGroup& group, SamplerOptions options)
    : DataSampler(BalancedSampler(dataset_size, group, std::move(options))) {}

DataSampler::DataSampler(BalancedSampler sampler) : shared_(std::make_shared<Shared>(std::move(sampler))) {}

void DataSampler::set_epoch(int64_t epoch) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  if (shared_->resume_pending && epoch == shared_->sampler.epoch()) return;
  shared_->sampler.set_epoch(epoch);
  shared_->resume_pending = false;
  shared_->first_step = 0;
  shared_->cursor = 0;
}

int64_t DataSampler::epoch() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->sampler.epoch();
}

int64_t DataSampler::steps_per_epoch() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->sampler.steps_per_epoch();
}

int64_t DataSampler::first_step() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->first_step;
}

Batch DataSampler::batch(int64_t step) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->sampler.batch(step);
}

SamplerState DataSampler::state(int64_t next_step) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  return shared_->sampler.state(next_step);
}

void DataSampler::restore(const SamplerState& state) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  shared_->sampler.restore(state);
  shared_->first_step = state.next_step;
  shared_->cursor = state.next_step;
  shared_->resume_pending = true;
}

void DataSampler::reset(std::optional<size_t> new_size) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  const int64_t size = shared_->sampler.dataset_size();
  SHARDOPT_CHECK(!new_size || static_cast<int64_t>(*new_size) == size, "DataSampler::reset: the dataset ",
              "size is fixed at ", size, ", got a new size of ", *new_size, "; build a new sampler instead");
  if (!shared_->resume_pending) shared_->first_step = 0;
  shared_->resume_pending = false;
  shared_->cursor = shared_->first_step;
}

std::optional<std::vector<size_t>> DataSampler::next(size_t batch_size) {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  const auto& sampler = shared_->sampler;
  SHARDOPT_CHECK(static_cast<int64_t>(batch_size) == sampler.options().batch_size(),
              "DataSampler::next: ", "asked for ", batch_size, " indices but the sampler's batch_size is ",
              sampler.options().batch_size(), "; give the data loader DataLoaderOptions(",
              sampler.options().batch_size(), ")");
  if (shared_->cursor >= sampler.steps_per_epoch()) return std::nullopt;
  const Batch b = sampler.batch(shared_->cursor++);
  return std::vector<size_t>(b.indices.begin(), b.indices.end());
}

void DataSampler::save(torch::serialize::OutputArchive& archive) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  const auto values = shared_->sampler.state(shared_->cursor).to_fields();
  for (size_t i = 0; i < std::size(kFields); ++i) archive.write(key(kFields[i]), c10::IValue(values[i]));
}

void DataSampler::load(torch::serialize::InputArchive& archive) {
  std::array<int64_t, 6> values{};
  for (size_t i = 0; i < std::size(kFields); ++i) {
    c10::IValue v;
    SHARDOPT_CHECK(archive.try_read(key(kFields[i]), v) && v.isInt(), "DataSampler::load: the archive ",
                "has no integer '", key(kFields[i]), "'; it was not written by DataSampler::save");
    values[i] = v.toInt();
  }
  restore(SamplerState::from_fields(values));
}

}  // namespace shardopt
