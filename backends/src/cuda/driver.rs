//! Finding the CUDA driver and NVRTC, and the device's context.
//!
//! cudarc loads libcuda/libnvrtc lazily and panics when a library or a symbol is
//! missing. A panic inside someone else's server is not an error report, so before
//! the first call we dlopen the same library names cudarc would and dlsym every
//! function this backend uses: a missing one becomes an error that names it.

use cudarc::driver::sys;
use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt;
use std::sync::OnceLock;

/// Why the cuda backend cannot do something; each maps to the errno the C ABI returns.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CuError {
    /// libcuda or libnvrtc cannot be loaded, or lacks a function (ENODEV).
    Missing(String),
    /// The driver loaded but found no usable device (ENODEV).
    NoDevice(String),
    /// Device or pinned host memory exhausted (ENOMEM).
    OutOfMemory(String),
    /// NVRTC could not compile the kernel, or the module would not load (EIO).
    Kernel(String),
    /// Any other driver failure (EIO).
    Driver(String),
    /// The device did not finish an operation in time (EIO).
    Hung(String),
}

impl CuError {
    pub fn errno(&self) -> i32 {
        match self {
            CuError::Missing(_) | CuError::NoDevice(_) => libc::ENODEV,
            CuError::OutOfMemory(_) => libc::ENOMEM,
            CuError::Kernel(_) | CuError::Driver(_) | CuError::Hung(_) => libc::EIO,
        }
    }

