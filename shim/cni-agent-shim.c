/* cni-agent-shim: a CNI plugin that forwards its call to cni-agent.
 *
 * A runtime (containerd, CRI-O, podman, nerdctl, cnitool) execs it like any
 * plugin. It sends the CNI_* environment (and the runtime's TRACEPARENT,
 * TRACESTATE and BAGGAGE) and stdin untouched to the agent and
 * prints what comes back: the agent decides everything, so the shim holds no
 * CNI logic and cannot disagree with the agent.
 *
 * Two ways to the agent, the same call and the same answers:
 * - the agent's own socket, /run/cni-agent/shim.sock (agent/cni_agent/service/
 *   shimsock.py has the protocol): one connect and one exchange, the caller
 *   known to the agent by SO_PEERCRED;
 * - else the agent's CNICall method on the system bus: when the socket is not
 *   there (the agent stopped or restarting: bus activation starts it and holds
 *   the call; an older agent without the socket).
 * The bus costs three round trips through the bus daemon (Hello, the call, the
 * agent's look-up of our credentials) and libsystemd's loading (0.5 ms of CPU
 * per exec here), so libsystemd is loaded only when the bus is used.
 *
 * Why C and not Python: the shim runs once per CNI call, and containerd runs
 * STATUS on every CRI Status query. Python with dbus-fast costs 110-200 ms to
 * start; this costs about a millisecond. libsystemd is on every systemd node,
 * so the binary needs nothing new there.
 *
 * Errors of the shim itself (no bus, no agent, access refused, timeout) are
 * printed as CNI errors: 11 (try again later) when the agent is not there or
 * went away mid-call (a runtime retries), 7 for a configuration too large to
 * send, 999 otherwise, always with a message a person can act on and the bus
 * or socket error and errno in "details". The agent's own errors arrive by
 * name on either way and are mapped by the same code (call_failed).
 *
 * CNI_AGENT_SHIM_SOCKET overrides the socket's path; set and empty, the shim
 * uses the bus alone. DBUS_SYSTEM_BUS_ADDRESS names the bus, as for every
 * D-Bus client.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <sys/un.h>
#include <unistd.h>

/* Types and error names only: the library is loaded on demand (load_sd_bus). */
#include <systemd/sd-bus.h>

#define AGENT_NAME "org.cniagent.Agent1"
#define AGENT_PATH "/org/cniagent/Agent1"
#define AGENT_IFACE "org.cniagent.Agent1"
#define SOCKET_PATH "/run/cni-agent/shim.sock"
#define SOCKET_ENV "CNI_AGENT_SHIM_SOCKET"
#define LIBSYSTEMD "libsystemd.so.0"
/* The agent bounds every verb itself, and the runtime bounds the shim; this is
 * a backstop for callers that do not (podman, cnitool) against an agent that
 * never answers. Derived from the agent's default timeouts
 * (docs/configuration.md, "Timeouts"): an ADD, the longest call, waits for
 * readiness (timeouts.ready, 30 s) and for recovery and the lock
 * (timeouts.lock, 60 s), runs its chain (timeouts.add, 120 s for the whole
 * chain) and, if that fails, the rollback (timeouts.del, 60 s): 270 s, + 30 s
 * margin. When it fires, the agent still
 * finishes or rolls back the ADD, as when a runtime kills the shim, and the
 * runtime's DEL removes what is left. */
#define CALL_TIMEOUT_SEC 300ULL
#define CALL_TIMEOUT_USEC (CALL_TIMEOUT_SEC * 1000000ULL)
/* The agent refuses configurations over 1 MiB (bytes); one byte more than
 * that is read so that a longer one is refused here, whole, with the same
 * code, and never cut in the middle of a UTF-8 sequence and sent. */
#define MAX_CONFIG (1024 * 1024)
#define MAX_STDIN (MAX_CONFIG + 1)
/* The socket's bounds (shimsock.py): an environment larger than the agent
 * reads there goes by the bus, which carries any; a reply this large is not
 * the agent's (its plugins' output is bounded at 8 MiB). */
