/* cubegate-agent: the exec agent that runs inside a sandbox (see PROTOCOL.md).
 *
 * Modes:
 *   --listen-unix PATH   bind+listen on a unix socket, fork per connection
 *   --listen-fd N        same, on an already-listening socket inherited as fd N
 *                        (the namespace backend creates the socket on the host, so
 *                        no host directory has to be visible inside the sandbox)
 *   --serve-fd PATH      open a stream device (virtio-serial port), serve sequentially
 *   --launch [--cgroup PROCS_FILE]... -- ARGV...
 *                        host side helper (not inside the sandbox): setsid, join the
 *                        given cgroups, exec ARGV; so the sandbox never runs unconfined.
 *   --parked FD [--cgroup PROCS_FILE]... --view PATH...
 *                        host side, the namespace backend's launcher: setsid, join the
 *                        cgroups, pivot into a mount namespace of its own that holds only
 *                        the --view paths (build_view()), say 'R' on the SOCK_SEQPACKET
 *                        socket FD, then wait for one claim on it (see parked()): enter
 *                        the netns, attach the claim's mount trees, drop to the sandbox
 *                        uid, exec. All of that ahead of the claim keeps the cgroup
 *                        migration (an RCU grace period on v1) and the copy of the host's
 *                        mount table off the start path.
 *
 * Static, no dependencies beyond libc. Every request is bounded (frame size,
 * exec timeout); malformed input closes the connection, never the agent.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <limits.h>
#include <grp.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define AGENT_VERSION "cubegate-agent 3"
#define MAX_FRAME (16u << 20)
#define MAX_STREAM (16u << 20)
#define CHUNK 65536
#define FIRST_FRAME_TIMEOUT_S 10
#define DRAIN_GRACE_MS 300
#define STDIN_EOF_IDLE_MS 5000    /* serial mode: wait this long (since the last frame) for 'i' */
#define STDIN_EOF_MAX_MS 60000    /* ... and never longer than this in total */
#define REOPEN_MS 50              /* serial mode: port reopen delay while the host is away, */
#define REOPEN_FAST_TRIES 20      /* for this many tries (~1 s: reconnects/restores stay quick), */
#define REOPEN_MAX_MS 1000        /* then doubling up to this (an idle VM must not spin) */

extern char **environ;

static char **base_env;          /* env for execs; replaced by 'V' */
static int serial_mode;          /* --serve-fd: no fork per request, resync after errors */

/* ---------- low level I/O ---------- */

static int read_full(int fd, void *buf, size_t n) {
    char *p = buf;
    while (n > 0) {
        ssize_t r = read(fd, p, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return -1;
        p += r;
        n -= (size_t)r;
    }
    return 0;
}

static int write_full(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n > 0) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && errno == EAGAIN) {  /* fd may be non-blocking: wait */
            struct pollfd pf = {.fd = fd, .events = POLLOUT};
            poll(&pf, 1, 1000);
            continue;
        }
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int send_frame(int fd, char type, const void *data, size_t len) {
    unsigned char hdr[5] = {(unsigned char)type, (unsigned char)(len >> 24), (unsigned char)(len >> 16),
                            (unsigned char)(len >> 8), (unsigned char)len};
    if (write_full(fd, hdr, 5) < 0) return -1;
    return len ? write_full(fd, data, len) : 0;
}

static int send_str(int fd, char type, const char *s) { return send_frame(fd, type, s, strlen(s)); }

/* Skip n bytes (serial mode resync after an oversize frame). */
static void discard(int fd, uint32_t n) {
    char buf[4096];
    while (n > 0) {
        size_t k = n < sizeof buf ? n : sizeof buf;
        if (read_full(fd, buf, k) < 0) return;
        n -= (uint32_t)k;
    }
}

/* Read one frame. Returns 0 ok, -1 eof/io error, -2 oversize (error already sent). */
static int recv_frame(int fd, char *type, char **payload, uint32_t *len) {
    unsigned char hdr[5];
    if (read_full(fd, hdr, 5) < 0) return -1;
    *type = (char)hdr[0];
    *len = ((uint32_t)hdr[1] << 24) | ((uint32_t)hdr[2] << 16) | ((uint32_t)hdr[3] << 8) | hdr[4];
    if (*len > MAX_FRAME) {
        send_str(fd, 'F', "frame too large");
        if (serial_mode) discard(fd, *len);
        return -2;
    }
    *payload = malloc(*len + 1);
    if (!*payload) return -1;
    if (*len && read_full(fd, *payload, *len) < 0) { free(*payload); return -1; }
    (*payload)[*len] = 0;
    return 0;
}

/* Split a payload into NUL-terminated fields. Returns the count found (<= max). */
static int split_fields(char *p, uint32_t len, char **out, int max, uint32_t *consumed) {
    int n = 0;
    uint32_t i = 0;
    while (n < max && i < len) {
        char *end = memchr(p + i, 0, len - i);
        if (!end) break;
        out[n++] = p + i;
        i = (uint32_t)(end - p) + 1;
    }
    if (consumed) *consumed = i;
    return n;
}

static long parse_long(const char *s, int base, int *ok) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, base);
    *ok = (errno == 0 && end != s && *end == 0);
    return v;
}

static int64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static char **dup_env(char **src) {
    size_t n = 0;
    while (src && src[n]) n++;
    char **e = calloc(n + 1, sizeof(char *));
    for (size_t i = 0; e && i < n; i++) e[i] = strdup(src[i]);
    return e;
}

/* ---------- 'V' ---------- */

static void handle_setenv(int fd, char *p, uint32_t len) {
    char **fields = calloc(len / 2 + 2, sizeof(char *));
    if (!fields) { send_str(fd, 'F', "out of memory"); return; }
    int n = split_fields(p, len, fields, (int)(len / 2 + 1), NULL);
    for (int i = 0; i < n; i++) {
        if (!strchr(fields[i], '=')) { free(fields); send_str(fd, 'F', "bad env entry"); return; }
    }
    char **e = calloc((size_t)n + 1, sizeof(char *));
    if (!e) { free(fields); send_str(fd, 'F', "out of memory"); return; }
    for (int i = 0; i < n; i++) e[i] = strdup(fields[i]);
    for (size_t i = 0; base_env && base_env[i]; i++) free(base_env[i]);
    free(base_env);
    base_env = e;
    free(fields);
    send_frame(fd, 'k', NULL, 0);
}

