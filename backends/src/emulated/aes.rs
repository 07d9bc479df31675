//! The emulated device's transform: AES-128-CTR in place, counter restarting for
//! every operation, so out = in XOR keystream(len) and a client can verify any answer.

use openssl::cipher::Cipher;
use openssl::cipher_ctx::CipherCtx;

/// The device key (FIPS-197's example key).
pub const KEY: [u8; 16] = [
    0x00, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f,
];

/// The initial counter block (SP 800-38A F.5's).
pub const IV: [u8; 16] = [
    0xf0, 0xf1, 0xf2, 0xf3, 0xf4, 0xf5, 0xf6, 0xf7, 0xf8, 0xf9, 0xfa, 0xfb, 0xfc, 0xfd, 0xfe, 0xff,
];

/// A reusable cipher context: re-keying per operation costs far less than a new one.
pub struct CtrEngine {
    ctx: CipherCtx,
}

impl CtrEngine {
    pub fn new() -> Result<Self, openssl::error::ErrorStack> {
        let mut ctx = CipherCtx::new()?;
        // Expand the key once; each operation then only resets the counter.
        ctx.encrypt_init(Some(Cipher::aes_128_ctr()), Some(&KEY), Some(&IV))?;
        Ok(CtrEngine { ctx })
    }

    /// Transforms `buf` in place from counter block IV.
    pub fn apply(&mut self, buf: &mut [u8]) -> Result<(), openssl::error::ErrorStack> {
        self.ctx.encrypt_init(None, None, Some(&IV))?;
        // OpenSSL processes at most i32::MAX bytes per update call.
        for chunk in buf.chunks_mut(1 << 30) {
            self.ctx.cipher_update_inplace(chunk, chunk.len())?;
        }
        Ok(())
    }
}

/// One-shot transform, for clients and tests.
pub fn aes_ctr_in_place(buf: &mut [u8]) {
    CtrEngine::new()
        .and_then(|mut e| e.apply(buf))
        .expect("openssl AES-128-CTR");
}

#[cfg(test)]
mod tests {
    use super::*;
    use openssl::symm::{encrypt, Cipher as SymmCipher};

    #[test]
    fn known_answer() {
        // `openssl enc -aes-128-ctr -K 000102..0f -iv f0f1..ff` of SP 800-38A's first
        // plaintext block (with SP 800-38A's own key it gives 874d6191..., F.5.1).
        let mut block = [
            0x6b, 0xc1, 0xbe, 0xe2, 0x2e, 0x40, 0x9f, 0x96, 0xe9, 0x3d, 0x7e, 0x11, 0x73, 0x93,
            0x17, 0x2a,
        ];
        aes_ctr_in_place(&mut block);
        assert_eq!(
            block,
            [
                0x0d, 0x66, 0x79, 0x0a, 0x1a, 0x12, 0xae, 0xde, 0x7e, 0x6c, 0xa0, 0x16, 0x40, 0x85,
                0xba, 0x87
            ]
        );
    }

    #[test]
    fn matches_openssl_one_shot_for_many_sizes() {
        let mut engine = CtrEngine::new().unwrap();
        for &n in &[1usize, 15, 16, 17, 1000, 4096, 65_537, 1 << 20, 8 << 20] {
            let input: Vec<u8> = (0..n).map(|i| (i * 131 + n) as u8).collect();
            let want = encrypt(SymmCipher::aes_128_ctr(), &KEY, Some(&IV), &input).unwrap();
            let mut got = input.clone();
            engine.apply(&mut got).unwrap();
            assert_eq!(got, want, "size {n}");
            // CTR is an involution: applying it again restores the input.
            engine.apply(&mut got).unwrap();
            assert_eq!(got, input, "size {n} round trip");
        }
    }
}
