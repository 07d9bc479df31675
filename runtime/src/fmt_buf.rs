//! Formatting into a stack buffer: usable in a signal handler, where allocating is not.

use std::fmt::Write;

struct Buf<'a> {
    b: &'a mut [u8],
    n: usize,
}

impl Write for Buf<'_> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let room = self.b.len() - self.n;
        let k = s.len().min(room);
        self.b[self.n..self.n + k].copy_from_slice(&s.as_bytes()[..k]);
        self.n += k;
        Ok(())
    }
}

/// Formats `args` into `b` (truncating) and returns the written part.
pub fn format<'a>(b: &'a mut [u8], args: std::fmt::Arguments<'_>) -> &'a [u8] {
    let mut w = Buf { b, n: 0 };
    let _ = w.write_fmt(args);
    let n = w.n;
    &w.b[..n]
}