/* ---------- 'W' / 'G' ---------- */

static int mkdirs(const char *path) {  /* mkdir -p of path's parent */
    char tmp[PATH_MAX];
    if (strlen(path) >= sizeof tmp) { errno = ENAMETOOLONG; return -1; }
    strcpy(tmp, path);
    char *slash = strrchr(tmp, '/');
    if (!slash || slash == tmp) return 0;
    *slash = 0;
    for (char *q = tmp + 1; *q; q++) {
        if (*q != '/') continue;
        *q = 0;
        if (mkdir(tmp, 0755) < 0 && errno != EEXIST) return -1;
        *q = '/';
    }
    if (mkdir(tmp, 0755) < 0 && errno != EEXIST) return -1;
    return 0;
}

static void send_errno(int fd, const char *what) {
    char msg[512];
    snprintf(msg, sizeof msg, "%s: %s", what, strerror(errno));
    send_str(fd, 'F', msg);
}

static void handle_write(int fd, char *p, uint32_t len) {
    char *f[2];
    uint32_t used;
    if (split_fields(p, len, f, 2, &used) != 2 || !f[0][0]) { send_str(fd, 'F', "bad write request"); return; }
    int ok;
    long mode = parse_long(f[1], 8, &ok);
    if (!ok || mode < 0 || mode > 07777) { send_str(fd, 'F', "bad mode"); return; }
    if (mkdirs(f[0]) < 0) { send_errno(fd, "mkdir"); return; }
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.cgtmpXXXXXX", f[0]) >= (int)sizeof tmp) { send_str(fd, 'F', "path too long"); return; }
    int out = mkstemp(tmp);
    if (out < 0) { send_errno(fd, "create"); return; }
    if (write_full(out, p + used, len - used) < 0 || fchmod(out, (mode_t)mode) < 0) {
        send_errno(fd, "write"); close(out); unlink(tmp); return;
    }
    close(out);
    if (rename(tmp, f[0]) < 0) { send_errno(fd, "rename"); unlink(tmp); return; }
    send_frame(fd, 'k', NULL, 0);
}

