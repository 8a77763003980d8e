//! roccl's layers point one way (docs/ARCHITECTURE.md): a module under `src/` names only its
//! own layer and the layers below it, and no cycle runs between top-level modules, nor
//! between the files of one folder (see [`folder_uses`]).
//!
//! A module names another through `crate::…` paths (in `use` or inline, grouped
//! `use crate::{a::B, c}` included), a macro exported by it (`crate::info!`), an item the
//! crate root re-exports (`crate::Algo`), or `super::` paths that climb out of the
//! top-level module. Comments, strings and `#[cfg(test)]` items (and the files of
//! `#[cfg(test)] mod x;`) do not count: tests may reach anywhere. `src/lib.rs` (the root,
//! which re-exports) and `src/bin/` (programs, on top of everything) are not checked.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, top to bottom, each with the top-level modules of `src/` in it. A module may
/// name modules of its own layer (as long as no cycle forms) and of every layer below.
/// Adding a layer or a module is one line here (and one in docs/ARCHITECTURE.md).
const LAYERS: &[(&str, &[&str])] = &[
    ("bindings and tools", &["bin", "tool", "fuzzing"]),
    ("communicator and stream scheduling", &["comm"]),
    ("algorithms and cost model", &["algo"]),
    ("executor", &["exec"]),
    ("networks", &["net"]),
    ("providers and rendezvous", &["rdma", "device", "bootstrap"]),
    (
        "OS primitives and foundations",
        &["os", "types", "error", "log", "envvar", "reduce", "metrics"],
    ),
];

/// The layer of a top-level module: its index in [`LAYERS`] (0 = top).
fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

/// One name of another top-level module, found in a file.
#[derive(Clone, Debug)]
struct Use {
    /// The file, relative to the crate (`src/net/mod.rs`).
    file: String,
    /// Its top-level module.
    from: String,
    /// The top-level module named.
    to: String,
    /// The name as written (`crate::comm::timeout`).
    name: String,
}

/// `src` without comments, string and character literals (each replaced by a space, so
/// that no path spans them).
fn strip(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        let rest = &src[i..];
        if rest.starts_with("//") {
            i += rest.find('\n').unwrap_or(rest.len());
        } else if rest.starts_with("/*") {
            let mut depth = 0;
            while i < b.len() {
                if src[i..].starts_with("/*") {
                    depth += 1;
                    i += 2;
                } else if src[i..].starts_with("*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if let Some(hashes) = raw_string_start(src, i) {
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 2 + hashes;
            i = src[body..]
                .find(&close)
                .map_or(b.len(), |j| body + j + close.len());
            out.push(' ');
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else if b[i] == b'\'' {
            // A character literal ('x', '\n', '\u{..}'), not a lifetime ('a).
            match char_literal_len(&src[i..]) {
                Some(n) => {
                    i += n;
                    out.push(' ');
                }
                None => {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let c = rest.chars().next().unwrap();
            out.push(c);
            i += c.len_utf8();
        }
    }
    out
}

/// The number of `#` of a raw string starting at `i` (`r"`, `r#"`, `br"`...).
fn raw_string_start(src: &str, i: usize) -> Option<usize> {
    let b = src.as_bytes();
    let ident_at = |j: usize| b[j].is_ascii_alphanumeric() || b[j] == b'_';
    // `r"` or `br"`, not the end of an identifier such as `for"`.
    let start_ok = match i {
        0 => true,
        _ if b[i - 1] == b'b' => i < 2 || !ident_at(i - 2),
        _ => !ident_at(i - 1),
    };
    if b[i] != b'r' || !start_ok {
        return None;
    }
    let hashes = src[i + 1..].bytes().take_while(|&c| c == b'#').count();
    (src.as_bytes().get(i + 1 + hashes) == Some(&b'"')).then_some(hashes)
}

fn char_literal_len(s: &str) -> Option<usize> {
    let b = s.as_bytes();
    if b.get(1) == Some(&b'\\') {
        // The escaped character may itself be a quote: look for the end after it.
        let end = s.get(3..)?.find('\'')? + 3;
        return (end <= 12).then_some(end + 1);
    }
    let c = s[1..].chars().next()?;
    let n = 1 + c.len_utf8();
    (b.get(n) == Some(&b'\'')).then_some(n + 1)
}

/// The end of the item starting at `i`: after its `;` or its closing brace, whichever
/// comes first at depth 0.
fn item_end(s: &str, i: usize) -> usize {
    let b = s.as_bytes();
    let mut depth = 0usize;
    let mut j = i;
    while j < b.len() {
        match b[j] {
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return j + 1;
                }
            }
            b';' if depth == 0 => return j + 1,
            _ => {}
        }
        j += 1;
    }
    b.len()
}

/// `code` (stripped) without its `#[cfg(test)]` items, and the modules declared by
/// `#[cfg(test)] mod name;` (their files are test code too).
fn without_tests(code: &str) -> (String, Vec<String>) {
    let mut out = String::new();
    let mut test_mods = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let item = &rest[at + "#[cfg(test)]".len()..];
        let end = item_end(item, 0);
        let words: Vec<&str> = item[..end]
            .split(|c: char| !(c.is_alphanumeric() || c == '_' || c == ';'))
            .filter(|w| !w.is_empty())
            .collect();
        if let Some(k) = words.iter().position(|w| *w == "mod") {
            if let Some(name) = words.get(k + 1).and_then(|w| w.strip_suffix(';')) {
                test_mods.push(name.to_string());
            }
        }
        rest = &item[end..];
    }
    out.push_str(rest);
    (out, test_mods)
}

fn is_ident(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// The identifier at the start of `s`.
fn ident(s: &str) -> &str {
    &s[..s.find(|c: char| !is_ident(c)).unwrap_or(s.len())]
}

/// The items of a group `{a::b, c, d::{e, f}}` starting after its `{`, split at depth 0.
fn group_items(s: &str) -> Vec<&str> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0);
    for (j, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' if depth == 0 => {
                items.push(s[start..j].trim());
                return items;
            }
            '}' => depth -= 1,
            ',' if depth == 0 => {
                items.push(s[start..j].trim());
                start = j + 1;
            }
            _ => {}
        }
    }
    items
}

