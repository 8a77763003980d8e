//! Helpers of roccl's command-line tools (`roccl-perf`, `roccl-info`): output that ends the
//! tool quietly when its standard output is closed (`roccl-perf | head`), and the launcher of
//! `roccl-perf --ranks N` (`launch`), `roccl-info --status` (`status`) and `roccl-info --watch` (`watch`).

pub mod launch;
pub mod status;
pub mod thread_job;
pub mod watch;

use std::io::Write;
use std::sync::atomic::{AtomicU8, Ordering};

/// Exit status of a rank of `roccl-perf --ranks N` whose standard output was closed: it
/// first signals its launcher ([`launch::STDOUT_CLOSED_SIGNAL`]), which ends the job quietly,
/// with status 0.
pub const EXIT_STDOUT_CLOSED: u8 = 3;

static CLOSED_STDOUT_STATUS: AtomicU8 = AtomicU8::new(0);

/// The status [`print_line`] exits with when standard output is closed (0 unless set).
pub fn set_closed_stdout_status(status: u8) {
    CLOSED_STDOUT_STATUS.store(status, Ordering::Relaxed);
}

/// Write one line to standard output, flushed. When standard output is closed (the reader of
/// a pipe has gone, as `head` does after its lines), the process ends at once and quietly,
/// with the status [`set_closed_stdout_status`] set; any other write error ends it with a
/// message and status 2.
pub fn print_line(args: std::fmt::Arguments) {
    let mut out = std::io::stdout().lock();
    let r = out
        .write_fmt(args)
        .and_then(|()| out.write_all(b"\n"))
        .and_then(|()| out.flush());
    match r {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            let status = CLOSED_STDOUT_STATUS.load(Ordering::Relaxed);
            if status == EXIT_STDOUT_CLOSED {
                // A rank of our launcher: ask it to end the job, and stay until it does, so
                // that no other rank sees this one exit and reports it.
                // SAFETY: getppid and kill have no memory effects.
                unsafe { libc::kill(libc::getppid(), launch::STDOUT_CLOSED_SIGNAL) };
                std::thread::sleep(std::time::Duration::from_secs(10));
            }
            std::process::exit(status.into())
        }
        Err(e) => {
            print_error(format_args!("writing to standard output: {e}"));
            std::process::exit(2)
        }
    }
}

/// Write one message line to standard error in one write, so that the lines of several
/// processes sharing it do not interleave; a closed standard error is ignored.
pub fn print_error(args: std::fmt::Arguments) {
    let mut line = args.to_string();
    line.push('\n');
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}
