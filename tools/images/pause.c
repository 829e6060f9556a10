/* The pod sandbox's process (registry.k8s.io/pause:3.10 as tools/images.sh builds it): holds the
 * pod's namespaces open and does nothing else. As PID 1 of the sandbox it reaps any orphan that
 * is reparented to it, and it exits 0 when the runtime stops the sandbox with SIGINT or SIGTERM
 * (PID 1 gets no default action for a signal, so both need a handler). Built with -static. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void on_stop(int sig) {
  (void)sig;
  _exit(0);
}

static void on_child(int sig) {
  (void)sig;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
}

static int handle(int sig, void (*fn)(int)) {
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = fn;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = sig == SIGCHLD ? SA_NOCLDSTOP | SA_RESTART : 0;
  return sigaction(sig, &sa, NULL);
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    puts("pause (vgpu tools/images/pause.c)");
    return 0;
  }
  if (getpid() != 1) {
    fputs("pause: warning: not PID 1; orphans will not be reaped here\n", stderr);
  }
  if (handle(SIGINT, on_stop) < 0 || handle(SIGTERM, on_stop) < 0 || handle(SIGCHLD, on_child) < 0) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) {
    pause();
  }
  return 42; /* not reached */
}
