//! toffload-remoted's start: its configuration (from the command line, cli.rs, and the
//! device knobs), logging, the plaintext check, and the listening loop's launch.

use super::cli::{Cli, LocalBackend};
use super::daemon::Daemon;
use super::limits::Limits;
use super::tls::TlsFiles;
use crate::cuda::CudaConfig;
use crate::EmuConfig;
use std::io::{self, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use tracing::{error, info, warn};

#[derive(Clone, Debug)]
pub struct DaemonConfig {
    pub listen: String,
    pub port_file: Option<PathBuf>,
    pub state_dir: Option<PathBuf>,
    pub fsync: bool,
    pub rsa_key: Option<PathBuf>,
    pub sign_threads: usize,
    pub tls: Option<TlsFiles>,
    /// --tls-psk: the clients' identities and keys (read at start).
    pub psk: Option<PathBuf>,
    pub insecure_plaintext: bool,
    pub cache_mb: usize,
    pub cache_dir: Option<PathBuf>,
    pub cache_disk_mb: usize,
    pub track: usize,
    pub dedup: bool,
    pub stats_file: Option<PathBuf>,
    pub limits: Limits,
    /// Where AES ops run (--backend), with its knobs (TOFFLOAD_EMU_*, TOFFLOAD_CUDA_*).
    pub backend: LocalBackend,
    pub emu: EmuConfig,
    pub cuda: CudaConfig,
}

impl DaemonConfig {
    /// From the command line (without the program name); --help, --version and
    /// usage errors come back as clap's error.
    pub fn parse(
        args: &[String],
        emu: EmuConfig,
        cuda: CudaConfig,
    ) -> Result<DaemonConfig, clap::Error> {
        let c = Cli::parse_args(args)?;
        Ok(DaemonConfig {
            tls: c.tls(),
            listen: c.listen,
            port_file: c.port_file,
            state_dir: c.state_dir,
            fsync: c.fsync,
            rsa_key: c.rsa_key,
            sign_threads: c.sign_threads as usize,
            psk: c.tls_psk,
            insecure_plaintext: c.insecure_plaintext,
            cache_mb: c.cache_mb as usize,
            cache_dir: c.cache_dir,
            cache_disk_mb: c.cache_disk_mb as usize,
            track: c.track as usize,
            dedup: !c.test_disable_dedup,
            stats_file: c.stats_file,
            limits: c.limits,
            backend: c.backend,
            emu,
            cuda,
        })
    }
}

/// Logs to stderr with timestamps, at the level TOFFLOAD_REMOTED_LOG names (error,
/// warn, info, debug, trace; default info).
fn init_logging() -> Result<(), String> {
    use tracing_subscriber::filter::LevelFilter;
    let k = &crate::knobs::REMOTED_LOG;
    let level = match std::env::var(k.var).as_deref() {
        Err(_) | Ok("") | Ok("info") => LevelFilter::INFO,
        Ok("error") => LevelFilter::ERROR,
        Ok("warn") => LevelFilter::WARN,
        Ok("debug") => LevelFilter::DEBUG,
        Ok("trace") => LevelFilter::TRACE,
        Ok(other) => return Err(format!("{}={other:?}: expected {}", k.var, k.form)),
    };
    tracing_subscriber::fmt()
        .with_writer(io::stderr)
        .with_max_level(level)
        .with_ansi(false)
        .with_target(false)
        .init();
    Ok(())
}

/// Entry point of the binary.
pub fn main() -> std::process::ExitCode {
    toffload_cli::generate_if_requested::<Cli>();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let knobs = EmuConfig::from_env().and_then(|e| Ok((e, CudaConfig::from_env()?)));
    let (emu, cuda) = match knobs {
        Ok(k) => k,
        Err(e) => {
            eprintln!("toffload-remoted: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let cfg = match DaemonConfig::parse(&args, emu, cuda) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    if let Err(e) = init_logging() {
        eprintln!("toffload-remoted: {e}");
        return std::process::ExitCode::from(2);
    }
    match run(cfg) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            eprintln!("toffload-remoted: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Plaintext is for loopback; anywhere else it takes --insecure-plaintext.
fn check_plaintext(cfg: &DaemonConfig, addr: SocketAddr) -> io::Result<()> {
    if cfg.tls.is_some() || cfg.psk.is_some() || addr.ip().is_loopback() {
        return Ok(());
    }
    if !cfg.insecure_plaintext {
        return Err(io::Error::other(format!(
            "refusing plaintext on {addr}, which is not a loopback address: anyone who \
             reaches it could submit ops and read and change the traffic. Give --tls-psk \
             FILE or --tls-cert/--tls-key/--tls-ca, or --insecure-plaintext to accept that"
        )));
    }
    warn!(%addr, "serving PLAINTEXT on a non-loopback address (--insecure-plaintext): no authentication, no encryption");
    Ok(())
}

/// Starts the daemon and serves until the process ends.
pub fn run(cfg: DaemonConfig) -> io::Result<()> {
    let listener = TcpListener::bind(&cfg.listen)?;
    let addr = listener.local_addr()?;
    check_plaintext(&cfg, addr)?;
    let d = Daemon::start(cfg)?;
    if let Some(p) = &d.cfg.port_file {
        let tmp = p.with_extension("tmp");
        std::fs::write(&tmp, addr.port().to_string())?;
        std::fs::rename(&tmp, p)?;
    }
    let backend = d.cfg.backend;
    let mode = match (&d.cfg.tls, &d.cfg.psk) {
        (Some(_), _) => "TLS, client certificates",
        (_, Some(_)) => "TLS 1.3, pre-shared keys",
        _ => "plaintext",
    };
    info!(%addr, mode, ?backend, "listening");
    println!("toffload-remoted: listening on {addr}");
    let _ = io::stdout().flush();
    d.serve(listener)
}
