// The engine's one mutex, and the proof that it is held.
//
// Every function that reads or writes the engine's shared state (communicators,
// rendezvous, inboxes) takes a `Locked` as its first parameter. A Locked can
// only be made by an EngineLock, which holds the mutex while it lives, so a
// call from a place that does not hold the lock does not compile. Copies of
// the token are for passing down the call chain; never store one.
#pragma once

#include <cassert>
#include <mutex>

namespace collectived::engine {

class EngineLock;

/// Proof that the engine's mutex is held (an empty value, free to pass).
class Locked {
 public:
  Locked(const Locked&) = default;
  Locked& operator=(const Locked&) = delete;

 private:
  friend class EngineLock;
  Locked() = default;
};

/// Holds the engine's mutex (std::unique_lock semantics) and hands out the
/// token while it does.
class EngineLock {
 public:
  explicit EngineLock(std::mutex& mu) : lock_(mu) {}
  EngineLock(const EngineLock&) = delete;
  EngineLock& operator=(const EngineLock&) = delete;

  Locked token() const {
    assert(lock_.owns_lock());
    return Locked{};
  }
  /// For waits that give the mutex up meanwhile (the channel's receive).
  void unlock() { lock_.unlock(); }
  void lock() { lock_.lock(); }

 private:
  std::unique_lock<std::mutex> lock_;
};

}  // namespace collectived::engine
