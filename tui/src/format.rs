//! Number formatting shared by the panels: short enough for a 24-column chart cell,
//! precise enough to compare two windows by eye.

/// A rate or count: "265", "39,050", "1.2M"; small values keep decimals.
pub fn rate(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    let a = x.abs();
    if a < 10.0 {
        format!("{x:.2}")
    } else if a < 100.0 {
        format!("{x:.1}")
    } else if a < 1e6 {
        thousands(x.round() as i64)
    } else {
        format!("{:.1}M", x / 1e6)
    }
}

/// A compact rate for tight spots: "39.1k" instead of "39,050".
pub fn rate_short(x: f64) -> String {
    if x.is_finite() && x.abs() >= 10_000.0 && x.abs() < 1e6 {
        format!("{:.1}k", x / 1e3)
    } else {
        rate(x)
    }
}

/// A duration given in microseconds: "0.8us", "120us", "1.25ms", "2.10s".
pub fn us(x: f64) -> String {
    if !x.is_finite() {
        return "-".into();
    }
    let a = x.abs();
    if a < 10.0 {
        format!("{x:.1}us")
    } else if a < 1000.0 {
        format!("{x:.0}us")
    } else if a < 10_000.0 {
        format!("{:.2}ms", x / 1e3)
    } else if a < 1e6 {
        format!("{:.1}ms", x / 1e3)
    } else {
        format!("{:.2}s", x / 1e6)
    }
}

/// A histogram bucket bound, as short as it gets: "512n", "8u", "128u", "1m", "2s".
pub fn bound(x: f64) -> String {
    if x < 1.0 {
        format!("{:.0}n", x * 1e3)
    } else if x < 1000.0 {
        format!("{x:.0}u")
    } else if x < 1e6 {
        format!("{:.0}m", x / 1e3)
    } else {
        format!("{:.0}s", x / 1e6)
    }
}

pub fn speedup(x: f64) -> String {
    if x.is_finite() {
        format!("{x:.2}x")
    } else {
        "-".into()
    }
}

/// `f` of the value, or a dash where it was not measured.
pub fn opt(x: Option<f64>, f: fn(f64) -> String) -> String {
    x.map_or_else(|| "-".into(), f)
}

fn thousands(n: i64) -> String {
    let digits = n.unsigned_abs().to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3 + 1);
    if n < 0 {
        out.push('-');
    }
    for (i, ch) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats() {
        assert_eq!(rate(265.3), "265");
        assert_eq!(rate(39050.0), "39,050");
        assert_eq!(rate(1234567.0), "1.2M");
        assert_eq!(rate(2.0), "2.00");
        assert_eq!(rate(-1500.0), "-1,500");
        assert_eq!(rate_short(39050.0), "39.0k");
        assert_eq!(rate_short(950.0), "950");
        assert_eq!(us(0.8), "0.8us");
        assert_eq!(us(120.4), "120us");
        assert_eq!(us(1250.0), "1.25ms");
        assert_eq!(us(2_100_000.0), "2.10s");
        assert_eq!(bound(128.0), "128u");
        assert_eq!(bound(0.512), "512n");
        assert_eq!(bound(16384.0), "16m");
        assert_eq!(speedup(1.5), "1.50x");
        assert_eq!(opt(None, us), "-");
        assert_eq!(rate(f64::NAN), "-");
    }
}