#define SOCKET_MAGIC "CNA1"
#define SOCKET_MAX_ENV (64 * 1024)
#define SOCKET_MAX_NAME 4096
#define SOCKET_MAX_TEXT (64 * 1024 * 1024)

/* VERSION is answered here, without the agent: it is about this binary, and
 * runtimes ask it while validating configs, agent running or not. The list is
 * the agent's too (SHIM_VERSIONS in cni_agent/cni/config.py; a test
 * compares them). */
#define SUPPORTED_VERSIONS "\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\""

#define CODE_INVALID_CONFIG 7
#define CODE_TRY_AGAIN_LATER 11
#define CODE_INTERNAL 999

extern char **environ;

static const char *not_running = "cni-agent is not running: systemctl start cni-agent";
static const char *masked = "cni-agent is not running: its unit is masked "
                            "(systemctl unmask cni-agent && systemctl start cni-agent)";
static const char *went_away = "cni-agent went away during the call: see journalctl -u cni-agent";
static const char *too_slow = "cni-agent did not answer in time: see journalctl -u cni-agent";
static const char *not_utf8 = "cni-agent-shim: cannot send the call (the environment or "
                              "configuration is not valid UTF-8?)";

/* The length of the valid UTF-8 sequence at p (1-4), or 0 if there is none
 * (a stray byte, or a character cut in two by a bounded snprintf below). */
static size_t utf8_length(const unsigned char *p) {
    size_t n = *p < 0x80 ? 1 : (*p & 0xE0) == 0xC0 ? 2 : (*p & 0xF0) == 0xE0 ? 3
             : (*p & 0xF8) == 0xF0 ? 4 : 0;
    if (n == 0 || (n == 2 && *p < 0xC2) || (n == 4 && *p > 0xF4))
        return 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xC0) != 0x80)
            return 0;
    if ((n == 3 && *p == 0xE0 && p[1] < 0xA0) || (n == 3 && *p == 0xED && p[1] >= 0xA0)
        || (n == 4 && *p == 0xF0 && p[1] < 0x90) || (n == 4 && *p == 0xF4 && p[1] >= 0x90))
        return 0; /* overlong, a surrogate, beyond U+10FFFF */
    return n;
}

/* A JSON string, quoted and escaped: whatever it holds, the runtime can parse
 * what we print (invalid UTF-8 becomes U+FFFD). */
static void json_string(const char *text) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)text; *p;) {
        size_t n = utf8_length(p);
        if (n == 0) {
            fputs("\\ufffd", stdout);
            p++;
            continue;
        }
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20 || *p == 0x7F)
            printf("\\u%04x", *p);
        else
            fwrite(p, 1, n, stdout);
        p += n;
    }
    putchar('"');
}

/* Print a CNI error to stdout (where runtimes read it) and return the exit status. */
static int cni_error(int code, const char *msg, const char *details) {
    printf("{\"cniVersion\":\"1.1.0\",\"code\":%d,\"msg\":", code);
    json_string(msg);
    if (details && *details) {
        fputs(",\"details\":", stdout);
        json_string(details);
    }
    puts("}");
    fflush(stdout);
    return 1;
}

static char *read_stdin(size_t *len) {
    size_t cap = 8192, n = 0;
    char *buf = malloc(cap + 1);
    if (!buf)
        return NULL;
    for (;;) {
        if (n == cap) {
            if (cap >= MAX_STDIN)
                break;
            cap = cap * 2 > MAX_STDIN ? MAX_STDIN : cap * 2;
            char *bigger = realloc(buf, cap + 1);
            if (!bigger) {
                free(buf);
                return NULL;
            }
            buf = bigger;
        }
        ssize_t got = read(STDIN_FILENO, buf + n, cap - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0) {
            free(buf);
            return NULL;
        }
        if (got == 0)
            break;
        n += (size_t)got;
    }
    buf[n] = '\0';
    *len = n;
    return buf;
}

