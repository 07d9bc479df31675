/*
 * toffload_redis.so: toffload's offload in a stock redis-server (7.0), loaded with
 * `--loadmodule`, in two forms whose difference is the reroute:
 *
 *   ACCEL.SYNC key   runs the offload with accel_run on the event loop thread: the
 *                    whole server waits for the device.
 *   ACCEL.ASYNC key  the reroute: submit, suspend the client with Redis's own
 *                    deferred-response primitive (RedisModule_BlockClient), resume it
 *                    when the device's completion fd, added to Redis's event loop,
 *                    says an operation finished. No thread of our own.
 *   ACCEL.STATS      [in flight now, most in flight at once, completed] of ACCEL.ASYNC
 *                    (and of ACCEL.INCR and ACCEL.INCRLOCKED, which share its path).
 *
 * and a read-modify-write across the rerouted offload, for the conflict guard
 * (TOFFLOAD_GUARD; see the ACCEL.INCR section below):
 *
 *   ACCEL.INCR key        reads the key's counter, offloads, writes it back plus one.
 *   ACCEL.INCRLOCKED key  the same under one coarse lock held across the offload.
 *   ACCEL.GET key         the key's counter.
 *   ACCEL.SUM             the sum of all counters (the increments that took effect).
 *   ACCEL.GUARD           [mode, mechanism, pages, faults, conflicts, deferred, released].
 *
 * Both reply with the value at key transformed by the device (AES-128-CTR on every
 * backend, see toffload_accel.h) as a bulk string; the stored value is not changed.
 * Bad arguments, a missing key and backend failures are error replies.
 *
 * The lines between REROUTE BEGIN and REROUTE END are the rerouted path, those
 * between SYNC BEGIN and SYNC END the synchronous one (read_value and the module's
 * setup are shared); the benchmark counts them (tests/results/reroute.md).
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "redismodule.h"
#include "toffload_accel.h"

/* A client is never left waiting on a device that does not answer. */
#define ASYNC_TIMEOUT_MS 10000

static int reply_errno(RedisModuleCtx *ctx, const char *what, long rc) {
    char msg[160];
    snprintf(msg, sizeof msg, "ERR %s failed: %s (errno %ld)", what, strerror((int)-rc), -rc);
    return RedisModule_ReplyWithError(ctx, msg);
}

/* A copy of the string at argv[1] (the device transforms its buffer in place and the
 * stored value must not change), or NULL after an error reply. */
static unsigned char *read_value(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, size_t *len) {
    if (argc != 2) {
        RedisModule_WrongArity(ctx);
        return NULL;
    }
    RedisModuleKey *key = RedisModule_OpenKey(ctx, argv[1], REDISMODULE_READ);
    int type = RedisModule_KeyType(key);
    const char *p = type == REDISMODULE_KEYTYPE_STRING ? RedisModule_StringDMA(key, len, REDISMODULE_READ) : NULL;
    if (!p || *len > INT_MAX) {
        RedisModule_CloseKey(key);
        RedisModule_ReplyWithError(ctx, type == REDISMODULE_KEYTYPE_EMPTY   ? "ERR no such key"
                                        : type != REDISMODULE_KEYTYPE_STRING ? REDISMODULE_ERRORMSG_WRONGTYPE
                                                                             : "ERR value too large to offload");
        return NULL;
    }
    unsigned char *buf = RedisModule_Alloc(*len ? *len : 1);
    memcpy(buf, p, *len);
    RedisModule_CloseKey(key);
    return buf;
}

/* SYNC BEGIN */
static int sync_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    size_t len;
    unsigned char *buf = read_value(ctx, argv, argc, &len);
    if (!buf)
        return REDISMODULE_OK;
    int rc = accel_run(buf, (int)len);
    if (rc < 0)
        reply_errno(ctx, "accel_run", rc);
    else
        RedisModule_ReplyWithStringBuffer(ctx, (const char *)buf, len);
    RedisModule_Free(buf);
    return REDISMODULE_OK;
}
/* SYNC END */

