// Watching a group's ranks for signs of life (Note [Roll call] in liveness.cpp): the roll call
// and the survivors' agreement share it. Internal.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>
#include <vector>

namespace shardopt::detail {

// How long a rank's heartbeat counter (bumped once a second) may stand still before the rank
// counts as gone: exited, killed or hung. A rank whose process is on this machine and has exited
// counts as gone at once.
inline constexpr std::chrono::seconds kHeartbeatTimeout(3);
// How long a rank's heartbeat counter may stand still, while this rank waits on a watched group,
// before the rank is taken for hung and breaks the group (Note [A silent rank breaks the group]).
// Longer than kHeartbeatTimeout: a live rank's heartbeat thread can go unscheduled for 3 s on an
// overloaded machine, and a false alarm costs the whole group a recovery.
inline constexpr std::chrono::seconds kHungTimeout(10);

// The store key of rank r's heartbeat counter (Note [Roll call]).
std::string heartbeat_key(int rank);
// The store key under which rank r of a group records which process it is.
std::string process_key(int rank);
// The key a rank sets for rank r of its group when r's heartbeat stood still for
// kHungTimeout while it waited on the group (Note [A silent rank breaks the group]).
std::string silent_key(int rank);
// This process as process_key records it: "<machine>|<pid>|<start time>", where <machine> is the
// boot id and pid namespace (processes on one machine and in one pid namespace see each other's
// pids); "" where /proc cannot tell.
std::string this_process();

struct RankWatch {
  std::vector<bool> beat;     // its heartbeat counter moved during the watch
  std::vector<bool> exited;   // its process is on this machine and has exited, or (silent_key) a
                              // rank saw its heartbeat stand still for kHungTimeout
  std::vector<bool> flagged;  // `flag_prefix + rank` is set in the store
  std::vector<bool> hung;     // of the exited: found silent by a rank (silent_key), not seen to exit
};

// Watches ranks [0, size) other than `self` until each one is known: its counter moved, its
// process exited, or (when `flag_counts_as_known`) its flag is set; a rank still unknown after
// `silence` has stopped answering. Returns as soon as every rank is known: no fixed sleep. Store
// errors propagate.
RankWatch watch_ranks(c10d::Store& store, int size, int self, const std::string& flag_prefix,
                      bool flag_counts_as_known, std::chrono::milliseconds silence = kHeartbeatTimeout);

// How long the survivors of a broken group wait for a rank's heartbeat before they count it gone
// (Note [Who is gone]): the group's timeout (a collective waiting on that rank would have failed
// by then), at least kHeartbeatTimeout and at most kHungTimeout.
std::chrono::milliseconds survivors_silence(std::chrono::milliseconds group_timeout);

}  // namespace shardopt::detail
