//! The AES-128-CTR kernel: its source (aes_ctr.cu, in the repository), its run-time
//! compilation with NVRTC, and the host side of it: the key schedule and the counter
//! block the kernel takes as parameters. `model_ctr` is a Rust transcription of the
//! kernel's own code path (T-table rounds, counter = IV + block index, byte tail), so
//! that its logic is unit-tested against OpenSSL on machines with no GPU.

use super::driver::{self, CuError};
use crate::emulated::aes::{IV, KEY};
use cudarc::driver::sys;
use cudarc::nvrtc::sys as nv;
use std::ffi::{c_char, c_void, CStr, CString};

/// The kernel's source, compiled at run time (no CUDA toolkit needed to build).
pub const SOURCE: &str = include_str!("aes_ctr.cu");
/// Its entry point.
pub const ENTRY: &CStr = c"aes128_ctr";
/// Threads per block: the T-table fill uses one thread per entry at 256.
pub const THREADS: u32 = 256;

/// The kernel's by-value parameter, laid out as `struct AesParams` in aes_ctr.cu.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AesParams {
    pub rk: [u32; 44],
    pub iv: [u32; 4],
}

impl AesParams {
    /// The device's key and counter block (the emulated backend's).
    pub fn device() -> Self {
        AesParams::new(&KEY, &IV)
    }

    pub fn new(key: &[u8; 16], iv: &[u8; 16]) -> Self {
        let mut w = [0u32; 4];
        for (i, c) in iv.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([c[0], c[1], c[2], c[3]]);
        }
        AesParams {
            rk: expand_key(key),
            iv: w,
        }
    }
}

/// FIPS-197's S-box (the same table as in aes_ctr.cu).
const SBOX: [u8; 256] = {
    // Generated from the field inverse and affine map rather than typed twice; the
    // unit test checks it against the table in the kernel's source.
    let mut s = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        let inv = gf_inv(i as u8);
        let mut x = inv;
        let mut r = inv;
        let mut k = 0;
        while k < 4 {
            x = x.rotate_left(1);
            r ^= x;
            k += 1;
        }
        s[i] = r ^ 0x63;
        i += 1;
    }
    s
};

const fn gf_mul(mut a: u8, mut b: u8) -> u8 {
    let mut p = 0u8;
    while b != 0 {
        if b & 1 != 0 {
            p ^= a;
        }
        a = xtime(a);
        b >>= 1;
    }
    p
}

const fn gf_inv(a: u8) -> u8 {
    // a^254 = a^-1 in GF(2^8) (0 maps to 0), by square-and-multiply: 254 = 0b11111110.
    let mut r = 1u8;
    let mut base = a;
    let mut e = 254u32;
    while e != 0 {
        if e & 1 != 0 {
            r = gf_mul(r, base);
        }
        base = gf_mul(base, base);
        e >>= 1;
    }
    r
}

const fn xtime(b: u8) -> u8 {
    (b << 1) ^ if b & 0x80 != 0 { 0x1b } else { 0 }
}

/// AES-128 key expansion (FIPS-197 5.2): 44 big-endian words.
pub fn expand_key(key: &[u8; 16]) -> [u32; 44] {
    let mut w = [0u32; 44];
    for i in 0..4 {
        w[i] = u32::from_be_bytes([key[4 * i], key[4 * i + 1], key[4 * i + 2], key[4 * i + 3]]);
    }
    let mut rcon = 1u8;
    for i in 4..44 {
        let mut t = w[i - 1];
        if i % 4 == 0 {
            let b = t.rotate_left(8).to_be_bytes();
            t = u32::from_be_bytes([
                SBOX[b[0] as usize],
                SBOX[b[1] as usize],
                SBOX[b[2] as usize],
                SBOX[b[3] as usize],
            ]) ^ ((rcon as u32) << 24);
            rcon = xtime(rcon);
        }
        w[i] = w[i - 4] ^ t;
    }
    w
}

