/* cni-agent-shim: a CNI plugin that forwards its call to cni-agent over D-Bus.
 *
 * A runtime (containerd, CRI-O, podman, nerdctl, cnitool) execs it like any
 * plugin. It sends the CNI_* environment and stdin untouched to the agent's
 * CNICall method and prints what comes back: the agent decides everything, so
 * the shim holds no CNI logic and cannot disagree with the agent.
 *
 * Why C on sd-bus and not Python: the shim runs once per CNI call, and
 * containerd runs STATUS on every CRI Status query. Python with dbus-fast
 * costs 110-200 ms to start; this costs about a millisecond. libsystemd is on
 * every systemd node, so the binary needs nothing new there.
 *
 * Errors of the shim itself (no bus, no agent, access refused, timeout) are
 * printed as CNI errors: 11 (try again later) when the agent is not there or
 * went away mid-call (a runtime retries), 7 for a configuration too large to
 * send, 999 otherwise, always with a message a person can act on and the bus
 * error and errno in "details".
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <systemd/sd-bus.h>

#define AGENT_NAME "org.cniagent.Agent1"
#define AGENT_PATH "/org/cniagent/Agent1"
#define AGENT_IFACE "org.cniagent.Agent1"
/* The agent bounds every verb itself, and the runtime bounds the shim; this is
 * a backstop for callers that do not (podman, cnitool) against an agent that
 * never answers. Derived from the agent's default timeouts (README,
 * "Timeouts"): an ADD, the longest call, waits for readiness (timeouts.ready,
 * 30 s) and for recovery and the lock (timeouts.lock, 60 s), runs its chain
 * (timeouts.add, 120 s for the whole chain) and, if that fails, the rollback
 * (timeouts.del, 60 s): 270 s, + 30 s margin. When it fires, the agent still
 * finishes or rolls back the ADD, as when a runtime kills the shim, and the
 * runtime's DEL removes what is left. */
#define CALL_TIMEOUT_SEC 300ULL
#define CALL_TIMEOUT_USEC (CALL_TIMEOUT_SEC * 1000000ULL)
/* The agent refuses configurations over 1 MiB (bytes); one byte more than
 * that is read so that a longer one is refused here, whole, with the same
 * code, and never cut in the middle of a UTF-8 sequence and sent. */
#define MAX_CONFIG (1024 * 1024)
#define MAX_STDIN (MAX_CONFIG + 1)

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

static int is(const char *name, const char *which) {
    return !strcmp(name, which);
}

/* A failed call, as the CNI error a runtime acts on. "details" carries the
 * bus error and the errno, so that the runtime's log says what happened. */
