#include <shardopt/comm/agree.h>

#include "harness.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <cstdlib>
#include <thread>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using testing::run_ranks;
using testing::run_ranks_collect_errors;

// Every rank failed with a message that contains `expected`.
void expect_everywhere(const std::vector<std::string>& errors, const std::string& expected) {
  for (size_t r = 0; r < errors.size(); ++r) {
    ASSERT_FALSE(errors[r].empty()) << "rank " << r << " did not fail";
    EXPECT_NE(errors[r].find(expected), std::string::npos) << "rank " << r << ": " << errors[r];
  }
}

Agreement three_fields(int64_t a, int64_t b, int64_t c) {
  Agreement agreement("Widget");
  agreement.field("a", a).field("b", b).field("c", c).hint("pass the same widgets");
  return agreement;
}

TEST(Agree, EqualFieldsPassOnEveryRankInEveryMode) {
  run_ranks(3, [](std::shared_ptr<ProcessGroup> g) {
    auto agreement = three_fields(1, 2, 3);
    agreement.field("list", std::vector<int64_t>{4, 5, 6});
    agreement.check(*g);
    agreement.check(*g, Agreement::Mode::kHashFirst);
  });
}

TEST(Agree, NamesTheFirstDifferingFieldBothValuesAndTheRanksHoldingThem) {
  // Ranks 1 and 3 differ on b and on c; b is reported, with the ranks grouped by value.
  auto errors = run_ranks_collect_errors(4, [](std::shared_ptr<ProcessGroup> g) {
    const bool odd = g->rank() % 2 == 1;
    three_fields(1, odd ? 5 : 2, odd ? 9 : 3).check(*g);
  });
  expect_everywhere(errors, "shardopt: Widget: ranks disagree on b: 2 on ranks 0, 2 but 5 on ranks 1, 3; "
                            "pass the same widgets");
  for (const auto& e : errors) EXPECT_EQ(e.find("on c"), std::string::npos) << e;
}

TEST(Agree, ThreeValuesAreAllListed) {
  auto errors = run_ranks_collect_errors(3, [](std::shared_ptr<ProcessGroup> g) {
    three_fields(1, 2, 10 + g->rank()).check(*g);
  });
  expect_everywhere(errors, "ranks disagree on c: 10 on rank 0 but 11 on rank 1, 12 on rank 2");
}

TEST(Agree, HashFirstReportsLikeTheExactCheck) {
  auto errors = run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    three_fields(g->rank() == 1 ? 7 : 1, 2, 3).check(*g, Agreement::Mode::kHashFirst);
  });
  expect_everywhere(errors, "Widget: ranks disagree on a: 1 on rank 0 but 7 on rank 1");
}

TEST(Agree, EachNamesTheElementAndFormatsItsValue) {
  auto errors = run_ranks_collect_errors(3, [](std::shared_ptr<ProcessGroup> g) {
    std::vector<int64_t> flags(6, 1);
    if (g->rank() == 2) flags[4] = 0;
    Agreement()
        .each(flags, [](size_t i) { return "item #" + std::to_string(i); },
              [](const std::vector<int64_t>& v) { return v[0] ? std::string("on") : std::string("off"); })
        .check(*g);
  });
  expect_everywhere(errors, "ranks disagree on item #4: on on ranks 0, 1 but off on rank 2");
}

TEST(Agree, VectorFieldsShowTheirValues) {
  auto errors = run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    Agreement("Shapes").field("shape", g->rank() == 0 ? std::vector<int64_t>{3, 8} : std::vector<int64_t>{3, 9}).check(*g);
  });
  expect_everywhere(errors, "Shapes: ranks disagree on shape: [3, 8] on rank 0 but [3, 9] on rank 1");
}

TEST(Agree, DifferentNumbersOfFieldsAreReported) {
  auto errors = run_ranks_collect_errors(2, [](std::shared_ptr<ProcessGroup> g) {
    Agreement agreement("Extra");
    agreement.field("a", 1);
    if (g->rank() == 1) agreement.field("b", 2);
    agreement.check(*g);
  });
  expect_everywhere(errors, "Extra: ranks disagree on the number of fields checked: 1 on rank 0 but 2 on rank 1");
}

