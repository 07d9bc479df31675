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

#include "toffload_accel.h"

#define TOFFLOAD_MAX_BYTES (1 << 20)

typedef enum {
    FORM_UNSET = 0,
    FORM_SYNC,
    FORM_ASYNC,
    FORM_STATS,
} toffload_form_t;

typedef struct {
    ngx_uint_t form;
} toffload_loc_conf_t;

static char *toffload_accel(ngx_conf_t *cf, ngx_command_t *cmd, void *conf);
static void *toffload_create_loc_conf(ngx_conf_t *cf);
static char *toffload_merge_loc_conf(ngx_conf_t *cf, void *parent, void *child);
static ngx_int_t toffload_init_process(ngx_cycle_t *cycle);
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
    ngx_int_t n = request_size(r);
    if (n < 0)
        return NGX_HTTP_BAD_REQUEST;
    ngx_buf_t *b = payload(r, (size_t)n);
    if (b == NULL)
        return NGX_HTTP_INTERNAL_SERVER_ERROR;
    return lc->form == FORM_SYNC ? handle_sync(r, b) : handle_async(r, b);
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
    };
    if (lc->form != FORM_UNSET)
        return "is duplicate";
    for (size_t i = 0; i < sizeof forms / sizeof forms[0]; i++) {
        if (v[1].len == forms[i].name.len && ngx_strncmp(v[1].data, forms[i].name.data, v[1].len) == 0) {
            lc->form = forms[i].form;
            ngx_http_core_loc_conf_t *clcf = ngx_http_conf_get_module_loc_conf(cf, ngx_http_core_module);
            clcf->handler = toffload_handler;
            return NGX_CONF_OK;
        }
    }
    ngx_conf_log_error(NGX_LOG_EMERG, cf, 0, "toffload_accel: \"%V\" is not sync, async or stats", &v[1]);
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
    (void)cycle;
    ngx_queue_init(&pending);
    completion = NULL;
    n_inflight = most_inflight = n_finished = 0;
    return NGX_OK;
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
