//! Content-defined chunking (a gear rolling hash with FastCDC's normalised cut masks)
//! and chunk hashing (SHA-256 through openssl). Cut points depend only on the bytes
//! near them, so an insertion moves the chunks it touches and no others.

/// Chunk length bounds and target.
pub const MIN_CHUNK: usize = 4 << 10;
pub const AVG_CHUNK: usize = 16 << 10;
pub const MAX_CHUNK: usize = 64 << 10;

/// Stricter mask below the average length, looser above (FastCDC normalisation 1).
const MASK_S: u64 = (1 << 16) - 1; // 16 bits: harder to cut before AVG
const MASK_L: u64 = (1 << 12) - 1; // 12 bits: easier after

const fn gear_table() -> [u64; 256] {
    let mut t = [0u64; 256];
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut i = 0;
    while i < 256 {
        // splitmix64
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        t[i] = z ^ (z >> 31);
        i += 1;
    }
    t
}

static GEAR: [u64; 256] = gear_table();

/// Length of the first chunk of `data`.
fn cut(data: &[u8]) -> usize {
    let n = data.len();
    if n <= MIN_CHUNK {
        return n;
    }
    let end = n.min(MAX_CHUNK);
    let mid = end.min(AVG_CHUNK);
    let mut h: u64 = 0;
    let mut i = MIN_CHUNK;
    while i < mid {
        h = (h << 1).wrapping_add(GEAR[data[i] as usize]);
        if h & (MASK_S << 48) == 0 {
            return i + 1;
        }
        i += 1;
    }
    while i < end {
        h = (h << 1).wrapping_add(GEAR[data[i] as usize]);
        if h & (MASK_L << 52) == 0 {
            return i + 1;
        }
        i += 1;
    }
    end
}

/// The chunks of `data`, as (start, len), covering it in order.
pub fn chunks(data: &[u8]) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(data.len() / AVG_CHUNK + 1);
    let mut at = 0;
    while at < data.len() {
        let n = cut(&data[at..]);
        out.push((at, n));
        at += n;
    }
    out
}

pub fn sha256(b: &[u8]) -> [u8; 32] {
    openssl::sha::sha256(b)
}

pub fn hex(h: &[u8; 32]) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u64) -> Vec<u8> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    #[test]
    fn chunks_cover_and_respect_bounds() {
        let d = noise(1 << 20, 1);
        let c = chunks(&d);
        let mut at = 0;
        for (i, &(s, n)) in c.iter().enumerate() {
            assert_eq!(s, at);
            assert!(n <= MAX_CHUNK);
            assert!(n >= MIN_CHUNK || i == c.len() - 1);
            at += n;
        }
        assert_eq!(at, d.len());
        let avg = d.len() / c.len();
        assert!((AVG_CHUNK / 2..AVG_CHUNK * 2).contains(&avg), "avg {avg}");
    }

    #[test]
    fn an_insertion_moves_only_nearby_chunks() {
        let d = noise(1 << 20, 2);
        let mut e = d[..300_000].to_vec();
        e.extend_from_slice(b"inserted bytes");
        e.extend_from_slice(&d[300_000..]);
        let hs = |x: &[u8]| -> std::collections::HashSet<[u8; 32]> {
            chunks(x)
                .iter()
                .map(|&(s, n)| sha256(&x[s..s + n]))
                .collect()
        };
        let (a, b) = (hs(&d), hs(&e));
        let shared = a.intersection(&b).count();
        assert!(
            shared + 3 >= a.len(),
            "{shared} of {} chunks shared",
            a.len()
        );
    }
}
