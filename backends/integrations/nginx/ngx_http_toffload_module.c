/*
 * ngx_http_toffload_module: toffload's offload in Debian's stock nginx, as a dynamic
 * module, in two forms.
 *
 *   location /sync  { toffload_accel sync; }   accel_run in the content handler: the
 *                                              worker's event loop waits for the device
 *   location /async { toffload_accel async; }  the reroute: accel_submit, the request
 *                                              suspended (NGX_DONE); the device's
 *                                              completion fd is a connection in the
 *                                              worker's own event loop, whose read
 *                                              handler polls accel_done and finishes
 *                                              the requests whose operation is done
 *   location /stats { toffload_accel stats; }  "in-flight-now most-at-once finished"
 *
 * and a read-modify-write across the rerouted offload, for the conflict guard
 * (TOFFLOAD_GUARD; see the INCR section below), on this worker's counters:
 *
 *   toffload_accel incr;        GET ?k=KEY: reads KEY's counter, offloads, writes it
 *                               back plus one; answers the new value
 *   toffload_accel incrlocked;  the same under one coarse lock held across the offload
 *   toffload_accel get;         GET ?k=KEY: the counter
 *   toffload_accel sum;         every counter added up
 *   toffload_accel guard;       "mode mechanism pages faults conflicts deferred released"
 *
 * A request `GET /LOCATION?n=BYTES` is answered with the device's transformation of a
 * fixed payload of BYTES bytes (byte i = i*7 mod 256). Errors are HTTP errors (400 bad
 * n, 405 not GET, 500 a device error), never a crash of the worker. The device is set
 * by the TOFFLOAD_* variables of nginx's environment (`env TOFFLOAD_EMU_LAT_US;` in
 * nginx.conf keeps one for the workers); it is first touched in a worker, never in
 * the master, whose threads would not survive the fork.
 */
#include <ngx_config.h>
#include <ngx_core.h>
#include <ngx_http.h>

#include <setjmp.h>
#include <sys/mman.h>

#include "toffload_accel.h"

#define TOFFLOAD_MAX_BYTES (1 << 20)

typedef enum {
    FORM_UNSET = 0,
    FORM_SYNC,
    FORM_ASYNC,
    FORM_STATS,
    FORM_INCR,
    FORM_INCRLOCKED,
    FORM_GET,
    FORM_SUM,
    FORM_GUARD,
} toffload_form_t;

typedef struct {
    ngx_uint_t form;
} toffload_loc_conf_t;

