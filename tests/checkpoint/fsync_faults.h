// Faults in fsync for the checkpoint tests: this test binary's fsync comes before the C library's,
// for the library's code linked into it too (tests/checkpoint/fsync_faults.cpp).
#pragma once

#include <atomic>
#include <chrono>

namespace shardopt::testing {

// While nonzero, syncing a folder fails with this errno (EIO: a disk error; EINVAL: a file system
// that cannot sync folders).
extern std::atomic<int> folder_fsync_errno;

// While held, syncing a regular file waits until release_file_fsync(), or at most `most`; a wait
// that ran out is counted (file_fsync_waits_ran_out).
void hold_file_fsync(std::chrono::milliseconds most);
void release_file_fsync();
int file_fsync_waits_ran_out();

}  // namespace shardopt::testing
