//! The driver API this library exports: each function checks its arguments, simulates
//! what it returns (handles, device addresses) and queues the call for the daemon;
//! only the functions whose answer the program needs wait (device queries once each,
//! cuModuleGetFunction for the parameter layout, synchronize, DtoH).

use crate::remote::{self, log, CuResult, PendKind, Remote, INVALID_HANDLE, INVALID_VALUE};
use crate::remote::{NOT_SUPPORTED, SUCCESS};
use crate::replay::Rec;
use crate::wire::{self, Call, Query};
use libc::{c_char, c_int, c_uint, c_void, size_t};
use std::ffi::CStr;

type CUdeviceptr = u64;
type Handle = *mut c_void;

fn r() -> Result<&'static Remote, CuResult> {
    remote::get().map(|a| &**a)
}

macro_rules! tri {
    ($e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return e,
        }
    };
}

fn handle(id: u64) -> Handle {
    (id << 8) as Handle
}

fn id_of(h: Handle) -> u64 {
    h as u64 >> 8
}

/// A stream handle's id: the null, legacy (0x1) and per-thread (0x2) handles are all
/// the default stream here.
fn stream_of(h: Handle) -> u64 {
    if (h as u64) < 0x100 {
        wire::NULL_STREAM
    } else {
        id_of(h)
    }
}

fn done(r: Result<(), CuResult>) -> CuResult {
    match r {
        Ok(()) => SUCCESS,
        Err(e) => e,
    }
}

#[no_mangle]
pub extern "C" fn cuInit(_flags: c_uint) -> CuResult {
    done(r().map(|_| ()))
}

fn driver_info() -> Result<(i32, i32), CuResult> {
    let a = cached("driver", || Call::Query {
        req: 0,
        q: Query::Driver,
    })?;
    if a.len() != 8 {
        return Err(INVALID_VALUE);
    }
    Ok((
        i32::from_le_bytes(a[..4].try_into().unwrap()),
        i32::from_le_bytes(a[4..].try_into().unwrap()),
    ))
}

/// A query's answer, asked once per process.
fn cached(key: &str, q: impl Fn() -> Call<'static>) -> Result<Vec<u8>, CuResult> {
    let r = r()?;
    if let Some(a) = r.cached.lock().unwrap_or_else(|p| p.into_inner()).get(key) {
        return Ok(a.clone());
    }
    let a = r.ask(|req| match q() {
        Call::Query { q, .. } => Call::Query { req, q },
        c => c,
    })?;
    r.cached
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(key.to_string(), a.clone());
    Ok(a)
}

/// # Safety
/// `v` points to an int (the driver API's contract).
#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CuResult {
    if v.is_null() {
        return INVALID_VALUE;
    }
    let (ver, _) = tri!(driver_info());
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *v = ver };
    SUCCESS
}

/// # Safety
/// `n` points to an int.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CuResult {
    if n.is_null() {
        return INVALID_VALUE;
    }
    let (_, count) = tri!(driver_info());
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *n = count };
    SUCCESS
}

/// # Safety
/// `dev` points to an int.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(dev: *mut c_int, ordinal: c_int) -> CuResult {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    let (_, count) = tri!(driver_info());
    if ordinal < 0 || ordinal >= count {
        return 101; // CUDA_ERROR_INVALID_DEVICE
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *dev = ordinal };
    SUCCESS
}

/// # Safety
/// `name` points to `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CuResult {
    if name.is_null() || len <= 0 {
        return INVALID_VALUE;
    }
    let a = tri!(cached(&format!("name {dev}"), || Call::Query {
        req: 0,
        q: Query::Name { dev },
    }));
    let n = a.len().min(len as usize - 1);
    // SAFETY: the caller's buffer holds `len` bytes; we write n + 1 <= len.
    unsafe {
        std::ptr::copy_nonoverlapping(a.as_ptr(), name as *mut u8, n);
        *name.add(n) = 0;
    }
    SUCCESS
}

/// # Safety
/// `v` points to an int.
#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(v: *mut c_int, attr: c_int, dev: c_int) -> CuResult {
    if v.is_null() {
        return INVALID_VALUE;
    }
    let a = tri!(cached(&format!("attr {dev} {attr}"), || Call::Query {
        req: 0,
        q: Query::Attr { dev, attr },
    }));
    if a.len() != 4 {
        return INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *v = i32::from_le_bytes(a[..4].try_into().unwrap()) };
    SUCCESS
}