/// The kernel's path for one buffer, in Rust: what thread `b` of aes128_ctr computes,
/// for every b. Used by tests (and the GPU check's CPU reference is OpenSSL, not this).
pub fn model_ctr(p: &AesParams, data: &mut [u8]) {
    let mut te0 = [0u32; 256];
    for (i, t) in te0.iter_mut().enumerate() {
        let s = SBOX[i];
        let s2 = xtime(s);
        let s3 = s2 ^ s;
        *t = (s2 as u32) << 24 | (s as u32) << 16 | (s as u32) << 8 | s3 as u32;
    }
    let te = |x: u32, rot: u32| te0[x as usize & 0xff].rotate_right(8 * rot);
    let sb = |x: u32| SBOX[x as usize & 0xff] as u32;
    let len = data.len() as u64;
    for b in 0..len.div_ceil(16) {
        let lo = (p.iv[2] as u64) << 32 | p.iv[3] as u64;
        let hi = (p.iv[0] as u64) << 32 | p.iv[1] as u64;
        let nlo = lo.wrapping_add(b);
        let hi = hi.wrapping_add((nlo < lo) as u64);
        let mut s = [
            (hi >> 32) as u32 ^ p.rk[0],
            hi as u32 ^ p.rk[1],
            (nlo >> 32) as u32 ^ p.rk[2],
            nlo as u32 ^ p.rk[3],
        ];
        for r in 1..10 {
            let mut t = [0u32; 4];
            for (c, tc) in t.iter_mut().enumerate() {
                *tc = te(s[c] >> 24, 0)
                    ^ te(s[(c + 1) % 4] >> 16, 1)
                    ^ te(s[(c + 2) % 4] >> 8, 2)
                    ^ te(s[(c + 3) % 4], 3)
                    ^ p.rk[4 * r + c];
            }
            s = t;
        }
        let mut k = [0u32; 4];
        for (c, kc) in k.iter_mut().enumerate() {
            *kc = sb(s[c] >> 24) << 24
                ^ sb(s[(c + 1) % 4] >> 16) << 16
                ^ sb(s[(c + 2) % 4] >> 8) << 8
                ^ sb(s[(c + 3) % 4])
                ^ p.rk[40 + c];
        }
        let off = (b * 16) as usize;
        for j in 0..16.min(data.len() - off) {
            data[off + j] ^= (k[j / 4] >> (24 - 8 * (j % 4))) as u8;
        }
    }
}

/// Grid size for `len` bytes: one thread per 16-byte block, capped so that large
/// buffers loop (grid-stride) instead of launching millions of tiny blocks.
pub fn grid_for(len: usize) -> u32 {
    let blocks = len.div_ceil(16).div_ceil(THREADS as usize);
    blocks.clamp(1, 4096) as u32
}

/// The compiled kernel in the current context.
pub struct Kernel {
    pub module: sys::CUmodule,
    pub func: sys::CUfunction,
}

// SAFETY: CUDA module and function handles are usable from any thread that has the
// context current.
unsafe impl Send for Kernel {}
// SAFETY: as for Send; the handles are only read after loading.
unsafe impl Sync for Kernel {}

/// Compiles aes_ctr.cu with NVRTC for compute capability `cc` (e.g. (9, 0)), loads it
/// into the current context, and looks the kernel up. Tries, in order: a CUBIN for the
/// device's own SM (no driver JIT, and immune to an NVRTC newer than the driver), PTX
/// for its compute capability, then PTX for NVRTC's default target (an NVRTC older than
/// the device does not know its architecture; the driver JIT-compiles that PTX forward).
/// The first image that loads wins; if none does, the first error is reported.
pub fn build(cc: (i32, i32)) -> Result<Kernel, CuError> {
    driver::probe_nvrtc()?;
    let sm = format!("--gpu-architecture=sm_{}{}", cc.0, cc.1);
    let compute = format!("--gpu-architecture=compute_{}{}", cc.0, cc.1);
    let tries: [(&[&str], Output); 3] = [
        (&[sm.as_str()], Output::Cubin),
        (&[compute.as_str()], Output::Ptx),
        (&[], Output::Ptx),
    ];
    let mut first = None;
    for (opts, out) in tries {
        match compile_with(opts, out).and_then(|image| load(&image)) {
            Ok(k) => return Ok(k),
            Err(e) => {
                first.get_or_insert(e);
            }
        }
    }
    Err(first.expect("at least one attempt"))
}

