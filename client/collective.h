/* libcollective: the client library of collectived.
 *
 * An application connects to its node's daemon over a Unix socket, allocates
 * host buffers that the daemon maps too, and submits collectives on them.
 * Every function returns a collective_result_t; on failure,
 * collective_last_error() gives a message that says what failed and where.
 * All functions are thread-safe; one client may be used from many threads.
 */
#ifndef COLLECTIVE_H_
#define COLLECTIVE_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(COLLECTIVE_BUILDING_LIBRARY)
#define COLLECTIVE_API __attribute__((visibility("default")))
#else
#define COLLECTIVE_API
#endif

/** Result codes; the same values travel on the wire. */
typedef enum collective_result {
  COLLECTIVE_OK = 0,
  COLLECTIVE_INVALID_ARGUMENT = 1, /**< a value is out of range; the call had no effect */
  COLLECTIVE_INVALID_USAGE = 2,    /**< the call is not allowed in this state */
  COLLECTIVE_SYSTEM_ERROR = 3,     /**< an operating-system call failed */
  COLLECTIVE_REMOTE_ERROR = 4,     /**< another rank, client or daemon failed */
  COLLECTIVE_TIMEOUT = 5,          /**< a deadline expired */
  COLLECTIVE_ABORTED = 6,          /**< aborted, or the daemon is stopping */
  COLLECTIVE_MISMATCH = 7,         /**< ranks submitted different operations */
  COLLECTIVE_NOT_FOUND = 8,        /**< unknown handle, communicator or request */
  COLLECTIVE_PERMISSION_DENIED = 9,
  COLLECTIVE_PROTOCOL_ERROR = 10, /**< malformed message or version mismatch */
  COLLECTIVE_UNAVAILABLE = 11,    /**< the daemon cannot be reached */
  COLLECTIVE_INTERNAL_ERROR = 12,
  COLLECTIVE_RESOURCE_EXHAUSTED = 13 /**< a limit of the node's profile was reached */
} collective_result_t;

/** The default socket when neither the argument nor COLLECTIVED_SOCKET names one. */
#define COLLECTIVE_DEFAULT_SOCKET "/run/collectived/collectived.sock"

typedef struct collective_client collective_client_t;

/** Stable short name of a result ("timeout"). Never NULL. */
COLLECTIVE_API const char* collective_result_string(collective_result_t result);

/** Message of the last failed call made by this thread ("" if none). The
 *  pointer stays valid until this thread's next libcollective call. */
COLLECTIVE_API const char* collective_last_error(void);

/** libcollective's version, e.g. "0.1.0". */
COLLECTIVE_API const char* collective_version(void);

/** Connects to the node's daemon and performs the Hello handshake.
 *  @param socket_path  the daemon's socket; NULL: $COLLECTIVED_SOCKET, else
 *                      COLLECTIVE_DEFAULT_SOCKET
 *  @param client_name  shown in the daemon's logs and status; may be NULL
 *  @param out          receives the client on success */
COLLECTIVE_API collective_result_t collective_connect(const char* socket_path,
                                                      const char* client_name,
                                                      collective_client_t** out);

/** Closes the connection. The daemon releases everything the client
 *  registered; host buffers from collective_host_alloc are unmapped. */
COLLECTIVE_API void collective_disconnect(collective_client_t* client);

/** Allocates `bytes` of host memory shared with the daemon (a sealed memfd,
 *  mapped by both) and registers it. *ptr is usable directly by the
 *  application; collectives on it run without copies into daemon memory. */
COLLECTIVE_API collective_result_t collective_host_alloc(collective_client_t* client, size_t bytes,
                                                         void** ptr);

/** Deregisters and unmaps a buffer from collective_host_alloc. */
COLLECTIVE_API collective_result_t collective_host_free(collective_client_t* client, void* ptr);

/** Finds the registration holding `ptr`: its daemon handle and ptr's offset. */
COLLECTIVE_API collective_result_t collective_host_lookup(collective_client_t* client,
                                                          const void* ptr, uint64_t* handle,
                                                          uint64_t* offset);

