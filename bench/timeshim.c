/* Times a plugin: runs REAL with the same argv, env, stdin and stdout, then
 * appends "<CNI_COMMAND> <start_ns> <end_ns>\n" (CLOCK_MONOTONIC, the clock
 * of Python's time.monotonic_ns) to LOG and exits as REAL did.
 * Built by bench/concurrency.py: gcc -O2 -DREAL='"…"' -DLOG='"…"' timeshim.c
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv) {
    (void)argc;
    long long start = now_ns();
    pid_t pid = fork();
    if (pid == 0) {
        execv(REAL, argv);
        _exit(127);
    }
    int status = 0;
    if (pid < 0 || waitpid(pid, &status, 0) < 0)
        return 126;
    long long end = now_ns();
    const char *cmd = getenv("CNI_COMMAND");
    char line[160];
    int n = snprintf(line, sizeof line, "%s %lld %lld\n", cmd ? cmd : "-", start, end);
    int fd = open(LOG, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) {
        if (write(fd, line, (size_t)n) < 0) { /* timing is best effort */ }
        close(fd);
    }
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}
