"""toffload's offload from Python asyncio, in two forms.

`Accel.run_sync(data)` calls `accel_run` on the event loop's thread: the whole loop
waits for the device, as a handler that calls a blocking accelerator API does.

`await Accel.run(data)` is the minimal-edit reroute: `accel_submit`, then the
coroutine suspends on a future; the device's completion fd is in the event loop
(`loop.add_reader`), so no executor thread is added. When the fd is readable, every
operation in flight is polled with `accel_done` and the finished ones resolve their
futures.

Run as a program, it is a small HTTP/1.1 server (keep-alive) offering both:
`GET /sync?n=BYTES`, `GET /async?n=BYTES` (the device's transformation of a fixed
payload of BYTES bytes, byte i = i*7 mod 256) and `GET /stats` (in flight now, most
in flight at once, finished). Errors are HTTP errors, never a crash of the server.

With `--guard-helper PATH` (toffload_guard_helper.c built, see that file) it also
offers a read-modify-write across the rerouted offload, for the conflict guard
(TOFFLOAD_GUARD, toffload_accel.h), on counters of its own: `GET /incr?k=KEY` reads
KEY's counter, offloads it, writes it back plus one; `/incrlocked?k=KEY` does the same
holding one coarse lock across the offload; `/get?k=KEY`, `/sum` and `/guard` ("mode
mechanism pages faults conflicts deferred released"). See `Counters`.

    python3 toffload_asyncio.py --port 8080 --lib target/toffload/lib/libtoffload_accel.so

The device is configured by the TOFFLOAD_* variables of the environment, as
everywhere else (docs/configuration.md).
"""

import argparse
import asyncio
import ctypes
import collections
import errno
import mmap
import os
import sys

MAX_BYTES = 1 << 20


class Accel:
    """libtoffload_accel.so through ctypes (no compiled glue)."""

    def __init__(self, lib_path):
        lib = ctypes.CDLL(lib_path)
        lib.accel_submit.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.accel_submit.restype = ctypes.c_long
        lib.accel_done.argtypes = [ctypes.c_long]
        lib.accel_done.restype = ctypes.c_int
        lib.accel_release.argtypes = [ctypes.c_long]
        lib.accel_release.restype = ctypes.c_int
        lib.accel_run.argtypes = [ctypes.c_void_p, ctypes.c_int]
        lib.accel_run.restype = ctypes.c_int
        lib.accel_completion_fd.argtypes = []
        lib.accel_completion_fd.restype = ctypes.c_int
        self.lib = lib
        self.max_inflight = 0
        self.finished = 0

    # SYNC BEGIN
    def run_sync(self, data):
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        r = self.lib.accel_run(buf, len(data))
        if r < 0:
            raise OSError(-r, "accel_run: " + os.strerror(-r))
        return buf.raw[: len(data)]
    # SYNC END

    # REROUTE BEGIN
    inflight = None  # handle -> (buffer, future, length)
    fd = None
    loop = None
    room = None  # futures of submitters waiting for the device to have room

    def attach(self, loop):
        if self.loop is loop:
            return
        fd = self.lib.accel_completion_fd()
        if fd < 0:
            raise OSError(-fd, "accel_completion_fd: " + os.strerror(-fd))
        loop.add_reader(fd, self.on_completion)
        self.fd, self.loop, self.inflight, self.room = fd, loop, {}, []

    async def run(self, data):
        loop = asyncio.get_running_loop()
        self.attach(loop)
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        while True:
            h = self.lib.accel_submit(buf, len(data))
            if h != -errno.EAGAIN or not self.inflight:
                break
            # The device is full: wait for a completion, then try again.
            w = loop.create_future()
            self.room.append(w)
            await w
        if h < 0:
            raise OSError(-h, "accel_submit: " + os.strerror(-h))
        fut = loop.create_future()
        self.inflight[h] = (buf, fut, len(data))
        self.max_inflight = max(self.max_inflight, len(self.inflight))
        try:
            return await fut
        finally:
            # Cancelled (the client went away): the device lets go of the buffer.
            if self.inflight.pop(h, None) is not None:
                self.lib.accel_release(h)

    def on_completion(self):
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        for h, (buf, fut, n) in list(self.inflight.items()):
            r = self.lib.accel_done(h)
            if r == 0:
                continue
            del self.inflight[h]
            self.lib.accel_release(h)
            self.finished += 1
            if fut.done():
                continue
            if r == 1:
                fut.set_result(buf.raw[:n])
            else:
                fut.set_exception(OSError(-r, "accel_done: " + os.strerror(-r)))
        room, self.room = self.room, []
        for w in room:
            if not w.done():
                w.set_result(None)
    # REROUTE END


