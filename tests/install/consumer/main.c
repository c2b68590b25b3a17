/* An application built outside collectived's tree against an installed one
 * (tests/install/install_test.sh): it connects to the daemon at argv[1],
 * all-reduces in a one-rank communicator and checks the result. With argv[2],
 * libcollective's version must be that (the package's version). */
#include <client/collective.h>

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#define COUNT 1024

static int fail(const char* what, collective_result_t r) {
  fprintf(stderr, "consumer: %s: %s: %s\n", what, collective_result_string(r),
          collective_last_error());
  return 1;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: consumer SOCKET [VERSION]\n");
    return 2;
  }
  if (argc > 2 && strcmp(collective_version(), argv[2]) != 0) {
    fprintf(stderr, "consumer: libcollective %s, expected %s\n", collective_version(), argv[2]);
    return 1;
  }
  collective_client_t* client = NULL;
  collective_result_t r = collective_connect(argv[1], "install-consumer", &client);
  if (r != COLLECTIVE_OK) return fail("connect", r);

  int32_t* buf = NULL;
  r = collective_host_alloc(client, 2 * COUNT * sizeof *buf, (void**)&buf);
  if (r != COLLECTIVE_OK) return fail("host_alloc", r);
  int32_t* send = buf;
  int32_t* recv = buf + COUNT;
  for (int i = 0; i < COUNT; i++) {
    send[i] = 3 * i - 7;
    recv[i] = -1;
  }

  collective_unique_id_t id;
  collective_comm_t* comm = NULL;
  if ((r = collective_get_unique_id(client, &id)) != COLLECTIVE_OK) return fail("get_unique_id", r);
  if ((r = collective_comm_init_rank(client, &id, 1, 0, &comm)) != COLLECTIVE_OK) {
    return fail("comm_init_rank", r);
  }
  collective_request_t* req = NULL;
  r = collective_all_reduce(comm, send, recv, COUNT, COLLECTIVE_INT32, COLLECTIVE_SUM, &req);
  if (r != COLLECTIVE_OK) return fail("all_reduce", r);
  r = collective_wait(req, 30000);
  collective_request_free(req);
  if (r != COLLECTIVE_OK) return fail("wait", r);
  for (int i = 0; i < COUNT; i++) {
    if (recv[i] != 3 * i - 7) {
      fprintf(stderr, "consumer: recv[%d] = %d, expected %d\n", i, recv[i], 3 * i - 7);
      return 1;
    }
  }

  if ((r = collective_comm_destroy(comm)) != COLLECTIVE_OK) return fail("comm_destroy", r);
  if ((r = collective_host_free(client, buf)) != COLLECTIVE_OK) return fail("host_free", r);
  collective_disconnect(client);
  printf("ok\n");
  return 0;
}
