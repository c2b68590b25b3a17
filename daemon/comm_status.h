// StatusReply.comms from the engine's snapshot: communicators, their ranks
// and the operations in flight with the ranks that have not arrived.
#pragma once

#include <vector>

#include "engine/engine.h"
#include "ipc/protocol.capnp.h"

namespace collectived::daemon {

void fill_comm_status(const std::vector<engine::CommSnapshot>& comms,
                      wire::StatusReply::Builder status);

}  // namespace collectived::daemon
