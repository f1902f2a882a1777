#include <shardopt/comm/launch_env.h>
#include <shardopt/comm/process_group.h>

#include "harness.h"

#include <c10/util/Exception.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <dirent.h>
#include <sched.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <future>
#include <cstdlib>
#include <map>
#include <set>
#include <thread>

namespace shardopt {
namespace {
namespace SHARDOPT_UNITY_ID {

using testing::run_ranks;

TEST(Comm, CollectivesMoveDataAndCountBytes) {
  run_ranks(3, [](std::shared_ptr<ProcessGroup> g) {
    const int r = g->rank();
    at::Tensor t = at::full({4}, static_cast<float>(r + 1));
    g->allreduce(t);
    EXPECT_TRUE(t.equal(at::full({4}, 6.0f)));

    at::Tensor b = at::full({2}, static_cast<float>(r));
    g->broadcast(b, 2);
    EXPECT_TRUE(b.equal(at::full({2}, 2.0f)));

    at::Tensor red = at::full({3}, 1.0f);
    g->reduce(red, 1);
    if (r == 1) EXPECT_TRUE(red.equal(at::full({3}, 3.0f)));

    std::vector<at::Tensor> outs;
    for (int i = 0; i < 3; ++i) outs.push_back(at::empty({2}));
    g->allgather(outs, at::full({2}, static_cast<float>(10 * r)));
    for (int i = 0; i < 3; ++i) EXPECT_TRUE(outs[i].equal(at::full({2}, 10.0f * i)));

    std::vector<at::Tensor> ins;
    for (int i = 0; i < 3; ++i) ins.push_back(at::full({2}, static_cast<float>(i + r)));
    at::Tensor out = at::empty({2});
    g->reduce_scatter(out, ins);
    EXPECT_TRUE(out.equal(at::full({2}, static_cast<float>(3 * r + 3))));

    const auto& s = g->stats();
    EXPECT_EQ(s.calls[CommStats::kAllreduce], 1);
    EXPECT_EQ(s.bytes[CommStats::kAllreduce], 16);
    EXPECT_EQ(s.bytes[CommStats::kAllgather], 3 * 8);
    EXPECT_EQ(s.bytes[CommStats::kReduceScatter], 3 * 8);
  });
}

// send_async and recv_async in flight together: every rank sends to the next and receives from
// the one before, all started before any is waited for (a ring of blocking sends of 8 MB each
// would wait on itself), several messages per pair arriving in the order they were started, and
// each counted once.
TEST(Comm, SendsAndReceivesInFlightTogetherAroundARing) {
  for (int world : {2, 3}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank(), to = (r + 1) % world, from = (r + world - 1) % world;
      const int64_t n = 2 << 20;  // 8 MB of floats
      std::vector<at::Tensor> out{at::full({n}, static_cast<float>(r)), at::arange(5, at::kFloat) + 100 * r};
      std::vector<at::Tensor> in{at::empty({n}), at::empty({5})};
      std::vector<PendingWork> works;
      for (auto& t : out) works.push_back(g->send_async(t, to, 3));
      for (auto& t : in) works.push_back(g->recv_async(t, from, 3));
      for (auto& w : works) w.wait();
      EXPECT_TRUE(in[0].equal(at::full({n}, static_cast<float>(from)))) << "world " << world;
      EXPECT_TRUE(in[1].equal(at::arange(5, at::kFloat) + 100 * from)) << "world " << world;
      EXPECT_EQ(g->stats().calls[CommStats::kSend], 2);
      EXPECT_EQ(g->stats().calls[CommStats::kRecv], 2);
      EXPECT_EQ(g->stats().bytes[CommStats::kRecv], 4 * (n + 5));
    });
  }
}

// A sum-reduce is N-1 direct transfers to the root (Note [Reduce to one owner]): several in
// flight to different roots, waited in any order, each lands in its own tensor; other reductions
// still go through Gloo.
TEST(Comm, ReducesInFlightToAnyRoot) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      std::vector<at::Tensor> ts;
      std::vector<PendingWork> works;
      for (int k = 0; k < 6; ++k) {
        ts.push_back(at::arange(1000, at::kFloat) * (k + 1) + 1000 * r);
        works.push_back(g->reduce_async(ts.back(), k % world));
      }
      for (int k = 5; k >= 0; --k) works[k].wait();
      const float rank_sum = 1000.0f * world * (world - 1) / 2;
      for (int k = 0; k < 6; ++k) {
        if (r != k % world) continue;
        EXPECT_TRUE(ts[k].equal(at::arange(1000, at::kFloat) * (world * (k + 1)) + rank_sum))
            << "reduce " << k << " at world " << world;
      }
      at::Tensor m = at::full({3}, static_cast<float>(5 * r));
      g->reduce(m, 0, Reduction::kMax);
      if (r == 0) EXPECT_TRUE(m.equal(at::full({3}, 5.0f * (world - 1))));
      EXPECT_EQ(g->stats().calls[CommStats::kReduce], 7);
      EXPECT_EQ(g->stats().bytes[CommStats::kReduce], 6 * 4000 + 12);
    });
  }
}

