// The rendezvous store served by a launcher, so that any rank can die without taking the store
// with it (torchrun's agent store, for shardopt's own launchers: `shardopt train -n N`).
//
//   int port = 0;                                            // any free port: set to the one bound
//   auto store = shardopt::serve_store("127.0.0.1", port);   // in the launcher, before the ranks
//   // each rank's environment: MASTER_ADDR, MASTER_PORT and kLauncherStoreVariable=True
//
// A rank whose environment has TORCHELASTIC_USE_AGENT_STORE=True connects to the store at
// MASTER_ADDR:MASTER_PORT as a client, rank 0 included, as under torchrun; without it rank 0's
// process serves the store (plain env://), and the job ends when rank 0's process does.
#pragma once

#include <c10/util/intrusive_ptr.h>

#include <chrono>
#include <string>

namespace c10d {
class Store;
}

namespace shardopt {

// The variable (torchrun's) that tells ranks a launcher serves the store.
inline constexpr const char* kLauncherStoreVariable = "TORCHELASTIC_USE_AGENT_STORE";

// Serves a TCP store on host:port until the returned store is destroyed; a loopback host listens
// on loopback only. Port 0 (loopback IPv4 only) binds a free port and sets `port` to it. Errors
// name the address.
c10::intrusive_ptr<c10d::Store> serve_store(const std::string& host, int& port,
                                            std::chrono::milliseconds timeout = std::chrono::minutes(5));

// Whether this process's environment says a launcher serves the store.
bool store_served_by_launcher();

}  // namespace shardopt
