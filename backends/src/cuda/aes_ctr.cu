// AES-128-CTR in place, one 16-byte block per thread (grid-stride), compiled at run time
// by NVRTC (backends/src/cuda/kernel.rs). Bit-identical to the emulated backend: the
// host expands the key (kernel.rs: expand_key) and passes the 44 round-key words and
// the initial counter block as big-endian words; block i uses counter IV + i, a
// big-endian 128-bit add, as OpenSSL's CTR mode does. kernel.rs holds a Rust model of
// this exact code path (model_ctr), unit-tested against OpenSSL on any machine.
//
// No headers: NVRTC has no libc, and the kernel needs none. Written in the subset
// that is also C, so that the tests' fake driver (backends/tests/c/fake_cuda.c) runs
// this very source on the CPU, with a few macros standing in for CUDA's keywords.

#ifndef KERNEL_EXPORT
#define KERNEL_EXPORT extern "C"
#endif

struct AesParams {
    unsigned int rk[44];
    unsigned int iv[4];
};

__device__ __constant__ unsigned char SBOX[256] = {
    0x63, 0x7c, 0x77, 0x7b, 0xf2, 0x6b, 0x6f, 0xc5, 0x30, 0x01, 0x67, 0x2b, 0xfe, 0xd7, 0xab, 0x76,
    0xca, 0x82, 0xc9, 0x7d, 0xfa, 0x59, 0x47, 0xf0, 0xad, 0xd4, 0xa2, 0xaf, 0x9c, 0xa4, 0x72, 0xc0,
    0xb7, 0xfd, 0x93, 0x26, 0x36, 0x3f, 0xf7, 0xcc, 0x34, 0xa5, 0xe5, 0xf1, 0x71, 0xd8, 0x31, 0x15,
    0x04, 0xc7, 0x23, 0xc3, 0x18, 0x96, 0x05, 0x9a, 0x07, 0x12, 0x80, 0xe2, 0xeb, 0x27, 0xb2, 0x75,
    0x09, 0x83, 0x2c, 0x1a, 0x1b, 0x6e, 0x5a, 0xa0, 0x52, 0x3b, 0xd6, 0xb3, 0x29, 0xe3, 0x2f, 0x84,
    0x53, 0xd1, 0x00, 0xed, 0x20, 0xfc, 0xb1, 0x5b, 0x6a, 0xcb, 0xbe, 0x39, 0x4a, 0x4c, 0x58, 0xcf,
    0xd0, 0xef, 0xaa, 0xfb, 0x43, 0x4d, 0x33, 0x85, 0x45, 0xf9, 0x02, 0x7f, 0x50, 0x3c, 0x9f, 0xa8,
    0x51, 0xa3, 0x40, 0x8f, 0x92, 0x9d, 0x38, 0xf5, 0xbc, 0xb6, 0xda, 0x21, 0x10, 0xff, 0xf3, 0xd2,
    0xcd, 0x0c, 0x13, 0xec, 0x5f, 0x97, 0x44, 0x17, 0xc4, 0xa7, 0x7e, 0x3d, 0x64, 0x5d, 0x19, 0x73,
    0x60, 0x81, 0x4f, 0xdc, 0x22, 0x2a, 0x90, 0x88, 0x46, 0xee, 0xb8, 0x14, 0xde, 0x5e, 0x0b, 0xdb,
    0xe0, 0x32, 0x3a, 0x0a, 0x49, 0x06, 0x24, 0x5c, 0xc2, 0xd3, 0xac, 0x62, 0x91, 0x95, 0xe4, 0x79,
    0xe7, 0xc8, 0x37, 0x6d, 0x8d, 0xd5, 0x4e, 0xa9, 0x6c, 0x56, 0xf4, 0xea, 0x65, 0x7a, 0xae, 0x08,
    0xba, 0x78, 0x25, 0x2e, 0x1c, 0xa6, 0xb4, 0xc6, 0xe8, 0xdd, 0x74, 0x1f, 0x4b, 0xbd, 0x8b, 0x8a,
    0x70, 0x3e, 0xb5, 0x66, 0x48, 0x03, 0xf6, 0x0e, 0x61, 0x35, 0x57, 0xb9, 0x86, 0xc1, 0x1d, 0x9e,
    0xe1, 0xf8, 0x98, 0x11, 0x69, 0xd9, 0x8e, 0x94, 0x9b, 0x1e, 0x87, 0xe9, 0xce, 0x55, 0x28, 0xdf,
    0x8c, 0xa1, 0x89, 0x0d, 0xbf, 0xe6, 0x42, 0x68, 0x41, 0x99, 0x2d, 0x0f, 0xb0, 0x54, 0xbb, 0x16,
};

// Only the language's own keywords and built-in variables are used (no uint4, no
// intrinsics), so nothing depends on what a given NVRTC pre-declares.

// A 16-byte block, aligned so that a whole block is one vector load and store.
typedef struct __attribute__((aligned(16))) {
    unsigned int x, y, z, w;
} block16;

__device__ inline unsigned int ror8(unsigned int x) { return (x >> 8) | (x << 24); }

__device__ inline unsigned char xtime(unsigned char b) {
    return (unsigned char)((b << 1) ^ ((b & 0x80) ? 0x1b : 0x00));
}

