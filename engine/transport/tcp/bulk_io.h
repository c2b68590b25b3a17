// Threads that move the bulk bytes of peer streams: the raw bytes of a data
// chunk read from a socket into its reassembly buffer, and a data chunk
// (frame + bytes in place) written to a socket. Otherwise the daemon's event
// loop does every socket copy of every peer itself, and that one thread, not
// the sockets, limits what a daemon moves where cores are spare
// (docs/architecture.md). Frames, handshakes and heartbeats stay on the event
// loop; only transfers of at least kMinBytes come here.
//
// Reads and writes have separate threads. A read waits only for bytes that a
// writer on the other side is already sending (its frame has arrived), so it
// always finishes; a write waits only for the other side's reads. With one
// pool for both, every thread could sit in a write to a peer whose threads
// all sit in writes back: a deadlock.
#pragma once

#include <sys/uio.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace collectived::engine::transport::tcp {

class BulkIo {
 public:
  /// Transfers smaller than this stay on the event loop (a hand-off to a
  /// thread and back costs more than copying them there).
  static constexpr std::size_t kMinBytes = 64 * 1024;

  /// `err`: 0, an errno value, or -1 for end of stream; `n`: bytes moved.
  /// Runs on a bulk thread: post what it does to the owner's thread.
  using Done = std::function<void(int err, std::size_t n)>;

  /// `threads` read threads and as many write threads (at least one each).
  explicit BulkIo(unsigned threads);
  /// Stops the threads (transfers in progress end within 100 ms with
  /// ECANCELED, queued ones are dropped without their Done).
  ~BulkIo();
  BulkIo(const BulkIo&) = delete;
  BulkIo& operator=(const BulkIo&) = delete;

  /// Reads exactly `bytes` into `dest` from the non-blocking socket `fd`.
  /// The caller keeps `fd` open and `dest` alive until `done` has run; to
  /// end it early, shutdown(2) the socket.
  void read(int fd, std::byte* dest, std::size_t bytes, Done done);
  /// Writes all of `iov` to `fd` (same rules).
  void write(int fd, std::vector<iovec> iov, Done done);

  unsigned threads() const { return static_cast<unsigned>(readers_.size()); }

  /// While a Batch lives, write() queues without waking a thread; its end
  /// wakes one per write queued meanwhile. For the chunks of one message
  /// spread over several streams: each wake-up can put the woken thread on
  /// the caller's core ahead of it, delaying the next chunk's hand-over by
  /// ~15 us; woken together, the threads start together. Nests; one thread's
  /// (the event loop's).
  class Batch {
   public:
    explicit Batch(BulkIo& io);
    ~Batch();
    Batch(const Batch&) = delete;
    Batch& operator=(const Batch&) = delete;

   private:
    BulkIo& io_;
  };

 private:
  struct Task {
    int fd = -1;
    std::vector<iovec> iov;
    Done done;
  };
  struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Task> tasks;
  };
  void serve(Queue& q, bool reading);
  /// Moves the task's bytes; returns 0, an errno value or -1 (end of stream).
  int transfer(Task& t, bool reading, std::size_t& moved);

  Queue reads_, writes_;
  // Under writes_.mu: open Batches, and the writes queued under them.
  unsigned held_ = 0, deferred_ = 0;
  std::atomic<bool> stop_{false};
  std::vector<std::thread> readers_, writers_;
};

}  // namespace collectived::engine::transport::tcp
