/* A real collectived for the libnccl tests, in C (the tests are NCCL programs,
 * linked to nothing of ours but libnccl.so.2): started on a socket in a
 * private directory, its log kept there, stopped with SIGTERM. */
#ifndef COLLECTIVED_TESTS_NCCL_TEST_DAEMON_H_
#define COLLECTIVED_TESTS_NCCL_TEST_DAEMON_H_

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct {
  pid_t pid;
  char dir[64];
  char socket[128];
  char log[128];
} test_daemon;

static inline double test_now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static inline int test_daemon_answers(const char* path) {
  struct sockaddr_un addr;
  memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  const size_t len = strlen(path);
  if (len >= sizeof addr.sun_path) return 0;
  memcpy(addr.sun_path, path, len + 1);
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  const int ok = connect(fd, (struct sockaddr*)&addr, sizeof addr) == 0;
  close(fd);
  return ok;
}

static inline void test_daemon_dump_log(const test_daemon* d) {
  FILE* f = fopen(d->log, "r");
  if (f == NULL) return;
  fprintf(stderr, "--- collectived's log (%s):\n", d->log);
  char line[1024];
  while (fgets(line, sizeof line, f) != NULL) fputs(line, stderr);
  fclose(f);
}

/* `sets`: profile overrides (KEY=VALUE), NULL-terminated. 0: up. */
static inline int test_daemon_start(test_daemon* d, const char* bin, const char* const* sets) {
  memset(d, 0, sizeof *d);
  strcpy(d->dir, "/tmp/nccl-test-XXXXXX");
  if (mkdtemp(d->dir) == NULL) return -1;
  snprintf(d->socket, sizeof d->socket, "%s/cd.sock", d->dir);
  snprintf(d->log, sizeof d->log, "%s/daemon.log", d->dir);
  char sock_set[160];
  snprintf(sock_set, sizeof sock_set, "client.socket=%s", d->socket);
  const char* argv[64];
  int n = 0;
  argv[n++] = bin;
  argv[n++] = "--set";
  argv[n++] = sock_set;
  argv[n++] = "--set";
  argv[n++] = "client.socket_mode=0666";
  for (int i = 0; sets != NULL && sets[i] != NULL && n < 60; ++i) {
    argv[n++] = "--set";
    argv[n++] = sets[i];
  }
  argv[n] = NULL;
  fflush(NULL);
  d->pid = fork();
  if (d->pid < 0) return -1;
  if (d->pid == 0) {
    const int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0644);
    dup2(fd, 2);
    const int null = open("/dev/null", O_RDWR);
    dup2(null, 0);
    dup2(null, 1);
    for (int k = 3; k < 1024; ++k) close(k);
    unsetenv("NOTIFY_SOCKET");
    execv(bin, (char* const*)argv);
    _exit(127);
  }
  const double until = test_now_s() + 10;
  while (test_now_s() < until) {
    int status = 0;
    if (waitpid(d->pid, &status, WNOHANG) == d->pid) {
      d->pid = 0;
      test_daemon_dump_log(d);
      return -1;
    }
    if (test_daemon_answers(d->socket)) return 0;
    usleep(20000);
  }
  test_daemon_dump_log(d);
  return -1;
}

static inline void test_daemon_stop(test_daemon* d) {
  if (d->pid > 0) {
    kill(d->pid, SIGTERM);
    const double until = test_now_s() + 10;
    int status = 0;
    while (waitpid(d->pid, &status, WNOHANG) == 0) {
      if (test_now_s() > until) {
        kill(d->pid, SIGKILL);
        waitpid(d->pid, &status, 0);
        break;
      }
      usleep(10000);
    }
    d->pid = 0;
  }
  unlink(d->socket);
  unlink(d->log);
  rmdir(d->dir);
}

#endif /* COLLECTIVED_TESTS_NCCL_TEST_DAEMON_H_ */
