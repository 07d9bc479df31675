use std::fmt;

/// Why an accelerator call failed. Each maps to the negative errno the C ABI returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AccelError {
    /// Null buffer with a non-zero length (EFAULT).
    NullBuffer,
    /// Negative length (EINVAL).
    BadLength,
    /// Longer than the device accepts (EMSGSIZE).
    TooLarge { len: usize, max: usize },
    /// Every operation slot is in use (EAGAIN).
    TooManyInFlight { max: usize },
    /// Unknown, stale or already released handle (EBADF).
    BadHandle,
    /// The device failed the operation (EIO).
    DeviceFault,
    /// The backend could not be configured or started (EINVAL).
    Unusable,
    /// The backend's device or driver is missing (ENODEV).
    NoDevice,
    /// Device or pinned host memory is exhausted (ENOMEM).
    OutOfMemory,
    /// No result before the operation's deadline (ETIMEDOUT; the remote backend).
    TimedOut,
    /// The remote daemon refused the operation without running it: its client had
    /// too much in flight there (ENOBUFS; the remote backend).
    OverLimit,
    /// The backend has no such mode (EOPNOTSUPP: `submit_polled` where completions
    /// are only signalled).
    NotSupported,
}

impl AccelError {
    /// The positive errno value for this error.
    pub fn errno(self) -> i32 {
        match self {
            AccelError::NullBuffer => libc::EFAULT,
            AccelError::BadLength | AccelError::Unusable => libc::EINVAL,
            AccelError::TooLarge { .. } => libc::EMSGSIZE,
            AccelError::TooManyInFlight { .. } => libc::EAGAIN,
            AccelError::BadHandle => libc::EBADF,
            AccelError::DeviceFault => libc::EIO,
            AccelError::NoDevice => libc::ENODEV,
            AccelError::OutOfMemory => libc::ENOMEM,
            AccelError::TimedOut => libc::ETIMEDOUT,
            AccelError::OverLimit => libc::ENOBUFS,
            AccelError::NotSupported => libc::EOPNOTSUPP,
        }
    }
}

impl fmt::Display for AccelError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AccelError::NullBuffer => write!(f, "null buffer"),
            AccelError::BadLength => write!(f, "negative length"),
            AccelError::TooLarge { len, max } => {
                write!(f, "length {len} exceeds the device maximum {max}")
            }
            AccelError::TooManyInFlight { max } => {
                write!(f, "too many operations in flight (max {max})")
            }
            AccelError::BadHandle => write!(f, "unknown or released handle"),
            AccelError::DeviceFault => write!(f, "device fault"),
            AccelError::Unusable => write!(f, "backend unusable (see its load-time message)"),
            AccelError::NoDevice => write!(f, "no device (see the backend's message)"),
            AccelError::OutOfMemory => write!(f, "out of device or pinned memory"),
            AccelError::TimedOut => write!(f, "no result before the deadline"),
            AccelError::OverLimit => write!(
                f,
                "the remote daemon refused the op: past its per-client in-flight bound"
            ),
            AccelError::NotSupported => write!(f, "not supported by this backend"),
        }
    }
}

impl std::error::Error for AccelError {}
