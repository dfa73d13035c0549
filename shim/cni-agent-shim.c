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
 * printed as CNI errors: 11 (try again later) when the agent is not there,
 * 999 otherwise, always with a message a person can act on.
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
/* The agent refuses configurations over 1 MiB with a clear error; read a
 * little more so that it, not a truncation here, says so. */
#define MAX_STDIN (1024 * 1024 + 1)

/* VERSION is answered here, without the agent: it is about this binary, and
 * runtimes ask it while validating configs, agent running or not. The list is
 * the agent's too (SHIM_VERSIONS in cni_agent/cni/config.py; a test
 * compares them). */
#define SUPPORTED_VERSIONS "\"0.3.0\",\"0.3.1\",\"0.4.0\",\"1.0.0\",\"1.1.0\""

#define CODE_TRY_AGAIN_LATER 11
#define CODE_INTERNAL 999

extern char **environ;

static const char *not_running = "cni-agent is not running: systemctl start cni-agent";

/* A JSON string, quoted and escaped. */
static void json_string(const char *text) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)text; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
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

/* A failed call, as the CNI error a runtime acts on. */
static int call_failed(const sd_bus_error *error, int r) {
    const char *name = error && error->name ? error->name : "";
    const char *message = error && error->message ? error->message : strerror(-r);
    char msg[1024];

    if (!strcmp(name, SD_BUS_ERROR_SERVICE_UNKNOWN) || !strcmp(name, SD_BUS_ERROR_NAME_HAS_NO_OWNER)
        || !strcmp(name, "org.freedesktop.systemd1.NoSuchUnit")
        || !strcmp(name, "org.freedesktop.DBus.Error.Spawn.ChildExited")
        || !strcmp(name, "org.freedesktop.DBus.Error.Spawn.ServiceNotFound"))
        return cni_error(CODE_TRY_AGAIN_LATER, not_running, message);
    if (!strcmp(name, AGENT_IFACE ".Error.NotReady") || !strcmp(name, AGENT_IFACE ".Error.Busy")
        || !strcmp(name, AGENT_IFACE ".Error.ShuttingDown"))
        return cni_error(CODE_TRY_AGAIN_LATER, message, "");
    if (!strcmp(name, SD_BUS_ERROR_ACCESS_DENIED) || !strcmp(name, AGENT_IFACE ".Error.AccessDenied")) {
        snprintf(msg, sizeof msg, "access denied by cni-agent: run the runtime as root or as a "
                                  "member of the cni-agent group (%s)", message);
        return cni_error(CODE_INTERNAL, msg, "");
    }
    if (!strcmp(name, SD_BUS_ERROR_NO_REPLY) || !strcmp(name, SD_BUS_ERROR_TIMEOUT) || r == -ETIMEDOUT) {
        snprintf(msg, sizeof msg, "cni-agent did not answer in time: see journalctl -u cni-agent (%s)",
                 message);
        return cni_error(CODE_INTERNAL, msg, "");
    }
    if (!strcmp(name, SD_BUS_ERROR_DISCONNECTED)) {
        snprintf(msg, sizeof msg, "cni-agent went away during the call: see journalctl -u "
                                  "cni-agent (%s)", message);
        return cni_error(CODE_TRY_AGAIN_LATER, msg, "");
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
    if (strlen(config) != len)
        return cni_error(6, "the network configuration contains a NUL byte", "");

    /* sd_bus_open_system honours DBUS_SYSTEM_BUS_ADDRESS, as every D-Bus client does. */
    r = sd_bus_open_system(&bus);
    if (r < 0)
        return cni_error(CODE_TRY_AGAIN_LATER, not_running, "cannot connect to the system bus");

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