// reduce_mean_async: the root's leading elements are the sum divided by the divisor, the rest the
// plain sum, with the rounding of ATen's add_ in rank order then div_ (computed here from every
// rank's tensor, gathered first): float and double in the one-pass loop (odd lengths across its
// chunks), bfloat16 through ATen's operators.
TEST(Comm, ReduceMeanDividesTheLeadingElementsAsSumThenDiv) {
  for (int world : {2, 3, 4}) {
    run_ranks(world, [world](std::shared_ptr<ProcessGroup> g) {
      const int r = g->rank();
      for (auto dtype : {at::kFloat, at::kDouble, at::kBFloat16}) {
        for (double divisor : {static_cast<double>(world), 7.3}) {
          const int64_t n = 40001, lead = n - 3;
          const int root = (world - 1 + static_cast<int>(divisor)) % world;
          auto gen = at::make_generator<at::CPUGeneratorImpl>(100 + r);  // this rank's own (ranks are threads)
          at::Tensor mine = at::randn({n}, gen, at::kDouble).to(dtype);
          std::vector<at::Tensor> all;
          for (int k = 0; k < world; ++k) all.push_back(at::empty_like(mine));
          g->allgather(all, mine);
          for (int k = 1; k < world; ++k) ASSERT_FALSE(all[k].equal(all[0])) << "ranks need different data";
          at::Tensor t = mine.clone();
          g->reduce_mean_async(t, root, lead, divisor).wait();
          if (r != root) continue;
          at::Tensor expected = all[root].clone();
          for (int k = 0; k < world; ++k) {
            if (k != root) expected.add_(all[k]);
          }
          expected.narrow(0, 0, lead).div_(divisor);
          EXPECT_TRUE(t.equal(expected)) << "world " << world << " " << dtype << " divisor " << divisor << ": max diff "
                                         << (t - expected).abs().max().item<double>();
        }
      }
      at::Tensor t = at::ones({4});
      EXPECT_THROW(
          {
            try {
              g->reduce_mean_async(t, 0, 5, 2.0);
            } catch (const c10::Error& e) {
              EXPECT_NE(std::string(e.what()).find("5 leading elements of a tensor of 4"), std::string::npos) << e.what();
              throw;
            }
          },
          c10::Error);
      EXPECT_THROW(g->reduce_mean_async(t, 0, 4, 0.0), c10::Error);
    });
  }
}

// Two ranks, one thread each, rendezvous through `init_method`; each contributes rank + 1.
void two_ranks_through(const std::string& init_method) {
  std::vector<std::string> errors(2);
  std::vector<double> sums(2, 0);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto g = init_process_group(InitOptions().backend("gloo").init_method(init_method).rank(r).world_size(2).timeout(std::chrono::seconds(30)));
        at::Tensor t = at::full({1}, r + 1.0);
        g->allreduce(t);
        sums[r] = t.item<double>();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(errors[r], "") << init_method;
    EXPECT_EQ(sums[r], 3.0) << init_method << " rank " << r;
  }
}

// Note [Several ranks in one process]: c10d's flight recorder is off from the start, whatever
// rendezvous the ranks' threads use next (it was once set on a caller's store's path only).
TEST(Comm, TheFlightRecorderIsOffBeforeAnyGroupForms) {
  const char* v = std::getenv("TORCH_FR_BUFFER_SIZE");
  ASSERT_NE(v, nullptr) << "ctest runs this without TORCH_FR_BUFFER_SIZE; shardopt sets it when loaded";
  EXPECT_STREQ(v, "0");
}

TEST(Comm, InitThroughTcpAndFile) {
  const testing::ReservedPort port;
  two_ranks_through(port.tcp());

  std::string path = ::testing::TempDir() + "shardopt_filestore_" + std::to_string(::getpid());
  std::remove(path.c_str());
  two_ranks_through("file://" + path);
  std::remove(path.c_str());
}

