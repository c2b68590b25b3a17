#include "daemon/notify.h"

#include <systemd/sd-daemon.h>

#include <string>

namespace collectived::daemon {

Notifier::Notifier() {
  uint64_t usec = 0;
  // unset_environment = 0: child processes we might start must not inherit it,
  // but we start none, and tests read the variables back.
  if (sd_watchdog_enabled(0, &usec) > 0 && usec > 0) watchdog_ = std::chrono::microseconds(usec);
}

void Notifier::send(std::string_view state) const {
  sd_notify(0, std::string(state).c_str());
}

void Notifier::ready() const { send("READY=1\nSTATUS=serving clients"); }
void Notifier::stopping() const { send("STOPPING=1\nSTATUS=stopping"); }
void Notifier::reloading() const { send("RELOADING=1"); }
void Notifier::watchdog() const { send("WATCHDOG=1"); }
void Notifier::status(std::string_view text) const { send("STATUS=" + std::string(text)); }

}  // namespace collectived::daemon