/// The path written from `s` on (`a::b::c`, up to the first character not in a path).
fn path_text(s: &str) -> String {
    let t: String = s
        .chars()
        .take_while(|&c| is_ident(c) || c == ':' || c == '!')
        .collect();
    t.trim_end_matches(':').to_string()
}

/// What names the crate root exports under another module: `Algo` → `algo` for
/// `pub use algo::Algo;` in `src/lib.rs`.
fn root_reexports(lib: &str) -> BTreeMap<String, String> {
    let code = strip(lib);
    let mut map = BTreeMap::new();
    for stmt in code.split(';') {
        let Some(at) = stmt.find("pub use ") else {
            continue;
        };
        let path = stmt[at + "pub use ".len()..].trim();
        let module = ident(path).to_string();
        let tail = &path[module.len()..];
        let names: Vec<&str> = match tail.find('{') {
            Some(k) => group_items(&tail[k + 1..]),
            None => vec![tail.rsplit("::").next().unwrap_or("")],
        };
        for n in names {
            let last = n.rsplit("::").next().unwrap_or(n).trim();
            let last = last.rsplit(" as ").next().unwrap_or(last).trim();
            if !last.is_empty() {
                map.insert(last.to_string(), module.clone());
            }
        }
    }
    map
}

/// What a first path segment after `crate::` names: a top-level module, a root re-export,
/// or an exported macro.
struct Names {
    modules: BTreeSet<String>,
    reexports: BTreeMap<String, String>,
    macros: BTreeMap<String, String>,
}

impl Names {
    fn resolve(&self, first: &str, is_macro: bool) -> Option<String> {
        if is_macro {
            return self.macros.get(first).cloned();
        }
        if self.modules.contains(first) {
            return Some(first.to_string());
        }
        self.reexports.get(first).cloned()
    }
}

/// The module path of a file under `src/` (`src/net/shm/mod.rs` → `[net, shm]`).
fn module_path(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .iter()
        .skip(1)
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap_or_default();
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts
}

