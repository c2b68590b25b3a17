// collectivectl status, comms and peers: readable tables or JSON.
#pragma once

#include <string>

#include "client/ctl/status_model.h"

namespace collectived::client::ctl {

std::string print_status(const DaemonStatus& s, bool json);
std::string print_comms(const DaemonStatus& s, bool json);
std::string print_peers(const DaemonStatus& s, bool json);

}  // namespace collectived::client::ctl
