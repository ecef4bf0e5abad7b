//! The agent's module graph, checked on every `cargo test`: no two top-level modules of
//! `agent/src` may depend on each other, directly or through others, and only the composition
//! root may import `metrics` (see `docs/architecture.md`).
//!
//! How it reads the sources: every `.rs` file under `agent/src` belongs to the top-level module
//! named by its first path component (`launch/group.rs` → `launch`). Comments, string and
//! character literals are blanked out, and what is left is scanned for paths that start with
//! `crate::` or `super::` (including `use crate::{a, b::c}` groups). A `super::` path is resolved
//! against the file's own module path, so `super::x` in `metrics.rs` or `metrics/mod.rs` means
//! the crate root's `x`, and in `metrics/agent.rs` it stays inside `metrics`. Inline
//! `#[cfg(test)] mod tests { ... }` blocks are left out: their `super::` is relative to the
//! inline module, and test code may reach across layers. An edge `a → b` is any reference from a
//! file of `a` to a name `b` that is a top-level module; the test fails on the first cycle found,
//! printing it.
//!
//! The same holds one level down, inside each room: the modules of `launch/` (`launch/group.rs`,
//! `launch/summary.rs`, …) may not import each other in a circle either. There an edge
//! `launch::a → launch::b` is any reference from a file under `launch/a` to `crate::launch::b`
//! or, relative to the file, `super::b`; the room's own `mod.rs` (which declares and re-exports
//! its modules) is no node, as the crate root is none above.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The only top-level modules that may import `metrics`: where the agent is wired together.
const METRICS_IMPORTERS: &[&str] = &["app"];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The module path of a file: `launch/mod.rs` → `[launch]`, `launch/group.rs` →
/// `[launch, group]`, `lib.rs` → `[]`.
fn module_path(relative: &Path) -> Vec<String> {
    let mut parts: Vec<String> = relative
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if stem != "mod" && stem != "lib" && stem != "main" {
            parts.push(stem.to_owned());
        }
    }
    parts
}