/// The context handle the program sees (one primary context per device).
fn ctx_handle(dev: c_int) -> Handle {
    (0xc7c7_0000_0000_u64 + dev as u64) as Handle
}

/// # Safety
/// `ctx` points to a handle.
#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: c_int) -> CuResult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    tri!(r.send(&Call::CtxRetain { dev }, false));
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *ctx = ctx_handle(dev) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(_dev: c_int) -> CuResult {
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease(dev: c_int) -> CuResult {
    cuDevicePrimaryCtxRelease_v2(dev)
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CuResult {
    if ctx.is_null() || (ctx as u64) >> 16 == 0xc7c7_0000 {
        SUCCESS
    } else {
        INVALID_HANDLE
    }
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CuResult {
    let r = tri!(r());
    r.sync_all()
}

/// # Safety
/// `ctx` points to a handle.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Handle) -> CuResult {
    if ctx.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer from the caller. One device's primary context
    // is the only context there is.
    unsafe { *ctx = ctx_handle(0) };
    SUCCESS
}

/// # Safety
/// `dev` points to an int.
#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(dev: *mut c_int) -> CuResult {
    if dev.is_null() {
        return INVALID_VALUE;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *dev = 0 };
    SUCCESS
}

/// # Safety
/// `dptr` points to a CUdeviceptr.
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, size: size_t) -> CuResult {
    if dptr.is_null() || size == 0 {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    let addr = r.alloc_addr(size as u64);
    let size = size as u64;
    tri!(r.send_rec(
        &Call::MemAlloc { addr, size },
        Some(Rec::Alloc { addr, size }),
        false
    ));
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *dptr = addr };
    SUCCESS
}

/// # Safety
/// As cuMemAlloc_v2 (the 64-bit form; headers since CUDA 3.2 map the name to it).
#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc(dptr: *mut CUdeviceptr, size: size_t) -> CuResult {
    // SAFETY: same contract.
    unsafe { cuMemAlloc_v2(dptr, size) }
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(dptr: CUdeviceptr) -> CuResult {
    if dptr == 0 {
        return SUCCESS;
    }
    if !wire::is_sim(dptr) {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    r.freed(dptr);
    done(r.send_rec(
        &Call::MemFree { addr: dptr },
        Some(Rec::Free { addr: dptr }),
        false,
    ))
}

#[no_mangle]
pub extern "C" fn cuMemFree(dptr: CUdeviceptr) -> CuResult {
    cuMemFree_v2(dptr)
}

/// # Safety
/// `p` points to a pointer.
#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    p: *mut *mut c_void,
    size: size_t,
    _flags: c_uint,
) -> CuResult {
    if p.is_null() {
        return INVALID_VALUE;
    }
    let mut m: *mut c_void = std::ptr::null_mut();
    // SAFETY: plain allocation; host memory stays on the client (nothing to pin).
    if unsafe { libc::posix_memalign(&mut m, 4096, size.max(1)) } != 0 {
        return 2; // CUDA_ERROR_OUT_OF_MEMORY
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *p = m };
    SUCCESS
}

/// # Safety
/// As cuMemHostAlloc.
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(p: *mut *mut c_void, size: size_t) -> CuResult {
    // SAFETY: same contract.
    unsafe { cuMemHostAlloc(p, size, 0) }
}

/// # Safety
/// `p` came from cuMemHostAlloc.
#[no_mangle]
pub unsafe extern "C" fn cuMemFreeHost(p: *mut c_void) -> CuResult {
    // SAFETY: allocated by posix_memalign in cuMemHostAlloc.
    unsafe { libc::free(p) };
    SUCCESS
}