static unsigned long long async_max_inflight, async_completed;

/* REROUTE BEGIN */
struct op {
    RedisModuleBlockedClient *bc;
    long id;
    int status; /* 0 done, or -errno */
    size_t len;
    unsigned char *buf;
    struct op *prev, *next;
};
static struct op *inflight; /* submitted, client still blocked */
static unsigned long long inflight_n;

/* Hands op back to Redis, which calls async_reply (if the client is still there) and
 * then async_free. Only here does an op leave the list, so it is unblocked once. */
static void finish(struct op *op, int status) {
    if (op->prev)
        op->prev->next = op->next;
    else
        inflight = op->next;
    if (op->next)
        op->next->prev = op->prev;
    inflight_n--;
    async_completed++;
    op->status = status;
    accel_release(op->id); /* cancels a pending op: the device stops touching buf */
    RedisModule_UnblockClient(op->bc, op);
}

static void on_completion(int fd, void *user_data, int mask) {
    (void)user_data, (void)mask;
    uint64_t n;
    /* Reset before polling: a completion after the poll signals the fd again. */
    while (read(fd, &n, sizeof n) > 0) {
    }
    for (struct op *op = inflight, *next; op; op = next) {
        next = op->next;
        int r = accel_done(op->id);
        if (r != 0)
            finish(op, r < 0 ? r : 0);
    }
}

static int async_reply(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv, (void)argc;
    struct op *op = RedisModule_GetBlockedClientPrivateData(ctx);
    if (op->status < 0)
        return reply_errno(ctx, "accel_done", op->status);
    return RedisModule_ReplyWithStringBuffer(ctx, (const char *)op->buf, op->len);
}

static void async_free(RedisModuleCtx *ctx, void *privdata) {
    (void)ctx;
    struct op *op = privdata;
    RedisModule_Free(op->buf);
    RedisModule_Free(op);
}

/* The client went away (or timed out) while its op was in flight: cancel the op. */
static void async_abandon(RedisModuleCtx *ctx, RedisModuleBlockedClient *bc) {
    (void)ctx;
    for (struct op *op = inflight; op; op = op->next)
        if (op->bc == bc)
            return finish(op, -ECANCELED);
}

static int async_timeout(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv, (void)argc;
    async_abandon(ctx, RedisModule_GetBlockedClientHandle(ctx));
    return RedisModule_ReplyWithError(ctx, "ERR offload timed out");
}

static int async_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    if (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING)
        return sync_cmd(ctx, argv, argc); /* MULTI or Lua: a blocked client is refused */
    size_t len;
    unsigned char *buf = read_value(ctx, argv, argc, &len);
    if (!buf)
        return REDISMODULE_OK;
    long id = accel_submit(buf, (int)len);
    if (id < 0) {
        RedisModule_Free(buf);
        return reply_errno(ctx, "accel_submit", id);
    }
    struct op *op = RedisModule_Alloc(sizeof *op);
    *op = (struct op){.id = id, .len = len, .buf = buf, .next = inflight};
    op->bc = RedisModule_BlockClient(ctx, async_reply, async_timeout, async_free, ASYNC_TIMEOUT_MS);
    RedisModule_SetDisconnectCallback(op->bc, async_abandon);
    if (inflight)
        inflight->prev = op;
    inflight = op;
    if (++inflight_n > async_max_inflight)
        async_max_inflight = inflight_n;
    return REDISMODULE_OK;
}

