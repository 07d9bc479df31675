//! The wall clock of the output: the `ts` of every JSON line (Unix seconds) and the
//! HH:MM:SS that -T puts before each text line (local time, as bcc's tools print it).

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `unix` (seconds since the epoch) as HH:MM:SS in the local time zone (TZ, else
/// /etc/localtime; UTC where neither says otherwise).
pub fn hms_local(unix: f64) -> String {
    let secs = unix.floor() as libc::time_t;
    // SAFETY: an all-zero tm is a valid value to be overwritten.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are to live locals; localtime_r is the reentrant form
    // (it reads the zone once, never a shared static buffer).
    let ok = unsafe { !libc::localtime_r(&secs, &mut tm).is_null() };
    if !ok {
        // A time the C library cannot place: UTC from the arithmetic alone.
        let day = secs.rem_euclid(86_400);
        return format!("{:02}:{:02}:{:02}", day / 3600, day / 60 % 60, day % 60);
    }
    format!("{:02}:{:02}:{:02}", tm.tm_hour, tm.tm_min, tm.tm_sec)
}

/// Each line of `text` with `stamp` and a space before it.
pub fn prefix_lines(text: &str, stamp: &str) -> String {
    text.lines().map(|l| format!("{stamp} {l}\n")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hms_is_eight_characters_of_a_time_of_day() {
        let s = hms_local(unix_now());
        let parts: Vec<u32> = s.split(':').map(|p| p.parse().expect("digits")).collect();
        assert_eq!(s.len(), 8, "{s}");
        assert!(parts[0] < 24 && parts[1] < 60 && parts[2] < 61, "{s}");
    }

    #[test]
    fn hms_follows_the_seconds() {
        // Whatever the zone, 61 s later is one minute and one second later (zones move
        // by whole minutes; no leap second lands on this instant).
        let t = 1_700_000_000.0;
        let sec = |s: &str| -> i64 {
            let p: Vec<i64> = s.split(':').map(|x| x.parse().expect("digits")).collect();
            p[0] * 3600 + p[1] * 60 + p[2]
        };
        let d = (sec(&hms_local(t + 61.0)) - sec(&hms_local(t))).rem_euclid(86_400);
        assert_eq!(d, 61);
    }

    #[test]
    fn every_line_prefixed() {
        assert_eq!(
            prefix_lines("[window 1.0s]\n  verdict: x\n", "12:00:01"),
            "12:00:01 [window 1.0s]\n12:00:01   verdict: x\n"
        );
        assert_eq!(prefix_lines("", "12:00:01"), "");
    }
}
