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
                "--ranks", ranks, "-b", "8", "-e", "1K", "-n", "2", "-w", "1",
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
        vec!["--listen".to_string(), format!("127.0.0.1:{port}")],
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

/// Whether process `pid` is stopped (state T in /proc: a stop signal took effect).
fn is_stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('T'))
    })
}

/// A running `roccl-perf --ranks 3` job, its ranks joined (rank 0 printed its header).
struct Job {
    launcher: Child,
    ranks: Vec<(usize, u32)>,
}

impl Job {
    fn start(timeout: &str) -> Job {
        Job::start_over(timeout, "auto")
    }

    fn start_over(timeout: &str, net: &str) -> Job {
        let mut launcher = Command::new(PERF)
            .args([
                "--net",
                net,
                "--ranks",
                "3",
                "-b",
                "8",
                "-e",
                "8",
                "-n",
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
    // Ranks left over hold the launcher's stderr open: end them before reading it.
    let left = job.survivors();
    let err = stderr_of(&mut job.launcher);
    let status = status.unwrap_or_else(|| panic!("the launcher hung; stderr:\n{err}"));
    assert!(left.is_empty(), "ranks {left:?} outlived the launcher");
    assert!(!status.success(), "{status}");
    let summary = err.lines().last().unwrap_or_default();
    assert!(
        summary.starts_with("roccl-perf: error: rank 1 ") && summary.contains("stopped"),
        "the stopped rank is not named first:\n{err}"
    );
}

/// The ranks waiting on a stopped rank of their host say that its process is stopped (not
/// that it may have died, hung or called another collective), over every network.
#[test]
fn survivors_say_that_a_stopped_rank_is_stopped() {
    for net in ["rocev2", "tcp", "shm"] {
        // 4 s: on a loaded machine (the test command runs beside `yes` and other tests) a
        // rank starved for ROCCL_TIMEOUT before the stop would be reported, rightly, as
        // possibly hung.
        let mut job = Job::start_over("4", net);
        let stopped = job.pid(1);
        // SAFETY: kill has no memory effects; the pid is a rank of the job just started.
        unsafe { libc::kill(stopped as i32, libc::SIGSTOP) };
        let t = std::time::Instant::now();
        while !is_stopped(stopped) && t.elapsed() < Duration::from_secs(10) {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(is_stopped(stopped), "{net}: SIGSTOP did not stop rank 1");
        let status = wait_for(&mut job.launcher, Duration::from_secs(60));
        let left = job.survivors();
        let err = stderr_of(&mut job.launcher);
        assert!(status.is_some(), "{net}: the launcher hung; stderr:\n{err}");
        assert!(
            left.is_empty(),
            "{net}: ranks {left:?} outlived the launcher"
        );
        // The launcher ends the job at the first rank's error: the other may not get to
        // print its own.
        let lines: Vec<&str> = err
            .lines()
            .filter(|l| {
                l.starts_with("roccl-perf: error: rank 0 of 3:")
                    || l.starts_with("roccl-perf: error: rank 2 of 3:")
            })
            .collect();
        assert!(
            !lines.is_empty(),
            "{net}: no error from rank 0 or 2:\n{err}"
        );
        for line in lines {
            assert!(
                line.contains(&format!("(pid {stopped} on this host) is stopped")),
                "{net}: a survivor does not say that rank 1 is stopped: {line}"
            );
        }
    }
}

#[test]
fn signals_to_the_launcher_end_every_rank() {
    // SIGKILL cannot be forwarded: the ranks' parent-death signal ends them.
    for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGKILL] {
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

/// Run roccl-perf; (status, stdout, stderr).
fn perf(args: &[&str], env: &[(&str, &str)]) -> (ExitStatus, String, String) {
    let mut child = Command::new(PERF)
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::io::Read::read_to_string(&mut out, &mut s);
        s
    });
    let status = wait_for(&mut child, Duration::from_secs(120))
        .unwrap_or_else(|| panic!("roccl-perf {args:?} hung"));
    let err = stderr_of(&mut child);
    (status, reader.join().unwrap(), err)
}

/// roccl-perf fails at once, with exit status 2, printing `want` once.
fn refused(args: &[&str], env: &[(&str, &str)], want: &[&str]) {
    let (status, out, err) = perf(args, env);
    assert_eq!(
        status.code(),
        Some(2),
        "{args:?} {env:?}: {status}\n{out}\n{err}"
    );
    assert!(
        want.iter().all(|w| err.contains(w)),
        "{args:?} {env:?}: expected {want:?} in:\n{err}"
    );
    assert_eq!(err.lines().count(), 1, "the error is printed once:\n{err}");
    assert!(!out.contains("# wrong results"), "{out}");
}

#[test]
fn bad_arguments_are_refused_once() {
    refused(&["--ranks", "0"], &[], &["--ranks 0"]);
    refused(
        &["--ranks", "2", "-b", "1M", "-e", "1K"],
        &[],
        &["-b 1M", "-e 1K"],
    );
    refused(&["-b", "1M", "-e", "1K"], &[], &["-b 1M", "-e 1K"]);
    refused(&["--ranks", "2", "-n", "0"], &[], &["--iters 0"]);
    refused(&["-e", "100000G"], &[], &["-e 100000G", "available"]);
    refused(
        &["--ranks", "3", "-e", "100000G"],
        &[],
        &["-e 100000G", "available"],
    );
    refused(&["--ranks", "2", "--root", "5"], &[], &["--root 5"]);
    refused(
        &["--ranks", "2", "--check-iters", "--stream"],
        &[],
        &["--check-iters", "--stream"],
    );
}

#[test]
fn bad_environment_settings_are_refused_naming_them() {
    for (k, v, accepts) in [
        ("ROCCL_TIMEOUT", "abc", "seconds"),
        ("ROCCL_SPIN_US", "fast", "whole number"),
        ("ROCCL_NSOCKS", "lots", "sockets"),
        ("ROCCL_SHM", "maybe", "0 or 1"),
    ] {
        let want = format!("{k}=\"{v}\"");
        refused(&["--ranks", "2", "-e", "1K"], &[(k, v)], &[&want, accepts]);
        refused(&["-e", "1K"], &[(k, v)], &[&want, accepts]);
    }
}

#[test]
fn errors_of_ranks_name_the_rank_and_do_not_interleave() {
    // Joined as ranks of a launcher-less job whose root nobody serves: every rank fails on
    // its own; each line is one whole message naming its rank.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let root = format!("127.0.0.1:{port}");
    let kids: Vec<Child> = (1..4)
        .map(|r| {
            Command::new(PERF)
                .args(["-e", "1K"])
                .env("ROCCL_RANK", r.to_string())
                .env("ROCCL_NRANKS", "4")
                .env("ROCCL_ROOT", &root)
                .env("ROCCL_TIMEOUT", "1")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, mut k) in kids.into_iter().enumerate() {
        let status = wait_for(&mut k, Duration::from_secs(60)).expect("a rank hung");
        let err = stderr_of(&mut k);
        assert!(!status.success());
        let last = err.lines().last().unwrap_or_default();
        assert!(
            last.starts_with(&format!("roccl-perf: error: rank {}: ", i + 1))
                && last.matches("roccl-perf: error:").count() == 1,
            "{err}"
        );
    }
}

/// The values `--help` lists for `flag` ("[possible values: a, b]").
fn help_values(help: &str, flag: &str) -> Vec<String> {
    let start = help
        .find(&format!("{flag} <"))
        .unwrap_or_else(|| panic!("{flag} not in --help:\n{help}"));
    let rest = &help[start..];
    let open = rest.find("[possible values: ").expect(flag) + "[possible values: ".len();
    let close = rest[open..].find(']').unwrap();
    rest[open..open + close]
        .split(',')
        .map(|v| v.trim().to_string())
        .collect()
}

#[test]
fn help_lists_what_the_parsers_accept() {
    use roccl::net::NetKind;
    use roccl::{Algo, DataType, RedOp};
    let out = Command::new(PERF).arg("--help").output().unwrap();
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let algos: Vec<String> = std::iter::once("auto".to_string())
        .chain(Algo::ALL.iter().map(|a| a.name().to_string()))
        .collect();
    assert_eq!(help_values(&help, "--algo"), algos);
    for a in &algos[1..] {
        assert!(a.parse::<Algo>().is_ok(), "{a}");
    }
    let all = || std::iter::once("all".to_string());
    let dts: Vec<String> = DataType::ALL
        .iter()
        .map(|d| d.name().to_string())
        .chain(all())
        .collect();
    assert_eq!(help_values(&help, "--dtype"), dts);
    let ops: Vec<String> = RedOp::ALL
        .iter()
        .map(|o| o.name().to_string())
        .chain(all())
        .collect();
    assert_eq!(help_values(&help, "--redop"), ops);
    // Every network, each named once (a new kind fails to compile here until it is listed).
    let nets = help_values(&help, "--net");
    let mut seen = [false; 6];
    for n in &nets {
        let k: NetKind = n.parse().unwrap_or_else(|e| panic!("--net {n}: {e}"));
        let i = match k {
            NetKind::Auto => 0,
            NetKind::Tcp => 1,
            NetKind::RoceV2 => 2,
            NetKind::Verbs => 3,
            NetKind::Shm => 4,
            NetKind::Sim => 5,
        };
        assert!(!seen[i], "{n} twice");
        seen[i] = true;
    }
    assert!(seen.iter().all(|s| *s), "--net lists {nets:?}");
    let colls = help_values(&help, "--op");
    for c in [
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce_scatter",
        "reduce",
        "all_to_all",
        "sendrecv",
        "barrier",
        "all",
    ] {
        assert!(colls.iter().any(|x| x == c), "--op lacks {c}: {colls:?}");
    }
}

#[test]
fn table_headers_sit_over_their_columns() {
    let (status, out, err) = perf(
        &[
            "--ranks", "2", "-b", "8", "-e", "1K", "-f", "128", "-n", "2", "-w", "1",
        ],
        &[],
    );
    assert!(status.success(), "{err}");
    // Right edges of the cells of a line.
    let edges = |l: &str| -> Vec<usize> {
        let b = l.as_bytes();
        (0..b.len())
            .filter(|&i| b[i] != b' ' && (i + 1 == b.len() || b[i + 1] == b' '))
            .collect()
    };
    let lines: Vec<&str> = out.lines().collect();
    let names = lines.iter().find(|l| l.contains(" busbw")).expect(&out);
    let data = lines
        .iter()
        .find(|l| l.trim_start().starts_with("all_reduce"))
        .expect(&out);
    let mut head = edges(names);
    head.remove(0); // the leading '#'
    assert_eq!(head, edges(data), "\n{names}\n{data}");
}

#[test]
fn an_algorithm_that_does_not_apply_is_not_replaced_silently() {
    let (status, _out, err) = perf(
        &[
            "--ranks",
            "2",
            "--algo",
            "tree",
            "--op",
            "all_gather",
            "-b",
            "1K",
            "-e",
            "1K",
            "-n",
            "2",
        ],
        &[],
    );
    assert!(status.success(), "{err}");
    assert!(
        err.contains("algorithm tree") && err.contains("does not apply"),
        "{err}"
    );
}

#[test]
fn info_says_what_auto_picks() {
    let out = Command::new(INFO)
        .env("ROCCL_SYSFS_ROOT", "/nonexistent-sysfs")
        .env_remove("ROCCL_NET")
        .env_remove("ROCCL_SHM")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("shared memory between ranks of this host"),
        "{text}"
    );
    assert!(
        !text.contains("roccl will use tcp (ROCCL_NET=auto)"),
        "{text}"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A rank of a job joined from the environment (`ROCCL_RANK` of `nranks`, root at `root`).
fn env_rank(rank: usize, nranks: usize, root: &str, timeout: &str) -> Child {
    Command::new(PERF)
        .args(["-e", "1K", "-n", "1", "-w", "0"])
        .env("ROCCL_RANK", rank.to_string())
        .env("ROCCL_NRANKS", nranks.to_string())
        .env("ROCCL_ROOT", root)
        .env("ROCCL_TIMEOUT", timeout)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

#[test]
fn a_waiting_bootstrap_says_who_has_joined() {
    let root = format!("127.0.0.1:{}", free_port());
    // Rank 2 of 3 never starts; rank 0 serves the root.
    let mut r0 = env_rank(0, 3, &root, "6");
    let mut r1 = env_rank(1, 3, &root, "6");
    let s0 = wait_for(&mut r0, Duration::from_secs(60)).expect("rank 0 hung");
    let s1 = wait_for(&mut r1, Duration::from_secs(60)).expect("rank 1 hung");
    let (e0, e1) = (stderr_of(&mut r0), stderr_of(&mut r1));
    assert!(!s0.success() && !s1.success());
    // Rank 1 may join after the first report on a loaded machine.
    let progress: Vec<&str> = e0
        .lines()
        .filter(|l| {
            l.contains("bootstrap root at")
                && l.contains("of 3 ranks joined (")
                && l.split("waiting for").nth(1).is_some_and(|w| {
                    let w = w.trim_start();
                    w.starts_with("rank 2 ") || w.starts_with("ranks 1, 2 ")
                })
        })
        .collect();
    assert!(
        !progress.is_empty(),
        "no progress report from the root:\n{e0}"
    );
    assert!(e1.contains("rank 2 never arrived"), "{e1}");
}

#[test]
fn a_rank_waiting_for_its_root_says_so() {
    let root = format!("127.0.0.1:{}", free_port());
    let mut r1 = env_rank(1, 2, &root, "3");
    let s = wait_for(&mut r1, Duration::from_secs(60)).expect("rank 1 hung");
    let e = stderr_of(&mut r1);
    assert!(!s.success());
    assert!(
        e.contains("rank 1: after")
            && e.contains(&format!("still waiting for the bootstrap root at {root}")),
        "{e}"
    );
}

#[test]
fn a_duplicate_rank_fails_every_process_naming_it() {
    let root = format!("127.0.0.1:{}", free_port());
    // Ranks 0, 1, 1 of 3 (rank 2 never comes), with a timeout they must not wait out.
    let mut kids = vec![env_rank(0, 3, &root, "60")];
    std::thread::sleep(Duration::from_millis(300));
    kids.push(env_rank(1, 3, &root, "60"));
    kids.push(env_rank(1, 3, &root, "60"));
    for k in &mut kids {
        let s = wait_for(k, Duration::from_secs(30)).expect("a rank waited for the timeout");
        let e = stderr_of(k);
        assert!(!s.success());
        assert!(e.contains("rank 1 joined twice"), "{e}");
    }
}

#[test]
fn info_peer_with_nothing_listening_says_so() {
    let at = format!("127.0.0.1:{}", free_port());
    let mut child = Command::new(INFO)
        .args(["--peer", &at])
        .env("ROCCL_TIMEOUT", "2")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let s = wait_for(&mut child, Duration::from_secs(60)).expect("roccl-info --peer hung");
    let e = stderr_of(&mut child);
    assert_eq!(s.code(), Some(2), "{e}");
    assert!(e.contains(&format!("nothing answers at {at}")), "{e}");
}

/// Run roccl-perf, which must succeed; its standard output.
fn perf_ok(args: &[&str]) -> String {
    let (status, out, err) = perf(args, &[]);
    assert!(status.success(), "{args:?}: {status}\n{out}\n{err}");
    out
}

/// The JSON file `--json` wrote.
fn json_of(path: &std::path::Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn short_flags_mean_what_they_mean_in_nccl_tests() {
    let dir = tempdir("flags");
    let json = dir.join("run.json");
    let j = json.to_str().unwrap();
    // -n iterations, -w warm-up, -c 0 no check, -z 0 issued without waiting, -T timeout,
    // -i step bytes (with -f 1), -o/-d nccl-tests' names.
    let out = perf_ok(&[
        "--ranks", "2", "-b", "1K", "-e", "3K", "-f", "1", "-i", "1K", "-n", "7", "-w", "1", "-c",
        "0", "-z", "0", "-T", "33", "-o", "max", "-d", "float", "-J", j,
    ]);
    let doc = json_of(&json);
    let h = &doc["header"];
    assert_eq!(
        (h["iters"].as_u64(), h["warmup"].as_u64()),
        (Some(7), Some(1)),
        "{h}"
    );
    assert_eq!(
        (h["check"].as_u64(), h["blocking"].as_bool()),
        (Some(0), Some(false)),
        "{h}"
    );
    assert_eq!(h["timeout_s"].as_f64(), Some(33.0), "{h}");
    assert_eq!(h["ranks"], 2);
    let rows = doc["results"].as_array().unwrap();
    let sizes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(sizes, [1024, 1024, 2048, 2048, 3072, 3072], "{doc}");
    for r in rows {
        assert!(r["wrong"].is_null(), "{r}");
        assert_eq!(
            (r["redop"].as_str(), r["dtype"].as_str()),
            (Some("max"), Some("f32"))
        );
        assert_eq!(r["iters"], 7);
    }
    assert!(doc["wrong_total"].is_null());
    // #wrong says N/A in both placements, and the closing lines are nccl-tests'.
    let data: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
    assert_eq!(data.len(), 3, "{out}");
    assert!(data.iter().all(|l| l.matches("N/A").count() == 2), "{out}");
    assert!(out.contains("# Avg bus bandwidth    : "), "{out}");
    assert!(out.contains("# wrong results: N/A"), "{out}");
    assert!(out
        .lines()
        .next()
        .unwrap()
        .contains(&format!("version {}", env!("CARGO_PKG_VERSION"))));
    // --version; and checked runs say 0 in both placements, blocking or not.
    let v = Command::new(PERF).arg("--version").output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&v.stdout).trim(),
        format!("roccl-perf {}", env!("CARGO_PKG_VERSION"))
    );
    for z in ["0", "1"] {
        let out = perf_ok(&[
            "--ranks", "2", "-b", "8", "-e", "4K", "-f", "8", "-n", "3", "-w", "1", "-z", z,
            "--stats",
        ]);
        assert!(
            out.contains("# wrong results: 0\n# Out of bounds values : 0 OK"),
            "{out}"
        );
        let row = out
            .lines()
            .find(|l| l.trim_start().starts_with("all_reduce"))
            .unwrap();
        // op .. algo, then (time, algbw, busbw, #wrong, min, p99, max) twice.
        assert_eq!(row.split_whitespace().count(), 7 + 2 * 7, "{row}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn nccl_tests_flags_roccl_cannot_honour_are_refused() {
    refused(&["-g", "2"], &[], &["-g/--ngpus 2", "--ranks"]);
    refused(
        &["--ranks", "2", "-t", "4"],
        &[],
        &["-t/--nthreads 4", "--ranks"],
    );
    refused(&["-G", "1"], &[], &["-G/--cudagraph"]);
    refused(&["-T", "0"], &[], &["-T 0"]);
    refused(&["-i", "0", "-f", "1"], &[], &["-i 0"]);
    refused(
        &["--ranks", "2", "--check-iters", "-z", "0"],
        &[],
        &["-z 0"],
    );
}

fn tempdir(what: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("roccl-perf-{what}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Whether `s` is well-formed XML (elements nested and closed, attributes quoted); the
/// elements' names and attributes, in order.
fn xml_elements(s: &str) -> Result<Vec<(String, String)>, String> {
    let (mut stack, mut found, mut rest) = (Vec::<String>::new(), Vec::new(), s);
    while let Some(i) = rest.find('<') {
        rest = &rest[i + 1..];
        let end = rest.find('>').ok_or("a tag is not closed")?;
        let tag = &rest[..end];
        rest = &rest[end + 1..];
        if tag.starts_with('?') || tag.starts_with('!') {
            continue;
        }
        if let Some(name) = tag.strip_prefix('/') {
            match stack.pop() {
                Some(open) if open == name.trim() => {}
                other => return Err(format!("</{name}> closes {other:?}")),
            }
            continue;
        }
        let (body, empty) = match tag.strip_suffix('/') {
            Some(b) => (b, true),
            None => (tag, false),
        };
        let (name, attrs) = body.split_once(' ').unwrap_or((body, ""));
        if attrs.matches('"').count() % 2 != 0 || attrs.contains('<') {
            return Err(format!("bad attributes in <{tag}>"));
        }
        found.push((name.to_string(), attrs.to_string()));
        if !empty {
            stack.push(name.to_string());
        }
    }
    match (stack.is_empty(), found.first()) {
        (true, Some((root, _))) if root == "svg" => Ok(found),
        _ => Err(format!("unclosed {stack:?} or no <svg> root")),
    }
}

#[test]
fn plot_draws_runs_of_two_networks_as_svg() {
    let dir = tempdir("plot");
    let mut files = Vec::new();
    for net in ["tcp", "shm"] {
        let f = dir.join(format!("{net}.json"));
        perf_ok(&[
            "--ranks",
            "2",
            "--net",
            net,
            "-b",
            "8",
            "-e",
            "64K",
            "-f",
            "8",
            "-n",
            "3",
            "-w",
            "1",
            "--json",
            f.to_str().unwrap(),
        ]);
        files.push(f.to_str().unwrap().to_string());
    }
    let svg = dir.join("perf.svg");
    let peer = format!("{}=a peer & co", files[0]);
    perf_ok(&["--plot", svg.to_str().unwrap(), &files[0], &files[1], &peer]);
    let text = std::fs::read_to_string(&svg).unwrap();
    let elems = xml_elements(&text).unwrap_or_else(|e| panic!("{e}:\n{text}"));
    // Per run a line in each panel (latency, bus bandwidth), with a point per size.
    let lines: Vec<&String> = elems
        .iter()
        .filter(|(n, a)| n == "polyline" && a.contains("class=\"series\""))
        .map(|(_, a)| a)
        .collect();
    assert_eq!(lines.len(), 2 * 3, "{text}");
    for l in &lines {
        let points = l
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(
            points.split_whitespace().count(),
            5,
            "a point per size (8 B-32K): {l}"
        );
    }
    for label in [
        "tcp all_reduce, 2 ranks",
        "shm all_reduce, 2 ranks",
        "a peer &amp; co",
    ] {
        assert!(
            text.contains(&format!(">{label}</text>")),
            "no legend {label}:\n{text}"
        );
    }
    // A run without results is refused, not drawn as an empty chart.
    let empty = dir.join("empty.json");
    std::fs::write(&empty, r#"{"results": []}"#).unwrap();
    refused(
        &["--plot", svg.to_str().unwrap(), empty.to_str().unwrap()],
        &[],
        &["no result"],
    );
    refused(&["--plot", svg.to_str().unwrap()], &[], &["--json files"]);
    refused(
        &["--plot", "perf.png", &files[0]],
        &[],
        &["--plot perf.png", ".svg"],
    );
    let _ = std::fs::remove_dir_all(dir);
}
