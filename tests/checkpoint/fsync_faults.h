// Faults in fsync for the checkpoint tests: this test binary's fsync comes before the C library's,
// for the library's code linked into it too (tests/checkpoint/fsync_faults.cpp).
#pragma once

#include <atomic>
#include <chrono>

namespace shardopt::testing {

// While set, syncing a folder fails with EIO.
extern std::atomic<bool> fail_folder_fsync;

// While held, syncing a regular file waits until release_file_fsync(), or at most `most`; a wait
// that ran out is counted (file_fsync_waits_ran_out).
void hold_file_fsync(std::chrono::milliseconds most);
void release_file_fsync();
int file_fsync_waits_ran_out();

}  // namespace shardopt::testing
