// A run whose every test skipped (GTEST_SKIP, such as the CUDA tests where no device is visible)
// exits 77, which ctest reports as skipped (SKIP_RETURN_CODE), not as passed. A run with a
// failure, or with one test that passed, exits as GoogleTest decides.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>

namespace {

class AllSkipped : public ::testing::EmptyTestEventListener {
  void OnTestProgramEnd(const ::testing::UnitTest& unit) override {
    // (At exit, once GoogleTest's own listeners, called after this one, have printed the summary.)
    if (unit.skipped_test_count() > 0 && unit.successful_test_count() == 0 && unit.failed_test_count() == 0) {
      std::atexit([] {
        std::fflush(nullptr);
        std::_Exit(77);
      });
    }
  }
};

const bool registered = [] {
  ::testing::UnitTest::GetInstance()->listeners().Append(new AllSkipped);
  return true;
}();

}  // namespace
