/* A no-op CNI plugin for benchmarks: as fast as a plugin can be, so what a
 * runtime adds on top of exec is visible.
 *
 * Reads all of stdin first (as real plugins do), then:
 *   VERSION  prints the supported versions
 *   ADD      prints stdin's prevResult if there is one, else a minimal 1.0.0
 *            result with one interface and one IP
 *   DEL, CHECK, STATUS, GC  print nothing
 * Built at run time by bench/harness.py (build_c): gcc -O2 -o noop noop.c
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char *read_all(size_t *len) {
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap + 1);
    for (;;) {
        if (n == cap) {
            cap *= 2;
            buf = realloc(buf, cap + 1);
        }
        ssize_t r = read(0, buf + n, cap - n);
        if (r <= 0)
            break;
        n += (size_t)r;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* The JSON object value of "prevResult", or NULL; sets *len. */
static const char *prev_result(const char *in, size_t *len) {
    const char *p = strstr(in, "\"prevResult\"");
    if (!p)
        return NULL;
    p += strlen("\"prevResult\"");
    while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r' || *p == ':')
        p++;
    if (*p != '{')
        return NULL;
    const char *start = p;
    int depth = 0, in_string = 0;
    for (; *p; p++) {
        if (in_string) {
            if (*p == '\\' && p[1])
                p++;
            else if (*p == '"')
                in_string = 0;
        } else if (*p == '"') {
            in_string = 1;
        } else if (*p == '{') {
            depth++;
        } else if (*p == '}' && --depth == 0) {
            *len = (size_t)(p - start + 1);
            return start;
        }
    }
    return NULL;
}

int main(void) {
    size_t n;
    char *in = read_all(&n);
    const char *cmd = getenv("CNI_COMMAND");
    if (!cmd) {
        fputs("{\"cniVersion\":\"1.0.0\",\"code\":4,\"msg\":\"CNI_COMMAND is not set\"}\n", stdout);
        return 1;
    }
    if (strcmp(cmd, "VERSION") == 0) {
        fputs("{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\"]}\n",
              stdout);
    } else if (strcmp(cmd, "ADD") == 0) {
        size_t len;
        const char *prev = prev_result(in, &len);
        if (prev) {
            fwrite(prev, 1, len, stdout);
            fputc('\n', stdout);
        } else {
            const char *ifname = getenv("CNI_IFNAME");
            const char *netns = getenv("CNI_NETNS");
            printf("{\"cniVersion\":\"1.0.0\",\"interfaces\":[{\"name\":\"%s\",\"sandbox\":\"%s\"}],"
                   "\"ips\":[{\"address\":\"10.99.0.2/24\",\"gateway\":\"10.99.0.1\",\"interface\":0}]}\n",
                   ifname ? ifname : "eth0", netns ? netns : "");
        }
    } else if (strcmp(cmd, "DEL") && strcmp(cmd, "CHECK") && strcmp(cmd, "STATUS") && strcmp(cmd, "GC")) {
        printf("{\"cniVersion\":\"1.0.0\",\"code\":4,\"msg\":\"unknown CNI_COMMAND %s\"}\n", cmd);
        return 1;
    }
    return 0;
}