/** A snapshot of the daemon's state. */
typedef struct collective_status {
  char daemon_version[32];
  char node_name[64];
  uint32_t protocol_version;
  int32_t daemon_pid;
  uint64_t uptime_ms;
  uint32_t clients;           /**< connected client sessions */
  uint32_t registrations;     /**< all clients' registrations */
  uint64_t registered_bytes;  /**< client memory mapped by the daemon */
  uint64_t pool_bytes;        /**< daemon-owned pools */
  uint64_t resident_bytes;    /**< the daemon's resident memory */
  uint32_t open_descriptors;  /**< the daemon's open file descriptors */
  uint32_t worker_threads;
  uint64_t session_id;        /**< this client's session */
} collective_status_t;

/** Reads the daemon's status. */
COLLECTIVE_API collective_result_t collective_status(collective_client_t* client,
                                                     collective_status_t* out);

/** The answer of another node's daemon to collective_peer_ping(). */
typedef struct collective_peer_ping {
  char node_name[64];  /**< the peer daemon's node name */
  uint64_t rtt_us;     /**< one heartbeat round trip between the two daemons */
  double skew_ms;      /**< the peer's wall clock minus the local daemon's */
  int new_connection;  /**< 1: the ping opened the daemons' connection; 0: it existed */
} collective_peer_ping_t;

/** Asks the local daemon to reach the daemon at `address` ("host:port" of its
 *  peer listener, "[v6]:port" for IPv6): the daemons connect (authenticated
 *  with the cluster secret) unless they already are, and measure one round
 *  trip. The daemon answers within its deadlines.connect_ms; errors name the
 *  peer and the reason (refused, unreachable, wrong secret, version mismatch). */
COLLECTIVE_API collective_result_t collective_peer_ping(collective_client_t* client,
                                                        const char* address,
                                                        collective_peer_ping_t* out);


/* ---------------------------------------------------------------------------
 * Communicators and collectives (NCCL's model).
 *
 * One rank creates a unique id with collective_get_unique_id() and hands it to
 * every rank by any means (environment, file, torchrun, MPI); each rank calls
 * collective_comm_init_rank() with the same id, the number of ranks and its own
 * rank. Operations return at once with a request; collective_wait() or
 * collective_test() completes it. Operations of one communicator run in
 * submission order; communicators run concurrently.
 *
 * Buffers are pointers into memory from collective_host_alloc() (any offset).
 * Counts follow NCCL: all_gather's count is per rank (recv holds nranks*count),
 * reduce_scatter's count is the per-rank result (send holds nranks*count),
 * all_to_all's count is per peer (both hold nranks*count). In-place: pass the
 * same pointer (all_gather: send == recv + rank*count; reduce_scatter:
 * recv == send + rank*count).
 * ------------------------------------------------------------------------- */

/** Element types. */
typedef enum collective_dtype {
  COLLECTIVE_INT8 = 0,
  COLLECTIVE_UINT8 = 1,
  COLLECTIVE_INT32 = 2,
  COLLECTIVE_UINT32 = 3,
  COLLECTIVE_INT64 = 4,
  COLLECTIVE_UINT64 = 5,
  COLLECTIVE_FLOAT16 = 6,
  COLLECTIVE_BFLOAT16 = 7,
  COLLECTIVE_FLOAT32 = 8,
  COLLECTIVE_FLOAT64 = 9
} collective_dtype_t;

/** Reductions. AVG divides the sum by the number of ranks (integer division
 *  for integer types; float16/bfloat16 reduce in float32 and round once). */
typedef enum collective_redop {
  COLLECTIVE_SUM = 0,
  COLLECTIVE_PROD = 1,
  COLLECTIVE_MIN = 2,
  COLLECTIVE_MAX = 3,
  COLLECTIVE_AVG = 4
} collective_redop_t;

/** Size in bytes of one element (0 for an unknown type). */
COLLECTIVE_API size_t collective_dtype_size(collective_dtype_t dtype);
COLLECTIVE_API const char* collective_dtype_name(collective_dtype_t dtype);
COLLECTIVE_API const char* collective_redop_name(collective_redop_t redop);

/** Opaque rendezvous token: a 128-bit random secret and the address of the
 *  daemon that hosts the rendezvous. Plain bytes: copy it anywhere. */
#define COLLECTIVE_UNIQUE_ID_BYTES 128
typedef struct collective_unique_id {
  char internal[COLLECTIVE_UNIQUE_ID_BYTES];
} collective_unique_id_t;