fn load(image: &[u8]) -> Result<Kernel, CuError> {
    let mut module: sys::CUmodule = std::ptr::null_mut();
    // SAFETY: `image` is a CUBIN or a NUL-terminated PTX image; out-pointer valid.
    let r = unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) };
    driver::check(r, "loading the AES kernel (cuModuleLoadData)")?;
    let mut func: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: module just loaded; ENTRY is NUL-terminated.
    let r = unsafe { sys::cuModuleGetFunction(&mut func, module, ENTRY.as_ptr()) };
    if let Err(e) = driver::check(r, "finding aes128_ctr in the module") {
        // SAFETY: loaded above, unused.
        unsafe { sys::cuModuleUnload(module) };
        return Err(e);
    }
    Ok(Kernel { module, func })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Output {
    Cubin,
    Ptx,
}

fn nvrtc_check(r: nv::nvrtcResult, what: &str, log: Option<String>) -> Result<(), CuError> {
    if r == nv::nvrtcResult::NVRTC_SUCCESS {
        return Ok(());
    }
    // SAFETY: nvrtcGetErrorString returns a static string.
    let name = unsafe { CStr::from_ptr(nv::nvrtcGetErrorString(r)) }.to_string_lossy();
    let mut msg = format!("NVRTC failed {what}: {name}");
    if let Some(log) = log.filter(|l| !l.trim().is_empty()) {
        // One log line: the compiler's log folded onto it.
        msg.push_str(": ");
        msg.push_str(&log.split_whitespace().collect::<Vec<_>>().join(" "));
    }
    Err(CuError::Kernel(msg))
}

/// NVRTC's output for the kernel: a CUBIN, or PTX (NUL-terminated).
fn compile_with(opts: &[&str], output: Output) -> Result<Vec<u8>, CuError> {
    let src = CString::new(SOURCE).expect("kernel source has no NUL");
    let mut prog: nv::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings; no headers.
    let r = unsafe {
        nv::nvrtcCreateProgram(
            &mut prog,
            src.as_ptr(),
            c"aes_ctr.cu".as_ptr(),
            0,
            std::ptr::null(),
            std::ptr::null(),
        )
    };
    nvrtc_check(r, "creating the program", None)?;
    let copts: Vec<CString> = opts.iter().map(|o| CString::new(*o).unwrap()).collect();
    let ptrs: Vec<*const c_char> = copts.iter().map(|c| c.as_ptr()).collect();
    // SAFETY: prog valid; option pointers live across the call.
    let r = unsafe { nv::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr()) };
    let out = if r == nv::nvrtcResult::NVRTC_SUCCESS {
        let mut size = 0usize;
        // SAFETY: prog compiled; buffer sized as NVRTC says.
        unsafe {
            let sized = match output {
                Output::Cubin => nv::nvrtcGetCUBINSize(prog, &mut size),
                Output::Ptx => nv::nvrtcGetPTXSize(prog, &mut size),
            };
            nvrtc_check(sized, "sizing the compiled kernel", None).and_then(|_| {
                let mut image = vec![0u8; size.max(1)];
                let p = image.as_mut_ptr() as *mut c_char;
                let got = match output {
                    Output::Cubin => nv::nvrtcGetCUBIN(prog, p),
                    Output::Ptx => nv::nvrtcGetPTX(prog, p),
                };
                nvrtc_check(got, "reading the compiled kernel", None)?;
                Ok(image)
            })
        }
    } else {
        nvrtc_check(r, "compiling aes_ctr.cu", program_log(prog)).map(|_| Vec::new())
    };
    // SAFETY: prog created above, destroyed once.
    unsafe { nv::nvrtcDestroyProgram(&mut prog) };
    out
}

