//! The launcher of `roccl-perf --ranks N`: starts the rank processes and supervises them so
//! that no rank outlives the job. As soon as one rank fails, the others are killed and the
//! failure is reported, naming the rank that caused it first (a stopped rank, when one is
//! stopped, then the rank that failed first: of failures seen in one look, the one whose
//! SIGCHLD came first, else one killed by a signal rather than one that exited with an error,
//! which is what its peers do once it is gone); SIGINT, SIGTERM and SIGHUP to the launcher are
//! forwarded to its ranks (killed after a grace period if they do not end); and each rank
//! asks the kernel to kill it when the launcher dies (`PR_SET_PDEATHSIG`), so that even a
//! SIGKILLed launcher leaves no rank behind.

use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::{Child, Command, ExitStatus};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
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

/// Entries of [`EXIT_ORDER`].
const EXITS: usize = 1024;
/// Pids of children in the order their SIGCHLD came (the order they ended: a second SIGCHLD
/// that comes while the first is still pending is merged into it, so the one kept is the
/// earlier), from entry 0 on; entries past [`EXITS`] are not kept.
static EXIT_ORDER: [AtomicI32; EXITS] = [const { AtomicI32::new(0) }; EXITS];
/// SIGCHLDs received so far (the next entry of [`EXIT_ORDER`]).
static EXITS_SEEN: AtomicUsize = AtomicUsize::new(0);

extern "C" fn on_child(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo to an SA_SIGINFO handler; SIGCHLD's names
    // the child. Atomic operations are async-signal-safe.
    let pid = unsafe { (*info).si_pid() };
    let i = EXITS_SEEN.fetch_add(1, Ordering::Relaxed);
    if i < EXITS {
        EXIT_ORDER[i].store(pid, Ordering::Relaxed);
    }
}

/// Where `pid` ended among the SIGCHLDs recorded from entry `from` on (`None`: not recorded).
fn exit_position(pid: u32, from: usize) -> Option<usize> {
    let seen = EXITS_SEEN.load(Ordering::Relaxed).min(EXITS);
    (from.min(seen)..seen).find(|&i| EXIT_ORDER[i].load(Ordering::Relaxed) as u32 == pid)
}

/// A rank that failed, as one look at the ranks found it.
struct Failure {
    rank: usize,
    /// How it ended, in words.
    how: String,
    /// Killed by a signal (not by us: nobody was killed yet), not exited with an error.
    signalled: bool,
    /// Its place in the order the ranks ended, when known.
    ended: Option<usize>,
}

/// The failure that came first of those one look found: the rank that ended first, by the
/// order of SIGCHLD; where that is not known, a rank killed by a signal before one that
/// exited with an error (ranks exit with an error once a peer is gone); then the lowest rank.
fn first_failure(failed: Vec<Failure>) -> Option<Failure> {
    failed
        .into_iter()
        .min_by_key(|f| (f.ended.unwrap_or(usize::MAX), !f.signalled, f.rank))
}

