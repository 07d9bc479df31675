//! Request payloads and their expected answers: AES-128-CTR with the emulated
//! device's key and counter, computed once, so that checking an answer on the hot
//! path is a comparison.

use openssl::symm::{encrypt, Cipher};

pub const KEY: [u8; 16] = *b"\x00\x01\x02\x03\x04\x05\x06\x07\x08\x09\x0a\x0b\x0c\x0d\x0e\x0f";
pub const IV: [u8; 16] = *b"\xf0\xf1\xf2\xf3\xf4\xf5\xf6\xf7\xf8\xf9\xfa\xfb\xfc\xfd\xfe\xff";

/// The expected answer to `req`.
pub fn expected(req: &[u8]) -> Vec<u8> {
    encrypt(Cipher::aes_128_ctr(), &KEY, Some(&IV), req).expect("openssl AES-128-CTR")
}

pub struct Pool {
    pub requests: Vec<Vec<u8>>,
    pub answers: Vec<Vec<u8>>,
}

impl Pool {
    /// Distinct random payloads (at most 64, at most ~256 MiB in all).
    pub fn new(size: usize, rng: &mut super::rng::Rng) -> Pool {
        let n = ((256usize << 20) / (2 * size.max(1))).clamp(1, 64);
        let requests: Vec<Vec<u8>> = (0..n)
            .map(|_| (0..size).map(|_| rng.next_u64() as u8).collect())
            .collect();
        let answers = requests.iter().map(|r| expected(r)).collect();
        Pool { requests, answers }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_answer_and_pool_consistency() {
        // Same vector as the device's own test (backends/src/emulated/aes.rs).
        let plain = [
            0x6b, 0xc1, 0xbe, 0xe2, 0x2e, 0x40, 0x9f, 0x96, 0xe9, 0x3d, 0x7e, 0x11, 0x73, 0x93,
            0x17, 0x2a,
        ];
        assert_eq!(
            expected(&plain),
            [
                0x0d, 0x66, 0x79, 0x0a, 0x1a, 0x12, 0xae, 0xde, 0x7e, 0x6c, 0xa0, 0x16, 0x40, 0x85,
                0xba, 0x87
            ]
        );
        let mut rng = crate::loadgen::rng::Rng::new(1);
        let p = Pool::new(100, &mut rng);
        assert_eq!(p.requests.len(), 64);
        assert_ne!(p.requests[0], p.requests[1]);
        for (r, a) in p.requests.iter().zip(&p.answers) {
            // CTR is its own inverse.
            assert_eq!(&expected(a), r);
        }
    }
}
