//! The minimal-edit integrations of backends/integrations, built into the dist
//! folder's integrations/ where their toolchains are present: each from its own build
//! file (the Makefiles, nginx's build.sh), so that the commands live in one place.
//! Where a toolchain is missing the integration is skipped with one line; the
//! reroute tests, which build their own copies, say the same under CI.

use crate::paths;
use crate::proc::{self, Result};
use std::path::Path;
use std::process::Command;

pub fn build(dist: &Path) -> Result {
    let src = paths::root().join("backends/integrations");
    let out = dist.join("integrations");
    let make = |dir: &str, target: &Path| -> Result {
        std::fs::create_dir_all(target.parent().expect("a folder"))
            .map_err(|e| format!("creating {}: {e}", target.display()))?;
        proc::run(
            Command::new("make")
                .arg("-s")
                .arg("-C")
                .arg(src.join(dir))
                .arg(format!("DIST={}", dist.display()))
                .arg(format!("OUT={}", target.display())),
        )
    };
    // cc and make come with build-essential, which every build needs.
    make("redis", &out.join("redis/toffload_redis.so"))?;
    make("python", &out.join("python/toffload_guard_helper.so"))?;
    copy(
        &src.join("python/toffload_asyncio.py"),
        &out.join("python/toffload_asyncio.py"),
    )?;
    if proc::succeeds("go", &["version"]) {
        make("go", &out.join("go/accelhttp"))?;
    } else {
        skipped("go", "Go is not installed (Debian: golang-go)");
    }
    let conf_flags = Path::new("/usr/share/nginx/src/conf_flags");
    if conf_flags.exists() {
        nginx(&src.join("nginx"), dist, &out.join("nginx"))?;
    } else {
        skipped("nginx", "nginx-dev is not installed");
    }
    Ok(())
}

fn skipped(what: &str, why: &str) {
    eprintln!("xtask: integration {what} not built: {why}");
}

fn copy(from: &Path, to: &Path) -> Result {
    std::fs::create_dir_all(to.parent().expect("a folder"))
        .and_then(|()| std::fs::copy(from, to))
        .map(|_| ())
        .map_err(|e| format!("copying {} to {}: {e}", from.display(), to.display()))
}

/// build.sh configures nginx-dev's sources whole (half a minute): only when what goes
/// into the module has changed, by content (the dist folder's files are copied anew
/// by every build, so their times say nothing). The stamp beside the module holds a
/// hash of them.
fn nginx(src: &Path, dist: &Path, out: &Path) -> Result {
    use std::hash::{Hash, Hasher};
    let module = out.join("ngx_http_toffload_module.so");
    let stamp = out.join(".inputs");
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for p in [
        src.join("ngx_http_toffload_module.c"),
        src.join("config"),
        src.join("build.sh"),
        dist.join("include/toffload_accel.h"),
    ] {
        std::fs::read(&p)
            .map_err(|e| format!("reading {}: {e}", p.display()))?
            .hash(&mut h);
    }
    let want = format!("{:016x}\n", h.finish());
    if module.exists() && std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(());
    }
    proc::run(
        Command::new("sh")
            .arg(src.join("build.sh"))
            .arg(dist)
            .arg(out)
            .stdout(std::process::Stdio::null()),
    )?;
    std::fs::write(&stamp, want).map_err(|e| format!("writing {}: {e}", stamp.display()))
}
