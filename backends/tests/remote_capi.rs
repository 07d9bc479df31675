//! The C ABI with TOFFLOAD_BACKEND=remote: a C program linked against
//! libtoffload_accel.so pipelines ops through accel_submit / accel_done /
//! accel_release, sleeps on accel_completion_fd, and uses accel_run; its answers are
//! checked here against a local AES-128-CTR.

mod remote_util;

use remote_util::*;
use std::path::Path;
use std::process::Command;

const PROGRAM: &str = r#"
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include "toffload_accel.h"

#define N 2000
#define LEN 256
static unsigned char bufs[N][LEN], orig[N][LEN];

int main(void) {
    int fails = 0;
    int fd = accel_completion_fd();
    if (fd < 0) { printf("FAIL completion_fd %d\n", fd); return 1; }
    for (int i = 0; i < N; i++)
        for (int j = 0; j < LEN; j++) orig[i][j] = bufs[i][j] = (unsigned char)(i * 7 + j * 13);
    long ids[N];
    for (int i = 0; i < N; i++) {
        ids[i] = accel_submit(bufs[i], LEN);
        if (ids[i] < 0) { printf("FAIL submit %d: %ld\n", i, ids[i]); return 1; }
    }
    int left = N, wakeups = 0;
    char done[N]; memset(done, 0, N);
    while (left > 0) {
        struct pollfd p = { .fd = fd, .events = POLLIN };
        int rc = poll(&p, 1, 10000);
        if (rc <= 0) { printf("FAIL poll timed out with %d left\n", left); return 1; }
        unsigned long long v; (void)!read(fd, &v, 8);
        wakeups++;
        for (int i = 0; i < N; i++) {
            if (done[i]) continue;
            int d = accel_done(ids[i]);
            if (d == 1) { done[i] = 1; left--; if (accel_release(ids[i]) != 0) fails++; }
            else if (d < 0) { printf("FAIL done %d: %d\n", i, d); return 1; }
        }
    }
    printf("ok pipelined %d ops, %d wake-ups\n", N, wakeups);
    /* The transform of op 5, for the test to check. */
    printf("op5 ");
    for (int j = 0; j < LEN; j++) printf("%02x", bufs[5][j]);
    printf("\n");
    /* accel_run applies it again: AES-CTR is its own inverse. */
    for (int i = 0; i < 50; i++) {
        int rc = accel_run(bufs[i], LEN);
        if (rc != 0 || memcmp(bufs[i], orig[i], LEN) != 0) { printf("FAIL run %d rc %d\n", i, rc); fails++; }
    }
    if (accel_release(ids[0]) != -EBADF) { printf("FAIL second release\n"); fails++; }
    printf("%d failures\n", fails);
    return fails != 0;
}
"#;

fn build(dir: &Path) -> std::path::PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = std::env::current_exe().unwrap();
    let lib_dir = exe.parent().unwrap().parent().unwrap().to_path_buf();
    assert!(lib_dir.join("libtoffload_accel.so").exists());
    let src = dir.join("remote_abi.c");
    std::fs::write(&src, PROGRAM).unwrap();
    let out = dir.join("remote_abi");
    let st = Command::new("cc")
        .args(["-O1", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(manifest.join("include"))
        .arg(&src)
        .arg("-L")
        .arg(&lib_dir)
        .arg("-ltoffload_accel")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(&out)
        .status()
        .expect("cc");
    assert!(st.success());
    out
}

#[test]
fn a_c_program_uses_the_remote_backend_through_the_abi() {
    let dir = TempDir::new("capi");
    let bin = build(dir.path());
    let d = Daemon::start(
        &["--listen", "127.0.0.1:0"],
        &[("TOFFLOAD_EMU_LAT_US", "100")],
    );
    let out = Command::new(&bin)
        .env("TOFFLOAD_BACKEND", "remote")
        .env("TOFFLOAD_REMOTE", d.addr())
        .env("TOFFLOAD_WAIT", "block")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    print!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success());
    assert!(stdout.contains("0 failures"));
    let op5: Vec<u8> = (0..256).map(|j| (5 * 7 + j * 13) as u8).collect();
    let want: String = aes(op5).iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        stdout.contains(&format!("op5 {want}")),
        "op 5's answer differs"
    );
    assert_eq!(stats(&d.addr())["executions"], 2000 + 50);

    // Misconfigured: remote without TOFFLOAD_REMOTE is reported at load, calls fail EINVAL.
    let out = Command::new(&bin)
        .env("TOFFLOAD_BACKEND", "remote")
        .env_remove("TOFFLOAD_REMOTE")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(stdout.contains("FAIL completion_fd -22"), "{stdout}");
    assert!(stderr.contains("TOFFLOAD_REMOTE"), "{stderr}");
}