/// Every name of another top-level module in `code` (a file of module `path`).
fn uses_in(file: &str, path: &[String], code: &str, names: &Names) -> Vec<Use> {
    let from = path[0].clone();
    let mut found = Vec::new();
    let mut add = |first: &str, is_macro: bool, written: String| {
        if let Some(to) = names.resolve(first, is_macro) {
            if to != from {
                found.push(Use {
                    file: file.to_string(),
                    from: from.clone(),
                    to,
                    name: written,
                });
            }
        }
    };
    let starts = |s: &str, k: usize, word: &str| {
        s[k..].starts_with(word) && !s[..k].ends_with(|c: char| is_ident(c) || c == ':')
    };
    let b = code.as_bytes();
    for k in 0..b.len() {
        if !code.is_char_boundary(k) {
            continue;
        }
        // Where the path continues after its root (`crate::`, or `super::` often enough
        // to climb out of the top-level module).
        let (root, rest) = if starts(code, k, "crate::") {
            ("crate::".to_string(), &code[k + "crate::".len()..])
        } else if starts(code, k, "super::") {
            let mut r = &code[k..];
            let mut ups = 0;
            while let Some(t) = r.strip_prefix("super::") {
                r = t.trim_start();
                ups += 1;
            }
            if ups < path.len() {
                continue;
            }
            ("super::".repeat(ups), r)
        } else {
            continue;
        };
        let rest = rest.trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            for item in group_items(group) {
                let first = ident(item);
                let is_macro = item[first.len()..].starts_with('!');
                add(first, is_macro, format!("{root}{}", path_text(item)));
            }
        } else {
            let first = ident(rest);
            let is_macro = rest[first.len()..].starts_with('!');
            add(first, is_macro, format!("{root}{}", path_text(rest)));
        }
    }
    found
}

/// The `.rs` files under `dir`, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    out
}

/// A file checked: its path relative to the crate, its module path, and its code without
/// comments, strings and test items.
type Checked = (PathBuf, Vec<String>, String);

/// The files of the crate at `root` that are checked (not `src/lib.rs`, `src/bin/` or test
/// files), and the macros each top-level module exports.
fn checked_files(root: &Path) -> (Vec<Checked>, BTreeMap<String, String>) {
    let src = root.join("src");
    let files: Vec<(PathBuf, String)> = rust_files(&src)
        .into_iter()
        .map(|p| {
            let rel = p.strip_prefix(root).unwrap().to_path_buf();
            let text = std::fs::read_to_string(&p).unwrap();
            (rel, text)
        })
        .filter(|(rel, _)| !rel.starts_with("src/bin") && rel != Path::new("src/lib.rs"))
        .collect();
    let mut macros = BTreeMap::new();
    let mut code_of = Vec::new();
    let mut test_files = BTreeSet::new();
    for (rel, text) in &files {
        let path = module_path(rel);
        let (code, test_mods) = without_tests(&strip(text));
        let dir = if rel.ends_with("mod.rs") {
            rel.parent().unwrap().to_path_buf()
        } else {
            rel.with_extension("")
        };
        for m in test_mods {
            test_files.insert(dir.join(format!("{m}.rs")));
            test_files.insert(dir.join(&m).join("mod.rs"));
        }
        for (at, _) in code.match_indices("macro_rules!") {
            let name = ident(code[at + "macro_rules!".len()..].trim_start());
            macros.insert(name.to_string(), path[0].clone());
        }
        code_of.push((rel.clone(), path, code));
    }
    code_of.retain(|(rel, _, _)| !test_files.iter().any(|t| rel.starts_with(t)));
    (code_of, macros)
}

/// Every cross-module name of the crate at `root`, and the top-level modules it has.
fn crate_uses(root: &Path) -> (Vec<Use>, BTreeSet<String>) {
    let (files, macros) = checked_files(root);
    let modules: BTreeSet<String> = files.iter().map(|f| f.1[0].clone()).collect();
    let lib = std::fs::read_to_string(root.join("src/lib.rs")).unwrap();
    let names = Names {
        modules: modules.clone(),
        reexports: root_reexports(&lib),
        macros,
    };
    let mut uses = Vec::new();
    for (rel, path, code) in &files {
        let file = rel.to_string_lossy();
        uses.extend(uses_in(&file, path, code, &names));
    }
    (uses, modules)
}