/* The device's completion fd joins Redis's own event loop: no thread of our own. */
static int reroute_init(RedisModuleCtx *ctx) {
    int fd = accel_completion_fd();
    if (fd < 0) {
        RedisModule_Log(ctx, "warning", "toffload: the accelerator is unusable: accel_completion_fd: %s",
                        strerror(-fd));
        return REDISMODULE_ERR;
    }
    if (RedisModule_EventLoopAdd(fd, REDISMODULE_EVENTLOOP_READABLE, on_completion, NULL) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    return RedisModule_CreateCommand(ctx, "accel.async", async_cmd, "readonly", 1, 1, 1);
}
/* REROUTE END */

/* ---- ACCEL.INCR: a read-modify-write across the offload, under the guard ---------
 *
 * ACCEL.INCR key reads a counter, offloads (the rerouted form: the client blocked,
 * others served meanwhile) and writes it back plus one. Overlapped, two increments of
 * the same counter can both read the same value: one update is lost. The guard
 * (TOFFLOAD_GUARD, toffload_accel.h) watches the counters: detect counts those
 * conflicts, enforce defers an increment that touches a counter page whose owner is
 * parked at its offload, until the owner's reply is out. ACCEL.INCRLOCKED does the
 * same under one coarse lock held across the offload (the fix without a guard);
 * ACCEL.GET key reads a counter, ACCEL.SUM all of them; ACCEL.GUARD gives the guard's
 * counters.
 *
 * The counters are the module's own page-aligned memory, registered with the guard:
 * one per slot, a slot per key hash (keys sharing a slot share a counter), 64 bytes
 * apart: 64 slots to a page. */
#define INCR_SLOTS 1024
#define SLOT_WORDS 8
#define SLOTS_PER_PAGE (4096 / (SLOT_WORDS * sizeof(uint64_t)))
#define COUNTERS_BYTES ((size_t)INCR_SLOTS * SLOT_WORDS * sizeof(uint64_t))

static volatile uint64_t *counters;
static uint64_t next_token;

enum incr_kind { KIND_INCR, KIND_LOCKED, KIND_GET, KIND_SUM };

struct incr {
    struct op op; /* first: on_completion, finish and async_abandon handle it as an op */
    uint64_t token;
    size_t slot;
    uint64_t old;
    enum incr_kind kind;
    int ended, deferred;
    struct incr *next_deferred;
    unsigned char val[sizeof(uint64_t)];
};

/* Waiting for the coarse lock, or sent back by enforce: retried after every end. */
static struct incr *deferred_head, *deferred_tail;
static struct incr *lock_holder;
static void incr_start(struct incr *in);

static size_t slot_of(RedisModuleString *key) {
    size_t len;
    const unsigned char *p = (const unsigned char *)RedisModule_StringPtrLen(key, &len);
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++)
        h = (h ^ p[i]) * 1099511628211ull;
    return (size_t)(h % INCR_SLOTS);
}

static void defer(struct incr *in) {
    in->deferred = 1;
    in->next_deferred = NULL;
    if (deferred_tail)
        deferred_tail->next_deferred = in;
    else
        deferred_head = in;
    deferred_tail = in;
}

static int undefer(struct incr *in) {
    for (struct incr **pp = &deferred_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next_deferred)
        if (*pp == in) {
            *pp = in->next_deferred;
            if (deferred_tail == in)
                deferred_tail = prev;
            in->deferred = 0;
            return 1;
        }
    return 0;
}

/* Starts the first deferred increment that `wants` what was freed (FIFO): the others
 * would only be sent back again. The list may change under incr_start (an increment
 * that ends at once retries in turn), so the walk stops there. */
static void retry_first(int (*wants)(const struct incr *, size_t), size_t page) {
    for (struct incr **pp = &deferred_head, *prev = NULL; *pp;) {
        struct incr *in = *pp;
        if (!wants(in, page)) {
            prev = in;
            pp = &in->next_deferred;
            continue;
        }
        *pp = in->next_deferred;
        if (deferred_tail == in)
            deferred_tail = prev;
        in->deferred = 0;
        incr_start(in); /* started, ended, or sent back: what was freed is taken */
        return;
    }
}

static int wants_page(const struct incr *in, size_t page) {
    return in->kind == KIND_SUM || (in->kind != KIND_LOCKED && in->slot / SLOTS_PER_PAGE == page);
}

static int wants_lock(const struct incr *in, size_t page) {
    (void)page;
    return in->kind == KIND_LOCKED && !lock_holder;
}

/* Its reply is out (or its client gone): free its pages and the lock, retry who
 * waited for them. */
