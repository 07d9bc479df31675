//! The daemon's executors: AES-128-CTR on a local device (emulated or cuda, the same
//! key and counter as TOFFLOAD_BACKEND=emulated, so results are bit-identical) and
//! RSA-2048 signing with openssl on a few worker threads.

use super::conn::{self, EventFd};
use crate::cuda::{Cuda, CudaConfig};
use crate::{AccelError, Accelerator, EmuConfig, Emulated, OpId, OpState};
use openssl::hash::MessageDigest;
use openssl::pkey::{PKey, Private};
use openssl::sign::Signer;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

pub struct Job {
    pub client: u64,
    pub seq: u64,
    pub data: Vec<u8>,
}

pub struct Finished {
    pub client: u64,
    pub seq: u64,
    pub status: i32,
    pub data: Vec<u8>,
    pub service_ns: u64,
}

pub type Sink = Arc<dyn Fn(Vec<Finished>) + Send + Sync>;

/// AES jobs go to the local device, at most its in-flight bound at once; the rest
/// wait here (the queue depth the daemon reports).
pub struct AesExec {
    queue: Mutex<VecDeque<Job>>,
    wake: EventFd,
}

/// A local device and its bounds: ops in flight, bytes per op, ops served at once.
pub struct Device {
    pub dev: Box<dyn Accelerator>,
    pub max_inflight: usize,
    pub max_bytes: usize,
    pub lanes: usize,
}

impl Device {
    pub fn emulated(cfg: EmuConfig) -> std::io::Result<Device> {
        let (max_inflight, max_bytes, lanes) = (cfg.max_inflight, cfg.max_bytes, cfg.lanes);
        Ok(Device {
            dev: Box::new(Emulated::new(cfg)?),
            max_inflight,
            max_bytes,
            lanes,
        })
    }

    pub fn cuda(cfg: CudaConfig) -> std::io::Result<Device> {
        let dev = Cuda::new(cfg.clone())
            .map_err(|e| std::io::Error::other(format!("--backend cuda: {e}")))?;
        Ok(Device {
            dev: Box::new(dev),
            max_inflight: cfg.max_inflight,
            max_bytes: cfg.max_bytes,
            lanes: cfg.streams,
        })
    }
}

impl AesExec {
    pub fn start(dev: Device, sink: Sink) -> std::io::Result<Arc<AesExec>> {
        let ex = Arc::new(AesExec {
            queue: Mutex::new(VecDeque::new()),
            wake: EventFd::new()?,
        });
        let me = Arc::clone(&ex);
        std::thread::Builder::new()
            .name("remoted-aes".into())
            .spawn(move || me.run(dev, sink))?;
        Ok(ex)
    }

    pub fn push(&self, jobs: impl IntoIterator<Item = Job>) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(jobs);
        self.wake.signal();
    }

    fn run(&self, d: Device, sink: Sink) {
        let (cap, max, dev) = (d.max_inflight, d.max_bytes, d.dev);
        let mut waiting: VecDeque<Job> = VecDeque::new();
        let mut inflight: Vec<(OpId, Job, Instant)> = Vec::new();
        let mut out: Vec<Finished> = Vec::new();
        loop {
            let mut fds = [
                conn::pollfd(self.wake.fd(), libc::POLLIN),
                conn::pollfd(dev.completion_fd(), libc::POLLIN),
            ];
            let _ = conn::poll(&mut fds, Some(std::time::Duration::from_millis(100)));
            self.wake.drain();
            let mut v = 0u64;
            // SAFETY: 8-byte read from the device's non-blocking eventfd.
            unsafe {
                libc::read(
                    dev.completion_fd(),
                    &mut v as *mut u64 as *mut libc::c_void,
                    8,
                )
            };
            waiting.extend(
                self.queue
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .drain(..),
            );
            while inflight.len() < cap {
                let Some(mut job) = waiting.pop_front() else {
                    break;
                };
                if job.data.len() > max {
                    out.push(Finished {
                        client: job.client,
                        seq: job.seq,
                        status: -libc::EMSGSIZE,
                        data: Vec::new(),
                        service_ns: 0,
                    });
                    continue;
                }
                // SAFETY: the job (and so its buffer) stays in `inflight` until the op
                // is done and released.
                match unsafe { dev.submit(job.data.as_mut_ptr(), job.data.len()) } {
                    Ok(id) => inflight.push((id, job, Instant::now())),
                    Err(AccelError::TooManyInFlight { .. }) => {
                        waiting.push_front(job);
                        break;
                    }
                    Err(e) => out.push(Finished {
                        client: job.client,
                        seq: job.seq,
                        status: -e.errno(),
                        data: Vec::new(),
                        service_ns: 0,
                    }),
                }
            }
            let mut k = 0;
            while k < inflight.len() {
                let st = dev.done(inflight[k].0);
                if st == Ok(OpState::Pending) {
                    k += 1;
                    continue;
                }
                let (id, job, t0) = inflight.swap_remove(k);
                let _ = dev.release(id);
                let (status, data) = match st {
                    Ok(_) => (0, job.data),
                    Err(e) => (-e.errno(), Vec::new()),
                };
                out.push(Finished {
                    client: job.client,
                    seq: job.seq,
                    status,
                    data,
                    service_ns: t0.elapsed().as_nanos() as u64,
                });
            }
            if !out.is_empty() {
                sink(std::mem::take(&mut out));
            }
        }
    }
}

/// RSA signing on worker threads.
pub struct RsaExec {
    queue: Mutex<VecDeque<Job>>,
    cv: Condvar,
}

impl RsaExec {
    pub fn start(key: PKey<Private>, threads: usize, sink: Sink) -> std::io::Result<Arc<RsaExec>> {
        let ex = Arc::new(RsaExec {
            queue: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
        });
        let key = Arc::new(key);
        for i in 0..threads.max(1) {
            let me = Arc::clone(&ex);
            let key = Arc::clone(&key);
            let sink = Arc::clone(&sink);
            std::thread::Builder::new()
                .name(format!("remoted-rsa{i}"))
                .spawn(move || me.run(&key, sink))?;
        }
        Ok(ex)
    }

    pub fn push(&self, jobs: impl IntoIterator<Item = Job>) {
        self.queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(jobs);
        self.cv.notify_all();
    }

    fn run(&self, key: &PKey<Private>, sink: Sink) {
        loop {
            let job = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                loop {
                    if let Some(j) = q.pop_front() {
                        break j;
                    }
                    q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            let t0 = Instant::now();
            let sig = sign(key, &job.data);
            let (status, data) = match sig {
                Some(s) => (0, s),
                None => (-libc::EIO, Vec::new()),
            };
            sink(vec![Finished {
                client: job.client,
                seq: job.seq,
                status,
                data,
                service_ns: t0.elapsed().as_nanos() as u64,
            }]);
        }
    }
}

/// PKCS#1 v1.5 over SHA-256.
pub fn sign(key: &PKey<Private>, data: &[u8]) -> Option<Vec<u8>> {
    let mut s = Signer::new(MessageDigest::sha256(), key).ok()?;
    s.update(data).ok()?;
    s.sign_to_vec().ok()
}
