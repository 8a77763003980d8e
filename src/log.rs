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

/// Print `msg` if `l` is enabled.
pub fn log(l: Level, msg: std::fmt::Arguments) {
    if l <= level() {
        eprintln!(
            "roccl {}: {msg}",
            if l == Level::Warn { "WARN" } else { "INFO" }
        );
    }
}

/// `info!(...)`: log at INFO.
#[macro_export]
macro_rules! info {
    ($($t:tt)*) => { $crate::log::log($crate::log::Level::Info, format_args!($($t)*)) };
}