// Byte swap (the compiler emits one PRMT for it).
__device__ inline unsigned int bswap32(unsigned int x) {
    return (x >> 24) | ((x >> 8) & 0xff00u) | ((x << 8) & 0xff0000u) | (x << 24);
}

// T-tables in shared memory: constant memory serialises divergent lookups.
// te0[x] = (2s, s, s, 3s) as a big-endian word; te1..te3 are its byte rotations.
KERNEL_EXPORT __global__ void aes128_ctr(unsigned char *data, unsigned long long len,
                                         struct AesParams p) {
    __shared__ unsigned int te0[256];
    __shared__ unsigned char sbox[256];
    for (unsigned int i = threadIdx.x; i < 256; i += blockDim.x) {
        unsigned char s = SBOX[i];
        unsigned char s2 = xtime(s);
        unsigned char s3 = s2 ^ s;
        te0[i] = ((unsigned int)s2 << 24) | ((unsigned int)s << 16) | ((unsigned int)s << 8) | s3;
        sbox[i] = s;
    }
    __syncthreads();

    unsigned long long nblocks = (len + 15) / 16;
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long b = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; b < nblocks;
         b += stride) {
        // Counter block = IV + b, big-endian 128-bit.
        unsigned long long lo = ((unsigned long long)p.iv[2] << 32) | p.iv[3];
        unsigned long long hi = ((unsigned long long)p.iv[0] << 32) | p.iv[1];
        unsigned long long nlo = lo + b;
        hi += (nlo < lo) ? 1ull : 0ull;
        unsigned int s0 = (unsigned int)(hi >> 32) ^ p.rk[0];
        unsigned int s1 = (unsigned int)hi ^ p.rk[1];
        unsigned int s2 = (unsigned int)(nlo >> 32) ^ p.rk[2];
        unsigned int s3 = (unsigned int)nlo ^ p.rk[3];
        for (int r = 1; r < 10; r++) {
            unsigned int t0 = te0[s0 >> 24] ^ ror8(te0[(s1 >> 16) & 0xff]) ^
                              ror8(ror8(te0[(s2 >> 8) & 0xff])) ^ ror8(ror8(ror8(te0[s3 & 0xff]))) ^
                              p.rk[4 * r];
            unsigned int t1 = te0[s1 >> 24] ^ ror8(te0[(s2 >> 16) & 0xff]) ^
                              ror8(ror8(te0[(s3 >> 8) & 0xff])) ^ ror8(ror8(ror8(te0[s0 & 0xff]))) ^
                              p.rk[4 * r + 1];
            unsigned int t2 = te0[s2 >> 24] ^ ror8(te0[(s3 >> 16) & 0xff]) ^
                              ror8(ror8(te0[(s0 >> 8) & 0xff])) ^ ror8(ror8(ror8(te0[s1 & 0xff]))) ^
                              p.rk[4 * r + 2];
            unsigned int t3 = te0[s3 >> 24] ^ ror8(te0[(s0 >> 16) & 0xff]) ^
                              ror8(ror8(te0[(s1 >> 8) & 0xff])) ^ ror8(ror8(ror8(te0[s2 & 0xff]))) ^
                              p.rk[4 * r + 3];
            s0 = t0;
            s1 = t1;
            s2 = t2;
            s3 = t3;
        }
        unsigned int k[4];
        k[0] = ((unsigned int)sbox[s0 >> 24] << 24) ^ ((unsigned int)sbox[(s1 >> 16) & 0xff] << 16) ^
               ((unsigned int)sbox[(s2 >> 8) & 0xff] << 8) ^ sbox[s3 & 0xff] ^ p.rk[40];
        k[1] = ((unsigned int)sbox[s1 >> 24] << 24) ^ ((unsigned int)sbox[(s2 >> 16) & 0xff] << 16) ^
               ((unsigned int)sbox[(s3 >> 8) & 0xff] << 8) ^ sbox[s0 & 0xff] ^ p.rk[41];
        k[2] = ((unsigned int)sbox[s2 >> 24] << 24) ^ ((unsigned int)sbox[(s3 >> 16) & 0xff] << 16) ^
               ((unsigned int)sbox[(s0 >> 8) & 0xff] << 8) ^ sbox[s1 & 0xff] ^ p.rk[42];
        k[3] = ((unsigned int)sbox[s3 >> 24] << 24) ^ ((unsigned int)sbox[(s0 >> 16) & 0xff] << 16) ^
               ((unsigned int)sbox[(s1 >> 8) & 0xff] << 8) ^ sbox[s2 & 0xff] ^ p.rk[43];
        unsigned long long off = b * 16;
        if (off + 16 <= len) {
            // A whole block: one 16-byte load and store (cuMemAlloc is 256-byte aligned).
            block16 *q = (block16 *)(data + off);
            block16 v = *q;
            v.x ^= bswap32(k[0]);
            v.y ^= bswap32(k[1]);
            v.z ^= bswap32(k[2]);
            v.w ^= bswap32(k[3]);
            *q = v;
        } else {
            // The tail: byte by byte, keystream bytes in big-endian word order.
            for (unsigned long long j = 0; off + j < len; j++) {
                data[off + j] ^= (unsigned char)(k[j / 4] >> (24 - 8 * (j % 4)));
            }
        }
    }
}