static void incr_end(struct incr *in) {
    in->ended = 1;
    toffload_guard_end(in->token);
    if (lock_holder == in)
        lock_holder = NULL;
    retry_first(wants_page, in->slot / SLOTS_PER_PAGE);
    retry_first(wants_lock, 0);
}

static void incr_fail(struct incr *in, int status) {
    in->op.status = status;
    incr_end(in);
    RedisModule_UnblockClient(in->op.bc, in);
}

static void incr_start(struct incr *in) {
    if (in->kind == KIND_LOCKED) {
        if (lock_holder)
            return defer(in);
        lock_holder = in;
    }
    sigjmp_buf env;
    if (sigsetjmp(env, 0))
        return defer(in); /* enforce: a parked increment owns the counter's page */
    int rc = toffload_guard_begin(in->token, &env);
    if (rc < 0)
        return incr_fail(in, rc);
    if (in->kind == KIND_SUM) {
        in->old = 0;
        for (size_t i = 0; i < INCR_SLOTS; i++)
            in->old += counters[i * SLOT_WORDS];
    } else {
        in->old = counters[in->slot * SLOT_WORDS]; /* the read */
    }
    if (in->kind == KIND_GET || in->kind == KIND_SUM) {
        incr_end(in);
        RedisModule_UnblockClient(in->op.bc, in);
        return;
    }
    memcpy(in->val, &in->old, sizeof in->val);
    long id = accel_submit(in->val, sizeof in->val);
    if (id < 0)
        return incr_fail(in, (int)id);
    toffload_guard_park(in->token);
    in->op.id = id;
    in->op.next = inflight;
    if (inflight)
        inflight->prev = &in->op;
    inflight = &in->op;
    if (++inflight_n > async_max_inflight)
        async_max_inflight = inflight_n;
}

static int incr_reply(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv, (void)argc;
    struct incr *in = RedisModule_GetBlockedClientPrivateData(ctx);
    if (in->op.status < 0)
        return reply_errno(ctx, in->kind >= KIND_GET ? "guard" : "accel_done", in->op.status);
    if (in->kind >= KIND_GET)
        return RedisModule_ReplyWithLongLong(ctx, (long long)in->old);
    toffload_guard_resume(in->token);
    counters[in->slot * SLOT_WORDS] = in->old + 1; /* the write back */
    incr_end(in);
    return RedisModule_ReplyWithLongLong(ctx, (long long)(in->old + 1));
}

static void incr_free(RedisModuleCtx *ctx, void *privdata) {
    (void)ctx;
    struct incr *in = privdata;
    if (!in->ended)
        incr_end(in); /* its client went away: no write back */
    RedisModule_Free(in);
}

static void incr_abandon(RedisModuleCtx *ctx, RedisModuleBlockedClient *bc) {
    for (struct incr *in = deferred_head; in; in = in->next_deferred)
        if (in->op.bc == bc) {
            undefer(in);
            in->op.status = -ECANCELED;
            in->ended = 1;
            RedisModule_UnblockClient(bc, in);
            return;
        }
    async_abandon(ctx, bc);
}

static int incr_timeout(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv, (void)argc;
    incr_abandon(ctx, RedisModule_GetBlockedClientHandle(ctx));
    return RedisModule_ReplyWithError(ctx, "ERR offload timed out");
}

static int incr_command(RedisModuleCtx *ctx, RedisModuleString **argv, int argc, enum incr_kind kind) {
    if (argc != (kind == KIND_SUM ? 1 : 2))
        return RedisModule_WrongArity(ctx);
    if (RedisModule_GetContextFlags(ctx) & REDISMODULE_CTX_FLAGS_DENY_BLOCKING)
        return RedisModule_ReplyWithError(ctx, "ERR ACCEL.INCR, INCRLOCKED, GET and SUM cannot run in MULTI or scripts");
    struct incr *in = RedisModule_Alloc(sizeof *in);
    *in = (struct incr){.token = ++next_token, .slot = kind == KIND_SUM ? 0 : slot_of(argv[1]), .kind = kind};
    in->op.bc = RedisModule_BlockClient(ctx, incr_reply, incr_timeout, incr_free, ASYNC_TIMEOUT_MS);
    RedisModule_SetDisconnectCallback(in->op.bc, incr_abandon);
    incr_start(in);
    return REDISMODULE_OK;
}

