/* The pod sandbox's process (what k8s.gcr.io/pause runs): holds the pod's namespaces,
 * reaps orphans, exits on SIGINT/SIGTERM. Built static by .ci/build_k8s_node.sh, since no
 * registry is reachable to pull the upstream image from. */
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }

int main(void) {
    struct sigaction q = {.sa_handler = quit}, r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGINT, &q, NULL);
    sigaction(SIGTERM, &q, NULL);
    sigaction(SIGCHLD, &r, NULL);
    for (;;) pause();
    return 1;
}