/// Queues the copy of `n` bytes at `src` to `dst`, cut into pieces (each a call;
/// large copies cached per piece).
fn htod(r: &Remote, stream: u64, dst: CUdeviceptr, src: *const u8, n: usize) -> CuResult {
    if n == 0 {
        return SUCCESS;
    }
    if src.is_null() || !wire::is_sim(dst) {
        return INVALID_VALUE;
    }
    // SAFETY: the program passed `n` readable bytes at `src` (the driver's contract);
    // they are copied into the batch before we return.
    let bytes = unsafe { std::slice::from_raw_parts(src, n) };
    let data = tri!(r.upload(bytes.chunks(wire::PIECE).collect(), n >= r.cache_min));
    for (i, data) in data.into_iter().enumerate() {
        let dst = dst + (i * wire::PIECE) as u64;
        // The guardian keeps the bytes (a copy, only while it is on).
        let rec = r.guarded().then(|| Rec::HtoD {
            stream,
            dst,
            bytes: bytes[i * wire::PIECE..][..data.len()].to_vec(),
        });
        tri!(r.send_rec(&Call::HtoD { stream, dst, data }, rec, false));
    }
    r.restored(dst, n as u64);
    r.touch(stream);
    SUCCESS
}

/// # Safety
/// `src` holds `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: size_t,
    stream: Handle,
) -> CuResult {
    let r = tri!(r());
    htod(r, stream_of(stream), dst, src as *const u8, n)
}

/// # Safety
/// `src` holds `n` bytes. The bytes are in the batch when this returns, as the
/// synchronous copy promises; the copy runs in the default stream's order.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: size_t,
) -> CuResult {
    let r = tri!(r());
    htod(r, wire::NULL_STREAM, dst, src as *const u8, n)
}

/// Largest DtoH piece (one note each).
const DTOH_PIECE: usize = 4 << 20;

fn dtoh(r: &Remote, stream: u64, dst: *mut u8, src: CUdeviceptr, n: usize, wait: bool) -> CuResult {
    if n == 0 {
        return SUCCESS;
    }
    if dst.is_null() || !wire::is_sim(src) {
        return INVALID_VALUE;
    }
    let mut last = 0;
    for off in (0..n).step_by(DTOH_PIECE) {
        let len = DTOH_PIECE.min(n - off);
        let d = dst as usize + off;
        let seq = r.track(stream, |_| PendKind::DtoH { dst: d, len });
        let (src, len) = (src + off as u64, len as u32);
        tri!(r.send_rec(
            &Call::DtoH {
                stream,
                seq,
                src,
                len,
            },
            Some(Rec::DtoH {
                stream,
                seq,
                src,
                len,
                data: None
            }),
            false
        ));
        last = seq;
    }
    if !wait {
        return SUCCESS;
    }
    tri!(r.flush());
    r.wait_seq(stream, last)
}

/// # Safety
/// `dst` holds `n` bytes and stays valid until the stream gets there.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: size_t,
    stream: Handle,
) -> CuResult {
    let r = tri!(r());
    dtoh(r, stream_of(stream), dst as *mut u8, src, n, false)
}

/// # Safety
/// `dst` holds `n` bytes.
#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: size_t,
) -> CuResult {
    let r = tri!(r());
    dtoh(r, wire::NULL_STREAM, dst as *mut u8, src, n, true)
}