fn catch_signals() -> Result<(), String> {
    // SAFETY: a zeroed sigaction is valid; the handler only uses atomics, which are
    // async-signal-safe, and the siginfo the kernel passes with SA_SIGINFO.
    let r = unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_child
            as extern "C" fn(libc::c_int, *mut libc::siginfo_t, *mut libc::c_void)
            as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART | libc::SA_SIGINFO | libc::SA_NOCLDSTOP;
        libc::sigaction(libc::SIGCHLD, &sa, std::ptr::null_mut())
    };
    if r != 0 {
        return Err(format!(
            "installing the handler of SIGCHLD: {}",
            std::io::Error::last_os_error()
        ));
    }
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
    // SIGCHLDs of this job are the ones recorded from here on.
    let exits_from = EXITS_SEEN.load(Ordering::Relaxed);
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
        // The ranks that failed since the last look, and how.
        let mut failed: Vec<Failure> = Vec::new();
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
                    } else if !(s.success() || s.code() == Some(1)) {
                        failed.push(Failure {
                            rank: r,
                            how: describe(s),
                            signalled: s.signal().is_some(),
                            ended: exit_position(k.id(), exits_from),
                        });
                    }
                }
                Ok(None) => {}
                Err(e) => failed.push(Failure {
                    rank: r,
                    how: format!("waiting for it failed: {e}"),
                    signalled: false,
                    ended: None,
                }),
            }
        }
        // Rank 0 found standard output closed and ended; ranks that failed meanwhile failed
        // because it had gone (it exited before them, and is looked at first).
        if stdout_closed {
            end_all(&mut kids, &mut done, libc::SIGKILL);
            return Ok(Outcome::StdoutClosed);
        }
        if let Some(Failure { rank: r, how, .. }) = first_failure(failed) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(rank: usize, signalled: bool, ended: Option<usize>) -> Failure {
        Failure {
            rank,
            how: String::new(),
            signalled,
            ended,
        }
    }

    /// Of failures one look found, the rank that ended first is named; where the order is
    /// not known, a rank killed by a signal before ranks that exited with an error; then
    /// the lowest rank.
    #[test]
    fn the_failure_named_is_the_one_that_came_first() {
        let first = |f: Vec<Failure>| first_failure(f).map(|f| f.rank);
        assert_eq!(first(vec![]), None);
        let killed_then_exits = vec![
            failure(0, false, Some(8)),
            failure(1, false, Some(9)),
            failure(2, true, Some(7)),
        ];
        assert_eq!(first(killed_then_exits), Some(2));
        let exit_then_killed = vec![failure(0, false, Some(3)), failure(2, true, Some(4))];
        assert_eq!(first(exit_then_killed), Some(0));
        let order_unknown = vec![failure(0, false, None), failure(3, true, None)];
        assert_eq!(first(order_unknown), Some(3));
        let partly_known = vec![failure(0, true, None), failure(2, false, Some(5))];
        assert_eq!(first(partly_known), Some(2));
        let alike = vec![failure(4, false, None), failure(1, false, None)];
        assert_eq!(first(alike), Some(1));
    }

    /// A job whose rank 2 is killed (SIGKILL) and whose ranks 0 and 1 exit with an error
    /// right after it is gone (as ranks whose peer died do), so that one look of the
    /// launcher usually finds all three: it names rank 2, not rank 0. Three jobs: a look
    /// can fall between rank 2's end and theirs (one job in five here), where any launcher
    /// names rank 2.
    #[test]
    fn a_killed_higher_rank_is_named_before_the_lower_ranks_that_then_fail() {
        for job in 0..3 {
            killed_rank_2_then_ranks_0_and_1_fail(job);
        }
    }

    fn killed_rank_2_then_ranks_0_and_1_fail(job: usize) {
        let dir = std::env::temp_dir().join(format!("roccl-launch-{}-{job}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pid_file = dir.join("rank2.pid");
        let _ = std::fs::remove_file(&pid_file);
        let sh = |script: String| {
            let mut c = Command::new("sh");
            c.arg("-c").arg(script);
            c
        };
        // Ranks 0 and 1 wait, with shell builtins only (no fork between its end and
        // theirs), until rank 2 is a zombie, then exit with status 2 (a rank's error).
        let follower = format!(
            r#"f='{}'; until [ -s "$f" ]; do sleep 0.01; done; read p < "$f"
               until {{ read l < /proc/$p/stat; case "$l" in *") Z "*) true;; *) false;; esac; }}; do :; done
               exit 2"#,
            pid_file.display()
        );
        let victim = format!(
            "echo $$ > '{}.tmp' && mv '{0}.tmp' '{0}'; sleep 0.3; kill -9 $$",
            pid_file.display()
        );
        let out = run(vec![sh(follower.clone()), sh(follower), sh(victim)]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        let Outcome::Failed(msg) = out else {
            panic!("the job did not fail: {out:?}");
        };
        assert!(
            msg.starts_with("rank 2 (pid ") && msg.contains("failed first: killed by signal 9"),
            "job {job}: {msg}"
        );
    }
}
