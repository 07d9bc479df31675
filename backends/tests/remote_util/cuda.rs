//! The remote CUDA client's pieces for tests and the remote-cuda bench: the fake
//! driver (tests/c/fake_cuda.c) as the daemons' GPU, a folder where the client
//! library is libcuda.so.1, and tests/c/cuda_app.c built against it.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

/// The profile folder of the running test or bench (target/release, say).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

/// Builds the client library (its own crate) in this profile; returns it.
pub fn client_lib() -> PathBuf {
    let dir = profile_dir();
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "-q", "-p", "toffload-cuda-remote"]);
    if dir.ends_with("release") {
        cmd.arg("--release");
    }
    assert!(
        cmd.status().expect("running cargo").success(),
        "building backends/cuda-remote failed"
    );
    let lib = dir.join("libtoffload_cuda_remote.so");
    assert!(lib.exists(), "{} missing", lib.display());
    lib
}

/// The fake driver's folder (also as libcuda.so.1), a folder where the client
/// library is libcuda.so.1 and libcuda.so (NVRTC stays the fake's: it compiles on
/// the client), and cuda_app; removed on drop.
pub struct Libs {
    pub fake: PathBuf,
    pub client: PathBuf,
    pub app: PathBuf,
}

impl Libs {
    pub fn new(tag: &str) -> Libs {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
        let fake =
            std::env::temp_dir().join(format!("toffload_cuda_sched_{}_{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&fake);
        std::fs::create_dir_all(&fake).unwrap();
        let ok = Command::new("cc")
            .args([
                "-shared", "-fPIC", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
            ])
            .arg("-I")
            .arg(manifest.join("src/cuda"))
            .arg(manifest.join("tests/c/fake_cuda.c"))
            .arg("-o")
            .arg(fake.join("libfakecuda.so"))
            .status()
            .expect("running cc")
            .success();
        assert!(ok, "compiling fake_cuda.c failed");
        for name in ["libcuda.so", "libnvrtc.so", "libcuda.so.1"] {
            std::os::unix::fs::symlink("libfakecuda.so", fake.join(name)).unwrap();
        }
        let client = fake.join("client");
        std::fs::create_dir_all(&client).unwrap();
        let lib = client_lib();
        for name in ["libcuda.so.1", "libcuda.so"] {
            std::os::unix::fs::symlink(&lib, client.join(name)).unwrap();
        }
        std::os::unix::fs::symlink(fake.join("libfakecuda.so"), client.join("libnvrtc.so"))
            .unwrap();
        let app = fake.join("cuda_app");
        let ok = Command::new("cc")
            .args(["-O1", "-Wall", "-Wextra", "-Werror", "-pthread"])
            .arg(manifest.join("tests/c/cuda_app.c"))
            .arg("-L")
            .arg(&fake)
            .args(["-l:libcuda.so.1", "-ldl", "-o"])
            .arg(&app)
            .status()
            .expect("running cc")
            .success();
        assert!(ok, "compiling cuda_app.c failed");
        Libs { fake, client, app }
    }

    /// A daemon's environment: the fake driver as its GPU, `kernel_us` per kernel.
    pub fn gpu_env(&self, kernel_us: u32) -> Vec<(String, String)> {
        vec![
            ("LD_LIBRARY_PATH".into(), self.fake.display().to_string()),
            ("FAKE_CUDA_KERNEL_US".into(), kernel_us.to_string()),
        ]
    }

    /// cuda_app run directly on the fake driver.
    pub fn direct(&self, args: &[&str], kernel_us: u32) -> Output {
        Command::new(&self.app)
            .args(args)
            .env("LD_LIBRARY_PATH", &self.fake)
            .env("FAKE_CUDA_KERNEL_US", kernel_us.to_string())
            .output()
            .unwrap()
    }

    /// `bin` with the client library as its driver, on the daemons `list`.
    pub fn remote_cmd(&self, bin: &Path, list: &str) -> Command {
        let mut c = Command::new(bin);
        c.env("LD_LIBRARY_PATH", &self.client)
            .env("TOFFLOAD_CUDA_REMOTE", list);
        c
    }
}

impl Drop for Libs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.fake);
    }
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Waits for a child with a deadline (a hang is the failure under test).
pub fn wait_with_deadline(mut c: Child, limit: Duration) -> Output {
    let t0 = Instant::now();
    loop {
        if c.try_wait().unwrap().is_some() {
            return c.wait_with_output().unwrap();
        }
        if t0.elapsed() > limit {
            let _ = c.kill();
            let out = c.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}: {}{}",
                text(&out.stdout),
                text(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// cuda_app in a `replay`/`unreplayable` mode (`child`, its stdin, stdout and
/// stderr piped): it runs to its pause between two synchronizations, `at_pause` runs
/// (kills a daemon, say), then it goes on; its whole output, within 30 s.
pub fn paused(mut child: Child, at_pause: impl FnOnce()) -> Output {
    use std::io::{BufRead, BufReader, Write};
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut seen = String::new();
    loop {
        let mut l = String::new();
        assert!(out.read_line(&mut l).unwrap() > 0, "no pause: {seen}");
        seen += &l;
        if l == "between syncs\n" {
            break;
        }
    }
    at_pause();
    let mut stdin = child.stdin.take().unwrap();
    stdin.write_all(b"go\n").unwrap();
    drop(stdin);
    // The rest of stdout, read while the app runs (it must not block on a pipe).
    let rest = std::thread::spawn(move || {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut out, &mut s).unwrap();
        s
    });
    let mut o = wait_with_deadline(child, Duration::from_secs(30));
    o.stdout = (seen + &rest.join().unwrap()).into_bytes();
    o
}

/// The client library's own counts (TOFFLOAD_CUDA_REMOTE_STATS=1), from its stderr
/// line "N calls in F frames (B bytes), R round trips waited, M moves".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClientCounts {
    pub calls: u64,
    pub frames: u64,
    pub bytes: u64,
    pub round_trips: u64,
    pub moves: u64,
}

#[allow(dead_code)] // not every suite that includes remote_util reads it
pub fn client_counts(stderr: &str) -> Option<ClientCounts> {
    let l = stderr.lines().find(|l| l.contains("round trips waited"))?;
    let n: Vec<u64> = l
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    (n.len() == 5).then(|| ClientCounts {
        calls: n[0],
        frames: n[1],
        bytes: n[2],
        round_trips: n[3],
        moves: n[4],
    })
}