/* Whether `s` is UTF-8 as D-Bus strings must be, exactly as sd-bus checks
 * them (no overlong forms, surrogates, code points past U+10FFFF, nor the
 * noncharacters U+FDD0-U+FDEF and U+xxFFFE/F): so both ways refuse the same
 * calls, here, with the same answer. */
static int valid_utf8(const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p;) {
        size_t n = utf8_length(p);
        if (n == 0)
            return 0;
        uint32_t c = n == 1 ? *p : (uint32_t)(*p & (0x7F >> n));
        for (size_t i = 1; i < n; i++)
            c = (c << 6) | (p[i] & 0x3F);
        if ((c >= 0xFDD0 && c <= 0xFDEF) || (c & 0xFFFE) == 0xFFFE)
            return 0; /* a noncharacter */
        p += n;
    }
    return 1;
}

/* The runtime's W3C trace context, which libcni 1.3 gives every plugin
 * (containernetworking/cni#1173): the agent checks it and passes it on to its
 * own plugins (agent/cni_agent/cni/tracectx.py). */
static int trace_context(const char *entry) {
    return !strncmp(entry, "TRACEPARENT=", 12) || !strncmp(entry, "TRACESTATE=", 11)
           || !strncmp(entry, "BAGGAGE=", 8);
}

/* The environment forwarded: CNI_* variables, not the shim's own setting, and
 * the trace context. */
static int forwarded(const char *entry) {
    return (!strncmp(entry, "CNI_", 4) && strchr(entry, '=')
            && strncmp(entry, SOCKET_ENV "=", sizeof SOCKET_ENV))
           || trace_context(entry);
}

static int is(const char *name, const char *which) {
    return !strcmp(name, which);
}

static int agent_down(const char *msg, const char *details);

/* A failed call, as the CNI error a runtime acts on: `name` and `message` are
 * the bus's or the agent's error (the same names on both ways), `r` the
 * negative errno. "details" carries them, so that the runtime's log says what
 * happened. */
static int call_failed(const char *name, const char *message, int r) {
    char msg[1024], details[1024];

    if (!name)
        name = "";
    if (!message)
        message = strerror(-r);
    snprintf(details, sizeof details, "%s%s%s (%s)", name, *name ? ": " : "", message, strerror(-r));
    if (is(name, SD_BUS_ERROR_SERVICE_UNKNOWN) || is(name, SD_BUS_ERROR_NAME_HAS_NO_OWNER)
        || is(name, "org.freedesktop.systemd1.NoSuchUnit")
        || is(name, "org.freedesktop.DBus.Error.Spawn.ChildExited")
        || is(name, "org.freedesktop.DBus.Error.Spawn.ServiceNotFound")
        || is(name, "org.freedesktop.DBus.Error.Spawn.Failed")
        /* Activation that did not finish in time: the agent is (re)starting. */
        || is(name, "org.freedesktop.DBus.Error.TimedOut"))
        return agent_down(not_running, details);
    if (is(name, "org.freedesktop.systemd1.UnitMasked"))
        return agent_down(masked, details);
    if (is(name, AGENT_IFACE ".Error.NotReady") || is(name, AGENT_IFACE ".Error.Busy")
        || is(name, AGENT_IFACE ".Error.ShuttingDown"))
        return cni_error(CODE_TRY_AGAIN_LATER, message, "");
    /* The agent's refusal names its reason (a runtime's ADD, DEL, CHECK and
     * GC are root's); the bus daemon's means the call never reached the
     * agent: the policy the packages install lets every caller send, so a
     * local one denied it. */
    if (is(name, AGENT_IFACE ".Error.AccessDenied")) {
        snprintf(msg, sizeof msg, "access denied by cni-agent: %s", message);
        return cni_error(CODE_INTERNAL, msg, "");
    }
    if (is(name, SD_BUS_ERROR_ACCESS_DENIED)) {
        snprintf(msg, sizeof msg, "access denied by the D-Bus daemon's policy, before cni-agent "
                                  "saw the call (%s): the policy cni-agent installs lets every "
                                  "caller reach it, so a local policy in /etc/dbus-1/system.d/ "
                                  "denies it", message);
        return cni_error(CODE_INTERNAL, msg, "");
    }
    /* NoReply comes from the bus: the agent exited, crashed or restarted with
     * the call in flight. Whatever it had started it finishes or rolls back
     * on its next start, so the runtime should simply try again. */
    if (is(name, SD_BUS_ERROR_NO_REPLY) || is(name, SD_BUS_ERROR_DISCONNECTED))
        return cni_error(CODE_TRY_AGAIN_LATER, went_away, details);
    /* Our own backstop (CALL_TIMEOUT_SEC): sd-bus names it Timeout. */
    if (is(name, SD_BUS_ERROR_TIMEOUT) || r == -ETIMEDOUT)
        return cni_error(CODE_INTERNAL, too_slow, details);
    snprintf(msg, sizeof msg, "cni-agent refused the call: %s%s%s", message, *name ? ": " : "", name);
    return cni_error(CODE_INTERNAL, msg, "");
}