static char *toffload_accel(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static void *toffload_create_loc_conf(ngx_conf_t *cf);
static char *toffload_merge_loc_conf(ngx_conf_t *cf, void *parent, void *child);
static ngx_int_t toffload_init_process(ngx_cycle_t *cycle);
static ngx_int_t handle_incr(ngx_http_request_t *r, ngx_uint_t form);
static ngx_int_t handle_guard(ngx_http_request_t *r);
static void incr_poll(void);
static void toffload_exit_process(ngx_cycle_t *cycle);

static ngx_command_t toffload_commands[] = {
    {ngx_string("toffload_accel"), NGX_HTTP_LOC_CONF | NGX_CONF_TAKE1, toffload_accel,
     NGX_HTTP_LOC_CONF_OFFSET, 0, NULL},
    ngx_null_command,
};

static ngx_http_module_t toffload_module_ctx = {
    NULL, NULL, NULL, NULL, NULL, NULL, toffload_create_loc_conf, toffload_merge_loc_conf,
};

ngx_module_t ngx_http_toffload_module = {
    NGX_MODULE_V1,
    &toffload_module_ctx,
    toffload_commands,
    NGX_HTTP_MODULE,
    NULL,
    NULL,
    toffload_init_process,
    NULL,
    NULL,
    toffload_exit_process,
    NULL,
    NGX_MODULE_V1_PADDING,
};

/* ---- shared: the request's size, the payload, the response ------------------------ */

/* BYTES from ?n= (default 1024), or -1 when malformed or out of range. */
static ngx_int_t request_size(ngx_http_request_t *r) {
    ngx_str_t v;
    if (ngx_http_arg(r, (u_char *)"n", 1, &v) != NGX_OK)
        return 1024;
    ngx_int_t n = ngx_atoi(v.data, v.len);
    return (n >= 1 && n <= TOFFLOAD_MAX_BYTES) ? n : -1;
}

static ngx_buf_t *payload(ngx_http_request_t *r, size_t n) {
    ngx_buf_t *b = ngx_create_temp_buf(r->pool, n);
    if (b == NULL)
        return NULL;
    for (size_t i = 0; i < n; i++)
        b->pos[i] = (u_char)(i * 7);
    b->last = b->pos + n;
    return b;
}

static ngx_int_t respond(ngx_http_request_t *r, ngx_buf_t *b, ngx_str_t type) {
    r->headers_out.status = NGX_HTTP_OK;
    r->headers_out.content_length_n = b->last - b->pos;
    r->headers_out.content_type = type;
    r->headers_out.content_type_len = type.len;
    ngx_int_t rc = ngx_http_send_header(r);
    if (rc == NGX_ERROR || rc > NGX_OK || r->header_only)
        return rc;
    b->last_buf = (r == r->main) ? 1 : 0;
    b->last_in_chain = 1;
    ngx_chain_t out = {b, NULL};
    return ngx_http_output_filter(r, &out);
}

static ngx_int_t device_error(ngx_http_request_t *r, const char *call, long err) {
    ngx_log_error(NGX_LOG_ERR, r->connection->log, (ngx_err_t)-err, "toffload: %s failed", call);
    return NGX_HTTP_INTERNAL_SERVER_ERROR;
}

/* SYNC BEGIN */
static ngx_int_t handle_sync(ngx_http_request_t *r, ngx_buf_t *b) {
    int rc = accel_run(b->pos, (int)(b->last - b->pos));
    if (rc < 0)
        return device_error(r, "accel_run", rc);
    return respond(r, b, (ngx_str_t)ngx_string("application/octet-stream"));
}
/* SYNC END */

/* REROUTE BEGIN */
typedef struct {
    ngx_queue_t link;
    ngx_http_request_t *r;
    ngx_buf_t *b;
    long id; /* -1 once released */
} toffload_op_t;

static ngx_queue_t pending; /* this worker's operations in flight */
static ngx_connection_t *completion; /* the completion fd in the event loop */
static ngx_uint_t n_inflight, most_inflight, n_finished;

/* The request's pool is going away (finished, or the client gone): the device must
 * let go of its buffer first. */
static void op_cleanup(void *data) {
    toffload_op_t *op = data;
    if (op->id >= 0) {
        accel_release(op->id);
        op->id = -1;
        ngx_queue_remove(&op->link);
        n_inflight--;
    }
}

static void on_completion(ngx_event_t *ev) {
    uint64_t v;
    /* Edge-triggered: read to reset, then poll everything in flight; a completion
     * after the read signals the fd again. */
    while (read(completion->fd, &v, sizeof v) > 0) {
    }
    ngx_queue_t *q = ngx_queue_head(&pending);
    while (q != ngx_queue_sentinel(&pending)) {
        toffload_op_t *op = ngx_queue_data(q, toffload_op_t, link);
        q = ngx_queue_next(q);
        int st = accel_done(op->id);
        if (st == 0)
            continue;
        accel_release(op->id);
        op->id = -1;
        ngx_queue_remove(&op->link);
        n_inflight--;
        n_finished++;
        ngx_http_request_t *r = op->r;
        ngx_connection_t *c = r->connection;
        ngx_int_t rc = st == 1 ? respond(r, op->b, (ngx_str_t)ngx_string("application/octet-stream"))
                               : device_error(r, "accel_done", st);
        ngx_http_finalize_request(r, rc);
        ngx_http_run_posted_requests(c);
    }
    incr_poll();
}

/* The completion fd joins this worker's event loop, once. */
static ngx_int_t attach(ngx_log_t *log) {
    if (completion != NULL)
        return NGX_OK;
    int fd = accel_completion_fd();
    if (fd < 0) {
        ngx_log_error(NGX_LOG_ERR, log, (ngx_err_t)-fd, "toffload: accel_completion_fd failed");
        return NGX_ERROR;
    }
    ngx_connection_t *c = ngx_get_connection(fd, log);
    if (c == NULL)
        return NGX_ERROR;
    c->read->handler = on_completion;
    c->read->log = log;
    c->write->log = log;
    if (ngx_add_event(c->read, NGX_READ_EVENT, NGX_CLEAR_EVENT) != NGX_OK) {
        ngx_free_connection(c);
        return NGX_ERROR;
    }
    completion = c;
    return NGX_OK;
}

static ngx_int_t handle_async(ngx_http_request_t *r, ngx_buf_t *b) {
    if (attach(r->connection->log) != NGX_OK)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    toffload_op_t *op = ngx_pcalloc(r->pool, sizeof *op);
    ngx_pool_cleanup_t *cln = ngx_pool_cleanup_add(r->pool, 0);
    if (op == NULL || cln == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    long id = accel_submit(b->pos, (int)(b->last - b->pos));
    if (id < 0)
        return device_error(r, "accel_submit", id);
    op->r = r;
    op->b = b;
    op->id = id;
    ngx_queue_insert_tail(&pending, &op->link);
    cln->handler = op_cleanup;
    cln->data = op;
    if (++n_inflight > most_inflight)
        most_inflight = n_inflight;
    r->main->count++; /* finished by on_completion */
    return NGX_DONE;
}
/* REROUTE END */

static ngx_int_t handle_stats(ngx_http_request_t *r) {
    ngx_buf_t *b = ngx_create_temp_buf(r->pool, 3 * NGX_INT_T_LEN + 4);
    if (b == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    b->last = ngx_sprintf(b->pos, "%ui %ui %ui\n", n_inflight, most_inflight, n_finished);
    return respond(r, b, (ngx_str_t)ngx_string("text/plain"));
}

static ngx_int_t toffload_handler(ngx_http_request_t *r) {
    toffload_loc_conf_t *lc = ngx_http_get_module_loc_conf(r, ngx_http_toffload_module);
    if (!(r->method & (NGX_HTTP_GET | NGX_HTTP_HEAD)))
        return NGX_HTTP_NOT_ALLOWED;
    ngx_int_t rc = ngx_http_discard_request_body(r);
    if (rc != NGX_OK)
        return rc;
    if (lc->form == FORM_STATS)
        return handle_stats(r);
    if (lc->form == FORM_GUARD)
        return handle_guard(r);
    if (lc->form >= FORM_INCR)
        return handle_incr(r, lc->form);
    ngx_int_t n = request_size(r);
    if (n < 0)
        return NGX_HTTP_BAD_REQUEST;
    ngx_buf_t *b = payload(r, (size_t)n);
    if (b == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    return lc->form == FORM_SYNC ? handle_sync(r, b) : handle_async(r, b);
}

/* ---- INCR: a read-modify-write across the offload, under the guard ----------------
 *
 * `incr` reads a counter, offloads its 8 bytes (rerouted: the request suspended, the
 * worker serving others meanwhile) and writes it back plus one. Overlapped, two
 * increments of one counter can both read the same value: one update is lost. The
 * guard (TOFFLOAD_GUARD, toffload_accel.h) watches the counters: detect counts those
 * conflicts, enforce sends back an increment that touches a counter page whose owner
 * is parked at its offload; it waits in `deferred` until an owner's response is out.
 * `incrlocked` holds one coarse lock across the offload instead (the fix without a
 * guard).
 *
 * The counters are this worker's own page-aligned memory (mmap'ed in the worker,
 * registered with the guard): with several workers each has its own, since the
 * guard's page protections are per process. One counter per slot, a slot per key
 * hash (keys sharing a slot share a counter), 64 bytes apart: 64 slots to a page. */
#define INCR_SLOTS 1024
#define SLOT_WORDS 8
#define SLOTS_PER_PAGE (4096 / (SLOT_WORDS * sizeof(uint64_t)))
#define COUNTERS_BYTES ((size_t)INCR_SLOTS * SLOT_WORDS * sizeof(uint64_t))

typedef enum { INCR_NEW, INCR_DEFERRED, INCR_INFLIGHT, INCR_ENDED } incr_state_t;

typedef struct {
    ngx_queue_t link; /* in incr_inflight or incr_deferred */
    ngx_http_request_t *r;
    uint64_t token;
    size_t slot;
    uint64_t old;
    ngx_uint_t form;
    incr_state_t state;
    unsigned counted : 1; /* r->main->count taken: finished by incr_settle */
    long id;
    unsigned char val[sizeof(uint64_t)];
    ngx_event_t wait_timer; /* the deadline of a request sent back (GUARD_WAIT_MS) */
} incr_t;

/* How long a request sent back may wait for owners to end, in all: then 503, as the
 * Redis module's and the Go handler's, never a wait without a deadline. */
#define GUARD_WAIT_MS 10000

static volatile uint64_t *counters;
static uint64_t next_token;
static ngx_queue_t incr_inflight, incr_deferred;
static incr_t *lock_holder;

static ngx_int_t incr_start(incr_t *in);

static ngx_int_t respond_number(ngx_http_request_t *r, uint64_t v) {
    ngx_buf_t *b = ngx_create_temp_buf(r->pool, NGX_INT64_LEN + 2);
    if (b == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    b->last = ngx_sprintf(b->pos, "%uL\n", v);
    return respond(r, b, (ngx_str_t)ngx_string("text/plain"));
}

/* A request that waited: its response goes out now, from the event loop. */
static void incr_settle(incr_t *in, ngx_int_t rc) {
    if (rc == NGX_DONE || !in->counted)
        return;
    ngx_connection_t *c = in->r->connection;
    ngx_http_finalize_request(in->r, rc);
    ngx_http_run_posted_requests(c);
}

static void incr_wait_expired(ngx_event_t *ev) {
    incr_t *in = ev->data;
    if (in->state != INCR_DEFERRED)
        return;
    ngx_queue_remove(&in->link);
    in->state = INCR_ENDED; /* never began: nothing of the guard's to end */
    incr_settle(in, NGX_HTTP_SERVICE_UNAVAILABLE);
}

static void incr_defer(incr_t *in) {
    in->state = INCR_DEFERRED;
    ngx_queue_insert_tail(&incr_deferred, &in->link);
    if (!in->wait_timer.timer_set) { /* first time sent back: the deadline starts */
        in->wait_timer.handler = incr_wait_expired;
        in->wait_timer.data = in;
        in->wait_timer.log = in->r->connection->log;
        ngx_add_timer(&in->wait_timer, GUARD_WAIT_MS);
    }
}

/* Its memory goes with the request's pool: no timer may outlive it. */
static void incr_drop_timer(incr_t *in) {
    if (in->wait_timer.timer_set)
        ngx_del_timer(&in->wait_timer);
}

static int wants_page(const incr_t *in, size_t page) {
    return in->form == FORM_SUM || (in->form != FORM_INCRLOCKED && in->slot / SLOTS_PER_PAGE == page);
}

static int wants_lock(const incr_t *in, size_t page) {
    (void)page;
    return in->form == FORM_INCRLOCKED && lock_holder == NULL;
}

/* Starts the first deferred request that wants what was freed (FIFO): the others
 * would only be sent back again. */
static void retry_first(int (*wants)(const incr_t *, size_t), size_t page) {
    for (ngx_queue_t *q = ngx_queue_head(&incr_deferred); q != ngx_queue_sentinel(&incr_deferred);
         q = ngx_queue_next(q)) {
        incr_t *in = ngx_queue_data(q, incr_t, link);
        if (!wants(in, page))
            continue;
        ngx_queue_remove(&in->link);
        in->state = INCR_NEW;
        incr_settle(in, incr_start(in));
        return;
    }
}

/* Its response is going out (or its client is gone): free its pages and the lock,
 * retry who waited for them. */
static void incr_end(incr_t *in) {
    in->state = INCR_ENDED;
    incr_drop_timer(in);
    toffload_guard_end(in->token);
    if (lock_holder == in)
        lock_holder = NULL;
    retry_first(wants_page, in->slot / SLOTS_PER_PAGE);
    retry_first(wants_lock, 0);
}

/* NGX_DONE when it waits (deferred or offloading), else the response's rc. */
static ngx_int_t incr_start(incr_t *in) {
    if (in->form == FORM_INCRLOCKED) {
        if (lock_holder != NULL) {
            incr_defer(in);
            return NGX_DONE;
        }
        lock_holder = in;
    }
    sigjmp_buf env;
    if (sigsetjmp(env, 0)) {
        /* enforce: a parked increment owns the counter's page */
        if (lock_holder == in)
            lock_holder = NULL;
        incr_defer(in);
        return NGX_DONE;
    }
    int rc = toffload_guard_begin(in->token, &env);
    if (rc < 0) {
        incr_end(in);
        return device_error(in->r, "toffload_guard_begin", rc);
    }
    if (in->form == FORM_SUM) {
        in->old = 0;
        for (size_t i = 0; i < INCR_SLOTS; i++)
            in->old += counters[i * SLOT_WORDS];
    } else {
        in->old = counters[in->slot * SLOT_WORDS]; /* the read */
    }
    if (in->form == FORM_GET || in->form == FORM_SUM) {
        incr_end(in);
        return respond_number(in->r, in->old);
    }
    ngx_memcpy(in->val, (const void *)&in->old, sizeof in->val);
    long id = accel_submit(in->val, sizeof in->val);
    if (id < 0) {
        incr_end(in);
        return device_error(in->r, "accel_submit", id);
    }
    toffload_guard_park(in->token);
    in->id = id;
    in->state = INCR_INFLIGHT;
    ngx_queue_insert_tail(&incr_inflight, &in->link);
    return NGX_DONE;
}

/* From on_completion: finish the increments whose offload is done. */
static void incr_poll(void) {
    if (counters == NULL)
        return;
    ngx_queue_t *q = ngx_queue_head(&incr_inflight);
    while (q != ngx_queue_sentinel(&incr_inflight)) {
        incr_t *in = ngx_queue_data(q, incr_t, link);
        q = ngx_queue_next(q);
        int st = accel_done(in->id);
        if (st == 0)
            continue;
        accel_release(in->id);
        ngx_queue_remove(&in->link);
        ngx_int_t rc;
        if (st == 1) {
            toffload_guard_resume(in->token);
            counters[in->slot * SLOT_WORDS] = in->old + 1; /* the write back */
            rc = respond_number(in->r, in->old + 1);
        } else {
            rc = device_error(in->r, "accel_done", st);
        }
        incr_end(in);
        /* The end may have started others, which can change the list: restart. */
        q = ngx_queue_head(&incr_inflight);
        incr_settle(in, rc);
    }
}

/* The request's pool is going away: a request still waiting leaves no trace. */
static void incr_cleanup(void *data) {
    incr_t *in = data;
    incr_drop_timer(in);
    switch (in->state) {
    case INCR_DEFERRED:
        ngx_queue_remove(&in->link);
        break;
    case INCR_INFLIGHT:
        accel_release(in->id); /* the device lets go of val; no write back */
        ngx_queue_remove(&in->link);
        incr_end(in);
        break;
    default:
        break;
    }
    in->state = INCR_ENDED;
}

static ngx_int_t handle_incr(ngx_http_request_t *r, ngx_uint_t form) {
    if (counters == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    if (attach(r->connection->log) != NGX_OK)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    ngx_str_t k = ngx_null_string;
    if (form != FORM_SUM && ngx_http_arg(r, (u_char *)"k", 1, &k) != NGX_OK)
        return NGX_HTTP_BAD_REQUEST;
    incr_t *in = ngx_pcalloc(r->pool, sizeof *in);
    ngx_pool_cleanup_t *cln = ngx_pool_cleanup_add(r->pool, 0);
    if (in == NULL || cln == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    uint64_t h = 1469598103934665603ull; /* FNV-1a, as the Redis module */
    for (size_t i = 0; i < k.len; i++)
        h = (h ^ k.data[i]) * 1099511628211ull;
    *in = (incr_t){.r = r, .token = ++next_token, .slot = (size_t)(h % INCR_SLOTS), .form = form, .id = -1};
    cln->handler = incr_cleanup;
    cln->data = in;
    ngx_int_t rc = incr_start(in);
    if (rc == NGX_DONE) {
        r->main->count++; /* finished by incr_settle */
        in->counted = 1;
    }
    return rc;
}

static ngx_int_t handle_guard(ngx_http_request_t *r) {
    struct toffload_guard_stats s;
    int rc = toffload_guard_stats(&s);
    if (rc < 0)
        return device_error(r, "toffload_guard_stats", rc);
    static const char *const modes[] = {"off", "detect", "enforce"};
    const char *mech = s.mode == 0 ? "off" : s.mode == 1 && s.uffd_async ? "uffd-async" : "mprotect";
    ngx_buf_t *b = ngx_create_temp_buf(r->pool, 200);
    if (b == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    b->last = ngx_sprintf(b->pos, "%s %s %uL %uL %uL %uL %uL\n", s.mode >= 0 && s.mode <= 2 ? modes[s.mode] : "invalid",
                          mech, (uint64_t)s.pages, (uint64_t)s.faults, (uint64_t)s.conflicts, (uint64_t)s.deferred,
                          (uint64_t)s.released);
    return respond(r, b, (ngx_str_t)ngx_string("text/plain"));
}

static ngx_uint_t incr_configured; /* an incr-family location exists */

/* In the worker: the counters, registered with the guard. */
static ngx_int_t incr_init(ngx_log_t *log) {
    ngx_queue_init(&incr_inflight);
    ngx_queue_init(&incr_deferred);
    lock_holder = NULL;
    if (!incr_configured || counters != NULL)
        return NGX_OK;
    void *p = mmap(NULL, COUNTERS_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        return NGX_ERROR;
    int rc = toffload_guard_register(p, COUNTERS_BYTES);
    if (rc < 0) {
        ngx_log_error(NGX_LOG_EMERG, log, (ngx_err_t)-rc, "toffload: toffload_guard_register failed");
        munmap(p, COUNTERS_BYTES);
        return NGX_ERROR;
    }
    counters = p;
    return NGX_OK;
}

/* ---- configuration and process hooks ----------------------------------------------- */

static char *toffload_accel(ngx_conf_t *cf, ngx_command_t *cmd, void *conf) {
    toffload_loc_conf_t *lc = conf;
    ngx_str_t *v = cf->args->elts;
    static const struct {
        ngx_str_t name;
        toffload_form_t form;
    } forms[] = {
        {ngx_string("sync"), FORM_SYNC},
        {ngx_string("async"), FORM_ASYNC},
        {ngx_string("stats"), FORM_STATS},
        {ngx_string("incr"), FORM_INCR},
        {ngx_string("incrlocked"), FORM_INCRLOCKED},
        {ngx_string("get"), FORM_GET},
        {ngx_string("sum"), FORM_SUM},
        {ngx_string("guard"), FORM_GUARD},
    };
    if (lc->form != FORM_UNSET)
        return "is duplicate";
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        if (v[1].len == forms[i].name.len && ngx_strncmp(v[1].data, forms[i].name.data, v[1].len) == 0) {
            lc->form = forms[i].form;
            if (lc->form >= FORM_INCR) {
                /* Checked here, in the master, so that nginx refuses to start. */
                if (toffload_guard_mode() < 0) {
                    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "toffload: TOFFLOAD_GUARD must be off, detect or enforce");
                    return NGX_CONF_ERROR;
                }
                incr_configured = 1;
            }
            ngx_http_core_loc_conf_t *clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
            clcf->handler = toffload_handler;
            return NGX_CONF_OK;
        }
    }
    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "toffload_accel: \"%V\" is not sync, async, stats, incr, incrlocked, get, sum or guard", &v[1]);
    return NGX_CONF_ERROR;
}

static void *toffload_create_loc_conf(ngx_conf_t *cf) {
    toffload_loc_conf_t *lc = ngx_pcalloc(cf->pool, sizeof *lc);
    return lc;
}

static char *toffload_merge_loc_conf(ngx_conf_t *cf, void *parent, void *child) {
    (void)cf;
    (void)parent;
    (void)child;
    return NGX_CONF_OK;
}

static ngx_int_t toffload_init_process(ngx_cycle_t *cycle) {
    ngx_queue_init(&pending);
    completion = NULL;
    n_inflight = most_inflight = n_finished = 0;
    return incr_init(cycle->log);
}

static void toffload_exit_process(ngx_cycle_t *cycle) {
    (void)cycle;
    /* Requests still suspended are freed with their pools (op_cleanup releases). */
    if (completion != NULL) {
        ngx_del_event(completion->read, NGX_READ_EVENT, NGX_CLOSE_EVENT);
        /* The fd is the library's: not closed here, but no longer the connection's
         * (nginx reports a connection with an fd left at exit). */
        completion->fd = (ngx_socket_t)-1;
        ngx_free_connection(completion);
        completion = NULL;
    }
}
