// Fuzzes BalancedSampler::restore with arbitrary states; a state it accepts must then give
// batches.
#include "fuzz_model.h"

#include <c10/util/Exception.h>

#include <cstring>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static shardopt::fuzz::Target t;  // restore() changes only the epoch
  std::array<int64_t, 6> f{};
  std::memcpy(f.data(), data, std::min(size, sizeof(f)));
  const auto s = shardopt::SamplerState::from_fields(f);
  try {
    t.sampler->restore(s);
  } catch (const c10::Error&) {
    return 0;
  }
  if (s.next_step < t.sampler->steps_per_epoch()) t.sampler->batch(s.next_step);
  return 0;
}
