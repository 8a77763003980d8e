//! Item 25 of issue 19: a rank of a rocev2 job stopped for a second (SIGSTOP, SIGCONT) is
//! waited for: the userspace engine retransmits with backoff until the communicator's
//! deadline instead of giving up after IB's 7 retries (~134 ms), and every result is right:
//! each call's, those in flight during the pause included (`--check-iters`: roccl-perf checks
//! the output of every warm-up and timed call, poisoned before it, not only one call after
//! them, which ran long after the pause).

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const PERF: &str = env!("CARGO_BIN_EXE_roccl-perf");

/// The launcher's child processes (its ranks).
fn children(pid: u32) -> Vec<i32> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(p) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) else {
            continue;
        };
        // pid (comm) state ppid ...: comm may hold spaces, so split after the last ')'.
        let rest = stat.rsplit_once(')').map_or("", |r| r.1);
        let ppid = rest
            .split_whitespace()
            .nth(1)
            .and_then(|v| v.parse::<u32>().ok());
        if ppid == Some(pid) {
            out.push(p);
        }
    }
    out
}

#[test]
fn a_rank_stopped_for_a_second_is_waited_for() {
    let mut child = Command::new(PERF)
        .args([
            "--ranks",
            "3",
            "--net",
            "rocev2",
            "-b",
            "256K",
            "-e",
            "256K",
            "-n",
            "4000",
            "-w",
            "5",
            "--check-iters",
        ])
        .env("ROCCL_SOCKET_IFNAME", "lo")
        .env("ROCCL_TIMEOUT", "60")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the ranks run (and have been exchanging data for a moment).
    let start = Instant::now();
    let ranks = loop {
        let r = children(child.id());
        if r.len() == 3 || start.elapsed() > Duration::from_secs(30) {
            break r;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(ranks.len(), 3, "the launcher did not start 3 ranks");
    std::thread::sleep(Duration::from_millis(1500));
    let victim = ranks[1];
    // SAFETY: kill(2) with a pid of our own child's child and a valid signal.
    unsafe { libc::kill(victim, libc::SIGSTOP) };
    std::thread::sleep(Duration::from_secs(1));
    // SAFETY: as above.
    unsafe { libc::kill(victim, libc::SIGCONT) };
    // Else the pause fell after the traffic and the test proves nothing.
    assert!(
        child.try_wait().unwrap().is_none(),
        "the job ended before the paused rank was continued: make it longer (-i)"
    );
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "the job did not survive a 1 s pause of one rank:\nstdout:\n{text}\nstderr:\n{err}"
    );
    assert!(text.contains("# wrong results: 0"), "{text}");
}