TEST(Agree, LongRankListsAreShortened) {
  // The message is a pure function of every rank's fields: twelve ranks without twelve threads.
  std::vector<std::vector<int64_t>> all;
  for (int r = 0; r < 12; ++r) all.push_back(Agreement().field("x", r == 11 ? 1 : 0).encode());
  const std::string message = Agreement().field("x", 0).disagreement(all);
  EXPECT_EQ(message, "ranks disagree on x: 0 on ranks 0, 1, 2, 3, 4, 5, 6, 7 and 3 more but 1 on rank 11");
  EXPECT_EQ(Agreement().field("x", 0).disagreement({all[0], all[1]}), "");
}

TEST(Agree, ThroughAStoreBeforeAnyGroupExists) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::seconds(20));
  std::vector<std::string> errors(3);
  std::vector<std::thread> threads;
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      try {
        // Twice under one key: the second round must not read the first round's values.
        three_fields(1, 2, 3).check(*store, "widgets", r, 3);
        three_fields(1, 2, r == 0 ? 4 : 3).check(*store, "widgets", r, 3);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  expect_everywhere(errors, "Widget: ranks disagree on c: 4 on rank 0 but 3 on ranks 1, 2");
}

TEST(Agree, ThroughAStoreAMissingRankIsNamedWithinTheTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  store->setTimeout(std::chrono::milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  try {
    three_fields(1, 2, 3).check(*store, "widgets", 0, 2);
    ADD_FAILURE() << "rank 1 never reports: the check must fail";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 0 of 2 could not connect to its peers within 300 ms: rank 1 never "
                                         "reported its widgets"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(20));
}

// init_process_group over one store, once per entry of `options` (one process each, as threads):
// each one's error ("" when it formed its group).
std::vector<std::string> init_errors(const std::vector<InitOptions>& options) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(options.size());
  std::vector<std::thread> threads;
  for (size_t t = 0; t < options.size(); ++t) {
    threads.emplace_back([&, t] {
      try {
        init_process_group(store, options[t]);
      } catch (const std::exception& e) {
        errors[t] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

TEST(Agree, ProcessGroupCreationChecksTheRanksWereStartedAlike) {
  const auto errors = init_errors({InitOptions().rank(0).world_size(2).timeout(std::chrono::seconds(20)),
                                   InitOptions().rank(1).world_size(2).timeout(std::chrono::seconds(30))});
  expect_everywhere(errors, "init_process_group: ranks disagree on timeout (ms): 20000 on rank 0 but 30000 on rank 1");
}

// Two processes started with RANK=1 in a world of 3 (and none with 2): the second to claim rank
// 1 fails at once, and the others, whose wait for rank 2 ends at the timeout, name the duplicate
// rather than only the missing rank.
TEST(Agree, ARankStartedTwiceIsNamedOnEveryRank) {
  std::vector<InitOptions> processes;
  for (int rank : {0, 1, 1}) {
    processes.push_back(InitOptions().backend("gloo").rank(rank).world_size(3).timeout(std::chrono::seconds(2)));
  }
  const auto errors = init_errors(processes);
  for (int t = 0; t < 3; ++t) {
    EXPECT_NE(errors[t].find("init_process_group: rank 1 was started twice: two processes have RANK (or the "
                             "launcher's rank variable) 1"),
              std::string::npos)
        << "process " << t << ": " << errors[t];
  }
}

// SHARDOPT_CHECK_DESYNC=1 (or check_desync) on some ranks only: the checking ranks' first
// collective would wait for checks the others never send. Refused as the group forms, everywhere.
TEST(Agree, ProcessGroupCreationChecksEveryRankChecksDesyncAlike) {
  // (The suite runs with SHARDOPT_CHECK_DESYNC=1 or 0: here check_desync alone decides. Set
  // before any thread of this test starts.)
  const char* was = std::getenv("SHARDOPT_CHECK_DESYNC");
  const std::string saved = was ? was : "";
  ::unsetenv("SHARDOPT_CHECK_DESYNC");
  const auto errors = init_errors({InitOptions().backend("gloo").rank(0).world_size(2),
                                   InitOptions().backend("gloo").rank(1).world_size(2).check_desync(true)});
  if (was) ::setenv("SHARDOPT_CHECK_DESYNC", saved.c_str(), 1);
  expect_everywhere(errors, "init_process_group: ranks disagree on desync check (check_desync or "
                            "SHARDOPT_CHECK_DESYNC=1): off on rank 0 but on on rank 1");
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
