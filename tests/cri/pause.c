/* The pod sandbox's one process, as Kubernetes' pause does it: hold the
 * namespaces, reap whatever is re-parented to it, exit on SIGINT/SIGTERM.
 * Built static by the test (tests/cri/image.py), so the image needs no libc. */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

static void leave(int sig) {
    (void)sig;
    _exit(0);
}

static void reap(int sig) {
    (void)sig;
    while (waitpid(-1, NULL, WNOHANG) > 0) {
    }
}

int main(void) {
    struct sigaction term = {.sa_handler = leave}, chld = {.sa_handler = reap,
                                                           .sa_flags = SA_NOCLDSTOP};
    sigaction(SIGINT, &term, NULL);
    sigaction(SIGTERM, &term, NULL);
    sigaction(SIGCHLD, &chld, NULL);
    for (;;)
        pause();
}