/// The names a file takes from another file of its own folder, as [`Use`]s from file to
/// file: `super::`, `self::` and `crate::` paths, resolved to the file of the longest module
/// they name. A folder's `mod.rs` is one of its files, but what it takes from its own
/// children does not count: it declares and assembles them (its children may take the
/// folder's shared items from it). `files`: every checked file.
fn folder_uses(files: &[Checked]) -> Vec<Use> {
    let file_of: BTreeMap<&[String], &Path> = files
        .iter()
        .map(|(rel, path, _)| (path.as_slice(), rel.as_path()))
        .collect();
    let mut uses = Vec::new();
    for (rel, module, code) in files.iter().filter(|f| !f.0.ends_with("mod.rs")) {
        let dir = rel.parent().unwrap();
        let mut add = |full: Vec<String>, written: String| {
            let target = (1..=full.len())
                .rev()
                .find_map(|k| file_of.get(&full[..k]))
                .copied();
            if let Some(t) = target.filter(|t| *t != rel.as_path() && t.parent() == Some(dir)) {
                uses.push(Use {
                    file: rel.to_string_lossy().into_owned(),
                    from: rel.to_string_lossy().into_owned(),
                    to: t.to_string_lossy().into_owned(),
                    name: written,
                });
            }
        };
        let starts = |k: usize| !code[..k].ends_with(|c: char| is_ident(c) || c == ':');
        for k in (0..code.len()).filter(|&k| code.is_char_boundary(k) && starts(k)) {
            let first = ident(&code[k..]);
            let after = &code[k + first.len()..];
            if first.is_empty() || !after.starts_with("::") {
                continue;
            }
            // Where the path is rooted, and what follows the root.
            let (mut base, mut rest) = match first {
                "crate" => (Vec::new(), &after[2..]),
                "self" => (module.clone(), &after[2..]),
                "super" => (
                    module[..module.len().saturating_sub(1)].to_vec(),
                    &after[2..],
                ),
                _ => continue,
            };
            while let Some(t) = rest.trim_start().strip_prefix("super::") {
                base.pop();
                rest = t;
            }
            let rest = rest.trim_start();
            let items = match rest.strip_prefix('{') {
                Some(group) => group_items(group),
                None => vec![rest],
            };
            for item in items {
                let text = path_text(item);
                let mut full = base.clone();
                full.extend(text.split("::").filter(|s| !s.is_empty()).map(String::from));
                add(full, format!("{first}::{text}"));
            }
        }
    }
    uses
}

/// The names that point up a layer, as messages.
fn upward(uses: &[Use]) -> Vec<String> {
    uses.iter()
        .filter_map(|u| {
            let (from, to) = (layer_of(&u.from)?, layer_of(&u.to)?);
            (to < from).then(|| {
                format!(
                    "{} names `{}`: `{}` is in the layer \"{}\", above `{}` (\"{}\")",
                    u.file, u.name, u.to, LAYERS[to].0, u.from, LAYERS[from].0
                )
            })
        })
        .collect()
}

/// A cycle between top-level modules, as the names that make it.
fn cycle(uses: &[Use]) -> Option<Vec<Use>> {
    let mut edges: BTreeMap<&str, BTreeMap<&str, &Use>> = BTreeMap::new();
    for u in uses {
        edges
            .entry(u.from.as_str())
            .or_default()
            .entry(u.to.as_str())
            .or_insert(u);
    }
    // Depth-first search; `stack` holds the path from the start.
    fn visit<'a>(
        m: &'a str,
        edges: &BTreeMap<&'a str, BTreeMap<&'a str, &'a Use>>,
        done: &mut BTreeSet<&'a str>,
        stack: &mut Vec<&'a str>,
    ) -> Option<Vec<&'a str>> {
        if let Some(at) = stack.iter().position(|s| *s == m) {
            let mut c = stack[at..].to_vec();
            c.push(m);
            return Some(c);
        }
        if !done.insert(m) {
            return None;
        }
        stack.push(m);
        for next in edges.get(m).into_iter().flat_map(|e| e.keys()) {
            if let Some(c) = visit(next, edges, done, stack) {
                return Some(c);
            }
        }
        stack.pop();
        None
    }
    let mut done = BTreeSet::new();
    for &m in edges.keys() {
        if let Some(c) = visit(m, &edges, &mut done, &mut Vec::new()) {
            return Some(c.windows(2).map(|w| edges[w[0]][w[1]].clone()).collect());
        }
    }
    None
}

fn describe(c: &[Use]) -> String {
    c.iter()
        .map(|u| format!("{} → {} ({} names `{}`)", u.from, u.to, u.file, u.name))
        .collect::<Vec<_>>()
        .join("; ")
}

#[test]
fn every_module_is_in_a_layer() {
    let (_, modules) = crate_uses(Path::new(env!("CARGO_MANIFEST_DIR")));
    let missing: Vec<&String> = modules.iter().filter(|m| layer_of(m).is_none()).collect();
    assert!(
        missing.is_empty(),
        "top-level modules in no layer of tests/layers.rs (add them to LAYERS): {missing:?}"
    );
}

#[test]
fn no_module_names_a_layer_above_it() {
    let (uses, _) = crate_uses(Path::new(env!("CARGO_MANIFEST_DIR")));
    let up = upward(&uses);
    assert!(
        up.is_empty(),
        "names that point up a layer (docs/ARCHITECTURE.md):\n  {}",
        up.join("\n  ")
    );
}

#[test]
fn no_cycle_between_top_level_modules() {
    let (uses, _) = crate_uses(Path::new(env!("CARGO_MANIFEST_DIR")));
    if let Some(c) = cycle(&uses) {
        panic!("a cycle between top-level modules: {}", describe(&c));
    }
}