/* What the agent answered: a plugin's stdout and exit status. */
static int answered(uint32_t status, const char *output, size_t len) {
    fwrite(output, 1, len, stdout);
    if (len && output[len - 1] != '\n')
        putchar('\n');
    fflush(stdout);
    /* Exiting frees everything: no cleanup needed on the way out. */
    return status > 255 ? 1 : (int)status;
}

/* --- the agent's socket ------------------------------------------------------------ */

#define SOCKET_UNREACHABLE (-1000) /* not connected: the bus is next */

static void put_u32(char *p, uint32_t v) {
    p[0] = (char)(v >> 24), p[1] = (char)(v >> 16), p[2] = (char)(v >> 8), p[3] = (char)v;
}

static uint32_t get_u32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* Read exactly `len` bytes: 0, or the negative errno (-ECONNRESET at an early end). */
static int read_all(int fd, void *buf, size_t len) {
    char *p = buf;
    while (len) {
        ssize_t got = read(fd, p, len);
        if (got < 0 && errno == EINTR)
            continue;
        if (got < 0)
            return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -errno;
        if (got == 0)
            return -ECONNRESET;
        p += got, len -= (size_t)got;
    }
    return 0;
}

/* The request, whole: "CNA1" env_len env config_len config. */
static char *socket_request(const char *config, size_t config_len, size_t *len) {
    size_t env_len = 0;
    for (char **e = environ; *e; e++)
        if (forwarded(*e))
            env_len += strlen(*e) + 1;
    if (env_len > SOCKET_MAX_ENV)
        return NULL; /* the bus carries it */
    char *buf = malloc(12 + env_len + config_len), *p = buf;
    if (!buf)
        return NULL;
    memcpy(p, SOCKET_MAGIC, 4), p += 4;
    put_u32(p, (uint32_t)env_len), p += 4;
    for (char **e = environ; *e; e++) {
        if (forwarded(*e)) {
            size_t n = strlen(*e) + 1;
            memcpy(p, *e, n), p += n;
        }
    }
    put_u32(p, (uint32_t)config_len), p += 4;
    memcpy(p, config, config_len), p += config_len;
    *len = (size_t)(p - buf);
    return buf;
}

/* The call over the agent's socket: the exit status, or SOCKET_UNREACHABLE
 * when there is no agent to connect to there (then the bus is asked). */
