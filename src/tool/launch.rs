//! The launcher of `roccl-perf --ranks N`: starts the rank processes and supervises them so
//! that no rank outlives the job. As soon as one rank fails, the others are killed and the
//! failure is reported, naming the rank that caused it first (a stopped rank, when one is
//! stopped, then the rank that failed first); SIGINT, SIGTERM and SIGHUP to the launcher are
//! forwarded to its ranks (killed after a grace period if they do not end); and each rank
//! asks the kernel to kill it when the launcher dies (`PR_SET_PDEATHSIG`), so that even a
//! SIGKILLed launcher leaves no rank behind.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use super::EXIT_STDOUT_CLOSED;

/// How a job of rank processes ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Every rank finished; `all_ok` is false when one reported wrong results (status 1).
    Done {
        /// No rank reported wrong results.
        all_ok: bool,
    },
    /// A rank's standard output was closed (a pipe into `head`): the job was ended quietly.
    StdoutClosed,
    /// A rank failed; the others were killed. The text names the rank that caused it first.
    Failed(String),
    /// The launcher received this signal; it was forwarded and the ranks have ended.
    Signalled(i32),
}

/// The signal a rank sends its launcher when it finds standard output closed.
pub const STDOUT_CLOSED_SIGNAL: i32 = libc::SIGUSR2;

/// The last of SIGINT, SIGTERM, SIGHUP received (0: none).
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// A rank sent [`STDOUT_CLOSED_SIGNAL`].
static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(sig: libc::c_int) {
    // Atomic stores are async-signal-safe.
    if sig == STDOUT_CLOSED_SIGNAL {
        STDOUT_CLOSED.store(true, Ordering::Relaxed);
    } else {
        SIGNAL.store(sig, Ordering::Relaxed);
    }
}

fn catch_signals() -> Result<(), String> {
    for sig in [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        STDOUT_CLOSED_SIGNAL,
    ] {
        // SAFETY: a zeroed sigaction is valid (empty mask, no flags); the handler only stores
        // to an atomic, which is async-signal-safe.
        let r = unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigaction(sig, &sa, std::ptr::null_mut())
        };
        if r != 0 {
            return Err(format!(
                "installing the handler of signal {sig}: {}",
                std::io::Error::last_os_error()
            ));
        }
    }
    Ok(())
}

/// How often the ranks are looked at.
const POLL: Duration = Duration::from_millis(20);
/// How long ranks get to end after a forwarded signal before they are killed.
const GRACE: Duration = Duration::from_secs(2);

