//! Journal replay over arbitrary file contents: never panics, accounts for every
//! byte (records + damaged stretches + torn tail), and what it recovers is stable
//! (replaying the records it kept, re-encoded, gives them back unchanged).
#![no_main]

use libfuzzer_sys::fuzz_target;
use toffload_accel::remote::journal;

fuzz_target!(|data: &[u8]| {
    let r = journal::scan(data);
    let damaged: u64 = r.damaged.iter().map(|d| d.len).sum();
    let kept = journal::encode(&r.recs);
    assert_eq!(kept.len() as u64 + damaged + r.torn_tail, data.len() as u64);
    let again = journal::scan(&kept);
    assert_eq!(again.recs, r.recs);
    assert!(again.damaged.is_empty() && again.torn_tail == 0);
});