static int call_socket(const char *path, const char *config, size_t config_len) {
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof addr.sun_path)
        return SOCKET_UNREACHABLE;
    strcpy(addr.sun_path, path);
    size_t len = 0;
    char *request = socket_request(config, config_len, &len);
    if (!request)
        return SOCKET_UNREACHABLE;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return SOCKET_UNREACHABLE;
    struct timeval timeout = {.tv_sec = CALL_TIMEOUT_SEC};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof timeout);
    /* Absent (ENOENT), stale (ECONNREFUSED), unreadable: the bus, as before the socket. */
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) < 0) {
        close(fd);
        free(request);
        return SOCKET_UNREACHABLE;
    }
    /* A write cut short (EPIPE: the agent answered before reading it all, a
     * refusal) still leaves its answer to read. */
    for (const char *p = request; len;) {
        ssize_t sent = send(fd, p, len, MSG_NOSIGNAL);
        if (sent < 0 && errno == EINTR)
            continue;
        if (sent < 0)
            break;
        p += sent, len -= (size_t)sent;
    }
    free(request);

    char details[1024];
    unsigned char head[16];
    int r = read_all(fd, head, sizeof head);
    if (r == 0 && memcmp(head, SOCKET_MAGIC, 4))
        r = -EPROTO;
    uint32_t status = r ? 0 : get_u32(head + 4), name_len = r ? 0 : get_u32(head + 8),
             text_len = r ? 0 : get_u32(head + 12);
    if (!r && (name_len > SOCKET_MAX_NAME || text_len > SOCKET_MAX_TEXT))
        r = -EPROTO;
    char *body = r ? NULL : malloc((size_t)name_len + text_len + 2);
    if (!r && !body)
        r = -ENOMEM;
    if (!r)
        r = read_all(fd, body, (size_t)name_len + text_len);
    close(fd);
    if (r) {
        snprintf(details, sizeof details, "the agent's socket %s: %s", path, strerror(-r));
        if (r == -ETIMEDOUT)
            return cni_error(CODE_INTERNAL, too_slow, details);
        if (r == -EPROTO || r == -ENOMEM)
            return cni_error(CODE_INTERNAL, "cni-agent-shim: the agent's answer is not one this "
                                            "shim reads", details);
        return cni_error(CODE_TRY_AGAIN_LATER, went_away, details);
    }
    if (!name_len)
        return answered(status, body, text_len);
    /* The agent's error by name, as the bus would carry it. */
    memmove(body + name_len + 1, body + name_len, text_len);
    body[name_len] = '\0', body[name_len + 1 + text_len] = '\0';
    return call_failed(body, body + name_len + 1, -EIO);
}

/* --- the system bus -------------------------------------------------------------------- */

/* The libsystemd functions the bus needs, loaded only when it is used. */
static struct {
    __typeof__(sd_bus_open_system) *open_system;
    __typeof__(sd_bus_message_new_method_call) *new_method_call;
    __typeof__(sd_bus_message_open_container) *open_container;
    __typeof__(sd_bus_message_close_container) *close_container;
    __typeof__(sd_bus_message_append) *append;
    __typeof__(sd_bus_call) *call;
    __typeof__(sd_bus_message_read) *read;
} sd;

