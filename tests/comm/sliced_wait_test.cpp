// The wait of a group that goes on after a death (Note [Failure watch] in
// csrc/comm/failure_watch.cpp): a Gloo collective's wait runs in slices of at most 100 ms, each a
// timed c10d wait that throws "Operation timed out!" when it ends first. A slice that ends in the
// instant its collective completes throws too, for a work that then reads as completed: that
// wait must succeed and leave the group whole, while a collective's own failure still fails it.
// Gloo collectives whose timed wait is scripted stand in for the race, which real ones hit only
// by chance on a loaded machine.
#include <shardopt/comm/process_group.h>
#include <shardopt/testing/introspection.h>

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using std::chrono::milliseconds;

// A Gloo collective whose first `slices_before_done` timed waits end before it completes, as a
// slow peer's do, and whose next one ends as it completes: it completes (with `error`, if set)
// and the slice still throws, as c10d's does when its deadline passes before it sees completion.
class ScriptedGlooWork : public c10d::ProcessGroupGloo::AsyncWork {
 public:
  ScriptedGlooWork(int slices_before_done, std::string error)
      : AsyncWork(nullptr, {}, c10d::OpType::ALLREDUCE, 0, std::chrono::minutes(1)),
        slices_before_done_(slices_before_done),
        error_(std::move(error)) {}

  bool wait(milliseconds timeout) override {
    if (timeout == kNoTimeout) return c10d::Work::wait(timeout);  // returns at once once completed
    slices.push_back(timeout);
    if (static_cast<int>(slices.size()) > slices_before_done_) {
      finish(error_.empty() ? nullptr : std::make_exception_ptr(std::runtime_error(error_)));
    }
    throw std::runtime_error("Operation timed out!");
  }
  void run() override {}
  const std::vector<at::Tensor> getInputTensors() override { return {}; }
  const std::vector<at::Tensor> getOutputTensors() override { return {}; }

  std::vector<milliseconds> slices;  // the timeout of each timed wait, in order

 private:
  int slices_before_done_;
  std::string error_;
};

struct Waited {
  bool broke = false;
  std::string error;
  std::vector<milliseconds> slices;
};

Waited wait_watched(int slices_before_done, const std::string& error = "") {
  auto work = c10::make_intrusive<ScriptedGlooWork>(slices_before_done, error);
  PendingWork pending(work, "allreduce #7 (backward)", 0, std::chrono::minutes(1));
  Waited out;
  out.broke = testing::Introspection::wait_watched(pending, out.error);
  out.slices = work->slices;
  return out;
}

TEST(SlicedWait, ASliceThatEndsAsItsCollectiveCompletesSucceeds) {
  const Waited w = wait_watched(0);
  ASSERT_EQ(w.slices.size(), 1u);
  EXPECT_LE(w.slices[0], milliseconds(100)) << "the wait is cut into slices under a failure watch";
  EXPECT_EQ(w.error, "");
  EXPECT_FALSE(w.broke) << "a collective that completed broke its healthy group";
}

TEST(SlicedWait, SlicesThatEndFirstAreWaitedThrough) {
  const Waited w = wait_watched(3);
  EXPECT_EQ(w.slices.size(), 4u);
  for (auto slice : w.slices) EXPECT_LE(slice, milliseconds(100));
  EXPECT_EQ(w.error, "");
  EXPECT_FALSE(w.broke);
}

TEST(SlicedWait, ACollectivesOwnFailureStillBreaksTheGroupNamingIt) {
  const Waited w = wait_watched(1, "Connection closed by peer [127.0.0.1]:4242");
  EXPECT_TRUE(w.broke);
  EXPECT_NE(w.error.find("allreduce #7 (backward) on rank 0 failed"), std::string::npos) << w.error;
  EXPECT_NE(w.error.find("Connection closed by peer"), std::string::npos) << w.error;
  EXPECT_EQ(w.error.find("Operation timed out"), std::string::npos) << "the slice's timeout hid the cause: " << w.error;
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