class Counters:
    """Counters read, offloaded and written back across the reroute, under the guard.

    Overlapped, two increments of one counter can both read the same value: one
    update is lost. The guard watches the counters' pages: detect counts those
    conflicts; enforce sends back an increment that touches a page whose owner is
    parked at its offload (the helper's begin-and-read returns 1), and the coroutine
    waits until an owner ends, then tries again. 1024 counters, a key's by its
    FNV-1a hash, 64 bytes apart: 64 to a page (as the Redis module).
    """

    SLOTS, WORDS, PER_PAGE = 1024, 8, 64
    # A request sent back waits at most this long for an owner to end (as the Redis
    # module's and the Go handler's): then 503, never a wait without a deadline.
    WAIT_S = 10.0

    def __init__(self, accel, helper_path):
        lib = accel.lib
        u64 = ctypes.c_uint64
        for name, args in (
            ("toffload_guard_mode", []),
            ("toffload_guard_register", [ctypes.c_void_p, ctypes.c_size_t]),
            ("toffload_guard_park", [u64]),
            ("toffload_guard_resume", [u64]),
            ("toffload_guard_end", [u64]),
        ):
            getattr(lib, name).argtypes = args
            getattr(lib, name).restype = ctypes.c_int
        self.mode = lib.toffload_guard_mode()
        if self.mode < 0:
            raise ValueError("TOFFLOAD_GUARD must be off, detect or enforce")
        # The helper's guard calls must reach this very copy of the library: make
        # its symbols global before loading the helper (which is not linked to one).
        ctypes.CDLL(lib._name, mode=ctypes.RTLD_GLOBAL)
        helper = ctypes.CDLL(helper_path)
        helper.toffload_py_begin_read.argtypes = [
            u64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(u64)
        ]
        helper.toffload_py_begin_read.restype = ctypes.c_int
        size = self.SLOTS * self.WORDS * 8
        # Our own pages: Python never touches them but through the helper and ctypes.
        self.mem = mmap.mmap(-1, size)
        self.base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        r = lib.toffload_guard_register(self.base, size)
        if r < 0:
            raise OSError(-r, "toffload_guard_register: " + os.strerror(-r))
        self.lib, self.helper, self.accel = lib, helper, accel
        self.token = 0
        self.locked = False
        self.waiting = collections.deque()  # (wants, future) of requests sent back

    def slot(self, key):
        h = 1469598103934665603
        for b in key:
            h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
        return h % self.SLOTS

    def addr(self, slot):
        return self.base + slot * self.WORDS * 8

    def wake(self, wants):
        """Wakes the first waiting request that wants what was freed (FIFO)."""
        for i, (w, fut) in enumerate(self.waiting):
            if wants(w) and not fut.done():
                del self.waiting[i]
                fut.set_result(None)
                return

    def ended(self, token, slot):
        self.lib.toffload_guard_end(token)
        page = slot // self.PER_PAGE
        self.wake(lambda w: w[0] == "sum" or w[1] // self.PER_PAGE == page)

    async def wait(self, kind, slot):
        fut = asyncio.get_running_loop().create_future()
        entry = ((kind, slot), fut)
        self.waiting.append(entry)
        try:
            await asyncio.wait_for(fut, self.WAIT_S)
        finally:
            if entry in self.waiting:  # timed out or cancelled: leave no trace
                self.waiting.remove(entry)

    # GUARD BEGIN
    async def op(self, kind, slot):
        """kind: incr, incrlocked, get or sum; the counter's new value (or the read)."""
        self.token += 1
        token = self.token
        out = ctypes.c_uint64()
        while True:
            if kind == "incrlocked" and self.locked:
                await self.wait(kind, slot)
                continue
            n, at = (self.SLOTS, self.base) if kind == "sum" else (1, self.addr(slot))
            r = self.helper.toffload_py_begin_read(token, at, n, self.WORDS, ctypes.byref(out))
            if r == 1:  # enforce: a parked request owns the page
                await self.wait(kind, slot)
                continue
            if r < 0:
                raise OSError(-r, "toffload_guard_begin: " + os.strerror(-r))
            break
        old = out.value
        if kind in ("get", "sum"):
            self.ended(token, slot)
            return old
        if kind == "incrlocked":
            self.locked = True
        self.lib.toffload_guard_park(token)
        wrote = False
        try:
            await self.accel.run(old.to_bytes(8, "little"))
            self.lib.toffload_guard_resume(token)
            ctypes.c_uint64.from_address(self.addr(slot)).value = old + 1  # the write back
            wrote = True
        finally:
            # Done, failed or cancelled: free the page (and the lock), wake who waits.
            self.ended(token, slot)
            if kind == "incrlocked":
                self.locked = False
                self.wake(lambda w: w[0] == "incrlocked")
        return old + 1 if wrote else None
    # GUARD END

    def stats(self):
        class Stats(ctypes.Structure):
            _fields_ = [("mode", ctypes.c_int), ("uffd_async", ctypes.c_int)] + [
                (f, ctypes.c_ulonglong)
                for f in ("pages", "faults", "conflicts", "deferred", "released")
            ]

        s = Stats()
        self.lib.toffload_guard_stats.argtypes = [ctypes.POINTER(Stats)]
        r = self.lib.toffload_guard_stats(ctypes.byref(s))
        if r < 0:
            raise OSError(-r, "toffload_guard_stats: " + os.strerror(-r))
        mode = ("off", "detect", "enforce")[s.mode]
        mech = "off" if s.mode == 0 else "uffd-async" if s.mode == 1 and s.uffd_async else "mprotect"
        return "%s %s %d %d %d %d %d\n" % (
            mode, mech, s.pages, s.faults, s.conflicts, s.deferred, s.released
        )


PAYLOADS = {}


def payload(n):
    p = PAYLOADS.get(n)
    if p is None:
        p = bytes((i * 7) & 0xFF for i in range(n))
        if len(PAYLOADS) < 64:
            PAYLOADS[n] = p
    return p


def response(status, body, ctype=b"application/octet-stream"):
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + ctype
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def size_of(query):
    for kv in query.split("&"):
        k, _, v = kv.partition("=")
        if k == "n":
            if not v.isdigit() or not 1 <= int(v) <= MAX_BYTES:
                raise ValueError("n must be an integer from 1 to %d" % MAX_BYTES)
            return int(v)
    return 1024


def key_of(query):
    for kv in query.split("&"):
        k, _, v = kv.partition("=")
        if k == "k":
            return v.encode("latin-1")
    return None


async def answer_counter(counters, path, query):
    if counters is None:
        return response(b"501 Not Implemented", b"start with --guard-helper\n", b"text/plain")
    if path == "/guard":
        return response(b"200 OK", counters.stats().encode(), b"text/plain")
    kind = path[1:]
    key = b"" if kind == "sum" else key_of(query)
    if key is None:
        return response(b"400 Bad Request", b"k=KEY is missing\n", b"text/plain")
    try:
        v = await counters.op(kind, counters.slot(key))
    except asyncio.TimeoutError:
        return response(
            b"503 Service Unavailable", b"the guard's wait timed out\n", b"text/plain"
        )
    except OSError as e:
        return response(b"500 Internal Server Error", (str(e) + "\n").encode(), b"text/plain")
    return response(b"200 OK", b"%d\n" % v, b"text/plain")


async def answer(accel, target, counters=None):
    path, _, query = target.partition("?")
    if path in ("/incr", "/incrlocked", "/get", "/sum", "/guard"):
        return await answer_counter(counters, path, query)
    if path == "/stats":
        now = len(accel.inflight or {})
        body = ("%d %d %d\n" % (now, accel.max_inflight, accel.finished)).encode()
        return response(b"200 OK", body, b"text/plain")
    if path not in ("/sync", "/async"):
        return response(b"404 Not Found", b"no such path\n", b"text/plain")
    try:
        n = size_of(query)
    except ValueError as e:
        return response(b"400 Bad Request", (str(e) + "\n").encode(), b"text/plain")
    try:
        if path == "/sync":
            out = accel.run_sync(payload(n))
        else:
            out = await accel.run(payload(n))
    except OSError as e:
        return response(b"500 Internal Server Error", (str(e) + "\n").encode(), b"text/plain")
    return response(b"200 OK", out)


async def serve_conn(accel, reader, writer, counters=None):
    try:
        while True:
            line = await reader.readline()
            if not line:
                break
            parts = line.split()
            # Headers: read and bounded (a peer cannot make us hold more than 100).
            for _ in range(100):
                h = await reader.readline()
                if h in (b"\r\n", b"\n", b""):
                    break
            else:
                writer.write(response(b"431 Request Header Fields Too Large", b"", b"text/plain"))
                break
            if len(parts) != 3 or parts[0] != b"GET":
                writer.write(response(b"400 Bad Request", b"GET only\n", b"text/plain"))
                break
            writer.write(await answer(accel, parts[1].decode("latin-1"), counters))
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
        pass
    finally:
        writer.close()


async def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8080, help="0: any; the port is printed")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--lib", required=True, help="path of libtoffload_accel.so")
    ap.add_argument("--guard-helper", help="toffload_guard_helper.so: offer /incr and the rest")
    a = ap.parse_args()
    accel = Accel(a.lib)
    counters = None
    if a.guard_helper:
        try:
            counters = Counters(accel, a.guard_helper)
        except (ValueError, OSError) as e:
            print("toffload_asyncio: " + str(e), file=sys.stderr)
            sys.exit(2)
    server = await asyncio.start_server(
        lambda r, w: serve_conn(accel, r, w, counters), a.host, a.port, limit=16384, backlog=1024
    )
    port = server.sockets[0].getsockname()[1]
    print("port", port, flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        sys.exit(0)