fn program_log(prog: nv::nvrtcProgram) -> Option<String> {
    let mut size = 0usize;
    // SAFETY: prog valid; buffer sized as NVRTC says.
    unsafe {
        if nv::nvrtcGetProgramLogSize(prog, &mut size) != nv::nvrtcResult::NVRTC_SUCCESS {
            return None;
        }
        let mut log = vec![0u8; size.max(1)];
        if nv::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char)
            != nv::nvrtcResult::NVRTC_SUCCESS
        {
            return None;
        }
        Some(
            CStr::from_bytes_until_nul(&log)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulated::aes::aes_ctr_in_place;
    use openssl::symm::{encrypt, Cipher};

    #[test]
    fn sbox_matches_the_kernel_source() {
        // The table typed into aes_ctr.cu and the one computed here must agree.
        let start = SOURCE.find("SBOX[256] = {").unwrap();
        let body = &SOURCE[start..SOURCE[start..].find("};").unwrap() + start];
        let bytes: Vec<u8> = body
            .split(|c: char| !c.is_ascii_alphanumeric())
            .filter_map(|t| t.strip_prefix("0x"))
            .map(|h| u8::from_str_radix(h, 16).unwrap())
            .collect();
        assert_eq!(bytes.len(), 256);
        assert_eq!(&bytes[..], &SBOX[..]);
    }

    #[test]
    fn key_schedule_matches_fips197() {
        // FIPS-197 Appendix C.1: key 000102..0f, last round key 13111d7f e3944a17 f307a78b 4d2b30c5.
        let w = expand_key(&KEY);
        assert_eq!(&w[..4], &[0x00010203, 0x04050607, 0x08090a0b, 0x0c0d0e0f]);
        assert_eq!(&w[40..], &[0x13111d7f, 0xe3944a17, 0xf307a78b, 0x4d2b30c5]);
        // Appendix A.1: key 2b7e1516..., w[43] = b6630ca6.
        let k = [
            0x2b, 0x7e, 0x15, 0x16, 0x28, 0xae, 0xd2, 0xa6, 0xab, 0xf7, 0x15, 0x88, 0x09, 0xcf,
            0x4f, 0x3c,
        ];
        assert_eq!(expand_key(&k)[43], 0xb6630ca6);
    }

    #[test]
    fn kernel_model_equals_the_emulated_device() {
        let p = AesParams::device();
        for n in [0usize, 1, 15, 16, 17, 31, 4096, 4097, 65_536 + 5, 1 << 20] {
            let input: Vec<u8> = (0..n).map(|i| (i * 7 + n) as u8).collect();
            let mut want = input.clone();
            aes_ctr_in_place(&mut want);
            let mut got = input.clone();
            model_ctr(&p, &mut got);
            assert_eq!(got, want, "size {n}");
        }
    }

    #[test]
    fn counter_carries_across_64_and_128_bits_like_openssl() {
        // OpenSSL's CTR increments the whole 16-byte block big-endian; so must we.
        for iv in [[0xffu8; 16], {
            let mut v = [0u8; 16];
            v[8..].copy_from_slice(&[0xff; 8]);
            v[15] = 0xfe;
            v
        }] {
            let input = vec![0x5au8; 16 * 5 + 3];
            let want = encrypt(Cipher::aes_128_ctr(), &KEY, Some(&iv), &input).unwrap();
            let mut got = input.clone();
            model_ctr(&AesParams::new(&KEY, &iv), &mut got);
            assert_eq!(got, want, "iv {iv:02x?}");
        }
    }

    #[test]
    fn params_layout_is_the_kernels() {
        // 44 round-key words then 4 counter words, no padding: cuLaunchKernel copies
        // exactly size_of::<AesParams>() bytes into `struct AesParams`.
        assert_eq!(std::mem::size_of::<AesParams>(), 48 * 4);
        assert_eq!(AesParams::device().iv[0], 0xf0f1f2f3);
    }

    #[test]
    fn grid_covers_every_block() {
        for n in [1usize, 16, 4096, 1 << 20, 64 << 20] {
            let g = grid_for(n) as usize;
            assert!((1..=4096).contains(&g));
            // Grid-stride: any grid covers all blocks; small buffers get one thread each.
            if n.div_ceil(16) <= 4096 * 256 {
                assert!(g * 256 >= n.div_ceil(16), "{n}");
            }
        }
    }
}
