//! toffload-remoted: the daemon behind TOFFLOAD_BACKEND=remote (`--help`).

fn main() -> std::process::ExitCode {
    toffload_accel::remote::daemon::main()
}