/// Start `ranks` (command `r` is rank `r`) and supervise them until the job ends. Call it from
/// the main thread: the kernel's parent-death signal follows the thread that started a child.
pub fn run(ranks: Vec<Command>) -> Result<Outcome, String> {
    catch_signals()?;
    // SAFETY: getpid has no memory effects.
    let parent = unsafe { libc::getpid() };
    let mut kids: Vec<Child> = Vec::with_capacity(ranks.len());
    for (r, mut cmd) in ranks.into_iter().enumerate() {
        // SAFETY: between fork and exec the closure calls only async-signal-safe functions
        // (prctl, getppid, _exit) and allocates nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died before the request took effect.
                if libc::getppid() != parent {
                    libc::_exit(2);
                }
                Ok(())
            });
        }
        match cmd.spawn() {
            Ok(k) => kids.push(k),
            Err(e) => {
                end_all(&mut kids, &mut vec![None; r], libc::SIGKILL);
                return Err(format!("starting rank {r}: {e}"));
            }
        }
    }
    let mut done: Vec<Option<ExitStatus>> = vec![None; kids.len()];
    loop {
        if STDOUT_CLOSED.load(Ordering::Relaxed) {
            end_all(&mut kids, &mut done, libc::SIGKILL);
            return Ok(Outcome::StdoutClosed);
        }
        let sig = SIGNAL.load(Ordering::Relaxed);
        if sig != 0 {
            end_all(&mut kids, &mut done, sig);
            return Ok(Outcome::Signalled(sig));
        }
        // The first rank that failed, and how.
        let mut failed: Option<(usize, String)> = None;
        let mut stdout_closed = false;
        for (r, k) in kids.iter_mut().enumerate() {
            if done[r].is_some() {
                continue;
            }
            match k.try_wait() {
                Ok(Some(s)) => {
                    done[r] = Some(s);
                    if s.code() == Some(EXIT_STDOUT_CLOSED.into()) {
                        stdout_closed = true;
                    } else if !(s.success() || s.code() == Some(1)) && failed.is_none() {
                        failed = Some((r, describe(s)));
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    failed.get_or_insert((r, format!("waiting for it failed: {e}")));
                }
            }
        }
        // Rank 0 found standard output closed and ended; ranks that failed meanwhile failed
        // because it had gone (it exited before them, and is looked at first).
        if stdout_closed {
            end_all(&mut kids, &mut done, libc::SIGKILL);
            return Ok(Outcome::StdoutClosed);
        }
        if let Some((r, how)) = failed {
            let stopped: String = kids
                .iter()
                .enumerate()
                .filter(|(q, k)| done[*q].is_none() && is_stopped(k.id()))
                .map(|(q, k)| {
                    format!(
                        "rank {q} (pid {}) is stopped (SIGSTOP or SIGTSTP) and has not been running; ",
                        k.id()
                    )
                })
                .collect();
            let alive: Vec<String> = (0..kids.len())
                .filter(|q| done[*q].is_none())
                .map(|q| q.to_string())
                .collect();
            end_all(&mut kids, &mut done, libc::SIGKILL);
            let ended = if alive.is_empty() {
                String::new()
            } else {
                format!("; ended the job: killed rank(s) {}", alive.join(", "))
            };
            return Ok(Outcome::Failed(format!(
                "{stopped}rank {r} (pid {}) failed first: {how}{ended}",
                kids[r].id()
            )));
        }
        if done.iter().all(Option::is_some) {
            let all_ok = done.iter().flatten().all(|s| s.success());
            return Ok(Outcome::Done { all_ok });
        }
        std::thread::sleep(POLL);
    }
}

fn describe(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exit status {c} (its error is above)"),
        (None, Some(sig)) => format!("killed by signal {sig} ({})", signal_name(sig)),
        _ => s.to_string(),
    }
}

fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT: an abort, e.g. a failed allocation",
        libc::SIGBUS => "SIGBUS",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGHUP => "SIGHUP",
        _ => "a signal",
    }
}

/// Whether the process is stopped (state T or t in /proc/PID/stat).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| matches!(rest.trim_start().chars().next(), Some('T' | 't')))
    })
}

/// Send `sig` to every rank still running; those not ended after [`GRACE`] (or at once for
/// SIGKILL) are killed; every rank is reaped.
fn end_all(kids: &mut [Child], done: &mut [Option<ExitStatus>], sig: i32) {
    for (k, d) in kids.iter().zip(done.iter()) {
        if d.is_none() {
            // SAFETY: kill has no memory effects; the pid is our unreaped child's.
            unsafe { libc::kill(k.id() as libc::pid_t, sig) };
            if sig != libc::SIGKILL {
                // A stopped rank acts on the signal only once continued.
                // SAFETY: as above.
                unsafe { libc::kill(k.id() as libc::pid_t, libc::SIGCONT) };
            }
        }
    }
    let deadline = Instant::now()
        + if sig == libc::SIGKILL {
            Duration::ZERO
        } else {
            GRACE
        };
    while Instant::now() < deadline {
        let mut running = false;
        for (k, d) in kids.iter_mut().zip(done.iter_mut()) {
            if d.is_none() {
                match k.try_wait() {
                    Ok(Some(s)) => *d = Some(s),
                    Ok(None) => running = true,
                    Err(_) => {}
                }
            }
        }
        if !running {
            return;
        }
        std::thread::sleep(POLL);
    }
    for (k, d) in kids.iter_mut().zip(done.iter_mut()) {
        if d.is_none() {
            let _ = k.kill();
            if let Ok(s) = k.wait() {
                *d = Some(s);
            }
        }
    }
}
