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
 *   ACCEL.STATS      [in flight now, most in flight at once, completed] of ACCEL.ASYNC.
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
    if (reroute_init(ctx) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.sync", sync_cmd, "readonly", 1, 1, 1) != REDISMODULE_OK ||
        RedisModule_CreateCommand(ctx, "accel.stats", stats_cmd, "readonly", 0, 0, 0) != REDISMODULE_OK)
        return REDISMODULE_ERR;
    return REDISMODULE_OK;
}
