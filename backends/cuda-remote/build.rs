//! The library stands in for the CUDA driver: it answers to the driver's soname.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