    /// A short name for the kind, used to log each kind once.
    pub fn kind(&self) -> usize {
        match self {
            CuError::Missing(_) => 0,
            CuError::NoDevice(_) => 1,
            CuError::OutOfMemory(_) => 2,
            CuError::Kernel(_) => 3,
            CuError::Driver(_) => 4,
            CuError::Hung(_) => 5,
        }
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CuError::Missing(m)
            | CuError::NoDevice(m)
            | CuError::OutOfMemory(m)
            | CuError::Kernel(m)
            | CuError::Driver(m)
            | CuError::Hung(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for CuError {}

/// Every driver function this backend calls (through cudarc's sys layer).
const DRIVER_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxSetCurrent",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuEventCreate",
    "cuEventDestroy_v2",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventSynchronize",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemHostAlloc",
    "cuMemFreeHost",
    "cuMemcpyHtoDAsync_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuLaunchKernel",
    "cuLaunchHostFunc",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuModuleUnload",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Every NVRTC function kernel.rs calls.
const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcGetErrorString",
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcGetPTXSize",
    "nvrtcGetPTX",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcDestroyProgram",
];

fn dlerror() -> String {
    // SAFETY: dlerror returns a thread-local string or null.
    let e = unsafe { libc::dlerror() };
    if e.is_null() {
        "unknown error".into()
    } else {
        // SAFETY: non-null C string from dlerror.
        unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned()
    }
}

/// dlopens the first of cudarc's candidate names for `lib` that loads (the one cudarc
/// itself will use) and checks `symbols`; the handle stays open for cudarc.
fn probe(lib: &str, what: &str, symbols: &[&str]) -> Result<(), CuError> {
    probe_names(lib, &cudarc::get_lib_name_candidates(lib), what, symbols)
}

fn probe_names(lib: &str, names: &[String], what: &str, symbols: &[&str]) -> Result<(), CuError> {
    let mut first_err = None;
    for name in names {
        let c = CString::new(name.clone()).expect("library name");
        // SAFETY: plain dlopen of a library name; the handle is deliberately kept.
        let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if h.is_null() {
            let e = dlerror();
            // The `.so.1`/`.so` names are the informative ones; keep the first error.
            first_err.get_or_insert(e);
            continue;
        }
        for sym in symbols {
            let s = CString::new(*sym).expect("symbol");
            // SAFETY: valid handle and C string.
            if unsafe { libc::dlsym(h, s.as_ptr()) }.is_null() {
                return Err(CuError::Missing(format!(
                    "{what} {name} lacks {sym} (too old for this backend, which needs CUDA 12 or later)"
                )));
            }
        }
        return Ok(());
    }
    Err(CuError::Missing(format!(
        "cannot load the {what} (lib{lib}.so, lib{lib}.so.1, ...): {}",
        first_err.unwrap_or_default()
    )))
}

/// The driver library, checked once per process.
pub fn probe_driver() -> Result<(), CuError> {
    static ONCE: OnceLock<Result<(), CuError>> = OnceLock::new();
    ONCE.get_or_init(|| {
        probe("cuda", "CUDA driver library", DRIVER_SYMBOLS).map_err(|e| match e {
            CuError::Missing(m) => CuError::Missing(format!(
                "{m}; is the NVIDIA driver installed and is this a GPU machine?"
            )),
            other => other,
        })
    })
    .clone()
}

/// The address of the driver's function `sym` (None: no driver, or it lacks the
/// function), for the calls cudarc's bindings would panic on when missing.
pub fn driver_sym(sym: &str) -> Option<usize> {
    static HANDLE: OnceLock<usize> = OnceLock::new();
    probe_driver().ok()?;
    let h = *HANDLE.get_or_init(|| {
        for name in cudarc::get_lib_name_candidates("cuda") {
            let c = CString::new(name).expect("library name");
            // SAFETY: plain dlopen of a library name (already loaded by the probe);
            // the handle is kept for the process.
            let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !h.is_null() {
                return h as usize;
            }
        }
        0
    });
    if h == 0 {
        return None;
    }
    let s = CString::new(sym).ok()?;
    // SAFETY: a valid handle and C string.
    let p = unsafe { libc::dlsym(h as *mut std::ffi::c_void, s.as_ptr()) };
    (!p.is_null()).then_some(p as usize)
}

/// NVRTC, checked once per process (needed only to compile the kernel).
pub fn probe_nvrtc() -> Result<(), CuError> {
    static ONCE: OnceLock<Result<(), CuError>> = OnceLock::new();
    ONCE.get_or_init(|| {
        probe("nvrtc", "NVRTC library", NVRTC_SYMBOLS).map_err(|e| match e {
            CuError::Missing(m) => CuError::Missing(format!(
                "{m}; install the CUDA toolkit's NVRTC or put it on LD_LIBRARY_PATH"
            )),
            other => other,
        })
    })
    .clone()
}

fn error_name(r: sys::CUresult) -> String {
    let mut name: *const c_char = std::ptr::null();
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: out-pointers valid; the driver returns static strings.
    unsafe {
        sys::cuGetErrorName(r, &mut name);
        sys::cuGetErrorString(r, &mut text);
    }
    let s = |p: *const c_char| {
        if p.is_null() {
            format!("{r:?}")
        } else {
            // SAFETY: non-null static C string from the driver.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    format!("{} ({})", s(name), s(text))
}

/// Turns a driver result into a CuError that says what we were doing.
pub fn check(r: sys::CUresult, what: &str) -> Result<(), CuError> {
    use sys::CUresult as R;
    match r {
        R::CUDA_SUCCESS => Ok(()),
        R::CUDA_ERROR_OUT_OF_MEMORY => Err(CuError::OutOfMemory(format!(
            "out of memory {what}: {}",
            error_name(r)
        ))),
        R::CUDA_ERROR_NO_DEVICE | R::CUDA_ERROR_INVALID_DEVICE => Err(CuError::NoDevice(format!(
            "no CUDA device {what}: {}",
            error_name(r)
        ))),
        R::CUDA_ERROR_STUB_LIBRARY => Err(CuError::Missing(format!(
            "{what}: {}; the libcuda found is the toolkit's stub, not a driver",
            error_name(r)
        ))),
        R::CUDA_ERROR_INVALID_PTX
        | R::CUDA_ERROR_INVALID_IMAGE
        | R::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
        | R::CUDA_ERROR_NO_BINARY_FOR_GPU
        | R::CUDA_ERROR_JIT_COMPILER_NOT_FOUND
        | R::CUDA_ERROR_NOT_FOUND => Err(CuError::Kernel(format!("{what}: {}", error_name(r)))),
        _ => Err(CuError::Driver(format!("{what}: {}", error_name(r)))),
    }
}

/// What `init` found.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub ordinal: i32,
    pub name: String,
    pub cc: (i32, i32),
    pub driver_version: i32,
    pub count: i32,
}

/// Loads the driver, initialises it and checks that device `ordinal` exists. Cheap
/// enough to run when the library loads, so that a machine without a GPU is reported
/// at start-up.
pub fn init(ordinal: i32) -> Result<(sys::CUdevice, DeviceInfo), CuError> {
    probe_driver()?;
    // SAFETY: symbols checked by probe_driver; plain driver calls with valid out-pointers.
    unsafe {
        check(sys::cuInit(0), "initialising the driver (cuInit)")?;
        let mut version: c_int = 0;
        check(
            sys::cuDriverGetVersion(&mut version),
            "reading the driver version",
        )?;
        let mut count: c_int = 0;
        check(sys::cuDeviceGetCount(&mut count), "counting devices")?;
        if count == 0 {
            return Err(CuError::NoDevice(
                "the CUDA driver loaded but reports no device".into(),
            ));
        }
        if ordinal >= count {
            return Err(CuError::NoDevice(format!(
                "TOFFLOAD_CUDA_DEVICE={ordinal} but the driver reports {count} device(s)"
            )));
        }
        let mut dev: sys::CUdevice = 0;
        check(sys::cuDeviceGet(&mut dev, ordinal), "opening the device")?;
        let mut name = [0 as c_char; 128];
        check(
            sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as c_int, dev),
            "reading the device name",
        )?;
        let name = CStr::from_ptr(name.as_ptr()).to_string_lossy().into_owned();
        let attr = |a| {
            let mut v: c_int = 0;
            check(
                sys::cuDeviceGetAttribute(&mut v, a, dev),
                "reading a device attribute",
            )
            .map(|_| v)
        };
        let major = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        Ok((
            dev,
            DeviceInfo {
                ordinal,
                name,
                cc: (major, minor),
                driver_version: version,
                count,
            },
        ))
    }
}

thread_local!(static CURRENT: std::cell::Cell<u64> = const { std::cell::Cell::new(0) });

/// Another context was made current on this thread (remoted CUDA sessions run in
/// their own): the next `make_current` must set the primary one again.
pub fn forget_current() {
    CURRENT.with(|c| c.set(0));
}

/// The device's primary context (shared with any other CUDA user in the process, as
/// the runtime API does), released on drop.
pub struct Context {
    pub dev: sys::CUdevice,
    pub ctx: sys::CUcontext,
    /// Unique per retain: a primary context released to zero and retained again may
    /// come back at the same address, and must still be made current again.
    id: u64,
}

// SAFETY: a CUcontext may be made current on any thread.
unsafe impl Send for Context {}
// SAFETY: the driver's context calls are thread-safe; a Context is never mutated.
unsafe impl Sync for Context {}

impl Context {
    pub fn retain(dev: sys::CUdevice) -> Result<Context, CuError> {
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        check(
            // SAFETY: driver initialised by init(); out-pointer valid.
            unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) },
            "creating the device context",
        )?;
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let c = Context { dev, ctx, id };
        c.make_current()?;
        Ok(c)
    }

