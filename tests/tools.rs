//! The command-line tools as a new user meets them: output into a closed pipe, the launcher
//! of `roccl-perf --ranks N` tearing its job down, checked input, bootstrap failures and help.

use std::io::{BufRead, BufReader};
use std::os::fd::{FromRawFd, OwnedFd};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const PERF: &str = env!("CARGO_BIN_EXE_roccl-perf");
const INFO: &str = env!("CARGO_BIN_EXE_roccl-info");

/// A pipe whose reading end is already closed, as `head` leaves it once it has its lines.
fn closed_pipe() -> Stdio {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 writes.
    assert_eq!(unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) }, 0);
    // SAFETY: both descriptors are ours and open; each is owned once.
    let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(read);
    Stdio::from(write)
}

/// Wait for `child` at most `limit`; on expiry it is killed and `None` returned.
fn wait_for(child: &mut Child, limit: Duration) -> Option<ExitStatus> {
    let end = Instant::now() + limit;
    while Instant::now() < end {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    None
}

fn stderr_of(child: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = std::io::Read::read_to_string(&mut e, &mut s);
    }
    s
}

#[test]
fn perf_into_a_closed_pipe_ends_quietly() {
    for ranks in ["1", "2"] {
        let mut child = Command::new(PERF)
            .args([
                "--ranks", ranks, "-b", "8", "-e", "1K", "-i", "2", "-w", "1",
            ])
            .stdout(closed_pipe())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = wait_for(&mut child, Duration::from_secs(120)).expect("roccl-perf hung");
        let err = stderr_of(&mut child);
        assert!(
            status.success() && err.is_empty(),
            "--ranks {ranks} into a closed pipe: {status}, stderr:\n{err}"
        );
    }
}

#[test]
fn info_into_a_closed_pipe_ends_quietly() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    for args in [
        vec![],
        vec!["--peer".to_string(), format!("127.0.0.1:{port}")],
    ] {
        let mut child = Command::new(INFO)
            .args(&args)
            .env("ROCCL_TIMEOUT", "5")
            .stdout(closed_pipe())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let status = wait_for(&mut child, Duration::from_secs(60)).expect("roccl-info hung");
        let err = stderr_of(&mut child);
        assert!(
            status.success() && err.is_empty(),
            "roccl-info {args:?} into a closed pipe: {status}, stderr:\n{err}"
        );
    }
}

/// The processes whose parent is `pid`.
fn children_of(pid: u32) -> Vec<u32> {
    let mut v = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(p) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        let ppid = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if ppid == Some(pid) {
            v.push(p);
        }
    }
    v
}

/// The rank (ROCCL_RANK in its environment) of process `pid`.
fn rank_of(pid: u32) -> Option<usize> {
    let env = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    env.split(|&b| b == 0).find_map(|kv| {
        std::str::from_utf8(kv.strip_prefix(b"ROCCL_RANK=")?)
            .ok()?
            .parse()
            .ok()
    })
}

/// Whether `pid` still exists as a process that is not a zombie.
fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// A running `roccl-perf --ranks 3` job, its ranks joined (rank 0 printed its header).
struct Job {
    launcher: Child,
    ranks: Vec<(usize, u32)>,
}

impl Job {
    fn start(timeout: &str) -> Job {
        let mut launcher = Command::new(PERF)
            .args([
                "--ranks",
                "3",
                "-b",
                "8",
                "-e",
                "8",
                "-i",
                "100000000",
                "-w",
                "0",
            ])
            .env("ROCCL_TIMEOUT", timeout)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = launcher.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for l in BufReader::new(out).lines().map_while(Result::ok) {
                let _ = tx.send(l);
            }
        });
        let header = rx.recv_timeout(Duration::from_secs(60));
        assert!(
            header
                .as_deref()
                .is_ok_and(|h| h.starts_with("# roccl-perf:")),
            "the job did not start: {header:?}"
        );
        let ranks: Vec<(usize, u32)> = children_of(launcher.id())
            .into_iter()
            .filter_map(|p| Some((rank_of(p)?, p)))
            .collect();
        assert_eq!(ranks.len(), 3, "rank processes: {ranks:?}");
        Job { launcher, ranks }
    }

    fn pid(&self, rank: usize) -> u32 {
        self.ranks.iter().find(|(r, _)| *r == rank).unwrap().1
    }

    /// Ranks still running after the launcher ended (then killed, so that a failing test
    /// leaves nothing behind).
    fn survivors(&self) -> Vec<usize> {
        let left: Vec<usize> = self
            .ranks
            .iter()
            .filter(|(_, p)| alive(*p))
            .map(|(r, _)| *r)
            .collect();
        for (_, p) in &self.ranks {
            if alive(*p) {
                // SAFETY: kill has no memory effects.
                unsafe { libc::kill(*p as i32, libc::SIGKILL) };
            }
        }
        left
    }
}

#[test]
fn launcher_ends_the_job_when_a_rank_is_stopped() {
    let mut job = Job::start("3");
    let stopped = job.pid(1);
    // SAFETY: kill has no memory effects; the pid is a rank of the job just started.
    unsafe { libc::kill(stopped as i32, libc::SIGSTOP) };
    // The other ranks give up after ROCCL_TIMEOUT (3 s); the launcher must then end the job.
    let status = wait_for(&mut job.launcher, Duration::from_secs(60));
    let err = stderr_of(&mut job.launcher);
    let left = job.survivors();
    let status = status.unwrap_or_else(|| panic!("the launcher hung; stderr:\n{err}"));
    assert!(left.is_empty(), "ranks {left:?} outlived the launcher");
    assert!(!status.success(), "{status}");
    let summary = err.lines().last().unwrap_or_default();
    assert!(
        summary.starts_with("roccl-perf: error: rank 1 ") && summary.contains("stopped"),
        "the stopped rank is not named first:\n{err}"
    );
}

#[test]
fn signals_to_the_launcher_end_every_rank() {
    for sig in [libc::SIGTERM, libc::SIGINT] {
        let mut job = Job::start("300");
        // SAFETY: kill has no memory effects; the pid is our child's.
        unsafe { libc::kill(job.launcher.id() as i32, sig) };
        let status = wait_for(&mut job.launcher, Duration::from_secs(30));
        // Children the launcher did not end would be reparented, still running.
        std::thread::sleep(Duration::from_millis(200));
        let left = job.survivors();
        assert!(status.is_some(), "the launcher did not end on signal {sig}");
        assert!(
            left.is_empty(),
            "ranks {left:?} outlived the launcher (signal {sig})"
        );
        assert!(!status.unwrap().success());
    }
}
