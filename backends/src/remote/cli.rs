//! toffload-remoted's command line (clap): what it runs, where it listens, its files,
//! and its bounds (limits.rs).

use super::limits::Limits;
use super::tls::TlsFiles;
use clap::{CommandFactory, Parser, ValueEnum};
use std::path::PathBuf;

/// Where the daemon runs AES ops.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum LocalBackend {
    /// The emulated device (TOFFLOAD_EMU_* knobs).
    Emulated,
    /// A CUDA GPU (TOFFLOAD_CUDA_* knobs; libcuda and libnvrtc loaded at start).
    Cuda,
}

/// toffload-remoted: runs toffload's remote ops (AES-128-CTR on a local device, the
/// emulated one or a CUDA GPU, see --backend; RSA-2048 signing) for clients using
/// TOFFLOAD_BACKEND=remote. Logs go to stderr with timestamps, at the level
/// TOFFLOAD_REMOTED_LOG names (error, warn, info, debug, trace; default info).
#[derive(Parser, Clone, Debug)]
#[command(name = "toffload-remoted", version = toffload_cli::VERSION)]
pub struct Cli {
    /// Address to listen on (port 0 = any). Plaintext is refused on anything but a
    /// loopback address unless --insecure-plaintext is given.
    #[arg(long, value_name = "HOST:PORT", default_value = "127.0.0.1:7878")]
    pub listen: String,
    /// The local device AES ops run on (results are bit-identical either way).
    #[arg(long, value_enum, default_value_t = LocalBackend::Emulated)]
    pub backend: LocalBackend,
    /// Write the port actually bound to FILE.
    #[arg(long, value_name = "FILE")]
    pub port_file: Option<PathBuf>,
    /// Journal of executed ops and unacknowledged results (exactly once across a
    /// restart), and the RSA key if none is given.
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// fdatasync the journal on every flush (survive power loss).
    #[arg(long)]
    pub fsync: bool,
    /// RSA private key (PEM) to sign with; default: generated at start (kept in
    /// --state-dir/rsa.pem, mode 0600, when there is one).
    #[arg(long, value_name = "FILE")]
    pub rsa_key: Option<PathBuf>,
    /// RSA signing threads.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
    pub sign_threads: u64,
    /// TLS: this daemon's certificate (with --tls-key and --tls-ca); clients must
    /// present a certificate signed by the CA, and its subject is their identity.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<PathBuf>,
    /// TLS: this daemon's private key (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<PathBuf>,
    /// TLS: the CA that signs the clients' certificates.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<PathBuf>,
    /// TLS 1.3 with pre-shared keys instead: FILE (mode 0600) has one line
    /// `IDENTITY HEXKEY` per client (keys of 16 to 64 bytes); a client without a
    /// listed identity and its key is refused.
    #[arg(long, value_name = "FILE")]
    pub tls_psk: Option<PathBuf>,
    /// Serve plaintext on a non-loopback address: anyone who can reach it can submit
    /// ops, and the traffic can be read and changed on the way.
    #[arg(long)]
    pub insecure_plaintext: bool,
    /// Chunk cache in memory, MiB (0 = no cache).
    #[arg(long, value_name = "MIB", default_value_t = 256, value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub cache_mb: u64,
    /// Chunk cache on disk (survives restarts), one folder per client identity.
    #[arg(long, value_name = "DIR")]
    pub cache_dir: Option<PathBuf>,
    /// Bound of the disk cache, MiB.
    #[arg(long, value_name = "MIB", default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1 << 24))]
    pub cache_disk_mb: u64,
    /// Remember the last N executed (client, seq) pairs to count any executed twice
    /// (0 = off).
    #[arg(long, value_name = "N", default_value_t = 1 << 20, value_parser = clap::value_parser!(u64).range(0..=1 << 28))]
    pub track: u64,
    /// Rewrite FILE (mode 0600) every second with the daemon's counters, one
    /// `name value` line each (the same pairs a stats query returns).
    #[arg(long, value_name = "FILE")]
    pub stats_file: Option<PathBuf>,
    /// Tests only: run every op received, resends included.
    #[arg(long, hide = true)]
    pub test_disable_dedup: bool,
    #[command(flatten)]
    pub limits: Limits,
}

impl Cli {
    /// The TLS files, when given (clap made sure all three are).
    pub fn tls(&self) -> Option<TlsFiles> {
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => Some(TlsFiles {
                ca: ca.clone(),
                cert: cert.clone(),
                key: key.clone(),
            }),
            _ => None,
        }
    }

    /// Parses `args` (without the program name); errors, --help and --version come
    /// back as clap's error, which prints and exits as clap does.
    pub fn parse_args(args: &[String]) -> Result<Cli, clap::Error> {
        let cli = Cli::try_parse_from(
            std::iter::once("toffload-remoted".to_string()).chain(args.iter().cloned()),
        )?;
        if cli.tls_psk.is_some() && cli.tls_cert.is_some() {
            return Err(Cli::command().error(
                clap::error::ErrorKind::ArgumentConflict,
                "--tls-psk and --tls-cert/--tls-key/--tls-ca exclude each other",
            ));
        }
        Ok(cli)
    }
}
