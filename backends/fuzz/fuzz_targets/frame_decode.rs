//! Frame decoding: bytes as a peer sends them, fed to the reader in pieces, each
//! complete frame decoded. Nothing may panic; a frame that decodes re-encodes to
//! bytes that decode to the same message.
#![no_main]

use libfuzzer_sys::fuzz_target;
use toffload_accel::remote::frame::{self, FrameReader};

fuzz_target!(|data: &[u8]| {
    let mut rd = FrameReader::new();
    // The first byte picks the piece size: frames split across reads.
    let step = data.first().map_or(1, |b| *b as usize % 61 + 1);
    for piece in data.get(1..).unwrap_or(&[]).chunks(step) {
        rd.push(piece);
        loop {
            match rd.next_frame() {
                Ok(Some(body)) => {
                    if let Ok(msg) = frame::decode(body) {
                        let mut again = Vec::new();
                        frame::encode(&msg, &mut again);
                        let back = frame::decode(&again[4..]).expect("re-encoded frame");
                        assert_eq!(back, msg);
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
});
