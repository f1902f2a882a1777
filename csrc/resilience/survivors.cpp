#include "resilience/survivors.h"

#include "comm/watch.h"

#include <shardopt/check.h>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <sstream>
#include <string>

namespace shardopt::detail {

// Note [Who is gone]
// Every rank's group bumps its heartbeat counter in the store once a second (Note [Roll call]).
// A survivor of a broken group:
// 1. sets "shardopt/recovering/<rank>": from now on it counts as alive even after its heartbeat
//    stops (it abandons the broken group, and with it the heartbeat, once recovery moves on);
// 2. watches every other rank until it knows each one (detail::watch_ranks): a rank is alive when
//    its counter moved or it is recovering, gone when its process on this machine exited, when
//    it was found silent for kHungTimeout while the group waited (10 s: a stopped process), or
//    when its counter stood still for the group's timeout, at least 3 s and at most 10 s
//    (survivors_silence). A rank that has not noticed the failure yet still beats, so it counts.
//    On an overloaded machine a live rank's heartbeat thread went unscheduled for 3 s, and the
//    survivors of that time, waiting 3 s, dropped it; a collective waiting on it would not have
//    given up so soon. The watch ends as soon as every rank is known: a rank killed on this
//    machine costs no wait at all;
// 3. proposes its list with a compare-and-set on one key: the first proposal wins, and every
//    survivor reads the same list from that key. No rank decides alone, none waits on a leader
//    that may be dead, and every survivor goes on with the same list. A rank left out of it (its
//    heartbeat stopped: a stopped process) gets an error rather than a group of its own.
// A rank that dies after the list is fixed fails the next step of recovery (making the new
// group), which is then an error on every survivor within the timeout.
namespace {

std::string encode(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? "," : "") + std::to_string(ranks[i]);
  return text;
}

std::vector<int> decode(const std::string& text) {
  std::vector<int> ranks;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ',')) ranks.push_back(std::stoi(item));
  return ranks;
}

}  // namespace

Survivors agree_on_survivors(ProcessGroup& group) {
  auto store = group.store();
  SHARDOPT_CHECK(store, "recovery needs the group's rendezvous store; this group has none");
  const int size = group.size(), rank = group.rank();
  std::vector<int> alive;
  try {
    const std::string recovering = "shardopt/recovering/";
    store->set(recovering + std::to_string(rank), std::vector<uint8_t>{1});
    const RankWatch w = watch_ranks(*store, size, rank, recovering, /*flag_counts_as_known=*/true,
                                    survivors_silence(group.timeout()));
    for (int r = 0; r < size; ++r) {
      if (r == rank || ((w.beat[r] || w.flagged[r]) && !w.exited[r])) alive.push_back(r);
    }
    const std::string mine = encode(alive);
    const auto decided = store->compareSet("shardopt/recovery/survivors", std::vector<uint8_t>{},
                                           std::vector<uint8_t>(mine.begin(), mine.end()));
    alive = decode(std::string(decided.begin(), decided.end()));
  } catch (const c10::Error& e) {
    const std::string cause = e.what_without_backtrace();
    SHARDOPT_CHECK(false, "", group.describe_rank(rank), " cannot reach the rendezvous store (",
                   cause.substr(0, cause.find('\n')), "): the store is gone, so the survivors cannot agree; restart ",
                   "from the last checkpoint");
  }
  Survivors s;
  s.alive = alive;
  bool me = false;
  for (int r = 0, i = 0; r < size; ++r) {
    if (i < static_cast<int>(alive.size()) && alive[i] == r) {
      me = me || r == rank;
      ++i;
    } else {
      s.lost.push_back(r);
    }
  }
  SHARDOPT_CHECK(me, "the other survivors counted ", group.describe_rank(rank),
                 " as gone (its heartbeat stopped for ", survivors_silence(group.timeout()).count(),
                 " ms: was this process stopped?); it cannot rejoin this run");
  return s;
}

}  // namespace shardopt::detail