// Each thread of this process with its scheduling policy and nice value.
std::map<long, std::pair<int, int>> thread_scheduling() {
  std::map<long, std::pair<int, int>> out;
  DIR* dir = ::opendir("/proc/self/task");
  if (!dir) return out;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] == '.') continue;
    const long tid = std::strtol(e->d_name, nullptr, 10);
    errno = 0;
    const int nice = ::getpriority(PRIO_PROCESS, static_cast<id_t>(tid));
    const int policy = ::sched_getscheduler(static_cast<pid_t>(tid));
    if (errno == 0 && policy >= 0) out[tid] = {policy, nice};
  }
  ::closedir(dir);
  return out;
}

std::pair<int, int> own_scheduling() {
  const auto tid = static_cast<pid_t>(::syscall(SYS_gettid));
  return {::sched_getscheduler(tid), ::getpriority(PRIO_PROCESS, static_cast<id_t>(tid))};
}

// Gloo's transport thread, and it alone, takes the scheduling InitOptions asks for (Note [The
// transport thread's scheduling]): rank 0 asks for 7 nice levels down without SCHED_BATCH,
// rank 1 takes the defaults (SCHED_BATCH, the caller's nice value).
// A rank that starts late (a slow scheduler, a loaded machine) delays forming the group, not its
// collectives' deadline: with setup_timeout the group forms after rank 1's 2 s delay although the
// collectives' timeout is 1 s, and a collective rank 1 skips still fails within that 1 s. Without
// it, forming the group takes the collectives' timeout and fails.
TEST(Comm, TheCollectivesClockStartsOnceTheGroupHasFormed) {
  using std::chrono::milliseconds;
  for (const milliseconds setup : {milliseconds(30000), milliseconds(0)}) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::string errors[2];
    std::thread ranks[2];
    std::promise<void> rank_0_done;
    std::shared_future<void> done = rank_0_done.get_future().share();
    for (int r = 0; r < 2; ++r) {
      ranks[r] = std::thread([&, r] {
        try {
          if (r == 1) std::this_thread::sleep_for(std::chrono::seconds(2));  // started late, not a handshake
          auto g = init_process_group(store, InitOptions().backend("gloo").rank(r).world_size(2)
                                                 .timeout(milliseconds(1000)).setup_timeout(setup));
          at::Tensor t = at::ones({4});
          if (r == 0) {
            try {
              g->allreduce(t);  // rank 1 skips it
            } catch (...) {
              rank_0_done.set_value();
              throw;
            }
            rank_0_done.set_value();
          } else {
            done.wait_for(std::chrono::seconds(30));  // rank 1 stays until rank 0 gave up waiting for it
          }
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    }
    for (auto& t : ranks) t.join();
    if (setup.count() > 0) {
      EXPECT_NE(errors[0].find("allreduce"), std::string::npos) << errors[0];
      EXPECT_NE(errors[0].find("timed out (timeout 1000 ms)"), std::string::npos) << errors[0];
      EXPECT_EQ(errors[0].find("could not connect"), std::string::npos) << errors[0];
      EXPECT_EQ(errors[1], "");
    } else {
      EXPECT_NE(errors[0].find("within 1000 ms"), std::string::npos) << errors[0];
    }
  }
}

TEST(Comm, TransportThreadSchedulingIsSetForItAlone) {
  const auto before = thread_scheduling();
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(2);
  std::vector<std::pair<int, int>> caller_before(2), caller_after(2);
  std::vector<double> sums(2);
  std::vector<std::shared_ptr<ProcessGroup>> groups(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      try {
        caller_before[r] = own_scheduling();
        auto options = InitOptions().backend("gloo").rank(r).world_size(2).timeout(std::chrono::seconds(30));
        if (r == 0) options.transport_thread_nice(7).transport_thread_batch(false);
        groups[r] = init_process_group(store, options);
        caller_after[r] = own_scheduling();
        at::Tensor t = at::full({1}, r + 1.0);
        groups[r]->allreduce(t);
        sums[r] = t.item<double>();
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(errors[r], "") << "rank " << r;
    EXPECT_EQ(sums[r], 3.0) << "rank " << r;
    EXPECT_EQ(caller_after[r], caller_before[r]) << "rank " << r << "'s own scheduling changed";
  }
  const auto [policy, nice] = caller_before[0];
  ASSERT_EQ(policy, SCHED_OTHER) << "the test runs from a SCHED_OTHER thread";
  std::multiset<std::pair<int, int>> changed;
  for (const auto& [tid, sched] : thread_scheduling()) {
    if (before.count(tid)) {
      EXPECT_EQ(sched, before.at(tid)) << "thread " << tid << " was there before and changed its scheduling";
    } else if (sched != caller_before[0]) {
      changed.insert(sched);
    }
  }
  std::multiset<std::pair<int, int>> expected;
  for (std::pair<int, int> sched : {std::make_pair(SCHED_OTHER, std::min(19, nice + 7)), std::make_pair(SCHED_BATCH, nice)}) {
    if (sched != caller_before[0]) expected.insert(sched);  // at nice 19 already, 7 levels down is the same
  }
  EXPECT_EQ(changed, expected);
  groups.clear();
}

void sigpipe_handler(int) {}

// Note [SIGPIPE]: with the default action a write to a peer that has gone would end the process
// before Gloo reports it; a Gloo group ignores SIGPIPE then, and leaves a program's handler alone.
TEST(Comm, AGlooGroupIgnoresSigpipeUnlessTheProgramHandlesIt) {
  struct sigaction saved {};
  ASSERT_EQ(::sigaction(SIGPIPE, nullptr, &saved), 0);
  ::signal(SIGPIPE, SIG_DFL);
  init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().backend("gloo").rank(0).world_size(1));
  struct sigaction now {};
  ::sigaction(SIGPIPE, nullptr, &now);
  EXPECT_EQ(now.sa_handler, SIG_IGN);

  ::signal(SIGPIPE, sigpipe_handler);
  init_process_group(c10::make_intrusive<c10d::HashStore>(), InitOptions().backend("gloo").rank(0).world_size(1));
  ::sigaction(SIGPIPE, nullptr, &now);
  EXPECT_EQ(now.sa_handler, &sigpipe_handler);
  ::sigaction(SIGPIPE, &saved, nullptr);
}

TEST(Comm, TransportThreadNiceOutOfRangeIsAnError) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  for (int bad : {-1, 40}) {
    try {
      init_process_group(store, InitOptions().backend("gloo").rank(0).world_size(1).transport_thread_nice(bad));
      ADD_FAILURE() << "transport_thread_nice(" << bad << ") must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("transport_thread_nice must be in [0, 39] (nice levels below the caller), got " +
                                           std::to_string(bad)),
                std::string::npos)
          << e.what();
    }
  }
}

