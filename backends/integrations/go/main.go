// accelhttp: toffload's offload from Go's net/http, in three forms.
//
//	GET /serial?n=BYTES  accel_run under one process-wide mutex: one offload at a
//	                     time, as a server that serializes its device calls does
//	GET /sync?n=BYTES    accel_run called straight from the handler through cgo.
//	                     Zero async code: while the call blocks, Go's scheduler
//	                     hands the goroutine's P to another thread, so the other
//	                     connections keep being served (one OS thread per offload
//	                     in flight)
//	GET /async?n=BYTES   the reroute: accel_submit, the goroutine waits on a
//	                     channel, and one goroutine reading the device's
//	                     completion fd through Go's netpoller polls accel_done and
//	                     wakes the finished ones (no thread per offload)
//	GET /stats           async in flight now, most at once, finished; OS threads
//
// and a read-modify-write across the rerouted offload, for the conflict guard
// (TOFFLOAD_GUARD, toffload_accel.h), on counters the handlers share (see guard.go):
//
//	GET /incr?k=KEY        reads KEY's counter, offloads it (/async's path), writes it
//	                       back plus one; answers the new value
//	GET /incrlocked?k=KEY  the same holding one coarse lock across the offload
//	GET /get?k=KEY, /sum   a counter, all of them added up
//	GET /guard             mode mechanism pages faults conflicts deferred released
//	GET /nilderef          a nil dereference, recovered: Go's own SIGSEGV handling
//	                       still works beside the guard's handler
//
// The answer is the device's transformation of a fixed payload of BYTES bytes
// (byte i = i*7 mod 256). Errors are HTTP errors, never a crash. The device is
// configured by the TOFFLOAD_* variables of the environment (docs/configuration.md).
package main

/*
#cgo LDFLAGS: -ltoffload_accel
#include <stdlib.h>
#include "toffload_accel.h"
*/
import "C"

import (
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"unsafe"
)

const maxBytes = 1 << 20

var payloads sync.Map // n -> []byte

func payload(n int) []byte {
	if p, ok := payloads.Load(n); ok {
		return p.([]byte)
	}
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(i * 7)
	}
	payloads.Store(n, p)
	return p
}

// SYNC BEGIN
func runBlocking(data []byte) ([]byte, error) {
	buf := append([]byte(nil), data...)
	// cgo: a Go pointer may be passed for the duration of the call.
	if r := C.accel_run((*C.uchar)(unsafe.Pointer(&buf[0])), C.int(len(buf))); r < 0 {
		return nil, syscall.Errno(-r)
	}
	return buf, nil
}

// SYNC END

var serial sync.Mutex

func runSerial(data []byte) ([]byte, error) {
	serial.Lock()
	defer serial.Unlock()
	return runBlocking(data)
}

// REROUTE BEGIN
type op struct {
	done chan error
}

var (
	mu          sync.Mutex
	inflight    = map[C.long]*op{}
	maxInflight int
	finished    int
)

// completions waits on the device's completion fd in Go's netpoller (os.NewFile of
// a non-blocking fd is pollable) and wakes the operations that finished.
func completions() error {
	fd := C.accel_completion_fd()
	if fd < 0 {
		return syscall.Errno(-fd)
	}
	f := os.NewFile(uintptr(fd), "accel-completion")
	go func() {
		var b [8]byte
		for {
			if _, err := f.Read(b[:]); err != nil && err != syscall.EAGAIN {
				log.Printf("accel completion fd: %v", err)
				return
			}
			mu.Lock()
			for id, o := range inflight {
				r := C.accel_done(id)
				if r == 0 {
					continue
				}
				delete(inflight, id)
				finished++
				if r == 1 {
					o.done <- nil
				} else {
					o.done <- syscall.Errno(-r)
				}
			}
			mu.Unlock()
		}
	}()
	return nil
}

func runAsync(data []byte) ([]byte, error) {
	n := len(data)
	// C memory: the device keeps the buffer after accel_submit returns, which cgo
	// does not allow for Go memory.
	p := C.malloc(C.size_t(n))
	defer C.free(p)
	copy(unsafe.Slice((*byte)(p), n), data)
	o := &op{done: make(chan error, 1)}
	mu.Lock()
	id := C.accel_submit((*C.uchar)(p), C.int(n))
	if id < 0 {
		mu.Unlock()
		return nil, syscall.Errno(-id)
	}
	inflight[id] = o
	if len(inflight) > maxInflight {
		maxInflight = len(inflight)
	}
	mu.Unlock()
	err := <-o.done
	C.accel_release(id)
	if err != nil {
		return nil, err
	}
	return C.GoBytes(p, C.int(n)), nil
}

// REROUTE END

func size(r *http.Request) (int, error) {
	v := r.URL.Query().Get("n")
	if v == "" {
		return 1024, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 || n > maxBytes || strings.ContainsAny(v, "+-") {
		return 0, fmt.Errorf("n must be an integer from 1 to %d", maxBytes)
	}
	return n, nil
}

func handler(run func([]byte) ([]byte, error)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet {
			http.Error(w, "GET only", http.StatusBadRequest)
			return
		}
		n, err := size(r)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		out, err := run(payload(n))
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.Itoa(len(out)))
		w.Write(out)
	}
}

func threads() int {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "Threads:") {
			t, _ := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(l, "Threads:")))
			return t
		}
	}
	return 0
}

func main() {
	port := flag.Int("port", 8080, "port to listen on (0: any; the port is printed)")
	host := flag.String("host", "127.0.0.1", "address to listen on")
	unserialized := flag.Bool("guard-unserialized", false,
		"an experiment: run the guard's calls from many threads at once (guard.go says why not)")
	flag.Parse()
	asyncErr := completions()
	mux := http.NewServeMux()
	if err := guardRoutes(mux, asyncErr, *unserialized); err != nil {
		fmt.Fprintf(os.Stderr, "accelhttp: %v\n", err)
		os.Exit(2)
	}
	mux.HandleFunc("/serial", handler(runSerial))
	mux.HandleFunc("/sync", handler(runBlocking))
	mux.HandleFunc("/async", handler(func(b []byte) ([]byte, error) {
		if asyncErr != nil {
			return nil, asyncErr
		}
		return runAsync(b)
	}))
	mux.HandleFunc("/stats", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		now, most, fin := len(inflight), maxInflight, finished
		mu.Unlock()
		fmt.Fprintf(w, "%d %d %d %d\n", now, most, fin, threads())
	})
	l, err := net.Listen("tcp", net.JoinHostPort(*host, strconv.Itoa(*port)))
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("port %d\n", l.Addr().(*net.TCPAddr).Port)
	srv := &http.Server{Handler: mux, MaxHeaderBytes: 16 << 10}
	log.Fatal(srv.Serve(l))
}
