// Communicators: unique ids, init (blocking and non-blocking), split,
// finalize, destroy, abort, and the queries.
//
// A non-blocking communicator (config.blocking = 0) follows NCCL's contract:
// init, split and finalize return ncclInProgress and run on the
// communicator's job thread; ncclCommGetAsyncError says ncclInProgress until
// the job is done, then ncclSuccess or its error.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "client/nccl/shim.h"

using namespace collectived::client::nccl;

static_assert(sizeof(ncclUniqueId) == sizeof(collective_unique_id_t),
              "NCCL's unique id carries libcollective's");

std::string ncclComm::where() const {
  return "communicator (rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
         (device >= 0 ? ", CUDA device " + std::to_string(device) + ")" : ", no CUDA device)");
}

namespace collectived::client::nccl {

namespace {

struct Config {
  bool blocking = true;
};

/// NCCL's rules: `size` says how much of the struct the caller has, `magic`
/// that NCCL_CONFIG_INITIALIZER made it, `version` which fields it knows
/// (blocking came in 2.14); NCCL_COMM_BLOCKING overrides the field.
Config parse_config(const ncclConfig_t* config) {
  int blocking = NCCL_CONFIG_UNDEF_INT;
  if (config != nullptr) {
    ncclConfig_t c = NCCL_CONFIG_INITIALIZER;
    std::size_t size = 0;
    std::memcpy(&size, config, sizeof size);
    std::memcpy(static_cast<void*>(&c), config, std::min(size, sizeof c));
    if (c.magic != NCCL_CONFIG_MAGIC) {
      throw Failure(
          ncclInvalidArgument,
          "the ncclConfig_t was not made from NCCL_CONFIG_INITIALIZER (its magic is wrong)");
    }
    if (c.version >= NCCL_VERSION(2, 14, 0)) blocking = c.blocking;
    if (blocking != NCCL_CONFIG_UNDEF_INT && blocking != 0 && blocking != 1) {
      throw Failure(ncclInvalidArgument,
                    "config.blocking is " + std::to_string(blocking) + " (0 or 1 expected)");
    }
  }
  Config out;
  const int env = env_blocking();
  out.blocking = env >= 0 ? env == 1 : blocking != 0;
  return out;
}

/// What a job (or the same work run in the caller's thread) produced.
struct Outcome {
  ncclResult_t rc = ncclSuccess;
  std::string message;
  collective_comm_t* made = nullptr;
};

Outcome outcome_of(collective_result_t r, collective_comm_t* made) {
  Outcome o;
  o.made = made;
  if (r != COLLECTIVE_OK) {
    o.rc = to_nccl(r);
    o.message = collective_last_error();  // names the libcollective call
  }
  return o;
}

/// Joins the daemon's communicator; once more on a fresh connection where
/// the process's daemon went away since the last call (a restarted daemon).
Outcome join(ncclComm* comm, const ncclUniqueId& id) {
  ContextScope scope(comm->ctx);
  const auto* cid = reinterpret_cast<const collective_unique_id_t*>(&id);
  collective_comm_t* made = nullptr;
  collective_result_t r =
      collective_comm_init_rank(comm->client.get(), cid, comm->nranks, comm->rank, &made);
  collective_status_t status;
  if (r == COLLECTIVE_UNAVAILABLE && collective_status(comm->client.get(), &status) != COLLECTIVE_OK) {
    comm->client = reconnect_process_client(comm->client);
    r = collective_comm_init_rank(comm->client.get(), cid, comm->nranks, comm->rank, &made);
  }
  return outcome_of(r, made);
}

void log_ready(const ncclComm* comm) {
  if (debug_level() < Debug::info) return;
  char text[160];
  std::snprintf(text, sizeof text, "comm %p rank %d nranks %d cudaDev %d - Init COMPLETE",
                static_cast<const void*>(comm), comm->rank, comm->nranks, comm->device);
  log_line("INFO", comm->device, text);
}

/// Frees a communicator nobody references any more (its job is over).
void dispose(ncclComm* comm, bool abort) noexcept {
  const ClientRef client = comm->client;  // outlives the daemon's communicator
  drop_requests(comm);
  release_premul(comm);
  if (comm->coll != nullptr) {
    if (abort) {
      collective_comm_abort(comm->coll);
    } else {
      collective_comm_destroy(comm->coll);
    }
  }
  delete comm;
}

/// Runs `work` on the communicator's job thread: ncclInProgress until done.
/// A communicator aborted meanwhile is freed by the job when it ends.
void start_job(ncclComm* comm, const char* call, std::function<Outcome()> work) {
  if (comm->job.joinable()) comm->job.join();  // the previous job is over (busy is false)
  comm->busy = true;
  comm->job = std::thread([comm, call, work = std::move(work)] {
    Outcome o;
    try {
      o = work();
    } catch (const Failure& f) {
      o.rc = f.code();
      o.message = f.what();
    } catch (const std::exception& e) {
      o.rc = ncclInternalError;
      o.message = e.what();
    }
    bool orphaned = false;
    {
      std::lock_guard lock(comm->mu);
      comm->busy = false;
      if (o.made != nullptr) {
        comm->coll = o.made;
        comm->rank = collective_comm_rank(o.made);
        comm->nranks = collective_comm_size(o.made);
      }
      if (o.rc != ncclSuccess && comm->error == ncclSuccess) {
        comm->error = o.rc;
        comm->message = std::string(call) + ": " + o.message;
      }
      orphaned = comm->orphaned;
    }
    if (o.rc != ncclSuccess) fail(o.rc, std::string(call) + ": " + o.message);
    if (orphaned) {
      dispose(comm, true);
    } else if (o.made != nullptr) {
      log_ready(comm);
    }
  });
}

/// A new communicator of this process on `device` (-1: the current one).
ncclComm* make_comm(const char* call, int nranks, const ncclUniqueId& id, int rank, Config cfg,
                    int device) {
  if (nranks < 1 || rank < 0 || rank >= nranks) {
    throw Failure(ncclInvalidArgument, "rank " + std::to_string(rank) + " of " +
                                           std::to_string(nranks) + " is out of range");
  }
  auto comm = std::make_unique<ncclComm>();
  // The device first: without one (no driver) the daemon is not asked.
  if (!host_only()) comm->ctx = bind_context(device, comm->device);
  comm->client = process_client();
  comm->rank = rank;
  comm->nranks = nranks;
  comm->blocking = cfg.blocking;
  // Inside a group a blocking init waits at the outermost ncclGroupEnd, as
  // NCCL's: one thread may init several ranks of one communicator in a group
  // (nccl-tests with several GPUs per process), and each init returns only
  // when all ranks have joined.
  if (!cfg.blocking || in_group()) {
    ncclComm* c = comm.release();
    std::lock_guard lock(c->mu);
    start_job(c, call, [c, id] { return join(c, id); });
    if (cfg.blocking) init_in_group(c);
    return c;
  }
  Outcome o = join(comm.get(), id);
  if (o.rc != ncclSuccess) throw Failure(o.rc, o.message);
  comm->coll = o.made;
  log_ready(comm.get());
  return comm.release();
}

ncclResult_t init_rank(const char* call, ncclComm_t* out, int nranks, const ncclUniqueId& id,
                       int rank, const ncclConfig_t* config) {
  return guarded(call, [&] {
    if (out == nullptr) throw Failure(ncclInvalidArgument, "comm is NULL");
    *out = nullptr;
    const Config cfg = parse_config(config);
    *out = make_comm(call, nranks, id, rank, cfg, -1);
    return cfg.blocking ? ncclSuccess : ncclInProgress;  // in a group: its end says
  });
}

/// ncclCommInitAll: every rank at once, one thread each, since a rank's init
/// returns only when all have joined.
void init_all(ncclComm_t* comms, int ndev, const int* devlist) {
  ncclUniqueId id;
  auto* cid = reinterpret_cast<collective_unique_id_t*>(&id);
  check(collective_get_unique_id(process_client().get(), cid));
  std::vector<std::unique_ptr<Failure>> failed(static_cast<std::size_t>(ndev));
  std::vector<std::thread> threads;
  for (int i = 0; i < ndev; ++i) {
    threads.emplace_back([&, i] {
      try {
        const int dev = devlist != nullptr ? devlist[i] : i;
        comms[i] = make_comm("ncclCommInitAll", ndev, id, i, Config{true}, dev);
      } catch (const Failure& f) {
        failed[static_cast<std::size_t>(i)] = std::make_unique<Failure>(f);
      } catch (const std::exception& e) {
        failed[static_cast<std::size_t>(i)] =
            std::make_unique<Failure>(ncclInternalError, e.what());
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < ndev; ++i) {
    if (!failed[static_cast<std::size_t>(i)]) continue;
    for (int k = 0; k < ndev; ++k) {
      if (comms[k] != nullptr) dispose(comms[k], true);
      comms[k] = nullptr;
    }
    const Failure& f = *failed[static_cast<std::size_t>(i)];
    throw Failure(f.code(), "rank " + std::to_string(i) + ": " + f.what());
  }
}

ncclComm* checked(ncclComm* comm) {
  if (comm == nullptr) throw Failure(ncclInvalidArgument, "comm is NULL");
  return comm;
}

}  // namespace

void require_ready(ncclComm* comm) {
  checked(comm);
  std::lock_guard lock(comm->mu);
  if (comm->busy) {
    throw Failure(ncclInvalidArgument, "the " + comm->where() +
                                           " is still being set up or finalized (ncclInProgress: "
                                           "poll ncclCommGetAsyncError until it is done)");
  }
  if (comm->error != ncclSuccess) {
    throw Failure(comm->error, "the " + comm->where() + " failed earlier: " + comm->message);
  }
  if (comm->coll == nullptr) throw Failure(ncclInvalidArgument, "the communicator has no members");
}

}  // namespace collectived::client::nccl

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (version == nullptr) return fail(ncclInvalidArgument, "ncclGetVersion: version is NULL");
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  return guarded("ncclGetUniqueId", [&] {
    if (uniqueId == nullptr) throw Failure(ncclInvalidArgument, "uniqueId is NULL");
    // The id names this daemon: one that went away (restarted) is reached anew.
    ClientRef client = process_client();
    collective_status_t status;
    if (collective_status(client.get(), &status) != COLLECTIVE_OK) {
      client = reconnect_process_client(client);
    }
    check(collective_get_unique_id(client.get(), reinterpret_cast<collective_unique_id_t*>(uniqueId)));
    return ncclSuccess;
  });
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank("ncclCommInitRank", comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
  return init_rank("ncclCommInitRankConfig", comm, nranks, commId, rank, config);
}

// NCCL spreads its bootstrap over nId roots; here the rendezvous is a
// daemon's, and every rank holds all nId ids, so the first one serves all.
ncclResult_t ncclCommInitRankScalable(ncclComm_t* newcomm, int nranks, int myrank, int nId,
                                      ncclUniqueId* commIds, ncclConfig_t* config) {
  if (nId < 1 || commIds == nullptr) {
    return fail(ncclInvalidArgument, "ncclCommInitRankScalable: nId must be >= 1 and commIds set");
  }
  return init_rank("ncclCommInitRankScalable", newcomm, nranks, commIds[0], myrank, config);
}

ncclResult_t ncclCommInitAll(ncclComm_t* comms, int ndev, const int* devlist) {
  return guarded("ncclCommInitAll", [&] {
    if (comms == nullptr || ndev < 1) {
      throw Failure(ncclInvalidArgument, "comms must be set and ndev at least 1");
    }
    std::fill(comms, comms + ndev, nullptr);
    init_all(comms, ndev, devlist);
    return ncclSuccess;
  });
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm,
                           ncclConfig_t* config) {
  return guarded("ncclCommSplit", [&] {
    if (newcomm == nullptr) throw Failure(ncclInvalidArgument, "newcomm is NULL");
    *newcomm = nullptr;
    require_ready(comm);
    const Config cfg = config != nullptr ? parse_config(config) : Config{comm->blocking};
    const int c = color < 0 ? COLLECTIVE_SPLIT_NOCOLOR : color;
    auto split = [comm, c, key] {
      ContextScope scope(comm->ctx);
      collective_comm_t* made = nullptr;
      const collective_result_t r = collective_comm_split(comm->coll, c, key, &made);
      return outcome_of(r, made);
    };
    auto child = std::make_unique<ncclComm>();
    child->client = comm->client;
    child->device = comm->device;
    child->ctx = comm->ctx;
    child->blocking = cfg.blocking;
    if (!cfg.blocking) {
      // The job belongs to the new communicator; with no color there is
      // none, and the parent reports the split's progress.
      ncclComm* owner = c == COLLECTIVE_SPLIT_NOCOLOR ? comm : child.release();
      std::lock_guard lock(owner->mu);
      start_job(owner, "ncclCommSplit", split);
      if (owner != comm) *newcomm = owner;
      return ncclInProgress;
    }
    Outcome o = split();
    if (o.rc != ncclSuccess) throw Failure(o.rc, o.message);
    if (o.made == nullptr) return ncclSuccess;  // NCCL_SPLIT_NOCOLOR
    child->coll = o.made;
    child->rank = collective_comm_rank(o.made);
    child->nranks = collective_comm_size(o.made);
    log_ready(child.get());
    *newcomm = child.release();
    return ncclSuccess;
  });
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  return guarded("ncclCommFinalize", [&] {
    checked(comm);
    std::unique_lock lock(comm->mu);
    if (comm->busy) throw Failure(ncclInvalidArgument, "a set-up or finalize is still running");
    if (!comm->blocking) {
      start_job(comm, "ncclCommFinalize", [comm] {
        reap(comm, true);
        return Outcome{};
      });
      return ncclInProgress;
    }
    lock.unlock();
    reap(comm, true);
    lock.lock();
    if (comm->error != ncclSuccess) throw Failure(comm->error, comm->message);
    return ncclSuccess;
  });
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  return guarded("ncclCommDestroy", [&] {
    if (comm->job.joinable()) comm->job.join();  // NCCL: the set-up must have finished
    drop_requests(comm);
    release_premul(comm);
    collective_comm_t* coll = comm->coll;
    comm->coll = nullptr;
    const ClientRef client = comm->client;  // outlives the daemon's communicator
    delete comm;
    if (coll != nullptr) check(collective_comm_destroy(coll));
    return ncclSuccess;
  });
}

// Never waits for a job: one still running (a set-up waiting for its
// ranks) is left to finish, and aborts and frees the communicator then.
ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  {
    std::lock_guard lock(comm->mu);
    if (comm->busy) {
      comm->orphaned = true;
      comm->job.detach();
      return ncclSuccess;
    }
  }
  if (comm->job.joinable()) comm->job.join();  // over already
  dispose(comm, true);
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  return guarded("ncclCommGetAsyncError", [&] {
    if (comm == nullptr || asyncError == nullptr) {
      throw Failure(ncclInvalidArgument, "comm and asyncError must be set");
    }
    {
      std::lock_guard lock(comm->mu);
      if (comm->busy) {
        *asyncError = ncclInProgress;
        return ncclSuccess;
      }
    }
    reap(comm, false);
    std::lock_guard lock(comm->mu);
    *asyncError = comm->error;
    return ncclSuccess;
  });
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (comm == nullptr || count == nullptr) {
    return fail(ncclInvalidArgument, "ncclCommCount: comm and count must be set");
  }
  std::lock_guard lock(comm->mu);
  if (comm->coll == nullptr && comm->busy) return ncclInProgress;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (comm == nullptr || device == nullptr) {
    return fail(ncclInvalidArgument, "ncclCommCuDevice: comm and device must be set");
  }
  *device = comm->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr || rank == nullptr) {
    return fail(ncclInvalidArgument, "ncclCommUserRank: comm and rank must be set");
  }
  std::lock_guard lock(comm->mu);
  if (comm->coll == nullptr && comm->busy) return ncclInProgress;
  *rank = comm->rank;
  return ncclSuccess;
}

}  // extern "C"