/** Writes the id as 256 hex characters plus NUL into `out` (size >= 257), for
 *  environment variables and files. */
COLLECTIVE_API collective_result_t collective_unique_id_to_string(const collective_unique_id_t* id,
                                                                  char* out, size_t size);
COLLECTIVE_API collective_result_t collective_unique_id_from_string(const char* text,
                                                                    collective_unique_id_t* id);

typedef struct collective_comm collective_comm_t;
typedef struct collective_request collective_request_t;

/** Creates a unique id whose rendezvous is hosted by this client's daemon. */
COLLECTIVE_API collective_result_t collective_get_unique_id(collective_client_t* client,
                                                            collective_unique_id_t* id);

/** Joins communicator `id` as `rank` of `nranks`. Blocks until every rank has
 *  joined or the node's rendezvous deadline (deadlines.rendezvous_ms) expires;
 *  the error then names the ranks that did not arrive. */
COLLECTIVE_API collective_result_t collective_comm_init_rank(collective_client_t* client,
                                                             const collective_unique_id_t* id,
                                                             int nranks, int rank,
                                                             collective_comm_t** comm);

/** Splits `comm`: ranks with the same color form a new communicator, ordered
 *  by key then by old rank. Collective over `comm`. color < 0
 *  (COLLECTIVE_SPLIT_NOCOLOR) yields *newcomm == NULL. */
#define COLLECTIVE_SPLIT_NOCOLOR (-1)
COLLECTIVE_API collective_result_t collective_comm_split(collective_comm_t* comm, int color, int key,
                                                         collective_comm_t** newcomm);

/** Leaves the communicator after this rank's operations completed, and frees
 *  it. Other ranks' later operations that need this rank fail with an error
 *  naming it. */
COLLECTIVE_API collective_result_t collective_comm_destroy(collective_comm_t* comm);

/** Aborts: every pending and future operation of the communicator, on every
 *  rank, fails with COLLECTIVE_ABORTED naming this rank; then frees it. */
COLLECTIVE_API collective_result_t collective_comm_abort(collective_comm_t* comm);

/** Sets the deadline of this rank's later operations on `comm` (collectives,
 *  send/recv groups, and the _stream calls): each fails with
 *  COLLECTIVE_TIMEOUT, naming the ranks that did not submit it (or the
 *  unmatched peers of a group), if it has not started timeout_ms after its
 *  submission, as with the node's deadlines.operation_ms, which it replaces
 *  for this rank's submissions (longer or shorter). Where ranks differ, an
 *  operation's deadline is the earliest of its submissions'. Across nodes it
 *  bounds the whole exchange with the other nodes, as the node's does; on the
 *  client's kernels (collective_comm_gpu_path) each kernel's wait for a peer.
 *  0 restores the node's; negative is COLLECTIVE_INVALID_ARGUMENT; values
 *  are capped at 2^40 ms. Operations already submitted keep theirs. A
 *  communicator starts at 0, also one made by collective_comm_split. */
COLLECTIVE_API collective_result_t collective_comm_set_timeout(collective_comm_t* comm,
                                                               int64_t timeout_ms);

/** The timeout set by collective_comm_set_timeout (0: the node's default). */
COLLECTIVE_API int64_t collective_comm_timeout(const collective_comm_t* comm);

COLLECTIVE_API int collective_comm_rank(const collective_comm_t* comm);
COLLECTIVE_API int collective_comm_size(const collective_comm_t* comm);

COLLECTIVE_API collective_result_t collective_all_reduce(collective_comm_t* comm, const void* send,
                                                         void* recv, size_t count,
                                                         collective_dtype_t dtype,
                                                         collective_redop_t redop,
                                                         collective_request_t** request);
COLLECTIVE_API collective_result_t collective_all_gather(collective_comm_t* comm, const void* send,
                                                         void* recv, size_t count,
                                                         collective_dtype_t dtype,
                                                         collective_request_t** request);
COLLECTIVE_API collective_result_t collective_reduce_scatter(collective_comm_t* comm,
                                                             const void* send, void* recv,
                                                             size_t count,
                                                             collective_dtype_t dtype,
                                                             collective_redop_t redop,
                                                             collective_request_t** request);
