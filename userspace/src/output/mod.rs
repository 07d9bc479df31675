//! Where a watch's results go: the text and JSON report, the sinks, the dashboard, the
//! wall clock of the lines and the syscall names they print.

pub mod dashboard;
pub mod report;
pub mod sink;
pub mod syscalls;
pub mod wall_clock;
