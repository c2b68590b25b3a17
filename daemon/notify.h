// systemd integration: readiness, watchdog and stop notifications.
#pragma once

#include <chrono>
#include <optional>
#include <string_view>

namespace collectived::daemon {

/// Talks to the service manager through $NOTIFY_SOCKET (sd_notify). Every call
/// is a no-op when the daemon is not started by systemd.
class Notifier {
 public:
  Notifier();
  void ready() const;
  void stopping() const;
  void reloading() const;
  void watchdog() const;
  void status(std::string_view text) const;
  /// The interval at which WATCHDOG=1 must be sent, when WatchdogSec= is set
  /// for this process.
  std::optional<std::chrono::microseconds> watchdog_interval() const { return watchdog_; }

 private:
  void send(std::string_view state) const;
  std::optional<std::chrono::microseconds> watchdog_;
};

}  // namespace collectived::daemon
