// The conflict guard on Go's rerouted path: /incr and the rest (see main.go).
//
// The guard's C API assumes one thread runs requests at a time (an event loop): it
// knows one running token. Go's handlers run on several OS threads at once, so every
// stretch that runs a token (begin, the read, park; resume, the write back, end) runs
// in C under one mutex, guard_mu; the offload between them runs unlocked, which is what
// the guard protects. The read is in C as well: enforce sends a token back by jumping
// to a sigsetjmp point, which must be a live C frame (a jump across Go frames would
// corrupt the goroutine's stack). Go's own SIGSEGV handler stays in the chain: the
// guard's handler passes on every fault outside the registered pages.
package main

/*
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdint.h>
#include <sys/mman.h>
#include "toffload_accel.h"

#define INCR_SLOTS 1024
#define SLOT_WORDS 8
#define SLOTS_PER_PAGE 64
#define COUNTERS_BYTES ((size_t)INCR_SLOTS * SLOT_WORDS * sizeof(uint64_t))

static volatile uint64_t *counters;
static pthread_mutex_t guard_mu = PTHREAD_MUTEX_INITIALIZER;
// 0 only for the experiment that shows why guard_mu is needed (-guard-unserialized).
static int serialize = 1;

static void guard_unserialize(void) { serialize = 0; }

static void guard_lock(void) {
	if (serialize)
		pthread_mutex_lock(&guard_mu);
}

static void guard_unlock(void) {
	if (serialize)
		pthread_mutex_unlock(&guard_mu);
}

static int counters_init(void) {
	if (toffload_guard_mode() < 0)
		return -EINVAL;
	void *p = mmap(NULL, COUNTERS_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (p == MAP_FAILED)
		return -ENOMEM;
	int rc = toffload_guard_register(p, COUNTERS_BYTES);
	if (rc < 0)
		return rc;
	counters = p;
	return 0;
}

// Begins token and reads slot's counter (all of them when sum), then parks it (an
// increment) or ends it (a read). 0 with *out; 1 when enforce sent it back; -errno.
static int counter_begin(uint64_t token, size_t slot, int sum, int park, uint64_t *out) {
	guard_lock();
	sigjmp_buf env;
	if (sigsetjmp(env, 0)) {
		guard_unlock();
		return 1;
	}
	int rc = toffload_guard_begin(token, &env);
	if (rc == 0) {
		uint64_t s = 0;
		for (size_t i = sum ? 0 : slot; i < (sum ? INCR_SLOTS : slot + 1); i++)
			s += counters[i * SLOT_WORDS];
		*out = s;
		if (park)
			toffload_guard_park(token);
		else
			toffload_guard_end(token);
	}
	guard_unlock();
	return rc;
}

// Resumes token, writes value back when write, ends it.
static void counter_finish(uint64_t token, size_t slot, uint64_t value, int write) {
	guard_lock();
	if (write) {
		toffload_guard_resume(token);
		counters[slot * SLOT_WORDS] = value;
	}
	toffload_guard_end(token);
	guard_unlock();
}

static int guard_stats(struct toffload_guard_stats *s) { return toffload_guard_stats(s); }
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// A request sent back by enforce waits at most this long for a page to be freed.
const deferWait = 10 * time.Second

var (
	nextToken atomic.Uint64
	coarse    sync.Mutex // /incrlocked: held across the offload

	// Requests sent back by enforce, in arrival order: an end wakes the first one
	// waiting for the page it freed (one, not all: the others would only be sent
	// back again).
	waitMu  sync.Mutex
	waiters []*waiter
)

type waiter struct {
	page int // -1: any (a sum)
	wake chan struct{}
}

func enqueue(page int) *waiter {
	w := &waiter{page: page, wake: make(chan struct{})}
	waitMu.Lock()
	waiters = append(waiters, w)
	waitMu.Unlock()
	return w
}

// wakeFirst wakes the first request waiting for page.
func wakeFirst(page int) {
	waitMu.Lock()
	defer waitMu.Unlock()
	for i, w := range waiters {
		if w.page == page || w.page < 0 {
			waiters = append(waiters[:i], waiters[i+1:]...)
			close(w.wake)
			return
		}
	}
}

// leave takes w out of the queue; a wake it got and will not use goes to the next.
func leave(w *waiter) {
	waitMu.Lock()
	for i, x := range waiters {
		if x == w {
			waiters = append(waiters[:i], waiters[i+1:]...)
			waitMu.Unlock()
			return
		}
	}
	waitMu.Unlock()
	wakeFirst(w.page)
}

func slotOf(key string) C.size_t {
	h := uint64(1469598103934665603) // FNV-1a, as the Redis module
	for i := 0; i < len(key); i++ {
		h = (h ^ uint64(key[i])) * 1099511628211
	}
	return C.size_t(h % 1024)
}

var errGone = errors.New("the client went away")

// errTooLong: sent back for longer than deferWait; answered 503, as nginx and Python.
var errTooLong = errors.New("the guard's wait timed out")

// begin runs counter_begin until the guard lets the token in (enforce may send it
// back while another request's offload owns the page).
func begin(r *http.Request, token uint64, slot C.size_t, sum, park bool) (uint64, error) {
	deadline := time.NewTimer(deferWait)
	defer deadline.Stop()
	page := int(slot) / 64
	if sum {
		page = -1
	}
	var out C.uint64_t
	for {
		w := enqueue(page) // before trying: an end after the try still wakes us
		rc := C.counter_begin(C.uint64_t(token), slot, cbool(sum), cbool(park), &out)
		if rc != 1 {
			leave(w)
			if rc < 0 {
				return 0, syscall.Errno(-rc)
			}
			return uint64(out), nil
		}
		select {
		case <-w.wake:
		case <-r.Context().Done():
			leave(w)
			return 0, errGone
		case <-deadline.C:
			leave(w)
			return 0, errTooLong
		}
	}
}

func cbool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// GUARD BEGIN
func increment(r *http.Request, slot C.size_t) (uint64, error) {
	token := nextToken.Add(1)
	old, err := begin(r, token, slot, false, true)
	if err != nil {
		return 0, err
	}
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], old)
	_, err = runAsync(b[:]) // the offload, rerouted: the goroutine waits on a channel
	C.counter_finish(C.uint64_t(token), slot, C.uint64_t(old+1), cbool(err == nil))
	wakeFirst(int(slot) / 64)
	return old + 1, err
}

// GUARD END

func guardRoutes(mux *http.ServeMux, asyncErr error, unserialized bool) error {
	if unserialized {
		C.guard_unserialize()
	}
	if rc := C.counters_init(); rc < 0 {
		if rc == -C.EINVAL {
			return errors.New("TOFFLOAD_GUARD must be off, detect or enforce")
		}
		return fmt.Errorf("the guarded counters: %v", syscall.Errno(-rc))
	}
	counter := func(run func(r *http.Request, slot C.size_t) (uint64, error)) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			k, ok := r.URL.Query()["k"]
			if !ok && r.URL.Path != "/sum" {
				http.Error(w, "k=KEY is missing", http.StatusBadRequest)
				return
			}
			var slot C.size_t
			if ok {
				slot = slotOf(k[0])
			}
			v, err := run(r, slot)
			if errors.Is(err, errTooLong) {
				http.Error(w, err.Error(), http.StatusServiceUnavailable)
				return
			} else if err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
			w.Header().Set("Content-Type", "text/plain")
			fmt.Fprintf(w, "%d\n", v)
		}
	}
	withAsync := func(run func(*http.Request, C.size_t) (uint64, error)) func(*http.Request, C.size_t) (uint64, error) {
		return func(r *http.Request, s C.size_t) (uint64, error) {
			if asyncErr != nil {
				return 0, asyncErr
			}
			return run(r, s)
		}
	}
	mux.HandleFunc("/incr", counter(withAsync(increment)))
	mux.HandleFunc("/incrlocked", counter(withAsync(func(r *http.Request, s C.size_t) (uint64, error) {
		coarse.Lock()
		defer coarse.Unlock()
		return increment(r, s)
	})))
	read := func(sum bool) func(*http.Request, C.size_t) (uint64, error) {
		return func(r *http.Request, s C.size_t) (uint64, error) {
			v, err := begin(r, nextToken.Add(1), s, sum, false)
			if err == nil && !sum {
				wakeFirst(int(s) / 64)
			}
			return v, err
		}
	}
	mux.HandleFunc("/get", counter(read(false)))
	mux.HandleFunc("/sum", counter(read(true)))
	mux.HandleFunc("/guard", func(w http.ResponseWriter, r *http.Request) {
		var s C.struct_toffload_guard_stats
		if rc := C.guard_stats(&s); rc < 0 {
			http.Error(w, syscall.Errno(-rc).Error(), http.StatusInternalServerError)
			return
		}
		mode := [...]string{"off", "detect", "enforce"}[s.mode]
		mech := "mprotect"
		if s.mode == 0 {
			mech = "off"
		} else if s.mode == 1 && s.uffd_async != 0 {
			mech = "uffd-async"
		}
		fmt.Fprintf(w, "%s %s %d %d %d %d %d\n", mode, mech, s.pages, s.faults, s.conflicts, s.deferred, s.released)
	})
	mux.HandleFunc("/nilderef", func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			fmt.Fprintf(w, "recovered: %v\n", recover())
		}()
		var p *[1 << 16]byte
		w.Header().Set("X-Byte", strconv.Itoa(int(p[4096]))) // faults: Go's handler turns it into a panic
	})
	return nil
}