/** root's `send` to every rank's `recv` (root may pass send == recv). */
COLLECTIVE_API collective_result_t collective_broadcast(collective_comm_t* comm, const void* send,
                                                        void* recv, size_t count,
                                                        collective_dtype_t dtype, int root,
                                                        collective_request_t** request);
/** Reduction of every rank's `send` into root's `recv` (recv ignored elsewhere). */
COLLECTIVE_API collective_result_t collective_reduce(collective_comm_t* comm, const void* send,
                                                     void* recv, size_t count,
                                                     collective_dtype_t dtype,
                                                     collective_redop_t redop, int root,
                                                     collective_request_t** request);
COLLECTIVE_API collective_result_t collective_all_to_all(collective_comm_t* comm, const void* send,
                                                         void* recv, size_t count,
                                                         collective_dtype_t dtype,
                                                         collective_request_t** request);
COLLECTIVE_API collective_result_t collective_barrier(collective_comm_t* comm,
                                                     collective_request_t** request);

/** Grouped point-to-point: between group_start and group_end, send and recv
 *  calls are collected; group_end submits them as one operation and returns
 *  its request. The k-th send from a to b matches the k-th recv at b from a;
 *  count and dtype must agree. */
COLLECTIVE_API collective_result_t collective_group_start(collective_comm_t* comm);
COLLECTIVE_API collective_result_t collective_send(collective_comm_t* comm, const void* send,
                                                   size_t count, collective_dtype_t dtype,
                                                   int peer);
COLLECTIVE_API collective_result_t collective_recv(collective_comm_t* comm, void* recv,
                                                   size_t count, collective_dtype_t dtype,
                                                   int peer);
COLLECTIVE_API collective_result_t collective_group_end(collective_comm_t* comm,
                                                        collective_request_t** request);

/** Waits up to timeout_ms (-1: until the operation's own deadline, the
 *  communicator's timeout it was submitted with or else the node's, plus a
 *  margin) for the request. Returns the operation's result, or
 *  COLLECTIVE_TIMEOUT if this wait ran out (the request stays valid). Errors
 *  name the communicator, the rank and the operation. */
COLLECTIVE_API collective_result_t collective_wait(collective_request_t* request, int timeout_ms);

/** Non-blocking: *done = 1 and the operation's result once complete. */
COLLECTIVE_API collective_result_t collective_test(collective_request_t* request, int* done);

/** Frees a request (completed or not; an incomplete one completes unseen). */
COLLECTIVE_API void collective_request_free(collective_request_t* request);

/* ===========================================================================
 * GPU buffers and stream-ordered collectives (issue C).
 *
 * Buffers are device pointers into any CUDA allocation of the caller: plain
 * cudaMalloc memory, virtual-memory allocations (cuMemCreate, as PyTorch's
 * expandable segments use; created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
 * among requestedHandleTypes), or cudaMallocAsync memory from a pool created
 * with handleTypes = cudaMemHandleTypePosixFileDescriptor (the default pool
 * cannot be shared: the error says so). A buffer may span several cuMemCreate
 * allocations mapped back to back on one GPU (expandable segments map chunks
 * that way); one that runs past the end of mapped memory, or from one
 * allocation into memory of another kind, is refused saying so. The first use
 * of an allocation registers all of it with the daemon (or call
 * collective_gpu_register), and all the allocations a buffer spans together;
 * a buffer freed and reallocated at the same address, or a chunk under it
 * unmapped and another mapped in its place, is detected by its buffer ids and
 * registered again.
 *
 * The _stream calls follow CUDA stream order, like NCCL: the operation runs
 * after the work queued before it on `stream` (a cudaStream_t; NULL: the legacy
 * default stream), and work queued after it waits for it; work on other
 * streams is the caller's to order before it (a cudaMemcpy from pageable host
 * memory returns before its DMA lands, on the legacy stream, which a
 * non-blocking `stream` does not wait for). They never block the
 * calling thread on the GPU. Every rank of the communicator must make the same
 * call. The daemon runs the operation with its own kernels over the GPUs' peer
 * mappings (NVLink); or, where every rank of the communicator owns one GPU of
 * one node and the daemon allows it (profile gpu.client_kernels), all-reduce,
 * reduce-scatter, all-gather and broadcast run as libcollective's own kernels
 * on `stream` (collective_comm_gpu_path says which; the communicator's first
 * stream-ordered collective sets them up and may wait for work queued on the
 * GPU, as NCCL's first collective does). `request` may be NULL (nothing to wait for; errors then go
 * unseen); with one, collective_wait() reports the outcome once the GPU work
 * is done. If an operation fails, the caller's stream is released anyway (its
 * output is then undefined) and the request carries the error.
 * ========================================================================= */

