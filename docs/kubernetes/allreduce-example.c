/* An all-reduce launched without MPI: every rank reads the job's unique id
 * from $COLLECTIVE_UNIQUE_ID (or the file named by $COLLECTIVE_UNIQUE_ID_FILE),
 * its rank from $RANK (else $JOB_COMPLETION_INDEX, set by a Kubernetes Indexed
 * Job) and the number of ranks from $WORLD_SIZE, talks to its own node's
 * collectived ($COLLECTIVED_SOCKET), and checks the result.
 *
 *   cc -O2 -o allreduce-example allreduce-example.c -I$REPO -L$BUILD/lib -lcollective
 *   id=$(collectivectl unique-id)
 *   COLLECTIVE_UNIQUE_ID=$id RANK=0 WORLD_SIZE=2 ./allreduce-example &
 *   COLLECTIVE_UNIQUE_ID=$id RANK=1 WORLD_SIZE=2 ./allreduce-example
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/collective.h"

static int fail(const char* what) {
  fprintf(stderr, "allreduce-example: %s: %s\n", what, collective_last_error());
  return 1;
}

static const char* env_or(const char* a, const char* b) {
  const char* v = getenv(a);
  return v != NULL ? v : getenv(b);
}

int main(void) {
  char text[2 * COLLECTIVE_UNIQUE_ID_BYTES + 2] = {0};
  const char* id_text = getenv("COLLECTIVE_UNIQUE_ID");
  const char* id_file = getenv("COLLECTIVE_UNIQUE_ID_FILE");
  if (id_text == NULL && id_file != NULL) {
    FILE* f = fopen(id_file, "r");
    if (f == NULL || fgets(text, sizeof text, f) == NULL) {
      fprintf(stderr, "allreduce-example: cannot read %s\n", id_file);
      return 1;
    }
    fclose(f);
    text[strcspn(text, "\r\n")] = '\0';
    id_text = text;
  }
  const char* rank_text = env_or("RANK", "JOB_COMPLETION_INDEX");
  const char* size_text = getenv("WORLD_SIZE");
  if (id_text == NULL || rank_text == NULL || size_text == NULL) {
    fprintf(stderr, "allreduce-example: set COLLECTIVE_UNIQUE_ID (or _FILE), RANK (or "
                    "JOB_COMPLETION_INDEX) and WORLD_SIZE\n");
    return 2;
  }
  const int rank = atoi(rank_text), nranks = atoi(size_text);
  const size_t count = 1 << 20;

  collective_unique_id_t id;
  collective_client_t* client;
  collective_comm_t* comm;
  collective_request_t* req;
  float* buf;
  if (collective_unique_id_from_string(id_text, &id) != COLLECTIVE_OK) return fail("unique id");
  if (collective_connect(NULL, "allreduce-example", &client) != COLLECTIVE_OK) return fail("connect");
  if (collective_host_alloc(client, count * sizeof(float), (void**)&buf) != COLLECTIVE_OK)
    return fail("host_alloc");
  for (size_t i = 0; i < count; ++i) buf[i] = (float)(rank + 1);
  if (collective_comm_init_rank(client, &id, nranks, rank, &comm) != COLLECTIVE_OK)
    return fail("comm_init_rank");
  if (collective_all_reduce(comm, buf, buf, count, COLLECTIVE_FLOAT32, COLLECTIVE_SUM, &req) !=
          COLLECTIVE_OK ||
      collective_wait(req, -1) != COLLECTIVE_OK)
    return fail("all_reduce");
  collective_request_free(req);
  const float want = (float)nranks * (nranks + 1) / 2;
  for (size_t i = 0; i < count; ++i) {
    if (buf[i] != want) {
      fprintf(stderr, "rank %d: element %zu is %g, expected %g\n", rank, i, buf[i], want);
      return 3;
    }
  }
  printf("rank %d of %d: all_reduce of %zu floats correct (%g)\n", rank, nranks, count, want);
  collective_comm_destroy(comm);
  collective_host_free(client, buf);
  collective_disconnect(client);
  return 0;
}