static void handle_read(int fd, char *p, uint32_t len) {
    char *f[2];
    if (split_fields(p, len, f, 2, NULL) != 2) { send_str(fd, 'F', "bad read request"); return; }
    int ok;
    long max = parse_long(f[1], 10, &ok);
    if (!ok || max < 0) { send_str(fd, 'F', "bad max_bytes"); return; }
    if (max > (long)MAX_FRAME) max = MAX_FRAME;
    int in = open(f[0], O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (in < 0) { send_errno(fd, "open"); return; }
    struct stat st;
    if (fstat(in, &st) < 0 || S_ISDIR(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISCHR(st.st_mode)) {
        close(in); send_str(fd, 'F', "not a regular file"); return;
    }
    char *buf = malloc((size_t)max + 1);
    if (!buf) { close(in); send_str(fd, 'F', "out of memory"); return; }
    size_t got = 0;
    while (got < (size_t)max) {
        ssize_t r = read(in, buf + got, (size_t)max - got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { send_errno(fd, "read"); free(buf); close(in); return; }
        if (r == 0) break;
        got += (size_t)r;
    }
    close(in);
    send_frame(fd, 'D', buf, got);
    free(buf);
}

/* ---------- 'E' ---------- */

static char **merge_env(char **extra, int n) {
    size_t nb = 0;
    while (base_env && base_env[nb]) nb++;
    char **e = calloc(nb + (size_t)n + 1, sizeof(char *));
    if (!e) return NULL;
    size_t k = 0;
    for (size_t i = 0; i < nb; i++) {
        size_t klen = strcspn(base_env[i], "=");
        int overridden = 0;
        for (int j = 0; j < n; j++)
            if (strncmp(extra[j], base_env[i], klen) == 0 && extra[j][klen] == '=') overridden = 1;
        if (!overridden) e[k++] = base_env[i];
    }
    for (int j = 0; j < n; j++) e[k++] = extra[j];
    return e;
}

static void set_nonblock(int fd) { fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK); }

static int pidfd_open_(pid_t pid) {
#ifdef SYS_pidfd_open
    return (int)syscall(SYS_pidfd_open, pid, 0);
#else
    errno = ENOSYS;
    return -1;
#endif
}

/* Output pump for one stream: forward up to `cap` bytes (MAX_STREAM for 'E'; no cap for
 * 'e', whose client consumes frames as they come and bounds what it keeps), note truncation. */
struct stream { int fd; char type; size_t sent; int truncated; size_t cap; };

static int pump(int sock, struct stream *s) {
    char buf[CHUNK];
    ssize_t r = read(s->fd, buf, sizeof buf);
    if (r < 0 && (errno == EINTR || errno == EAGAIN)) return 0;
    if (r <= 0) { close(s->fd); s->fd = -1; return 0; }
    size_t keep = (size_t)r;
    if (s->sent + keep > s->cap) { keep = s->cap - s->sent; s->truncated = 1; }
    s->sent += keep;
    if (keep && send_frame(sock, s->type, buf, keep) < 0) return -1;
    return 0;
}

/* Serial mode: the request stream goes on after this exec, so the client's 'i' (stdin EOF)
 * must be consumed before 'X' is sent: a child that exits without reading stdin finishes
 * the exec before that frame arrived, and it would otherwise be read as the next request.
 * Stdin still arriving ('I') is discarded. Bounded: after STDIN_EOF_IDLE_MS without a
 * frame (or STDIN_EOF_MAX_MS in all) 'X' is sent anyway; dispatch() ignores a late 'i'.
 * Returns 0 (go on, send 'X'), -1 (client gone or protocol error: do not answer). */
static int await_stdin_eof(int sock) {
    int64_t start = now_ms(), until = start + STDIN_EOF_IDLE_MS;
    for (;;) {
        int64_t now = now_ms();
        if (until > start + STDIN_EOF_MAX_MS) until = start + STDIN_EOF_MAX_MS;
        if (now >= until) return 0;
        struct pollfd pf = {sock, POLLIN | POLLRDHUP, 0};
        int r = poll(&pf, 1, (int)(until - now));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -1;
        if (r == 0) return 0;
        char t; char *pl; uint32_t l;
        if (recv_frame(sock, &t, &pl, &l) < 0) return -1;
        free(pl);
        if (t == 'i') return 0;
        if (t != 'I') return -1;
        until = now_ms() + STDIN_EOF_IDLE_MS;   /* the client is still sending stdin */
    }
}

static void handle_exec(int sock, char *p, uint32_t len, size_t cap) {
    char *hdr[3];
    uint32_t used;
    int ok;
    if (split_fields(p, len, hdr, 3, &used) != 3) { send_str(sock, 'F', "bad exec request"); return; }
    long timeout_ms = parse_long(hdr[0], 10, &ok);
    if (!ok || timeout_ms <= 0) { send_str(sock, 'F', "bad timeout"); return; }
    long argc = parse_long(hdr[2], 10, &ok);
    if (!ok || argc < 1 || argc > 65536) { send_str(sock, 'F', "bad argc"); return; }
    char **argv = calloc((size_t)argc + 1, sizeof(char *));
    uint32_t u2;
    if (!argv || split_fields(p + used, len - used, argv, (int)argc, &u2) != argc) { send_str(sock, 'F', "bad argv"); return; }
    used += u2;
    char *envc_s;
    uint32_t u3;
    if (split_fields(p + used, len - used, &envc_s, 1, &u3) != 1) { send_str(sock, 'F', "bad envc"); return; }
    used += u3;
    long envc = parse_long(envc_s, 10, &ok);
    if (!ok || envc < 0 || envc > 65536) { send_str(sock, 'F', "bad envc"); return; }
    char **extra = calloc((size_t)envc + 1, sizeof(char *));
    if (!extra || split_fields(p + used, len - used, extra, (int)envc, NULL) != envc) { send_str(sock, 'F', "bad env"); return; }
    char **env = merge_env(extra, (int)envc);
    const char *cwd = hdr[1][0] ? hdr[1] : "/";

    int in[2], out[2], err[2];
    if (pipe2(in, O_CLOEXEC) < 0 || pipe2(out, O_CLOEXEC) < 0 || pipe2(err, O_CLOEXEC) < 0) {
        send_errno(sock, "pipe"); return;
    }
    pid_t pid = fork();
    if (pid < 0) { send_errno(sock, "fork"); return; }
    if (pid == 0) {
        setsid();  /* own session + process group: the timeout kills the whole group */
        signal(SIGPIPE, SIG_DFL);
        signal(SIGCHLD, SIG_DFL);
        sigset_t none;
        sigemptyset(&none);
        sigprocmask(SIG_SETMASK, &none, NULL);
        dup2(in[0], 0); dup2(out[1], 1); dup2(err[1], 2);
        if (chdir(cwd) < 0) { dprintf(2, "cubegate-agent: chdir %s: %s\n", cwd, strerror(errno)); _exit(126); }
        environ = env;
        execvp(argv[0], argv);
        int e = errno;
        dprintf(2, "cubegate-agent: exec %s: %s\n", argv[0], strerror(e));
        _exit(e == ENOENT ? 127 : 126);
    }
    close(in[0]); close(out[1]); close(err[1]);
    char pidmsg[32];
    int pidlen = snprintf(pidmsg, sizeof pidmsg, "%d%c", (int)pid, 0);
    send_frame(sock, 'S', pidmsg, (size_t)pidlen);   /* the pid (= its process group) for 'K' */
    int pfd = pidfd_open_(pid);
    int stdin_fd = in[1];
    set_nonblock(stdin_fd);
    struct stream so = {out[0], 'O', 0, 0, cap}, se = {err[0], 'R', 0, 0, cap};
    set_nonblock(so.fd); set_nonblock(se.fd);

    char *inbuf = NULL;          /* pending stdin frame */
    uint32_t inlen = 0, inoff = 0;
    int client_eof = 0;          /* got 'i' (or client stopped sending) */
    int exited = 0, status = 0, timed_out = 0, lost = 0;
    int64_t deadline = now_ms() + timeout_ms, drain_until = 0;

    for (;;) {
        if (!exited) {
            pid_t w = waitpid(pid, &status, WNOHANG);
            if (w == pid) { exited = 1; drain_until = now_ms() + DRAIN_GRACE_MS; }
        }
        int64_t now = now_ms();
        if (!timed_out && now >= deadline) {
            kill(-pid, SIGKILL);
            kill(pid, SIGKILL);
            timed_out = 1;
            drain_until = now + DRAIN_GRACE_MS;
        }
        if (so.fd < 0 && se.fd < 0 && exited) break;
        if (drain_until && now >= drain_until && exited) break;
        if (lost) break;

        struct pollfd fds[5];
        int n = 0, i_sock = -1, i_in = -1, i_out = -1, i_err = -1, i_pid = -1;
        /* after 'i' the socket is still watched: a client that goes away ends the exec */
        if (!inbuf) { fds[n] = (struct pollfd){sock, POLLIN | POLLRDHUP, 0}; i_sock = n++; }
        if (inbuf && stdin_fd >= 0) { fds[n] = (struct pollfd){stdin_fd, POLLOUT, 0}; i_in = n++; }
        if (so.fd >= 0) { fds[n] = (struct pollfd){so.fd, POLLIN, 0}; i_out = n++; }
        if (se.fd >= 0) { fds[n] = (struct pollfd){se.fd, POLLIN, 0}; i_err = n++; }
        if (!exited && pfd >= 0) { fds[n] = (struct pollfd){pfd, POLLIN, 0}; i_pid = n++; }
        int64_t wake = drain_until ? drain_until : deadline;
        if (!timed_out && deadline < wake) wake = deadline;
        int64_t ms = wake - now;
        if (pfd < 0 && !exited && ms > 20) ms = 20;   /* no pidfd: poll for the exit */
        if (ms < 0) ms = 0;
        if (poll(fds, (nfds_t)n, (int)ms) < 0 && errno != EINTR) break;
        (void)i_pid;
        if (i_sock >= 0 && fds[i_sock].revents) {
            char t; char *pl; uint32_t l;
            int rc = recv_frame(sock, &t, &pl, &l);
            if (rc < 0) { client_eof = 1; lost = 1; }  /* client gone: stop the exec */
            else if (client_eof) { free(pl); lost = 1; }  /* nothing may follow 'i' */
            else if (t == 'I') { if (l) { inbuf = pl; inlen = l; inoff = 0; } else free(pl); }
            else if (t == 'i') { free(pl); client_eof = 1; close(stdin_fd); stdin_fd = -1; }
            else { free(pl); lost = 1; }                 /* protocol error */
        }
        if (i_in >= 0 && fds[i_in].revents) {
            ssize_t w = write(stdin_fd, inbuf + inoff, inlen - inoff);
            if (w > 0) inoff += (uint32_t)w;
            if ((w < 0 && errno != EAGAIN && errno != EINTR) || inoff >= inlen) {
                if (w < 0 && errno == EPIPE) { close(stdin_fd); stdin_fd = -1; }  /* child closed stdin */
                free(inbuf); inbuf = NULL;
            }
        }
        if (stdin_fd < 0 && inbuf) { free(inbuf); inbuf = NULL; }  /* discard stdin nobody reads */
        if (i_out >= 0 && fds[i_out].revents && pump(sock, &so) < 0) lost = 1;
        if (i_err >= 0 && fds[i_err].revents && pump(sock, &se) < 0) lost = 1;
    }
    if (lost || !exited) {
        kill(-pid, SIGKILL);
        kill(pid, SIGKILL);
        if (!exited) { waitpid(pid, &status, 0); exited = 1; }
    }
    if (stdin_fd >= 0) close(stdin_fd);
    if (so.fd >= 0) close(so.fd);
    if (se.fd >= 0) close(se.fd);
    if (pfd >= 0) close(pfd);
    free(inbuf);
    free(argv); free(extra); free(env);   /* the strings live in the caller's payload */
    if (!lost && !client_eof && serial_mode && await_stdin_eof(sock) < 0) lost = 1;
    if (lost) return;   /* client gone (or broke the protocol): nobody to answer */
    if (so.truncated) send_str(sock, 'R', "\n[cubegate-agent: stdout truncated at 16 MiB]\n");
    if (se.truncated) send_str(sock, 'R', "\n[cubegate-agent: stderr truncated at 16 MiB]\n");
    int code;
    if (timed_out) code = 124;
    else if (WIFSIGNALED(status)) code = -WTERMSIG(status);
    else code = WEXITSTATUS(status);
    char x[64];
    int xl = snprintf(x, sizeof x, "%d%c%d%c", code, 0, timed_out, 0);
    send_frame(sock, 'X', x, (size_t)xl);
}

/* ---------- 'K' 'T' 'L' 'M' 'N' 'U' 'A' 'H' (process signals, filesystem) ---------- */

static void handle_signal(int fd, char *p, uint32_t len) {
    char *f[2];
    int ok1, ok2;
    if (split_fields(p, len, f, 2, NULL) != 2) { send_str(fd, 'F', "bad signal request"); return; }
    long pid = parse_long(f[0], 10, &ok1), sig = parse_long(f[1], 10, &ok2);
    if (!ok1 || !ok2 || pid < 2 || pid > INT_MAX || sig < 1 || sig > 64) { send_str(fd, 'F', "bad pid or signal"); return; }
    /* the exec's child leads its own group (setsid): signal all of it, or the lone pid */
    if (kill(-(pid_t)pid, (int)sig) < 0 && kill((pid_t)pid, (int)sig) < 0) { send_errno(fd, "kill"); return; }
    send_frame(fd, 'k', NULL, 0);
}

/* One entry record: name type is_link size mode mtime_s mtime_ns uid gid target (10 fields). */
struct buf { char *p; size_t len, cap; int full; };

static void buf_add(struct buf *b, const char *s, size_t n) {
    if (b->full) return;
    if (b->len + n + 1 > MAX_FRAME) { b->full = 1; return; }
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap * 2 : 65536;
        while (cap < b->len + n + 1) cap *= 2;
        char *q = realloc(b->p, cap);
        if (!q) { b->full = 1; return; }
        b->p = q; b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->p[b->len + n] = 0;
    b->len += n + 1;
}

static void buf_num(struct buf *b, long long v) { char t[32]; buf_add(b, t, (size_t)snprintf(t, sizeof t, "%lld", v)); }

static int add_entry(struct buf *b, const char *name, const char *full) {
    struct stat lst, st;
    if (lstat(full, &lst) < 0) return -1;
    int is_link = S_ISLNK(lst.st_mode);
    int resolved = is_link ? stat(full, &st) == 0 : (st = lst, 1);
    const struct stat *s = resolved ? &st : &lst;
    const char *type = S_ISDIR(s->st_mode) ? "d" : S_ISREG(s->st_mode) ? "f" : (is_link && !resolved) ? "l" : "o";
    char target[PATH_MAX] = "";
    if (is_link) { ssize_t n = readlink(full, target, sizeof target - 1); target[n > 0 ? n : 0] = 0; }
    buf_add(b, name, strlen(name));
    buf_add(b, type, 1);
    buf_add(b, is_link ? "1" : "0", 1);
    buf_num(b, (long long)s->st_size);
    buf_num(b, (long long)(s->st_mode & 07777));
    buf_num(b, (long long)s->st_mtim.tv_sec);
    buf_num(b, (long long)s->st_mtim.tv_nsec);
    buf_num(b, (long long)s->st_uid);
    buf_num(b, (long long)s->st_gid);
    buf_add(b, target, strlen(target));
    return 0;
}

static void handle_stat(int fd, char *p, uint32_t len) {
    char *f[1];
    if (split_fields(p, len, f, 1, NULL) != 1 || !f[0][0]) { send_str(fd, 'F', "bad stat request"); return; }
    struct buf b = {0};
    if (add_entry(&b, f[0], f[0]) < 0) { free(b.p); send_errno(fd, "stat"); return; }
    send_frame(fd, 'D', b.p, b.len);
    free(b.p);
}

/* depth 1: the directory's entries; n: n levels below. Entries named relative to the root. */
static int list_dir(struct buf *b, const char *root, const char *rel, int depth) {
    char dir[PATH_MAX];
    if (snprintf(dir, sizeof dir, "%s%s%s", root, rel[0] ? "/" : "", rel) >= (int)sizeof dir) return 0;
    DIR *d = opendir(dir);
    if (!d) return -1;
    struct dirent *e;
    while ((e = readdir(d)) && !b->full) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char name[PATH_MAX], full[PATH_MAX];
        if (snprintf(name, sizeof name, "%s%s%s", rel, rel[0] ? "/" : "", e->d_name) >= (int)sizeof name) continue;
        if (snprintf(full, sizeof full, "%s/%s", root, name) >= (int)sizeof full) continue;
        if (add_entry(b, name, full) < 0) continue;   /* vanished meanwhile */
        struct stat lst;
        if (depth > 1 && lstat(full, &lst) == 0 && S_ISDIR(lst.st_mode)) list_dir(b, root, name, depth - 1);
    }
    closedir(d);
    return 0;
}

static void handle_list(int fd, char *p, uint32_t len) {
    char *f[2];
    int ok;
    if (split_fields(p, len, f, 2, NULL) != 2 || !f[0][0]) { send_str(fd, 'F', "bad list request"); return; }
    long depth = parse_long(f[1], 10, &ok);
    if (!ok || depth < 1 || depth > 64) { send_str(fd, 'F', "bad depth"); return; }
    struct stat st;
    if (stat(f[0], &st) < 0) { send_errno(fd, "stat"); return; }
    if (!S_ISDIR(st.st_mode)) { send_str(fd, 'F', "not a directory"); return; }
    struct buf b = {0};
    if (list_dir(&b, f[0], "", (int)depth) < 0) { free(b.p); send_errno(fd, "opendir"); return; }
    if (b.full) { free(b.p); send_str(fd, 'F', "listing too large"); return; }
    send_frame(fd, 'D', b.p, b.len);
    free(b.p);
}

static void handle_mkdir(int fd, char *p, uint32_t len) {
    char *f[1];
    if (split_fields(p, len, f, 1, NULL) != 1 || !f[0][0]) { send_str(fd, 'F', "bad mkdir request"); return; }
    struct stat st;
    if (stat(f[0], &st) == 0) {
        if (S_ISDIR(st.st_mode)) { send_str(fd, 'k', "0"); return; }   /* already there */
        errno = EEXIST; send_errno(fd, "mkdir"); return;
    }
    if (mkdirs(f[0]) < 0 || (mkdir(f[0], 0755) < 0 && errno != EEXIST)) { send_errno(fd, "mkdir"); return; }
    send_str(fd, 'k', "1");
}

static void handle_rename(int fd, char *p, uint32_t len) {
    char *f[2];
    if (split_fields(p, len, f, 2, NULL) != 2 || !f[0][0] || !f[1][0]) { send_str(fd, 'F', "bad rename request"); return; }
    if (rename(f[0], f[1]) < 0) { send_errno(fd, "rename"); return; }
    send_frame(fd, 'k', NULL, 0);
}

static int rm_one(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
    (void)st; (void)ftw;
    return (flag == FTW_DP ? rmdir(path) : unlink(path)) < 0 && errno != ENOENT ? -1 : 0;
}

static void handle_remove(int fd, char *p, uint32_t len) {
    char *f[1];
    if (split_fields(p, len, f, 1, NULL) != 1 || !f[0][0]) { send_str(fd, 'F', "bad remove request"); return; }
    struct stat st;
    if (lstat(f[0], &st) < 0) { send_errno(fd, "remove"); return; }
    int rc = S_ISDIR(st.st_mode) ? nftw(f[0], rm_one, 32, FTW_DEPTH | FTW_PHYS) : unlink(f[0]);
    if (rc < 0) { send_errno(fd, "remove"); return; }
    send_frame(fd, 'k', NULL, 0);
}

static void handle_write_at(int fd, char *p, uint32_t len) {
    char *f[2];
    uint32_t used;
    int ok;
    if (split_fields(p, len, f, 2, &used) != 2 || !f[0][0]) { send_str(fd, 'F', "bad write-at request"); return; }
    long long off = strtoll(f[1], NULL, 10);
    (void)ok;
    if (off < 0) { send_str(fd, 'F', "bad offset"); return; }
    int out = open(f[0], O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
    if (out < 0) { send_errno(fd, "open"); return; }
    const char *d = p + used;
    size_t n = len - used;
    while (n > 0) {
        ssize_t w = pwrite(out, d, n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) { send_errno(fd, "write"); close(out); return; }
        d += w; n -= (size_t)w; off += w;
    }
    close(out);
    send_frame(fd, 'k', NULL, 0);
}

static void handle_read_at(int fd, char *p, uint32_t len) {
    char *f[3];
    int ok;
    if (split_fields(p, len, f, 3, NULL) != 3) { send_str(fd, 'F', "bad read-at request"); return; }
    long long off = strtoll(f[1], NULL, 10);
    long max = parse_long(f[2], 10, &ok);
    if (off < 0 || !ok || max < 0) { send_str(fd, 'F', "bad offset or max_bytes"); return; }
    if (max > (long)MAX_FRAME) max = MAX_FRAME;
    int in = open(f[0], O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
    if (in < 0) { send_errno(fd, "open"); return; }
    struct stat st;
    if (fstat(in, &st) < 0 || !S_ISREG(st.st_mode)) { close(in); send_str(fd, 'F', "not a regular file"); return; }
    char *buf = malloc((size_t)max + 1);
    if (!buf) { close(in); send_str(fd, 'F', "out of memory"); return; }
    size_t got = 0;
    while (got < (size_t)max) {
        ssize_t r = pread(in, buf + got, (size_t)max - got, (off_t)(off + (long long)got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) { send_errno(fd, "read"); free(buf); close(in); return; }
        if (r == 0) break;
        got += (size_t)r;
    }
    close(in);
    send_frame(fd, 'D', buf, got);
    free(buf);
}

/* ---------- dispatch ---------- */

/* Returns 0 to keep the connection, -1 to close it. */
static int dispatch(int fd, char type, char *p, uint32_t len) {
    switch (type) {
    case 'P': send_str(fd, 'p', AGENT_VERSION); return 0;
    case 'V': handle_setenv(fd, p, len); return 0;
    case 'E': handle_exec(fd, p, len, MAX_STREAM); return 0;
    case 'e': handle_exec(fd, p, len, SIZE_MAX); return 0;   /* streamed: no lifetime cap (agent 3) */
    case 'W': handle_write(fd, p, len); return 0;
    case 'G': handle_read(fd, p, len); return 0;
    case 'K': handle_signal(fd, p, len); return 0;
    case 'T': handle_stat(fd, p, len); return 0;
    case 'L': handle_list(fd, p, len); return 0;
    case 'M': handle_mkdir(fd, p, len); return 0;
    case 'N': handle_rename(fd, p, len); return 0;
    case 'U': handle_remove(fd, p, len); return 0;
    case 'A': handle_write_at(fd, p, len); return 0;
    case 'H': handle_read_at(fd, p, len); return 0;
    }
    /* Serial mode: stdin frames of an exec that was already answered (it failed early, or
     * its 'i' came after the wait in await_stdin_eof) are not requests: ignore them, an 'F'
     * here would be taken as the answer to the client's next request. */
    if (serial_mode && (type == 'I' || type == 'i')) return 0;
    send_str(fd, 'F', "unknown request");
    return -1;
}

static void reap(int sig) {
    (void)sig;
    int saved = errno;
    while (waitpid(-1, NULL, WNOHANG) > 0) {}
    errno = saved;
}

static int serve_listener(int lfd) {
    struct sigaction sa = {0};
    sa.sa_handler = reap;
    sa.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    sigaction(SIGCHLD, &sa, NULL);
    for (;;) {
        int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
        if (c < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EMFILE || errno == ENFILE || errno == ENOMEM) {
                if (errno != EINTR && errno != ECONNABORTED) usleep(10000);
                continue;
            }
            perror("cubegate-agent: accept");
            return 1;
        }
        /* First frame read here (bounded): ping/set-env are answered in this process so
         * that 'V' changes the env every later exec inherits; the rest forks. */
        struct timeval tv = {FIRST_FRAME_TIMEOUT_S, 0};
        setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
        char t; char *p; uint32_t l;
        if (recv_frame(c, &t, &p, &l) < 0) { close(c); continue; }
        if (t == 'P' || t == 'V' || !strchr("EeWGKTLMNUAH", t)) {
            dispatch(c, t, p, l);
            free(p);
            close(c);
            continue;
        }
        pid_t pid = fork();
        if (pid == 0) {
            close(lfd);
            signal(SIGCHLD, SIG_DFL);
            struct timeval none = {0, 0};
            setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &none, sizeof none);
            dispatch(c, t, p, l);
            _exit(0);
        }
        if (pid < 0) send_errno(c, "fork");
        free(p);
        close(c);
    }
}

/* Delay before the next reopen after `idle` consecutive opens that read nothing. */
static unsigned reopen_delay_ms(unsigned idle) {
    if (idle < REOPEN_FAST_TRIES) return REOPEN_MS;
    unsigned shift = idle - REOPEN_FAST_TRIES + 1;
    if (shift > 16) return REOPEN_MAX_MS;
    unsigned ms = REOPEN_MS << shift;
    return ms < REOPEN_MAX_MS ? ms : REOPEN_MAX_MS;
}

static _Noreturn void serve_stream(const char *path) {
    serial_mode = 1;
    signal(SIGCHLD, SIG_DFL);
    unsigned idle = 0;   /* consecutive opens without a frame: the host side is not connected */
    for (;;) {
        int fd = open(path, O_RDWR | O_CLOEXEC | O_NOCTTY);
        if (fd < 0) { perror("cubegate-agent: open"); sleep(1); continue; }
        for (;;) {
            char t; char *p; uint32_t l;
            int rc = recv_frame(fd, &t, &p, &l);
            if (rc == -1) break;            /* host side closed (a virtio port with no host: at once): reopen */
            idle = 0;                       /* a frame came: the host is there */
            if (rc == -2) continue;
            if (dispatch(fd, t, p, l) < 0) { /* unknown type: payload already consumed, go on */ }
            free(p);
        }
        close(fd);
        /* Back off while nobody is connected: an unconnected port reads EOF immediately,
         * and reopening every 50 ms would double an idle VM's CPU. */
        usleep(reopen_delay_ms(idle) * 1000u);
        if (idle < UINT_MAX) idle++;
    }
}

/* Host side: join a cgroup by writing our own pid to its cgroup.procs. */
static int join_cgroup(const char *procs) {
    int fd = open(procs, O_WRONLY | O_CLOEXEC);
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%d\n", (int)getpid());
    if (fd < 0 || write(fd, pid, (size_t)n) != n) {
        fprintf(stderr, "launch: join cgroup %s: %s\n", procs, strerror(errno));
        if (fd >= 0) close(fd);
        return -1;  /* fail closed: never run outside the limits */
    }
    close(fd);
    return 0;
}

/* Under host memory pressure the kernel must kill sandboxes before the gateway
 * or the daemon; nothing inside can lower this again (no CAP_SYS_RESOURCE). */
static int set_oom_score(void) {
    int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
    if (oom < 0 || write(oom, "500\n", 4) != 4) {
        fprintf(stderr, "launch: oom_score_adj: %s\n", strerror(errno));
        if (oom >= 0) close(oom);
        return -1;
    }
    close(oom);
    return 0;
}

/* setsid, then every "--cgroup PROCS" from argv[*i] on (stops at "--" or the end); each
 * "--view PATH" goes to `view` (none allowed without one). */
static int confine(int argc, char **argv, int *i, int (*view)(char *)) {
    setsid();
    for (; *i < argc && strcmp(argv[*i], "--") != 0; (*i)++) {
        if (*i + 1 < argc && view && strcmp(argv[*i], "--view") == 0) {
            if (view(argv[++*i]) < 0) return -1;
            continue;
        }
        if (strcmp(argv[*i], "--cgroup") != 0 || *i + 1 >= argc) { fprintf(stderr, "launch: bad arguments\n"); return -1; }
        if (join_cgroup(argv[++*i]) < 0) return -1;
    }
    return set_oom_score();
}

static int launch(int argc, char **argv) {
    /* Host side: setsid, join cgroups, exec. */
    int i = 2;
    if (confine(argc, argv, &i, NULL) < 0) return 2;
    if (i + 1 >= argc) { fprintf(stderr, "launch: no command\n"); return 2; }
    execvp(argv[i + 1], argv + i + 1);
    fprintf(stderr, "launch: exec %s: %s\n", argv[i + 1], strerror(errno));
    return 127;
}

#define CLAIM_MAX 65536
#define CLAIM_FDS 16
#define CLAIM_ARGS 4096
#define VIEW_MAX 64
#define VIEW_ROOT "/tmp"        /* where the view is built before the pivot (bwrap's own choice too) */

/* An absolute path without empty, "." or ".." components, not "/" itself. */
static int clean_path(const char *p) {
    if (p[0] != '/' || !p[1] || strlen(p) >= PATH_MAX) return 0;
    for (const char *c = p; *c; ) {
        const char *e = strchr(c + 1, '/');
        size_t n = e ? (size_t)(e - c - 1) : strlen(c + 1);
        if (n == 0 || (n == 1 && c[1] == '.') || (n == 2 && c[1] == '.' && c[2] == '.')) return 0;
        if (!e) break;
        c = e;
    }
    return 1;
}

static int under(const char *p, const char *dir) {
    size_t n = strlen(dir);
    return strncmp(p, dir, n) == 0 && (p[n] == '/' || p[n] == 0);
}

/* Every path clean, none under another (VIEW_MAX at most, static and claimed together). */
static char *view_paths[VIEW_MAX];
static int nview_paths;

static int view_add_path(char *p) {
    if (nview_paths >= VIEW_MAX || !clean_path(p) || strcmp(p, VIEW_ROOT) == 0) { fprintf(stderr, "parked: bad view path %s\n", p); return -1; }
    for (int j = 0; j < nview_paths; j++)
        if (under(p, view_paths[j]) || under(view_paths[j], p)) { fprintf(stderr, "parked: nested view paths %s %s\n", view_paths[j], p); return -1; }
    view_paths[nview_paths++] = p;
    return 0;
}

/* Create the directories of `rel` (relative to dirfd `root`, no symlinks followed) and its
 * last component as a directory (dir), an empty file (a file's mount point) or a symlink. */
static int make_path(int root, const char *rel, int dir, const char *link) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", rel);
    int fd = dup(root);
    char *c = buf;
    for (char *slash; fd >= 0 && (slash = strchr(c, '/')); c = slash + 1) {
        *slash = 0;
        if (mkdirat(fd, c, 0755) < 0 && errno != EEXIST) { close(fd); return -1; }
        int next = openat(fd, c, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        close(fd);
        fd = next;
    }
    if (fd < 0) return -1;
    int rc;
    if (link) rc = symlinkat(link, fd, c);
    else if (dir) rc = mkdirat(fd, c, 0755);
    else {
        rc = openat(fd, c, O_CREAT | O_EXCL | O_WRONLY | O_NOFOLLOW | O_CLOEXEC, 0444);
        if (rc >= 0) rc = close(rc);
    }
    close(fd);
    return rc;
}

/* Attach a detached mount tree (open_tree(OPEN_TREE_CLONE)) at `path` under dirfd `root`
 * (whose path is `prefix`). */
static int attach_tree(int root, const char *prefix, const char *path, int tree) {
    struct stat st;
    char target[PATH_MAX];
    if (fstat(tree, &st) < 0 || snprintf(target, sizeof target, "%s%s", prefix, path) >= (int)sizeof target ||
        make_path(root, path + 1, S_ISDIR(st.st_mode), NULL) < 0 ||
        move_mount(tree, "", AT_FDCWD, target, MOVE_MOUNT_F_EMPTY_PATH) < 0) {
        fprintf(stderr, "parked: view %s: %s\n", path, strerror(errno));
        return -1;
    }
    return 0;
}

/* At park time: replace our mount namespace by a private one whose root is a small tmpfs
 * holding only the static view (host paths: each a recursive bind of the host's, or the
 * same symlink) and an empty VIEW_ROOT. bwrap re-reads /proc/self/mountinfo once per mount
 * it makes: this keeps that table short and the same whatever the host has mounted (every
 * other sandbox's netns and root), keeps all that out of its sight, and takes the copy of
 * the host's table off the start path. Fails closed: the caller parks only on 0. */
static int build_view(void) {
    int tree[VIEW_MAX];
    static char link[VIEW_MAX][PATH_MAX];
    struct stat st;
    if (nview_paths < 1) { fprintf(stderr, "parked: no view\n"); return -1; }
    /* private before anything changes: nothing done here may propagate to the host */
    if (unshare(CLONE_NEWNS) < 0 || mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0) {
        fprintf(stderr, "parked: private mount namespace: %s\n", strerror(errno));
        return -1;
    }
    /* sources first (lstat, clones): VIEW_ROOT's tmpfs would hide those under it */
    for (int k = 0; k < nview_paths; k++) {
        tree[k] = -1;
        link[k][0] = 0;
        const char *p = view_paths[k];
        if (lstat(p, &st) < 0) { fprintf(stderr, "parked: view %s: %s\n", p, strerror(errno)); return -1; }
        if (S_ISLNK(st.st_mode)) {
            ssize_t n = readlink(p, link[k], PATH_MAX - 1);
            if (n <= 0) { fprintf(stderr, "parked: view %s: %s\n", p, strerror(errno)); return -1; }
            link[k][n] = 0;
            continue;
        }
        tree[k] = open_tree(AT_FDCWD, p, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | AT_RECURSIVE | AT_SYMLINK_NOFOLLOW);
        if (tree[k] < 0) { fprintf(stderr, "parked: view %s: %s\n", p, strerror(errno)); return -1; }
    }
    if (mount("cubegate-view", VIEW_ROOT, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=64k,nr_inodes=1024") < 0) {
        fprintf(stderr, "parked: view root: %s\n", strerror(errno));
        return -1;
    }
    int root = open(VIEW_ROOT, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (root < 0 || make_path(root, VIEW_ROOT + 1, 1, NULL) < 0) { perror("parked: view root"); return -1; }
    for (int k = 0; k < nview_paths; k++) {
        if (tree[k] >= 0 ? attach_tree(root, VIEW_ROOT, view_paths[k], tree[k]) < 0
                         : make_path(root, view_paths[k] + 1, 0, link[k]) < 0) {
            fprintf(stderr, "parked: view %s: %s\n", view_paths[k], strerror(errno));
            return -1;
        }
        if (tree[k] >= 0) close(tree[k]);
    }
    close(root);
    /* the old root (all of the host's mounts) is stacked under the new one, then detached */
    if (chdir(VIEW_ROOT) < 0 || syscall(SYS_pivot_root, ".", ".") < 0 || umount2(".", MNT_DETACH) < 0 || chdir("/") < 0) {
        fprintf(stderr, "parked: pivot to the view: %s\n", strerror(errno));
        return -1;
    }
    return 0;
}

/* Receive one claim: "UID\0NTREES\0PATH1\0...PATHn\0ARGV0\0ARGV1\0..." with fds: the netns
 * to enter, then one detached mount tree per PATH (what the daemon cloned for this start,
 * attached there in the view), then the command's (up to CLAIM_FDS in all).
 * Returns the payload length (0: EOF), -1 on error; fds[] / *nfds filled. */
static ssize_t recv_claim(int sock, char *buf, size_t cap, int *fds, int *nfds) {
    union { char b[CMSG_SPACE(CLAIM_FDS * sizeof(int))]; struct cmsghdr align; } ctl;
    struct iovec iov = {.iov_base = buf, .iov_len = cap};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.b, .msg_controllen = sizeof ctl.b};
    ssize_t n;
    do n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC); while (n < 0 && errno == EINTR);
    *nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        int k = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
        for (int j = 0; j < k && *nfds < CLAIM_FDS; j++) memcpy(&fds[(*nfds)++], CMSG_DATA(c) + j * sizeof(int), sizeof(int));
    }
    if (n > 0 && (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) { fprintf(stderr, "parked: claim too large\n"); return -1; }
    return n;
}

static int parked(int argc, char **argv) {
    /* A launcher of the namespace backend. Confined first (cgroups named by a one-use token;
     * the daemon renames them to the sandbox's and sets its limits before it claims), then
     * in its view (build_view), then 'R', then one claim. It runs at most one command: EOF
     * (the daemon went away or discarded it) or anything malformed ends it with nothing run. */
    int ok;
    long sock = argc >= 3 ? parse_long(argv[2], 10, &ok) : (ok = 0);
    if (!ok || sock < 3 || sock > 1023) { fprintf(stderr, "parked: bad fd\n"); return 2; }
    fcntl((int)sock, F_SETFD, FD_CLOEXEC);
    int i = 3;
    if (confine(argc, argv, &i, view_add_path) < 0 || i != argc || build_view() < 0) return 2;
    /* parked now (the pool counts it ready); a daemon that claimed at once may have closed its end */
    if (send((int)sock, "R", 1, MSG_NOSIGNAL) != 1) {}
    static char buf[CLAIM_MAX];
    int fds[CLAIM_FDS], nfds;
    ssize_t n = recv_claim((int)sock, buf, sizeof buf - 1, fds, &nfds);
    if (n < 0) { perror("parked: claim"); return 2; }
    if (n == 0) return 0;       /* the daemon went away or discarded us: nothing to run */
    if (buf[n - 1] != 0) { fprintf(stderr, "parked: malformed claim\n"); return 2; }
    static char *f[CLAIM_ARGS + 1];
    int nf = split_fields(buf, (uint32_t)n, f, CLAIM_ARGS, NULL);
    long uid = nf >= 3 ? parse_long(f[0], 10, &ok) : (ok = 0);
    if (!ok || uid <= 0 || uid > 0x7fffffff) { fprintf(stderr, "parked: malformed claim\n"); return 2; }
    long ntrees = parse_long(f[1], 10, &ok);
    if (!ok || ntrees < 0 || ntrees > VIEW_MAX || 2 + ntrees >= nf || 1 + ntrees > nfds) {
        fprintf(stderr, "parked: malformed claim\n");
        return 2;
    }
    char **cmd = f + 2 + ntrees;
    f[nf] = NULL;
    if (setns(fds[0], CLONE_NEWNET) < 0) { fprintf(stderr, "parked: netns: %s\n", strerror(errno)); return 2; }
    close(fds[0]);
    int root = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    for (int k = 0; k < ntrees; k++) {
        if (root < 0 || view_add_path(f[2 + k]) < 0 || attach_tree(root, "", f[2 + k], fds[1 + k]) < 0) return 2;
        close(fds[1 + k]);
    }
    close(root);
    /* The command's fds are 3, 4, ... in the order sent: move them above that range first. */
    int *mine = fds + 1 + ntrees, nmine = nfds - 1 - (int)ntrees, tmp[CLAIM_FDS];
    for (int k = 0; k < nmine; k++) {
        tmp[k] = fcntl(mine[k], F_DUPFD_CLOEXEC, 3 + nmine);
        if (tmp[k] < 0) { perror("parked: dup"); return 2; }
        close(mine[k]);
    }
    for (int k = 0; k < nmine; k++) {
        if (dup2(tmp[k], 3 + k) < 0) { perror("parked: dup2"); return 2; }
        close(tmp[k]);
    }
    /* host root ends here: no supplementary groups, the sandbox's uid and gid, for good */
    if (setgroups(0, NULL) < 0 || setresgid((gid_t)uid, (gid_t)uid, (gid_t)uid) < 0 ||
        setresuid((uid_t)uid, (uid_t)uid, (uid_t)uid) < 0 || getuid() != (uid_t)uid || geteuid() != (uid_t)uid) {
        perror("parked: drop to the sandbox uid");
        return 2;
    }
    execv(cmd[0], cmd);
    fprintf(stderr, "parked: exec %s: %s\n", cmd[0], strerror(errno));
    return 127;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    if (argc >= 2 && strcmp(argv[1], "--launch") == 0) return launch(argc, argv);
    if (argc >= 2 && strcmp(argv[1], "--parked") == 0) return parked(argc, argv);
    base_env = dup_env(environ);
    /* Not dumpable: the sandbox's own processes (same uid) cannot pidfd_getfd/ptrace-read the
     * agent to take over its control socket. execve of a child resets this for the child. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    if (argc == 2 && strcmp(argv[1], "--version") == 0) { puts(AGENT_VERSION); return 0; }
    if (argc == 3 && strcmp(argv[1], "--listen-fd") == 0) {
        int ok;
        long fd = parse_long(argv[2], 10, &ok);
        if (!ok || fd < 0) { fprintf(stderr, "bad fd\n"); return 2; }
        fcntl((int)fd, F_SETFD, FD_CLOEXEC);
        if (chdir("/") < 0) {}
        return serve_listener((int)fd);
    }
    if (argc == 3 && strcmp(argv[1], "--listen-unix") == 0) {
        struct sockaddr_un sa = {.sun_family = AF_UNIX};
        if (strlen(argv[2]) >= sizeof sa.sun_path) { fprintf(stderr, "path too long\n"); return 2; }
        strcpy(sa.sun_path, argv[2]);
        unlink(argv[2]);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd < 0 || bind(fd, (struct sockaddr *)&sa, sizeof sa) < 0 || listen(fd, 128) < 0) {
            perror("cubegate-agent: listen");
            return 1;
        }
        return serve_listener(fd);
    }
    if (argc == 3 && strcmp(argv[1], "--serve-fd") == 0) serve_stream(argv[2]);
    fprintf(stderr, "usage: %s --listen-unix PATH | --listen-fd N | --serve-fd PATH | --version\n"
                    "       %s --launch [--cgroup PROCS_FILE]... -- ARGV...\n"
                    "       %s --parked FD [--cgroup PROCS_FILE]... --view PATH...\n", argv[0], argv[0], argv[0]);
    return 2;
}