/** Registers the whole CUDA allocation holding `ptr` (optional: the _stream
 *  calls do it on first use). *handle may be NULL. Errors name the allocation
 *  kind and why it cannot be shared. */
COLLECTIVE_API collective_result_t collective_gpu_register(collective_client_t* client,
                                                           const void* ptr, uint64_t* handle);

/** Deregisters the allocation holding `ptr`: the daemon closes its mapping once
 *  operations in flight on it are done. */
COLLECTIVE_API collective_result_t collective_gpu_deregister(collective_client_t* client,
                                                             const void* ptr);

COLLECTIVE_API collective_result_t collective_all_reduce_stream(
    collective_comm_t* comm, const void* send, void* recv, size_t count, collective_dtype_t dtype,
    collective_redop_t redop, void* stream, collective_request_t** request);
COLLECTIVE_API collective_result_t collective_all_gather_stream(
    collective_comm_t* comm, const void* send, void* recv, size_t count, collective_dtype_t dtype,
    void* stream, collective_request_t** request);
COLLECTIVE_API collective_result_t collective_reduce_scatter_stream(
    collective_comm_t* comm, const void* send, void* recv, size_t count, collective_dtype_t dtype,
    collective_redop_t redop, void* stream, collective_request_t** request);
COLLECTIVE_API collective_result_t collective_broadcast_stream(
    collective_comm_t* comm, const void* send, void* recv, size_t count, collective_dtype_t dtype,
    int root, void* stream, collective_request_t** request);
COLLECTIVE_API collective_result_t collective_reduce_stream(
    collective_comm_t* comm, const void* send, void* recv, size_t count, collective_dtype_t dtype,
    collective_redop_t redop, int root, void* stream, collective_request_t** request);
/** In place (send == recv) is allowed: blocks are exchanged pairwise on the GPU. */
COLLECTIVE_API collective_result_t collective_all_to_all_stream(
    collective_comm_t* comm, const void* send, void* recv, size_t count, collective_dtype_t dtype,
    void* stream, collective_request_t** request);

/** Ends the open group (collective_group_start, collective_send/recv) as a
 *  stream-ordered group on GPU buffers: every item's buffer is GPU memory (or
 *  has count 0). The sends read and the receives write after the work queued
 *  before on `stream`; work queued after waits for all of them. Inside a node
 *  the daemon copies over the GPUs' peer mappings (NVLink); across nodes
 *  through pinned host staging. Both sides of a send/recv inside one node
 *  must use the same kind of memory; across nodes a GPU group may pair with
 *  a host group (collective_group_end). */
COLLECTIVE_API collective_result_t collective_group_end_stream(collective_comm_t* comm,
                                                              void* stream,
                                                              collective_request_t** request);

/** The daemon's GPUs and CUDA MPS mode. */
typedef struct collective_gpu_status {
  int available;           /**< 1: the daemon runs GPU collectives */
  char reason[256];        /**< why not, or the driver and GPU count */
  uint32_t devices;        /**< GPUs the daemon sees */
  char device_names[8][128];
  char mps[16];            /**< managed | external | off (profile gpu.mps) */
  char mps_reason[256];    /**< the mode in force and why */
  uint32_t mappings;       /**< client GPU allocations open in the daemon */
  uint64_t mapped_bytes;
} collective_gpu_status_t;

COLLECTIVE_API collective_result_t collective_gpu_status(collective_client_t* client,
                                                         collective_gpu_status_t* out);

/** Who runs this communicator's stream-ordered collectives, and why: "client
 *  kernels: ..." (libcollective's own kernels on the caller's stream, for the
 *  operations they take), "daemon: <why not the client's kernels>", or
 *  "undecided: ..." before its first stream-ordered collective. Valid until
 *  the communicator is destroyed. */
COLLECTIVE_API const char* collective_comm_gpu_path(collective_comm_t* comm);

#ifdef __cplusplus
}
#endif

#endif /* COLLECTIVE_H_ */