static const char *load_sd_bus(void) {
    void *lib = dlopen(LIBSYSTEMD, RTLD_NOW | RTLD_LOCAL);
    if (!lib)
        return dlerror();
/* POSIX lets dlsym's object pointer be a function's. */
#define SYM(field, name)                                                                           \
    if (!(sd.field = (__typeof__(sd.field))dlsym(lib, #name)))                                     \
        return dlerror();
    SYM(open_system, sd_bus_open_system)
    SYM(new_method_call, sd_bus_message_new_method_call)
    SYM(open_container, sd_bus_message_open_container)
    SYM(close_container, sd_bus_message_close_container)
    SYM(append, sd_bus_message_append)
    SYM(call, sd_bus_call)
    SYM(read, sd_bus_message_read)
#undef SYM
    return NULL;
}

static int call_bus(const char *config) {
    sd_bus *bus = NULL;
    sd_bus_message *call = NULL, *reply = NULL;
    sd_bus_error error = SD_BUS_ERROR_NULL;
    uint32_t status = 0;
    const char *output = NULL;
    int r;

    const char *why = load_sd_bus();
    if (why)
        return cni_error(CODE_INTERNAL, "cni-agent-shim: cannot load " LIBSYSTEMD " to reach the "
                                        "agent over the system bus", why);
    /* sd_bus_open_system honours DBUS_SYSTEM_BUS_ADDRESS, as every D-Bus client does. */
    r = sd.open_system(&bus);
    if (r < 0) {
        char details[512];
        const char *address = getenv("DBUS_SYSTEM_BUS_ADDRESS");
        snprintf(details, sizeof details, "cannot connect to the system bus at %s: %s",
                 address && *address ? address : "unix:path=/run/dbus/system_bus_socket",
                 strerror(-r));
        return agent_down(not_running, details);
    }

    r = sd.new_method_call(bus, &call, AGENT_NAME, AGENT_PATH, AGENT_IFACE, "CNICall");
    if (r >= 0)
        r = sd.open_container(call, 'a', "{ss}");
    for (char **e = environ; r >= 0 && *e; e++) {
        if (!forwarded(*e))
            continue;
        const char *eq = strchr(*e, '=');
        char *key = strndup(*e, (size_t)(eq - *e));
        if (!key) {
            r = -ENOMEM;
            break;
        }
        r = sd.append(call, "{ss}", key, eq + 1);
        free(key);
    }
    if (r >= 0)
        r = sd.close_container(call);
    if (r >= 0)
        r = sd.append(call, "s", config);
    if (r < 0) /* checked before (valid_utf8): out of memory */
        return cni_error(CODE_INTERNAL, not_utf8, strerror(-r));

    r = sd.call(bus, call, CALL_TIMEOUT_USEC, &error, &reply);
    if (r < 0)
        return call_failed(error.name, error.message, r);
    r = sd.read(reply, "us", &status, &output);
    if (r < 0)
        return cni_error(CODE_INTERNAL, "cni-agent-shim: the agent's answer is not (us)", strerror(-r));
    return answered(status, output, strlen(output));
}

/* --- the queue: a DEL while no agent runs (queueWhenDown) -------------------------------
 *
 * A DEL that reaches no agent (neither its socket nor the bus: not running,
 * masked, activation failed or timed out) is written to the agent's queue,
 * STATE_DIR/queue/, one file per request, and answered as done: the agent runs
 * it when it starts (docs/reliability.md, "Teardowns queued while the agent is
 * down"). Unless the network's conflist says "queueWhenDown": false; its
 * "stateDir" names the agent's state_dir when it is not the default.
 *
 * Only while no agent holds the queue: the agent holds queue/.lock (LOCK_EX)
 * from before it lists the queue until it exits, and the shim writes under
 * LOCK_SH (shims queue side by side, never while an agent runs). So every file
 * is older than the agent that drains it. Written as libcni's cache is not:
 * a temporary file, fsync, rename, fsync of the directory; the file's owner
 * is who asked. Whatever fails, the DEL fails as before, the reason said. */

#define STATE_DIR "/var/lib/cni-agent"
#define QUEUE_DIR "queue"
#define QUEUE_LOCK ".lock"

static const char *queued_config; /* the DEL's stdin when it may be queued; else NULL */
static char queue_state_dir[4096] = STATE_DIR;

/* Past one JSON value at p (whitespace skipped before it); NULL if it is not one. */
static const char *json_skip(const char *p) {
    int depth = 0;
    p += strspn(p, " \t\r\n");
    do {
        if (*p == '"') {
            for (p++; *p && *p != '"'; p++)
                if (*p == '\\' && !*++p)
                    return NULL;
            if (!*p++)
                return NULL;
        } else if (*p == '{' || *p == '[') {
            depth++, p++;
        } else if (*p == '}' || *p == ']') {
            if (--depth < 0)
                return NULL;
            p++;
        } else if (*p == ',' || *p == ':' || *p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') {
            if (!depth)
                return NULL;
            p++;
        } else if (*p) {
            p += strcspn(p, ",:]} \t\r\n\"{[");
        } else {
            return NULL;
        }
    } while (depth);
    return p;
}

/* The value of a top-level `key` of the JSON object `json` (its first byte), or NULL. */
static const char *json_member(const char *json, const char *key) {
    const char *p = json + strspn(json, " \t\r\n"), *found = NULL;
    size_t n = strlen(key);
    if (*p++ != '{')
        return NULL;
    for (;;) {
        p += strspn(p, " \t\r\n");
        if (*p == '}')
            return found;
        const char *name = p;
        if (*p != '"' || !(p = json_skip(p)))
            return NULL;
        int match = (size_t)(p - name) == n + 2 && !strncmp(name + 1, key, n);
        p += strspn(p, " \t\r\n");
        if (*p++ != ':')
            return NULL;
        p += strspn(p, " \t\r\n");
        if (match)
            found = p; /* the last one wins, as Go's encoding/json */
        if (!(p = json_skip(p)))
            return NULL;
        p += strspn(p, " \t\r\n");
        if (*p == ',')
            p++;
        else if (*p != '}')
            return NULL;
    }
}

/* Whether this call may be queued: a DEL whose network did not turn it off;
 * and where (the conflist's "stateDir": a plain absolute path, no escapes). */
static void queue_prepare(const char *command, const char *config) {
    if (!command || strcmp(command, "DEL"))
        return;
    const char *start = config + strspn(config, " \t\r\n");
    const char *end = *start == '{' ? json_skip(start) : NULL;
    if (!end || end[strspn(end, " \t\r\n")])
        return; /* not one JSON object: the agent would refuse it, so it fails now */
    const char *off = json_member(config, "queueWhenDown");
    if (off && !strncmp(off, "false", 5))
        return;
    const char *dir = json_member(config, "stateDir");
    if (dir && *dir == '"') {
        size_t n = strcspn(dir + 1, "\"\\");
        if (dir[1 + n] != '"' || dir[1] != '/' || n >= sizeof queue_state_dir - 32)
            return; /* not a path the shim can use: not queued, the DEL fails as before */
        memcpy(queue_state_dir, dir + 1, n);
        queue_state_dir[n] = '\0';
    }
    queued_config = config;
}

static void json_put(FILE *f, const char *text) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        if (*p == '"' || *p == '\\')
            fprintf(f, "\\%c", *p);
        else if (*p < 0x20 || *p == 0x7F)
            fprintf(f, "\\u%04x", *p);
        else
            fputc(*p, f); /* valid UTF-8: checked in main */
    }
    fputc('"', f);
}

/* The queued request: the call as the agent would have received it, and the
 * identity of its namespace file now (the agent uses the path only if it is
 * still that namespace). */
static char *queue_request(size_t *len) {
    char *buf = NULL;
    FILE *f = open_memstream(&buf, len);
    if (!f)
        return NULL;
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    fprintf(f, "{\"version\":1,\"queued\":%lld.%09ld,\"env\":{", (long long)now.tv_sec, now.tv_nsec);
    int first = 1;
    for (char **e = environ; *e; e++) {
        if (!forwarded(*e))
            continue;
        const char *eq = strchr(*e, '=');
        char *key = strndup(*e, (size_t)(eq - *e));
        if (!key) {
            fclose(f);
            free(buf);
            return NULL;
        }
        fputs(first ? "" : ",", f);
        json_put(f, key);
        fputc(':', f);
        json_put(f, eq + 1);
        free(key);
        first = 0;
    }
    fputs("},\"config\":", f);
    json_put(f, queued_config);
    const char *netns = getenv("CNI_NETNS");
    struct stat st;
    if (netns && *netns && stat(netns, &st) == 0)
        fprintf(f, ",\"netns\":{\"dev\":%llu,\"ino\":%llu}", (unsigned long long)st.st_dev,
                (unsigned long long)st.st_ino);
    fputs("}\n", f);
    if (fclose(f)) {
        free(buf);
        return NULL;
    }
    return buf;
}

/* Write `data` to `dir`/`name` durably: a temporary file, fsync, rename,
 * fsync of the directory. 0, or the errno. */
static int queue_write(int dir, const char *name, const char *data, size_t len) {
    char tmp[64];
    snprintf(tmp, sizeof tmp, ".tmp-%ld", (long)getpid());
    int fd = openat(dir, tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0)
        return errno;
    int err = 0;
    for (const char *p = data; len && !err;) {
        ssize_t n = write(fd, p, len);
        if (n < 0 && errno != EINTR)
            err = errno;
        else if (n > 0)
            p += n, len -= (size_t)n;
    }
    if (!err && fsync(fd))
        err = errno;
    if (close(fd) && !err)
        err = errno;
    if (!err && renameat(dir, tmp, dir, name))
        err = errno;
    if (err) {
        unlinkat(dir, tmp, 0);
        return err;
    }
    return fsync(dir) ? errno : 0;
}

/* Queue the DEL: 0 when it is durably queued, else the errno with `why` saying what failed. */
static int queue_del(char *why, size_t size) {
    char path[4200];
    snprintf(path, sizeof path, "%s/" QUEUE_DIR, queue_state_dir);
    if (mkdir(path, 0700) && errno != EEXIST) {
        int err = errno;
        snprintf(why, size, "cannot create %s: %s", path, strerror(err));
        return err;
    }
    int dir = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NOFOLLOW);
    if (dir < 0) {
        int err = errno;
        snprintf(why, size, "cannot open %s: %s", path, strerror(err));
        return err;
    }
    int lock = openat(dir, QUEUE_LOCK, O_RDONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (lock < 0 || flock(lock, LOCK_SH | LOCK_NB)) {
        int err = errno;
        if (err == EWOULDBLOCK)
            snprintf(why, size, "a cni-agent holds %s/" QUEUE_LOCK " (it runs, but did not answer)",
                     path);
        else
            snprintf(why, size, "cannot lock %s/" QUEUE_LOCK ": %s", path, strerror(err));
        if (lock >= 0)
            close(lock);
        close(dir);
        return err;
    }
    size_t len = 0;
    char *data = queue_request(&len);
    int err = data ? 0 : ENOMEM;
    if (data) {
        /* Named in arrival order: the agent runs a sandbox's in this order. */
        struct timespec now;
        char name[64];
        clock_gettime(CLOCK_REALTIME, &now);
        snprintf(name, sizeof name, "%020lld%09ld-%ld.del", (long long)now.tv_sec, now.tv_nsec,
                 (long)getpid());
        err = queue_write(dir, name, data, len);
        free(data);
    }
    if (err)
        snprintf(why, size, "cannot write to %s: %s", path, strerror(err));
    close(lock); /* released only now: the request is durable */
    close(dir);
    return err;
}

/* No agent answers: a DEL is queued (and succeeds), or the call fails as it is. */
static int agent_down(const char *msg, const char *details) {
    if (!queued_config)
        return cni_error(CODE_TRY_AGAIN_LATER, msg, details);
    char why[4608], more[5760];
    if (!queue_del(why, sizeof why))
        return 0; /* a DEL's success: no output */
    snprintf(more, sizeof more, "%s; the DEL could not be queued for the agent's next start: %s",
             details, why);
    return cni_error(CODE_TRY_AGAIN_LATER, msg, more);
}

int main(void) {
    size_t len = 0;

    const char *command = getenv("CNI_COMMAND");
    if (command && !strcmp(command, "VERSION")) {
        puts("{\"cniVersion\":\"1.1.0\",\"supportedVersions\":[" SUPPORTED_VERSIONS "]}");
        return 0;
    }

    char *config = read_stdin(&len);
    if (!config)
        return cni_error(CODE_INTERNAL, "cni-agent-shim: cannot read the network configuration "
                                        "from stdin", strerror(errno));
    if (len > MAX_CONFIG)
        return cni_error(CODE_INVALID_CONFIG, "the network configuration is larger than 1048576 bytes",
                         "cni-agent-shim reads at most 1 MiB from stdin");
    if (strlen(config) != len)
        return cni_error(6, "the network configuration contains a NUL byte", "");
    int utf8 = valid_utf8(config);
    for (char **e = environ; utf8 && *e; e++)
        if (forwarded(*e))
            utf8 = valid_utf8(*e);
    if (!utf8)
        return cni_error(CODE_INTERNAL, not_utf8, strerror(EINVAL));

    queue_prepare(command, config);
    const char *path = getenv(SOCKET_ENV);
    if (!path)
        path = SOCKET_PATH;
    if (*path) {
        int status = call_socket(path, config, len);
        if (status != SOCKET_UNREACHABLE)
            return status;
    }
    return call_bus(config);
}