/// `text` with comments and the contents of string and character literals replaced by spaces.
fn strip(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let rest = &bytes[i..];
        if rest.starts_with(b"//") {
            while i < bytes.len() && bytes[i] != b'\n' {
                i += 1;
            }
        } else if rest.starts_with(b"/*") {
            let mut depth = 0;
            while i < bytes.len() {
                if bytes[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if bytes[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(b' ');
        } else if let Some(hashes) = raw_string_start(rest) {
            // r"..." or r#"..."#: no escapes inside.
            let closing: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            i += hashes + 2;
            while i < bytes.len() && !bytes[i..].starts_with(&closing) {
                i += 1;
            }
            i += closing.len();
            out.extend_from_slice(b"\"\"");
        } else if bytes[i] == b'"' {
            i += 1;
            while i < bytes.len() && bytes[i] != b'"' {
                i += if bytes[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.extend_from_slice(b"\"\"");
        } else if bytes[i] == b'\'' {
            // A character literal ('x', '\n', '\u{1F}'), else a lifetime or label ('a).
            if rest.get(1) == Some(&b'\\') {
                i += 2;
                while i < bytes.len() && bytes[i] != b'\'' {
                    i += 1;
                }
                i += 1;
                out.extend_from_slice(b"' '");
            } else if let Some(len) = text[i + 1..]
                .chars()
                .next()
                .map(char::len_utf8)
                .filter(|len| rest.get(1 + len) == Some(&b'\''))
            {
                i += len + 2;
                out.extend_from_slice(b"' '");
            } else {
                out.push(b'\'');
                i += 1;
            }
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// `Some(number of #)` when `bytes` starts a raw string literal (`r"`, `r#"`, `br"`...).
fn raw_string_start(bytes: &[u8]) -> Option<usize> {
    let rest = bytes.strip_prefix(b"b").unwrap_or(bytes);
    let rest = rest.strip_prefix(b"r")?;
    let hashes = rest.iter().take_while(|b| **b == b'#').count();
    (rest.get(hashes) == Some(&b'"')).then_some(hashes + usize::from(bytes[0] == b'b'))
}

/// The source without its inline `#[cfg(test)] mod NAME { ... }` blocks.
fn without_inline_tests(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("#[cfg(test)]") {
        out.push_str(&rest[..at]);
        let after = &rest[at + "#[cfg(test)]".len()..];
        let trimmed = after.trim_start();
        let is_inline_mod = trimmed.starts_with("mod ")
            && trimmed
                .find(['{', ';'])
                .is_some_and(|i| trimmed.as_bytes()[i] == b'{');
        if !is_inline_mod {
            out.push_str("#[cfg(test)]");
            rest = after;
            continue;
        }
        let open = after.len() - trimmed.len() + trimmed.find('{').unwrap_or(0);
        let mut depth = 0usize;
        let mut end = after.len();
        for (i, c) in after[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + i + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

fn is_ident_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// The first segment of every path that follows `crate::` or a `super::` chain, resolved to an
/// absolute module path's first segment (the top-level module), given the file's module path.
fn referenced_top_levels(code: &str, module: &[String]) -> BTreeSet<String> {
    referenced_pairs(code, module)
        .into_iter()
        .filter_map(|path| path.into_iter().next())
        .collect()
}

fn ident(text: &str) -> Option<String> {
    let end = text
        .bytes()
        .position(|b| !is_ident_byte(b))
        .unwrap_or(text.len());
    (end > 0).then(|| text[..end].to_owned())
}

/// The paths referenced in `code`, resolved against the file's module path and cut to their
/// first two segments: `crate::launch::group::x` and, from `launch/summary.rs`,
/// `super::group::x` are both `[launch, group]`.
fn referenced_pairs(code: &str, module: &[String]) -> BTreeSet<Vec<String>> {
    let bytes = code.as_bytes();
    let mut found = BTreeSet::new();
    let mut i = 0;
    while i < bytes.len() {
        let starts_word = i == 0 || !(is_ident_byte(bytes[i - 1]) || bytes[i - 1] == b'$');
        let rest = &code[i..];
        let (base, consumed): (Vec<String>, usize) = if starts_word && rest.starts_with("crate::") {
            (Vec::new(), "crate::".len())
        } else if starts_word && rest.starts_with("super::") {
            let mut depth = 0;
            let mut len = 0;
            while code[i + len..].starts_with("super::") {
                depth += 1;
                len += "super::".len();
            }
            let keep = module.len().saturating_sub(depth);
            (module[..keep].to_vec(), len)
        } else {
            i += 1;
            continue;
        };
        i += consumed;
        for tail in path_heads(&code[i..], 2usize.saturating_sub(base.len())) {
            let mut path = base.clone();
            path.extend(tail);
            path.truncate(2);
            found.insert(path);
        }
    }
    found
}

/// The paths at the start of `text`, each cut to `want` segments: `a::b::c` → `[a, b]`;
/// `a::{b, c::d}` → `[a, b]`, `[a, c]`; `{a, b}` → `[a]`, `[b]`.
fn path_heads(text: &str, want: usize) -> Vec<Vec<String>> {
    if want == 0 {
        return vec![Vec::new()];
    }
    let text = text.trim_start();
    if let Some(group) = text.strip_prefix('{') {
        let mut depth = 0usize;
        let mut items = Vec::new();
        let mut start = 0;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    items.push(&group[start..i]);
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    items.push(&group[start..i]);
                    start = i + 1;
                }
                _ => {}
            }
        }
        return items
            .into_iter()
            .flat_map(|item| path_heads(item, want))
            .filter(|p| p.first().is_some_and(|first| first != "self"))
            .collect();
    }
    let Some(first) = ident(text) else {
        return Vec::new();
    };
    let after = &text[first.len()..];
    match after.strip_prefix("::") {
        Some(rest) if want > 1 => {
            let deeper = path_heads(rest, want - 1);
            if deeper.is_empty() {
                return vec![vec![first]];
            }
            deeper
                .into_iter()
                .map(|mut tail| {
                    tail.insert(0, first.clone());
                    tail
                })
                .collect()
        }
        _ => vec![vec![first]],
    }
}

/// Room → (its module → the modules of the same room it references), for every top-level
/// module that is a directory of modules.
fn room_graphs() -> BTreeMap<String, BTreeMap<String, BTreeSet<String>>> {
    let src = src_dir();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let paths: Vec<(PathBuf, Vec<String>)> = files
        .iter()
        .filter_map(|f| Some((f.clone(), module_path(f.strip_prefix(&src).ok()?))))
        .collect();
    let mut children: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (_, module) in &paths {
        if let [room, child, ..] = module.as_slice() {
            children
                .entry(room.clone())
                .or_default()
                .insert(child.clone());
        }
    }
    let mut rooms: BTreeMap<String, BTreeMap<String, BTreeSet<String>>> = BTreeMap::new();
    for (file, module) in &paths {
        let [room, child, ..] = module.as_slice() else {
            continue;
        };
        let siblings = &children[room];
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let code = without_inline_tests(&strip(&text));
        let targets = rooms
            .entry(room.clone())
            .or_default()
            .entry(child.clone())
            .or_default();
        for path in referenced_pairs(&code, module) {
            if let [r, target] = path.as_slice() {
                if r == room && target != child && siblings.contains(target) {
                    targets.insert(target.clone());
                }
            }
        }
    }
    rooms
}

/// Top-level module → the top-level modules it references.
fn graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = src_dir();
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let modules: BTreeSet<String> = files
        .iter()
        .filter_map(|f| module_path(f.strip_prefix(&src).ok()?).first().cloned())
        .collect();
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in &files {
        let Ok(relative) = file.strip_prefix(&src) else {
            continue;
        };
        let module = module_path(relative);
        // The crate root declares the modules; it is no layer of its own.
        let Some(top) = module.first().cloned() else {
            continue;
        };
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let code = without_inline_tests(&strip(&text));
        let targets = edges.entry(top.clone()).or_default();
        for target in referenced_top_levels(&code, &module) {
            if target != top && modules.contains(&target) {
                targets.insert(target);
            }
        }
    }
    edges
}

/// A cycle in `edges`, as the list of modules along it (first = last), if there is one.
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let from = stack.iter().position(|n| n == node).unwrap_or(0);
                let mut cycle = stack[from..].to_vec();
                cycle.push(node.to_owned());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_owned(), Mark::Open);
        stack.push(node.to_owned());
        for next in edges.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, edges, marks, stack) {
                return Some(cycle);
            }
        }
        stack.pop();
        marks.insert(node.to_owned(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in edges.keys() {
        let mut stack = Vec::new();
        if let Some(cycle) = visit(node, edges, &mut marks, &mut stack) {
            return Some(cycle);
        }
    }
    None
}

fn describe(edges: &BTreeMap<String, BTreeSet<String>>) -> String {
    edges
        .iter()
        .map(|(from, to)| {
            format!(
                "  {from} → {}",
                to.iter().cloned().collect::<Vec<_>>().join(", ")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_top_level_modules_form_no_cycle() {
    let edges = graph();
    assert!(edges.len() > 5, "too few modules found: {edges:?}");
    if let Some(cycle) = find_cycle(&edges) {
        panic!(
            "import cycle: {}\nthe whole graph:\n{}",
            cycle.join(" → "),
            describe(&edges)
        );
    }
}

#[test]
fn the_modules_inside_each_room_form_no_cycle() {
    let rooms = room_graphs();
    assert!(
        rooms.get("launch").is_some_and(|m| m.len() > 5),
        "too few modules found in launch/: {rooms:?}"
    );
    for (room, edges) in &rooms {
        if let Some(cycle) = find_cycle(edges) {
            panic!(
                "import cycle inside {room}/: {}\nthe room's graph:\n{}",
                cycle.join(" → "),
                describe(edges)
            );
        }
    }
}

#[test]
fn only_the_composition_root_imports_metrics() {
    let edges = graph();
    let importers: Vec<&String> = edges
        .iter()
        .filter(|(from, to)| to.contains("metrics") && !METRICS_IMPORTERS.contains(&from.as_str()))
        .map(|(from, _)| from)
        .collect();
    assert!(
        importers.is_empty(),
        "{importers:?} import `metrics`; only {METRICS_IMPORTERS:?} may (metrics observe events \
         and read-only state instead of being called into)"
    );
}

#[test]
fn the_checker_sees_paths_the_way_rustc_does() {
    let module = |p: &str| module_path(Path::new(p));
    assert_eq!(module("launch/group.rs"), ["launch", "group"]);
    assert_eq!(module("launch/mod.rs"), ["launch"]);
    assert!(module("lib.rs").is_empty());
    let refs = |code: &str, file: &str| referenced_top_levels(&strip(code), &module(file));
    assert_eq!(
        refs("use crate::{logs::Sink, exit_code, self};", "a.rs"),
        BTreeSet::from(["logs".to_owned(), "exit_code".to_owned()])
    );
    assert_eq!(
        refs("use super::x; fn f() { super::super::y::z() }", "a/b/c.rs"),
        BTreeSet::from(["a".to_owned()])
    );
    assert_eq!(
        refs("use super::gpu;", "a/mod.rs"),
        BTreeSet::from(["gpu".to_owned()])
    );
    // Comments, strings and characters are not code.
    assert!(refs(
        "// crate::x\n/* crate::y */ let s = \"crate::z\"; let r = r#\"crate::w\"#; let c = '\"'; /// [`crate::v`]",
        "a.rs"
    )
    .is_empty());
    assert_eq!(
        refs("fn f<'a>(x: &'a str) -> crate::b::C { todo!() }", "a.rs"),
        BTreeSet::from(["b".to_owned()])
    );
    let code = without_inline_tests(
        "use crate::a;\n#[cfg(test)]\nmod tests { use crate::b; fn f() { {} } }\nuse crate::c;",
    );
    assert_eq!(
        refs(&code, "x.rs"),
        BTreeSet::from(["a".to_owned(), "c".to_owned()])
    );
    let pairs = |code: &str, file: &str| referenced_pairs(&strip(code), &module(file));
    let pair = |a: &str, b: &str| vec![a.to_owned(), b.to_owned()];
    assert_eq!(
        pairs("use super::gang_cause::GangCause;", "launch/summary.rs"),
        BTreeSet::from([pair("launch", "gang_cause")])
    );
    assert_eq!(
        pairs(
            "use crate::launch::{group::Worker, summary};",
            "launch/x.rs"
        ),
        BTreeSet::from([pair("launch", "group"), pair("launch", "summary")])
    );
    assert_eq!(
        pairs(
            "use super::{hang::{Phase, Stall}, cgroup};",
            "watch/startup.rs"
        ),
        BTreeSet::from([pair("watch", "hang"), pair("watch", "cgroup")])
    );
    assert_eq!(
        pairs("fn f() { crate::exit_code::HUNG }", "launch/x.rs"),
        BTreeSet::from([pair("exit_code", "HUNG")])
    );
    let cyclic = BTreeMap::from([
        ("a".to_owned(), BTreeSet::from(["b".to_owned()])),
        ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
        ("c".to_owned(), BTreeSet::from(["a".to_owned()])),
    ]);
    assert_eq!(
        find_cycle(&cyclic),
        Some(
            vec!["a", "b", "c", "a"]
                .into_iter()
                .map(String::from)
                .collect()
        )
    );
    let acyclic = BTreeMap::from([
        (
            "a".to_owned(),
            BTreeSet::from(["b".to_owned(), "c".to_owned()]),
        ),
        ("b".to_owned(), BTreeSet::from(["c".to_owned()])),
    ]);
    assert_eq!(find_cycle(&acyclic), None);
}
