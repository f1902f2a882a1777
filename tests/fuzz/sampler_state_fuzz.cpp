// Fuzzes BalancedSampler::restore with arbitrary states; a state it accepts must then give
// batches.
#include "fuzz_model.h"

#include <c10/util/Exception.h>

#include <cstring>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static shardopt::fuzz::Target t;  // restore() changes only the epoch
  int64_t f[6] = {};
  std::memcpy(f, data, std::min(size, sizeof(f)));
  shardopt::SamplerState s;
  s.version = f[0];
  s.fingerprint = static_cast<uint64_t>(f[1]);
  s.dataset_size = f[2];
  s.global_batch_size = f[3];
  s.epoch = f[4];
  s.next_step = f[5];
  try {
    t.sampler->restore(s);
  } catch (const c10::Error&) {
    return 0;
  }
  if (s.next_step < t.sampler->steps_per_epoch()) t.sampler->batch(s.next_step);
  return 0;
}