    /// Makes the context current on the calling thread (cached per thread: the
    /// runtime's carriers call in from a handful of threads, over and over).
    pub fn make_current(&self) -> Result<(), CuError> {
        let me = self.id;
        if CURRENT.with(|c| c.get()) == me {
            return Ok(());
        }
        check(
            // SAFETY: a live context handle.
            unsafe { sys::cuCtxSetCurrent(self.ctx) },
            "making the context current",
        )?;
        CURRENT.with(|c| c.set(me));
        Ok(())
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: retained in `retain`, released once.
        unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_errno() {
        assert_eq!(CuError::Missing("x".into()).errno(), libc::ENODEV);
        assert_eq!(CuError::NoDevice("x".into()).errno(), libc::ENODEV);
        assert_eq!(CuError::OutOfMemory("x".into()).errno(), libc::ENOMEM);
        assert_eq!(CuError::Kernel("x".into()).errno(), libc::EIO);
        assert_eq!(CuError::Driver("x".into()).errno(), libc::EIO);
        assert_eq!(CuError::Hung("x".into()).errno(), libc::EIO);
    }

    #[test]
    fn a_missing_library_is_an_error_that_names_it() {
        // A library that exists nowhere: the probe must report, never panic.
        let e = probe("toffload-no-such-lib", "test library", &["f"]).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, CuError::Missing(_)), "{m}");
        assert!(m.contains("libtoffload-no-such-lib.so"), "{m}");
    }

    #[test]
    fn a_missing_symbol_is_named() {
        // libc is always there; a symbol it lacks stands in for an old driver.
        let names = ["libtoffload-nope.so".to_string(), "libc.so.6".to_string()];
        let e = probe_names(
            "c",
            &names,
            "C library",
            &["malloc", "toffload_no_such_symbol"],
        );
        let m = e.unwrap_err().to_string();
        assert!(m.contains("libc.so.6 lacks toffload_no_such_symbol"), "{m}");
        assert!(probe_names("c", &names, "C library", &["malloc"]).is_ok());
    }
}
