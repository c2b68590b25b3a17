// Rendezvous: the ranks of a communicator meeting by unique id, at this
// daemon or (PendingJoin) at another node's.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/op.h"

namespace collectived::engine::detail {

struct Joiner {
  ClientRef client;             // local joiners
  std::uint64_t request = 0;
  std::string address;          // remote joiners: their daemon ("" = this one)
  std::string node;             // remote joiners: their node name
  pid_t pid = 0;
};

/// A rank of this node waiting for another node's rendezvous daemon.
struct PendingJoin {
  ClientRef client;
  std::uint64_t request = 0;
  std::string id;
  std::string rendezvous;
  std::uint32_t nranks = 0;
  std::uint32_t rank = 0;
  Clock::time_point deadline;
};

struct Rendezvous {
  std::string name;
  int nranks = 0;
  std::vector<std::optional<Joiner>> joined;
  int count = 0;
  Clock::time_point started;
  Clock::time_point deadline;
};

}  // namespace collectived::engine::detail