static int incr_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return incr_command(ctx, argv, argc, KIND_INCR);
}

static int incr_locked_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return incr_command(ctx, argv, argc, KIND_LOCKED);
}

static int get_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return incr_command(ctx, argv, argc, KIND_GET);
}

static int sum_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    return incr_command(ctx, argv, argc, KIND_SUM);
}

static int guard_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1)
        return RedisModule_WrongArity(ctx);
    struct toffload_guard_stats s;
    int rc = toffload_guard_stats(&s);
    if (rc < 0)
        return reply_errno(ctx, "toffload_guard_stats", rc);
    RedisModule_ReplyWithArray(ctx, 7);
    static const char *const modes[] = {"off", "detect", "enforce"};
    RedisModule_ReplyWithSimpleString(ctx, s.mode >= 0 && s.mode <= 2 ? modes[s.mode] : "invalid");
    RedisModule_ReplyWithSimpleString(ctx, s.mode == 0 ? "off" : s.mode == 1 && s.uffd_async ? "uffd-async" : "mprotect");
    RedisModule_ReplyWithLongLong(ctx, (long long)s.pages);
    RedisModule_ReplyWithLongLong(ctx, (long long)s.faults);
    RedisModule_ReplyWithLongLong(ctx, (long long)s.conflicts);
    RedisModule_ReplyWithLongLong(ctx, (long long)s.deferred);
    return RedisModule_ReplyWithLongLong(ctx, (long long)s.released);
}

static int incr_init(RedisModuleCtx *ctx) {
    int mode = toffload_guard_mode();
    if (mode < 0) {
        RedisModule_Log(ctx, "warning", "toffload: TOFFLOAD_GUARD must be off, detect or enforce");
        return REDISMODULE_ERR;
    }
    void *p = mmap(NULL, COUNTERS_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return REDISMODULE_ERR;
    counters = p;
    int rc = toffload_guard_register(p, COUNTERS_BYTES);
    if (rc < 0) {
        RedisModule_Log(ctx, "warning", "toffload: toffload_guard_register: %s", strerror(-rc));
        return REDISMODULE_ERR;
    }
    if (RedisModule_CreateCommand(ctx, "accel.incr", incr_cmd, "write", 1, 1, 1) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.incrlocked", incr_locked_cmd, "write", 1, 1, 1) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.get", get_cmd, "readonly", 1, 1, 1) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.sum", sum_cmd, "readonly", 0, 0, 0) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.guard", guard_cmd, "readonly", 0, 0, 0) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    return REDISMODULE_OK;
}

static int stats_cmd(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (argc != 1)
        return RedisModule_WrongArity(ctx);
    RedisModule_ReplyWithArray(ctx, 3);
    RedisModule_ReplyWithLongLong(ctx, (long long)inflight_n);
    RedisModule_ReplyWithLongLong(ctx, (long long)async_max_inflight);
    return RedisModule_ReplyWithLongLong(ctx, (long long)async_completed);
}

int RedisModule_OnLoad(RedisModuleCtx *ctx, RedisModuleString **argv, int argc) {
    (void)argv;
    if (RedisModule_Init(ctx, "toffload", 1, REDISMODULE_APIVER_1) == REDISMODULE_ERR)
        return REDISMODULE_ERR;
    if (argc != 0) {
        RedisModule_Log(ctx, "warning", "toffload: the module takes no arguments (configure it with TOFFLOAD_*)");
        return REDISMODULE_ERR;
    }
    if (reroute_init(ctx) != REDISMODULE_OK || incr_init(ctx) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.sync", sync_cmd, "readonly", 1, 1, 1) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.stats", stats_cmd, "readonly", 0, 0, 0) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    return REDISMODULE_OK;
}
