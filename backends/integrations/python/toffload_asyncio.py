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

    python3 toffload_asyncio.py --port 8080 --lib target/toffload/lib/libtoffload_accel.so

The device is configured by the TOFFLOAD_* variables of the environment, as
everywhere else (docs/configuration.md).
"""

import argparse
import asyncio
import ctypes
import errno
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


async def answer(accel, target):
    path, _, query = target.partition("?")
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


async def serve_conn(accel, reader, writer):
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
            writer.write(await answer(accel, parts[1].decode("latin-1")))
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
    a = ap.parse_args()
    accel = Accel(a.lib)
    server = await asyncio.start_server(
        lambda r, w: serve_conn(accel, r, w), a.host, a.port, limit=16384, backlog=1024
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
