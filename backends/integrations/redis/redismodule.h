/*
 * The subset of the Redis module API (Redis 7.0) that toffload_redis.c uses,
 * written by hand from the module API reference (https://redis.io/docs/reference/modules/)
 * because Debian's redis-server package ships no redismodule.h.
 *
 * The Redis module API is part of Redis, Copyright (c) Salvatore Sanfilippo and
 * Redis Ltd, distributed under the 3-clause BSD license; the names, signatures and
 * constant values below follow it so that the module is ABI compatible with a stock
 * redis-server 7.0: every function is a pointer that RedisModule_Init fills by name
 * through the server's RedisModule_GetApi, the first word of the load context.
 */
#ifndef TOFFLOAD_REDISMODULE_H
#define TOFFLOAD_REDISMODULE_H

#include <stddef.h>

#define REDISMODULE_OK 0
#define REDISMODULE_ERR 1
#define REDISMODULE_APIVER_1 1

#define REDISMODULE_READ (1 << 0)

#define REDISMODULE_KEYTYPE_EMPTY 0
#define REDISMODULE_KEYTYPE_STRING 1

#define REDISMODULE_EVENTLOOP_READABLE 1

/* MULTI, Lua, or RM_Call from another module: the command must not block. */
#define REDISMODULE_CTX_FLAGS_DENY_BLOCKING (1 << 21)

#define REDISMODULE_ERRORMSG_WRONGTYPE \
    "WRONGTYPE Operation against a key holding the wrong kind of value"

typedef struct RedisModuleCtx RedisModuleCtx;
typedef struct RedisModuleKey RedisModuleKey;
typedef struct RedisModuleString RedisModuleString;
typedef struct RedisModuleBlockedClient RedisModuleBlockedClient;

typedef int (*RedisModuleCmdFunc)(RedisModuleCtx *ctx, RedisModuleString **argv, int argc);
typedef void (*RedisModuleDisconnectFunc)(RedisModuleCtx *ctx, RedisModuleBlockedClient *bc);
typedef void (*RedisModuleEventLoopFunc)(int fd, void *user_data, int mask);

#define REDISMODULE_API_PTR(ret, name, args) static ret(*RedisModule_##name) args

REDISMODULE_API_PTR(int, GetApi, (const char *, void *));
REDISMODULE_API_PTR(int, IsModuleNameBusy, (const char *name));
REDISMODULE_API_PTR(void, SetModuleAttribs, (RedisModuleCtx *ctx, const char *name, int ver, int apiver));
REDISMODULE_API_PTR(int, CreateCommand, (RedisModuleCtx *ctx, const char *name, RedisModuleCmdFunc cmdfunc,
                                         const char *strflags, int firstkey, int lastkey, int keystep));
REDISMODULE_API_PTR(void *, Alloc, (size_t bytes));
REDISMODULE_API_PTR(void, Free, (void *ptr));
REDISMODULE_API_PTR(void, Log, (RedisModuleCtx *ctx, const char *level, const char *fmt, ...));
REDISMODULE_API_PTR(int, WrongArity, (RedisModuleCtx *ctx));
REDISMODULE_API_PTR(int, ReplyWithError, (RedisModuleCtx *ctx, const char *err));
REDISMODULE_API_PTR(int, ReplyWithStringBuffer, (RedisModuleCtx *ctx, const char *buf, size_t len));
REDISMODULE_API_PTR(int, ReplyWithLongLong, (RedisModuleCtx *ctx, long long ll));
REDISMODULE_API_PTR(int, ReplyWithArray, (RedisModuleCtx *ctx, long len));
REDISMODULE_API_PTR(int, ReplyWithSimpleString, (RedisModuleCtx *ctx, const char *msg));
REDISMODULE_API_PTR(const char *, StringPtrLen, (const RedisModuleString *str, size_t *len));
REDISMODULE_API_PTR(RedisModuleKey *, OpenKey, (RedisModuleCtx *ctx, RedisModuleString *keyname, int mode));
REDISMODULE_API_PTR(void, CloseKey, (RedisModuleKey *kp));
REDISMODULE_API_PTR(int, KeyType, (RedisModuleKey *kp));
REDISMODULE_API_PTR(char *, StringDMA, (RedisModuleKey *key, size_t *len, int mode));
REDISMODULE_API_PTR(int, GetContextFlags, (RedisModuleCtx *ctx));
REDISMODULE_API_PTR(RedisModuleBlockedClient *, BlockClient,
                    (RedisModuleCtx *ctx, RedisModuleCmdFunc reply_callback, RedisModuleCmdFunc timeout_callback,
                     void (*free_privdata)(RedisModuleCtx *, void *), long long timeout_ms));
REDISMODULE_API_PTR(int, UnblockClient, (RedisModuleBlockedClient *bc, void *privdata));
REDISMODULE_API_PTR(void *, GetBlockedClientPrivateData, (RedisModuleCtx *ctx));
REDISMODULE_API_PTR(RedisModuleBlockedClient *, GetBlockedClientHandle, (RedisModuleCtx *ctx));
REDISMODULE_API_PTR(void, SetDisconnectCallback, (RedisModuleBlockedClient *bc, RedisModuleDisconnectFunc callback));
REDISMODULE_API_PTR(int, EventLoopAdd, (int fd, int mask, RedisModuleEventLoopFunc func, void *user_data));

#define REDISMODULE_GET_API(name) RedisModule_GetApi("RedisModule_" #name, ((void **)&RedisModule_##name))

/* Fills the pointers above; ERR where the server lacks one (older than 7.0). */
static int RedisModule_Init(RedisModuleCtx *ctx, const char *name, int ver, int apiver) {
    void *getapifuncptr = ((void **)ctx)[0];
    RedisModule_GetApi = (int (*)(const char *, void *))(unsigned long)getapifuncptr;
    /* IsModuleNameBusy is optional, as in the upstream header. */
    REDISMODULE_GET_API(IsModuleNameBusy);
    if (REDISMODULE_GET_API(SetModuleAttribs) || REDISMODULE_GET_API(CreateCommand) ||
        REDISMODULE_GET_API(Alloc) || REDISMODULE_GET_API(Free) || REDISMODULE_GET_API(Log) ||
        REDISMODULE_GET_API(WrongArity) || REDISMODULE_GET_API(ReplyWithError) ||
        REDISMODULE_GET_API(ReplyWithStringBuffer) || REDISMODULE_GET_API(ReplyWithLongLong) ||
        REDISMODULE_GET_API(ReplyWithArray) || REDISMODULE_GET_API(ReplyWithSimpleString) || REDISMODULE_GET_API(StringPtrLen) ||
        REDISMODULE_GET_API(OpenKey) || REDISMODULE_GET_API(CloseKey) || REDISMODULE_GET_API(KeyType) ||
        REDISMODULE_GET_API(StringDMA) || REDISMODULE_GET_API(GetContextFlags) ||
        REDISMODULE_GET_API(BlockClient) || REDISMODULE_GET_API(UnblockClient) ||
        REDISMODULE_GET_API(GetBlockedClientPrivateData) || REDISMODULE_GET_API(GetBlockedClientHandle) ||
        REDISMODULE_GET_API(SetDisconnectCallback) || REDISMODULE_GET_API(EventLoopAdd))
        return REDISMODULE_ERR;
    if (RedisModule_IsModuleNameBusy && RedisModule_IsModuleNameBusy(name))
        return REDISMODULE_ERR;
    RedisModule_SetModuleAttribs(ctx, name, ver, apiver);
    return REDISMODULE_OK;
}

#endif