/// # Safety
/// `out` points to a handle.
#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(out: *mut Handle, flags: c_uint) -> CuResult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    let id = r.id();
    r.stream_created(id);
    tri!(r.send_rec(
        &Call::StreamCreate { id, flags },
        Some(Rec::StreamCreate { id, flags }),
        false
    ));
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *out = handle(id) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(stream: Handle) -> CuResult {
    let id = stream_of(stream);
    if id == wire::NULL_STREAM {
        return INVALID_HANDLE;
    }
    let r = tri!(r());
    // A last marker, so that the stream's record is dropped once the daemon is there.
    let seq = r.track(id, |_| PendKind::Mark);
    tri!(r.send_rec(
        &Call::Marker {
            stream: id,
            seq,
            sync: false
        },
        Some(Rec::Marker { stream: id, seq }),
        false
    ));
    r.stream_destroyed(id);
    done(r.send_rec(
        &Call::StreamDestroy { id },
        Some(Rec::StreamDestroy { id }),
        false,
    ))
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy(stream: Handle) -> CuResult {
    cuStreamDestroy_v2(stream)
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(stream: Handle) -> CuResult {
    let r = tri!(r());
    r.sync_stream(stream_of(stream))
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(stream: Handle) -> CuResult {
    let r = tri!(r());
    r.query_stream(stream_of(stream))
}

/// # Safety
/// `out` points to a handle.
#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(out: *mut Handle, flags: c_uint) -> CuResult {
    if out.is_null() {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    let id = r.id();
    let rc = r.event_create(id, flags);
    if rc != SUCCESS {
        return rc;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *out = handle(id) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(ev: Handle) -> CuResult {
    let r = tri!(r());
    r.event_destroy(id_of(ev))
}

#[no_mangle]
pub extern "C" fn cuEventDestroy(ev: Handle) -> CuResult {
    cuEventDestroy_v2(ev)
}

#[no_mangle]
pub extern "C" fn cuEventRecord(ev: Handle, stream: Handle) -> CuResult {
    let r = tri!(r());
    r.event_record(id_of(ev), stream_of(stream))
}

#[no_mangle]
pub extern "C" fn cuEventQuery(ev: Handle) -> CuResult {
    let r = tri!(r());
    r.event_query(id_of(ev))
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(ev: Handle) -> CuResult {
    let r = tri!(r());
    r.event_sync(id_of(ev))
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(stream: Handle, ev: Handle, flags: c_uint) -> CuResult {
    if flags != 0 {
        return unsupported("cuStreamWaitEvent with flags");
    }
    let r = tri!(r());
    r.wait_event(stream_of(stream), id_of(ev))
}

/// # Safety
/// `ms` points to a float.
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CuResult {
    if ms.is_null() {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    let v = tri!(r.elapsed(id_of(start), id_of(end)));
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *ms = v };
    SUCCESS
}

/// # Safety
/// As cuEventElapsedTime (CUDA 13's name for it).
#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: Handle,
    end: Handle,
) -> CuResult {
    // SAFETY: same contract.
    unsafe { cuEventElapsedTime(ms, start, end) }
}

/// # Safety
/// `f` is a host function the program may have called with `user` on any thread.
#[no_mangle]
pub unsafe extern "C" fn cuLaunchHostFunc(
    stream: Handle,
    f: Option<unsafe extern "C" fn(*mut c_void)>,
    user: *mut c_void,
) -> CuResult {
    let Some(f) = f else { return INVALID_VALUE };
    let r = tri!(r());
    let stream = stream_of(stream);
    let seq = r.track(stream, |_| PendKind::HostFn {
        f,
        user: user as usize,
    });
    done(r.send_rec(
        &Call::Marker {
            stream,
            seq,
            sync: false,
        },
        Some(Rec::Marker { stream, seq }),
        false,
    ))
}

/// The length of a module image: an ELF's (cubin), a fatbin's (its header says), or
/// a NUL-terminated PTX text's.
///
/// # Safety
/// `image` is a complete image as cuModuleLoadData takes.
unsafe fn image_len(image: *const u8) -> usize {
    // SAFETY: every image is at least 16 bytes or a NUL-terminated string; we read
    // the header only where its magic says it is one.
    unsafe {
        if std::slice::from_raw_parts(image, 4) == b"\x7fELF" {
            let shoff = (image.add(0x28) as *const u64).read_unaligned() as usize;
            let shentsize = (image.add(0x3a) as *const u16).read_unaligned() as usize;
            let shnum = (image.add(0x3c) as *const u16).read_unaligned() as usize;
            return shoff + shentsize * shnum;
        }
        if (image as *const u32).read_unaligned() == 0xBA55_ED50 {
            let hsize = (image.add(6) as *const u16).read_unaligned() as usize;
            let fsize = (image.add(8) as *const u64).read_unaligned() as usize;
            return hsize + fsize;
        }
        CStr::from_ptr(image as *const c_char).to_bytes().len()
    }
}

/// # Safety
/// `module` points to a handle; `image` is a complete module image.
#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(module: *mut Handle, image: *const c_void) -> CuResult {
    if module.is_null() || image.is_null() {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    // SAFETY: the caller's contract.
    let n = unsafe { image_len(image as *const u8) };
    if n > wire::MAX_BYTES {
        return INVALID_VALUE;
    }
    // SAFETY: `n` bytes of the caller's image.
    let bytes = unsafe { std::slice::from_raw_parts(image as *const u8, n) };
    let id = r.id();
    let image = tri!(r.upload(vec![bytes], true)).remove(0);
    let rec = r.guarded().then(|| Rec::Module {
        id,
        image: bytes.to_vec(),
    });
    tri!(r.send_rec(&Call::ModuleLoad { id, image }, rec, false));
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *module = handle(id) };
    SUCCESS
}

/// # Safety
/// `f` points to a handle; `name` is a C string.
#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CuResult {
    if f.is_null() || name.is_null() {
        return INVALID_VALUE;
    }
    let r = tri!(r());
    // SAFETY: a C string from the caller.
    let Ok(name) = unsafe { CStr::from_ptr(name) }.to_str() else {
        return INVALID_VALUE;
    };
    let id = r.id();
    let module = id_of(module);
    let a = tri!(r.ask(|req| Call::GetFunction {
        req,
        module,
        id,
        name,
    }));
    let layout: Vec<(u32, u32)> = a
        .chunks_exact(8)
        .map(|c| {
            (
                u32::from_le_bytes(c[..4].try_into().unwrap()),
                u32::from_le_bytes(c[4..].try_into().unwrap()),
            )
        })
        .collect();
    r.funcs
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .insert(id, layout);
    r.journal(Rec::Func {
        id,
        module,
        name: name.to_string(),
    });
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *f = handle(id) };
    SUCCESS
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(module: Handle) -> CuResult {
    let r = tri!(r());
    let id = id_of(module);
    done(r.send_rec(
        &Call::ModuleUnload { id },
        Some(Rec::ModuleUnload { id }),
        false,
    ))
}

/// # Safety
/// `params` holds one pointer per kernel parameter, each to the parameter's bytes.
#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shmem: c_uint,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CuResult {
    if !extra.is_null() {
        return unsupported("cuLaunchKernel with `extra` parameters");
    }
    let r = tri!(r());
    let func = id_of(f);
    let layout = match r.funcs.lock().unwrap_or_else(|p| p.into_inner()).get(&func) {
        Some(l) => l.clone(),
        None => return INVALID_HANDLE,
    };
    if !layout.is_empty() && params.is_null() {
        return INVALID_VALUE;
    }
    let mut blob = Vec::new();
    // Parameters that are addresses in our allocations (as the daemon translates
    // them): the buffers the kernel may read and write.
    let mut ptrs = Vec::new();
    for (i, &(_, size)) in layout.iter().enumerate() {
        // SAFETY: the program passes one pointer per parameter, each to `size` bytes
        // (the function's own layout).
        unsafe {
            let p = *params.add(i) as *const u8;
            if p.is_null() {
                return INVALID_VALUE;
            }
            let b = std::slice::from_raw_parts(p, size as usize);
            if size == 8 {
                let v = u64::from_le_bytes(b.try_into().expect("8 bytes"));
                if wire::is_sim(v) {
                    ptrs.push(v);
                }
            }
            blob.extend_from_slice(b);
        }
    }
    let stream = stream_of(stream);
    let (grid, block) = ([gx, gy, gz], [bx, by, bz]);
    let call = Call::Launch {
        func,
        stream,
        grid,
        block,
        shmem,
        params: &blob,
    };
    let rec = r.guarded().then(|| Rec::Launch {
        func,
        stream,
        grid,
        block,
        shmem,
        params: blob.clone(),
        ptrs,
    });
    let rc = done(r.send_rec(&call, rec, false));
    r.touch(stream);
    rc
}

static ERRORS: &[(CuResult, &CStr, &CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (
        46,
        c"CUDA_ERROR_DEVICE_UNAVAILABLE",
        c"the remote CUDA daemon is unreachable",
    ),
    (
        100,
        c"CUDA_ERROR_NO_DEVICE",
        c"no CUDA-capable device is detected",
    ),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (
        200,
        c"CUDA_ERROR_INVALID_IMAGE",
        c"device kernel image is invalid",
    ),
    (
        400,
        c"CUDA_ERROR_INVALID_HANDLE",
        c"invalid resource handle",
    ),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (
        909,
        c"CUDA_ERROR_TIMEOUT",
        c"the remote CUDA daemon did not answer in time",
    ),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// # Safety
/// `s` points to a string pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(e: CuResult, s: *mut *const c_char) -> CuResult {
    if s.is_null() {
        return INVALID_VALUE;
    }
    let name = ERRORS
        .iter()
        .find(|x| x.0 == e)
        .map_or(c"CUDA_ERROR_UNKNOWN", |x| x.1);
    // SAFETY: non-null out-pointer; the string is static.
    unsafe { *s = name.as_ptr() };
    SUCCESS
}

/// # Safety
/// `s` points to a string pointer.
#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(e: CuResult, s: *mut *const c_char) -> CuResult {
    if s.is_null() {
        return INVALID_VALUE;
    }
    let text = ERRORS
        .iter()
        .find(|x| x.0 == e)
        .map_or(c"unknown error", |x| x.2);
    // SAFETY: non-null out-pointer; the string is static.
    unsafe { *s = text.as_ptr() };
    SUCCESS
}

/// CUDA_ERROR_NOT_SUPPORTED, with one line on stderr per function named.
pub fn unsupported(name: &str) -> CuResult {
    use std::sync::Mutex;
    static SEEN: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut seen = SEEN.lock().unwrap_or_else(|p| p.into_inner());
    if !seen.iter().any(|s| s == name) {
        seen.push(name.to_string());
        log(&format!(
            "{name} is not supported by the remote CUDA client: CUDA_ERROR_NOT_SUPPORTED"
        ));
    }
    NOT_SUPPORTED
}

/// The driver's private tables, which NVRTC 13 asks libcuda.so.1 for when it loads
/// beside it and dereferences unless the call fails: a failure with the table set to
/// null, so that the client compiles with NVRTC and ships the image.
#[no_mangle]
pub extern "C" fn cuGetExportTable(table: *mut *const c_void, _id: *const c_void) -> CuResult {
    if !table.is_null() {
        // SAFETY: a non-null out-pointer from the caller.
        unsafe { *table = std::ptr::null() };
    }
    unsupported("cuGetExportTable")
}

/// Driver functions outside the remoted subset: each fails with
/// CUDA_ERROR_NOT_SUPPORTED and says so once (no arguments are read, so one
/// signature serves all).
macro_rules! unsupported {
    ($($name:ident)*) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> CuResult {
            unsupported(stringify!($name))
        }
    )*};
}

unsupported! {
    cuGetProcAddress cuGetProcAddress_v2 cuCtxCreate_v2 cuCtxCreate_v3 cuCtxCreate_v4
    cuCtxDestroy_v2 cuCtxPushCurrent_v2 cuCtxPopCurrent_v2 cuDeviceTotalMem_v2 cuDeviceGetUuid cuDeviceGetUuid_v2
    cuDeviceComputeCapability cuDevicePrimaryCtxReset_v2 cuDevicePrimaryCtxGetState
    cuDevicePrimaryCtxSetFlags_v2 cuMemGetInfo_v2 cuMemAllocManaged cuMemAllocPitch_v2
    cuMemAllocAsync cuMemFreeAsync cuMemsetD8_v2 cuMemsetD32_v2 cuMemsetD8Async
    cuMemsetD32Async cuMemcpy cuMemcpyAsync cuMemcpyDtoD_v2 cuMemcpyDtoDAsync_v2
    cuMemcpy2D_v2 cuMemcpy2DAsync_v2 cuMemcpy3D_v2 cuMemHostRegister_v2
    cuMemHostUnregister cuMemHostGetDevicePointer_v2 cuPointerGetAttribute
    cuModuleLoad cuModuleLoadDataEx cuModuleLoadFatBinary cuModuleGetGlobal_v2
    cuLibraryLoadData cuLibraryGetKernel cuLaunchKernelEx cuLaunchCooperativeKernel
    cuFuncGetAttribute cuFuncSetAttribute cuFuncSetCacheConfig cuFuncGetParamInfo
    cuOccupancyMaxActiveBlocksPerMultiprocessor cuOccupancyMaxPotentialBlockSize
    cuStreamCreateWithPriority cuStreamAddCallback
    cuStreamBeginCapture_v2 cuStreamEndCapture cuStreamGetFlags cuStreamGetPriority
    cuEventRecordWithFlags cuGraphCreate
    cuGraphLaunch cuGraphInstantiateWithFlags cuIpcGetMemHandle cuIpcOpenMemHandle_v2
    cuMemAddressReserve cuMemCreate cuMemMap cuMemSetAccess cuMemRelease cuMemUnmap
}
