//! The rest of the rendezvous: unique ids from bytes and from hex, the launcher
//! environment (every convention's rank, size, root and job-secret variables, Slurm node
//! lists), and the table of registration blobs every rank parses and agrees the cost model
//! over. (The root's registration parser has a target of its own, `registration`.)
#![no_main]

use libfuzzer_sys::fuzz_target;
use roccl::bootstrap::env;
use roccl::UniqueId;
use roccl_fuzz::Reader;

/// The variables the launcher conventions read (the secret file is left out: it names a
/// file to read).
const VARS: [&str; 22] = [
    "ROCCL_RANK",
    "ROCCL_NRANKS",
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "ROCCL_UNIQUE_ID",
    "ROCCL_ROOT",
    "ROCCL_ROOT_PORT",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_STEP_NODELIST",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "ROCCL_JOB_SECRET",
    "LOCAL_RANK",
];

/// A launcher environment: a Slurm node list (u16 length first), then variables: the index
/// of one of [`VARS`] (mod its length) and its value (u16 length first), repeated; a later
/// value of the same variable wins.
fn launch_env(r: &mut Reader) {
    let nodelist = String::from_utf8_lossy(r.chunk()).into_owned();
    let mut set: Vec<(usize, String)> = Vec::new();
    while !r.is_empty() {
        let k = usize::from(r.u8()) % VARS.len();
        set.push((k, String::from_utf8_lossy(r.chunk()).into_owned()));
    }
    let get = |name: &str| -> Option<String> {
        let k = VARS.iter().position(|v| *v == name)?;
        set.iter()
            .rev()
            .find(|(j, _)| *j == k)
            .map(|(_, v)| v.clone())
    };
    if let Ok(e) = env::from_lookup(&get) {
        assert!(e.rank < e.nranks);
    }
    // Pass phrases are stretched (0.3 s each): only hex secrets, short ones (refused) and
    // the file variable are fuzzed here.
    let phrase = get("ROCCL_JOB_SECRET").is_some_and(|v| {
        let t = v.trim();
        t.chars().count() >= 16 && !(t.len() == 32 && t.bytes().all(|c| c.is_ascii_hexdigit()))
    });
    if !phrase {
        let _ = env::job_secret_from(&get, std::net::SocketAddr::from(([127, 0, 0, 1], 29500)));
    }
    let _ = env::slurm_first_host(&nodelist);
}

// Layout: a kind byte (mod 4) — 0: a unique id's bytes, 1: a unique id in hex (the rest of
// the input each); 2: a rendezvous table: flags (bit 0: the network is shared memory, bit 1:
// node segments, bit 2: single copies), the node slot size u32, then blobs (u16 length
// first each, at most 16); 3: a launcher environment (see `launch_env`).
fuzz_target!(|data: &[u8]| {
    let mut r = Reader::new(data);
    match r.u8() % 4 {
        0 => {
            if let Ok(id) = UniqueId::from_bytes(r.rest()) {
                let (addr, _) = id.root().expect("a parsed id has a root");
                let again = UniqueId::from_hex(&id.to_hex()).expect("hex round trip");
                assert_eq!(again.as_bytes(), id.as_bytes());
                assert_eq!(again.root().unwrap().0, addr);
                let _ = id.job_key();
            }
        }
        1 => {
            let s = String::from_utf8_lossy(r.rest());
            if let Ok(id) = UniqueId::from_hex(&s) {
                assert!(id.root().is_ok());
            }
        }
        2 => {
            let flags = r.u8();
            let slot = r.u32() as usize;
            let node = (flags & 2 != 0).then_some((slot, flags & 4 != 0));
            let mut blobs = Vec::new();
            while !r.is_empty() && blobs.len() < 16 {
                blobs.push(r.chunk());
            }
            roccl::fuzzing::rendezvous_table(&blobs, flags & 1 != 0, node);
        }
        _ => launch_env(&mut r),
    }
});