static int call_failed(const sd_bus_error *error, int r) {
    const char *name = error && error->name ? error->name : "";
    const char *message = error && error->message ? error->message : strerror(-r);
    char msg[1024], details[1024];

    snprintf(details, sizeof details, "%s%s%s (%s)", name, *name ? ": " : "", message, strerror(-r));
    if (is(name, SD_BUS_ERROR_SERVICE_UNKNOWN) || is(name, SD_BUS_ERROR_NAME_HAS_NO_OWNER)
        || is(name, "org.freedesktop.systemd1.NoSuchUnit")
        || is(name, "org.freedesktop.DBus.Error.Spawn.ChildExited")
        || is(name, "org.freedesktop.DBus.Error.Spawn.ServiceNotFound")
        || is(name, "org.freedesktop.DBus.Error.Spawn.Failed")
        /* Activation that did not finish in time: the agent is (re)starting. */
        || is(name, "org.freedesktop.DBus.Error.TimedOut"))
        return cni_error(CODE_TRY_AGAIN_LATER, not_running, details);
    if (is(name, "org.freedesktop.systemd1.UnitMasked"))
        return cni_error(CODE_TRY_AGAIN_LATER, masked, details);
    if (is(name, AGENT_IFACE ".Error.NotReady") || is(name, AGENT_IFACE ".Error.Busy")
        || is(name, AGENT_IFACE ".Error.ShuttingDown"))
        return cni_error(CODE_TRY_AGAIN_LATER, message, "");
    if (is(name, SD_BUS_ERROR_ACCESS_DENIED) || is(name, AGENT_IFACE ".Error.AccessDenied")) {
        snprintf(msg, sizeof msg, "access denied by cni-agent: run the runtime as root or as a "
                                  "member of the cni-agent group (%s)", message);
        return cni_error(CODE_INTERNAL, msg, "");
    }
    /* NoReply comes from the bus: the agent exited, crashed or restarted with
     * the call in flight. Whatever it had started it finishes or rolls back
     * on its next start, so the runtime should simply try again. */
    if (is(name, SD_BUS_ERROR_NO_REPLY) || is(name, SD_BUS_ERROR_DISCONNECTED)) {
        snprintf(msg, sizeof msg, "cni-agent went away during the call: see journalctl -u "
                                  "cni-agent");
        return cni_error(CODE_TRY_AGAIN_LATER, msg, details);
    }
    /* Our own backstop (CALL_TIMEOUT_SEC): sd-bus names it Timeout. */
    if (is(name, SD_BUS_ERROR_TIMEOUT) || r == -ETIMEDOUT) {
        snprintf(msg, sizeof msg, "cni-agent did not answer in time: see journalctl -u cni-agent");
        return cni_error(CODE_INTERNAL, msg, details);
    }
    snprintf(msg, sizeof msg, "cni-agent refused the call: %s%s%s", message, *name ? ": " : "", name);
    return cni_error(CODE_INTERNAL, msg, "");
}

int main(void) {
    sd_bus *bus = NULL;
    sd_bus_message *call = NULL, *reply = NULL;
    sd_bus_error error = SD_BUS_ERROR_NULL;
    size_t len = 0;
    uint32_t status = 0;
    const char *output = NULL;
    int r;

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

    /* sd_bus_open_system honours DBUS_SYSTEM_BUS_ADDRESS, as every D-Bus client does. */
    r = sd_bus_open_system(&bus);
    if (r < 0) {
        char details[512];
        const char *address = getenv("DBUS_SYSTEM_BUS_ADDRESS");
        snprintf(details, sizeof details, "cannot connect to the system bus at %s: %s",
                 address && *address ? address : "unix:path=/run/dbus/system_bus_socket",
                 strerror(-r));
        return cni_error(CODE_TRY_AGAIN_LATER, not_running, details);
    }

    r = sd_bus_message_new_method_call(bus, &call, AGENT_NAME, AGENT_PATH, AGENT_IFACE, "CNICall");
    if (r >= 0)
        r = sd_bus_message_open_container(call, 'a', "{ss}");
    for (char **e = environ; r >= 0 && *e; e++) {
        const char *eq = strchr(*e, '=');
        if (strncmp(*e, "CNI_", 4) || !eq)
            continue;
        char *key = strndup(*e, (size_t)(eq - *e));
        if (!key) {
            r = -ENOMEM;
            break;
        }
        r = sd_bus_message_append(call, "{ss}", key, eq + 1);
        free(key);
    }
    if (r >= 0)
        r = sd_bus_message_close_container(call);
    if (r >= 0)
        r = sd_bus_message_append(call, "s", config);
    if (r < 0) {
        /* Only invalid UTF-8 gets here in practice: D-Bus strings must be UTF-8. */
        return cni_error(CODE_INTERNAL, "cni-agent-shim: cannot send the call (the environment "
                                        "or configuration is not valid UTF-8?)", strerror(-r));
    }

    r = sd_bus_call(bus, call, CALL_TIMEOUT_USEC, &error, &reply);
    if (r < 0)
        return call_failed(&error, r);
    r = sd_bus_message_read(reply, "us", &status, &output);
    if (r < 0)
        return cni_error(CODE_INTERNAL, "cni-agent-shim: the agent's answer is not (us)", strerror(-r));
    fputs(output, stdout);
    if (*output && output[strlen(output) - 1] != '\n')
        putchar('\n');
    fflush(stdout);
    /* Exiting frees everything: no cleanup needed on the way out. */
    return status > 255 ? 1 : (int)status;
}
