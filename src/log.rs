//! Minimal logging to stderr, enabled by `ROCCL_DEBUG=INFO` (or `WARN`; `WARN` is the default).

use std::sync::OnceLock;

/// Log levels, most severe first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Something the user should know about.
    Warn,
    /// What roccl chose and why.
    Info,
}

/// The level `ROCCL_DEBUG` asks for.
pub fn level() -> Level {
    static L: OnceLock<Level> = OnceLock::new();
    *L.get_or_init(|| {
        match std::env::var("ROCCL_DEBUG")
            .unwrap_or_default()
            .to_ascii_uppercase()
            .as_str()
        {
            "INFO" | "TRACE" | "DEBUG" => Level::Info,
            _ => Level::Warn,
        }
    })
}

/// Where log lines go instead of stderr (e.g. NCCL's logger when roccl runs as its network
/// plugin); the sink sees every level and filters itself.
pub type Sink = Box<dyn Fn(Level, &str) + Send + Sync>;

static SINK: OnceLock<Sink> = OnceLock::new();

/// Send every log line to `sink` from now on (the first sink set wins; false if one was set).
pub fn set_sink(sink: Sink) -> bool {
    SINK.set(sink).is_ok()
}

/// Print `msg` if `l` is enabled (or hand it to the sink).
pub fn log(l: Level, msg: std::fmt::Arguments) {
    if let Some(s) = SINK.get() {
        s(l, &msg.to_string());
        return;
    }
    if l <= level() {
        // Never `eprintln!`, which panics when stderr fails (a closed pipe with SIGPIPE
        // ignored, as in Python): a log line is not worth a crash, least of all inside a
        // C caller.
        // The whole line in one write: stderr is unbuffered, and a line written in pieces
        // interleaves with the lines of the other ranks sharing the terminal or pipe.
        use std::io::Write;
        let line = format!(
            "roccl {}: {msg}\n",
            if l == Level::Warn { "WARN" } else { "INFO" }
        );
        let _ = std::io::stderr().write_all(line.as_bytes());
    }
}

/// `warn!(...)`: log at WARN.
#[macro_export]
macro_rules! warn {
    ($($t:tt)*) => { $crate::log::log($crate::log::Level::Warn, format_args!($($t)*)) };
}

/// `info!(...)`: log at INFO.
#[macro_export]
macro_rules! info {
    ($($t:tt)*) => { $crate::log::log($crate::log::Level::Info, format_args!($($t)*)) };
}