// The launcher's local rank, which picks the CUDA device of an NCCL group: the first convention
// set wins; a bad value is an error naming the variable.
TEST(Comm, LocalRankFromTheLaunchersEnvironment) {
  const char* names[] = {"LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"};
  for (const char* n : names) unsetenv(n);
  EXPECT_EQ(local_rank(), -1);
  setenv("SLURM_LOCALID", "3", 1);
  EXPECT_EQ(local_rank(), 3);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2", 1);
  EXPECT_EQ(local_rank(), 2);
  setenv("LOCAL_RANK", "1", 1);
  EXPECT_EQ(local_rank(), 1);
  setenv("LOCAL_RANK", "one", 1);
  try {
    local_rank();
    ADD_FAILURE() << "LOCAL_RANK=one must throw";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("LOCAL_RANK must be an integer, got 'one'"), std::string::npos) << e.what();
  }
  for (const char* n : names) unsetenv(n);
}

// env_var is the one reader of the environment: a listed variable reads as set (unset or empty:
// null), and a variable missing from kLaunchVariables is refused, naming it.
TEST(Comm, EnvironmentIsReadOnlyThroughTheTableOfVariables) {
  setenv("SHARDOPT_CHECK_DESYNC", "1", 1);
  ASSERT_NE(env_var("SHARDOPT_CHECK_DESYNC"), nullptr);
  EXPECT_STREQ(env_var("SHARDOPT_CHECK_DESYNC"), "1");
  setenv("SHARDOPT_CHECK_DESYNC", "", 1);
  EXPECT_EQ(env_var("SHARDOPT_CHECK_DESYNC"), nullptr);
  unsetenv("SHARDOPT_CHECK_DESYNC");
  EXPECT_EQ(env_var("SHARDOPT_CHECK_DESYNC"), nullptr);
  setenv("SHARDOPT_NOT_A_VARIABLE", "1", 1);
  try {
    env_var("SHARDOPT_NOT_A_VARIABLE");
    ADD_FAILURE() << "a variable outside kLaunchVariables must be refused";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("SHARDOPT_NOT_A_VARIABLE is read but not listed in kLaunchVariables"),
              std::string::npos)
        << e.what();
  }
  unsetenv("SHARDOPT_NOT_A_VARIABLE");
}

}  // namespace SHARDOPT_UNITY_ID
}  // namespace
}  // namespace shardopt
