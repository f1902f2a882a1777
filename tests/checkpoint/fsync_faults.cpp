#include "checkpoint/fsync_faults.h"

#include <cerrno>
#include <condition_variable>
#include <mutex>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace shardopt::testing {

std::atomic<int> folder_fsync_errno{0};

namespace {
std::mutex gate_mu;
std::condition_variable gate_cv;
bool held = false;
std::chrono::milliseconds hold_at_most{0};
int ran_out = 0;
}  // namespace

void hold_file_fsync(std::chrono::milliseconds most) {
  std::lock_guard<std::mutex> lock(gate_mu);
  held = true;
  hold_at_most = most;
}

void release_file_fsync() {
  {
    std::lock_guard<std::mutex> lock(gate_mu);
    held = false;
  }
  gate_cv.notify_all();
}

int file_fsync_waits_ran_out() {
  std::lock_guard<std::mutex> lock(gate_mu);
  return ran_out;
}

}  // namespace shardopt::testing

extern "C" int fsync(int fd) {
  namespace t = shardopt::testing;
  struct stat st {};
  const bool known = ::fstat(fd, &st) == 0;
  if (const int error = t::folder_fsync_errno.load(); error != 0 && known && S_ISDIR(st.st_mode)) {
    errno = error;
    return -1;
  }
  if (known && S_ISREG(st.st_mode)) {
    std::unique_lock<std::mutex> lock(t::gate_mu);
    if (t::held && !t::gate_cv.wait_for(lock, t::hold_at_most, [] { return !t::held; })) ++t::ran_out;
  }
  return static_cast<int>(::syscall(SYS_fsync, fd));
}