#[test]
fn no_cycle_between_the_files_of_a_folder() {
    let (files, _) = checked_files(Path::new(env!("CARGO_MANIFEST_DIR")));
    if let Some(c) = cycle(&folder_uses(&files)) {
        panic!("a cycle between the files of one folder: {}", describe(&c));
    }
}

/// The check itself finds what it is meant to find (and ignores what it must ignore).
#[test]
fn the_check_finds_upward_names_and_cycles() {
    let names = Names {
        modules: ["comm", "net", "rdma", "log", "algo"]
            .map(String::from)
            .into(),
        reexports: root_reexports("pub use algo::{Algo, model::Cost as C};\npub use comm::Thing;"),
        macros: [("info".to_string(), "log".to_string())].into(),
    };
    let scan = |file: &str, text: &str| {
        let path = module_path(Path::new(file));
        let (code, _) = without_tests(&strip(text));
        uses_in(file, &path, &code, &names)
    };
    let text = r#"
        use crate::{comm::Waiter, log};
        // crate::comm::in_a_comment
        const S: &str = "crate::comm::in_a_string";
        fn f<'a>(x: &'a u8) -> char { crate::info!("x"); let _ = crate::Algo::Ring; 'c' }
        fn g() { super::super::comm::local(); super::super::super::comm::timeout(); }
        #[cfg(test)]
        mod tests { use crate::comm::Only; }
        #[cfg(test)]
        mod model;
    "#;
    let found = scan("src/net/shm/ring.rs", text);
    let named: Vec<(&str, &str)> = found
        .iter()
        .map(|u| (u.to.as_str(), u.name.as_str()))
        .collect();
    assert_eq!(
        named,
        [
            ("comm", "crate::comm::Waiter"),
            ("log", "crate::log"),
            ("log", "crate::info!"),
            ("algo", "crate::Algo::Ring"),
            ("comm", "super::super::super::comm::timeout"),
        ]
    );
    assert_eq!(without_tests(&strip(text)).1, ["model"]);
    let up = upward(&found);
    assert!(
        up[0].contains("src/net/shm/ring.rs names `crate::comm::Waiter`"),
        "{up:?}"
    );
    assert_eq!(up.len(), 3, "{up:?}");
    // net → rdma → net is a cycle, whatever the layers.
    let mut both = scan("src/net/mod.rs", "use crate::rdma::X;");
    both.extend(scan("src/rdma/udp.rs", "use crate::net::PollFd;"));
    let c = cycle(&both).expect("a cycle");
    assert!(describe(&c).contains("src/rdma/udp.rs names `crate::net::PollFd`"));
}

/// The folder check resolves each way a file names a sibling, and finds their cycle.
#[test]
fn the_check_finds_cycles_between_the_files_of_a_folder() {
    let file = |rel: &str, code: &str| {
        let rel = PathBuf::from(rel);
        let path = module_path(&rel);
        (rel, path, without_tests(&strip(code)).0)
    };
    let files = vec![
        file(
            "src/net/tcp/mod.rs",
            "mod send; mod recv; fn f() { recv::g(); }",
        ),
        file("src/net/tcp/send.rs", "use super::{recv::R, HDR};"),
        file(
            "src/net/tcp/recv.rs",
            "fn g() { crate::net::tcp::send::S::new(); }",
        ),
        file(
            "src/net/shm/ring.rs",
            "use super::super::tcp::send::S; // crate::net::tcp::recv::R",
        ),
        file(
            "src/net/other.rs",
            "#[cfg(test)]\nmod tests { use super::tcp::send::S; }",
        ),
        file(
            "src/net/tcp/setup.rs",
            "use self::inner::X; use super::send::S;",
        ),
    ];
    let found: Vec<(String, String)> = folder_uses(&files)
        .into_iter()
        .map(|u| (u.from, u.to))
        .collect();
    let pair = |a: &str, b: &str| (format!("src/net/tcp/{a}"), format!("src/net/tcp/{b}"));
    // Another folder's files, test code and what mod.rs takes from its children are not
    // counted.
    assert_eq!(
        found,
        [
            pair("send.rs", "recv.rs"),
            pair("send.rs", "mod.rs"),
            pair("recv.rs", "send.rs"),
            pair("setup.rs", "send.rs"),
        ]
    );
    let c = cycle(&folder_uses(&files)).expect("send and recv name each other");
    assert!(describe(&c).contains("send.rs"), "{}", describe(&c));
}
