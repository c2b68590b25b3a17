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

#ifdef __cplusplus
}
#endif

#endif /* COLLECTIVE_H_ */
