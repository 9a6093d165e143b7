//! The crate's structure, as written in docs/code-map.md, checked on the source.
//!
//! Every path a file names (`crate::…`, `super::…`, `self::…`, and the re-exports of a
//! folder's `mod.rs` followed to where the item is defined) is an edge from that file to the
//! file that defines its target. Two rules are read off those edges:
//!
//! - **Layering**: between top-level modules, an edge may only point to a lower layer of the
//!   code map's layering block (which also rules out a cycle between them).
//! - **No circle in any folder**: inside every folder, the files and sub-folders directly in
//!   it form a graph with no cycle. A folder's `mod.rs` counts as the folder itself: its `mod`
//!   and `pub use` lines are no edges, and a child may use what `mod.rs` defines.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module's path from the crate root (`[]` is the root; `["model", "hf"]` is
/// `src/model/hf.rs`).
type ModPath = Vec<String>;

/// The layers from docs/code-map.md's block between the two markers, top first.
fn layers() -> Vec<Vec<String>> {
    let readme =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/code-map.md"))
            .expect("docs/code-map.md");
    let start = readme
        .find("<!-- layering -->")
        .expect("docs/code-map.md has a <!-- layering --> block");
    let end = readme[start..]
        .find("<!-- /layering -->")
        .expect("the layering block is closed")
        + start;
    readme[start..end]
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .map(|l| {
            let names = l.split(':').next().unwrap_or("");
            names
                .split(['`', ',', ' '])
                .map(str::trim)
                .filter(|w| !w.is_empty() && w.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
                .map(str::to_string)
                .collect()
        })
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).expect("src is readable") {
        let p = e.expect("entry").path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The source without comments or string and char literals (newlines kept, so offsets map
/// to the same lines), so a doc link or a message that mentions `crate::x` is no edge.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let newlines = |s: &[u8], out: &mut String| {
        for _ in s.iter().filter(|&&c| c == b'\n') {
            out.push('\n');
        }
    };
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
            let start = i;
            let mut depth = 0;
            while i < b.len() {
                if b[i..].starts_with(b"/*") {
                    depth += 1;
                    i += 2;
                } else if b[i..].starts_with(b"*/") {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            newlines(&b[start..i.min(b.len())], &mut out);
        } else if b[i] == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && !(i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            // Raw string r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(b[i] as char);
                i += 1;
                continue;
            }
            let close: Vec<u8> = std::iter::once(b'"')
                .chain(std::iter::repeat_n(b'#', hashes))
                .collect();
            j += 1;
            let start = j;
            while j < b.len() && !b[j..].starts_with(&close) {
                j += 1;
            }
            out.push_str("\"\"");
            newlines(&b[start..j.min(b.len())], &mut out);
            i = j + close.len();
        } else if b[i] == b'"' {
            i += 1;
            let start = i;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            out.push_str("\"\"");
            newlines(&b[start..i.min(b.len())], &mut out);
            i += 1;
        } else if b[i] == b'\'' && b.get(i + 2) == Some(&b'\'') {
            i += 3;
        } else if b[i] == b'\'' && b.get(i + 1) == Some(&b'\\') {
            i += 2;
            while i < b.len() && b[i] != b'\'' {
                i += 1;
            }
            i += 1;
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// A cursor over code for reading paths.
struct Cursor<'a> {
    s: &'a str,
    at: usize,
}

impl Cursor<'_> {
    fn skip_ws(&mut self) {
        while self.s[self.at..].starts_with(char::is_whitespace) {
            self.at += self.s[self.at..].chars().next().map_or(1, char::len_utf8);
        }
    }
    fn eat(&mut self, tok: &str) -> bool {
        self.skip_ws();
        if self.s[self.at..].starts_with(tok) {
            self.at += tok.len();
            true
        } else {
            false
        }
    }
    fn ident(&mut self) -> Option<String> {
        self.skip_ws();
        let rest = &self.s[self.at..];
        if rest.starts_with('*') {
            self.at += 1;
            return Some("*".into());
        }
        let end = rest.find(|c: char| !is_ident(c)).unwrap_or(rest.len());
        if end == 0 {
            return None;
        }
        self.at += end;
        Some(rest[..end].to_string())
    }

    /// The paths of one path expression or `use` tree, from the segment at the cursor:
    /// `a::b::{c, d::e as f, self}` gives `[a, b, c]`, `[a, b, d, e]` and `[a, b]`.
    fn tree(&mut self, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
        let mut path = prefix;
        loop {
            if self.eat("{") {
                loop {
                    self.skip_ws();
                    if self.eat("}") {
                        return;
                    }
                    self.tree(path.clone(), out);
                    if self.eat("as") {
                        self.ident();
                    }
                    if !self.eat(",") {
                        self.eat("}");
                        return;
                    }
                }
            }
            match self.ident() {
                Some(seg) if seg == "self" && !path.is_empty() => {}
                Some(seg) => path.push(seg),
                None => break,
            }
            let save = self.at;
            if !self.eat("::") || self.s[self.at..].trim_start().starts_with('<') {
                self.at = save;
                break;
            }
        }
        out.push(path);
    }
}

/// Every `crate::`, `super::` and `self::` path in `code` with the byte offset it starts
/// at, unresolved.
fn raw_paths(code: &str) -> Vec<(usize, Vec<String>)> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < code.len() {
        let rest = &code[i..];
        let start = ["crate", "super", "self"]
            .into_iter()
            .find(|k| rest.starts_with(k) && rest[k.len()..].trim_start().starts_with("::"));
        let boundary = i == 0 || {
            let prev = code[..i].chars().next_back().unwrap_or(' ');
            !is_ident(prev) && prev != ':'
        };
        match start {
            Some(_) if boundary => {
                let mut c = Cursor { s: code, at: i };
                let mut paths = Vec::new();
                c.tree(Vec::new(), &mut paths);
                out.extend(paths.into_iter().map(|p| (i, p)));
                i = c.at.max(i + 1);
            }
            _ => i += rest.chars().next().map_or(1, char::len_utf8),
        }
    }
    out
}

/// Inline `mod name { … }` blocks: (start, end, name) byte ranges.
fn inline_mods(code: &str) -> Vec<(usize, usize, String)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(k) = code[from..].find("mod ") {
        let at = from + k;
        from = at + 4;
        if at > 0 && code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let mut c = Cursor {
            s: code,
            at: at + 4,
        };
        let Some(name) = c.ident() else { continue };
        if !c.eat("{") {
            continue;
        }
        let open = c.at;
        let mut depth = 1;
        let mut end = open;
        for (j, ch) in code[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + j;
                        break;
                    }
                }
                _ => {}
            }
        }
        out.push((open, end, name));
    }
    out
}

/// One source file and where it sits.
struct SourceFile {
    rel: PathBuf,
    module: ModPath,
    /// `mod.rs`, `lib.rs` or `main.rs`: the file that is its folder.
    folder: bool,
    /// Test code (a `tests.rs` file) or generated code (a file that says it was generated):
    /// exempt from the folder rule.
    exempt: bool,
    code: String,
}

fn module_of(rel: &Path) -> (ModPath, bool) {
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    let file = parts.pop().unwrap_or_default();
    let stem = file.trim_end_matches(".rs").to_string();
    match stem.as_str() {
        "mod" => (parts, true),
        "lib" | "main" if parts.is_empty() => (parts, true),
        _ => {
            parts.push(stem);
            (parts, false)
        }
    }
}

fn read_tree(src: &Path) -> Vec<SourceFile> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    files.sort();
    files
        .into_iter()
        .map(|f| {
            let rel = f.strip_prefix(src).expect("under src").to_path_buf();
            let (module, folder) = module_of(&rel);
            let text = std::fs::read_to_string(&f).expect("readable source");
            let exempt = rel.file_name().is_some_and(|n| n == "tests.rs")
                || text
                    .lines()
                    .next()
                    .is_some_and(|l| l.contains("Generated by"));
            SourceFile {
                rel,
                module,
                folder,
                exempt,
                code: code_only(&text),
            }
        })
        .collect()
}

/// What a folder's `mod.rs` re-exports: a name to the path it names, and the modules it
/// re-exports everything of (`pub use config::*`).
#[derive(Default)]
struct Reexports {
    names: BTreeMap<String, ModPath>,
    globs: Vec<ModPath>,
}

/// The crate's modules, their re-exports and what each defines, to resolve a path to the
/// file that defines its target.
struct Crate {
    files: Vec<SourceFile>,
    modules: BTreeSet<ModPath>,
    reexports: BTreeMap<ModPath, Reexports>,
}

/// Whether `code` defines an item called `name` at any depth (enough for a glob re-export).
fn defines(code: &str, name: &str) -> bool {
    [
        "struct", "enum", "fn", "const", "type", "trait", "static", "mod", "union",
    ]
    .iter()
    .any(|kw| {
        let pat = format!("{kw} {name}");
        code.match_indices(&pat).any(|(i, _)| {
            let after = code[i + pat.len()..].chars().next().unwrap_or(' ');
            let before = code[..i].chars().next_back().unwrap_or(' ');
            !is_ident(after) && !is_ident(before)
        })
    }) || code.contains(&format!("macro_rules! {name}"))
}

impl Crate {
    fn read(src: &Path) -> Crate {
        let files = read_tree(src);
        let modules: BTreeSet<ModPath> = files.iter().map(|f| f.module.clone()).collect();
        let mut reexports: BTreeMap<ModPath, Reexports> = BTreeMap::new();
        for f in files.iter().filter(|f| f.folder) {
            let r = reexports.entry(f.module.clone()).or_default();
            let mut from = 0;
            while let Some(k) = f.code[from..].find("pub use ") {
                let at = from + k + "pub use ".len();
                from = at;
                let mut c = Cursor { s: &f.code, at };
                let mut paths = Vec::new();
                c.tree(Vec::new(), &mut paths);
                for p in paths {
                    let Some(abs) = absolute(&f.module, 0, &p, &modules) else {
                        continue;
                    };
                    match p.last().map(String::as_str) {
                        Some("*") => r.globs.push(abs[..abs.len() - 1].to_vec()),
                        Some(name) => {
                            r.names.insert(name.to_string(), abs);
                        }
                        None => {}
                    }
                }
            }
        }
        Crate {
            files,
            modules,
            reexports,
        }
    }

    fn file(&self, module: &ModPath) -> Option<&SourceFile> {
        self.files.iter().find(|f| &f.module == module)
    }

    /// The module whose file defines `path`'s target: the longest module prefix, with a
    /// folder's re-exports followed to where the item is defined.
    fn defining(&self, path: &[String]) -> ModPath {
        let mut path = path.to_vec();
        for _ in 0..16 {
            let n = (0..=path.len())
                .rev()
                .find(|&n| self.modules.contains(&path[..n]))
                .unwrap_or(0);
            let module = path[..n].to_vec();
            let Some(item) = path.get(n) else {
                return module;
            };
            let Some(r) = self.reexports.get(&module) else {
                return module;
            };
            if let Some(target) = r.names.get(item) {
                let mut next = target.clone();
                next.extend_from_slice(&path[n + 1..]);
                if next == path {
                    return module;
                }
                path = next;
                continue;
            }
            let glob = r.globs.iter().find(|g| {
                self.file(g)
                    .is_some_and(|f| defines(&f.code, item) && *g != &module)
            });
            match glob {
                Some(g) => {
                    let mut next = g.clone();
                    next.extend_from_slice(&path[n..]);
                    path = next;
                }
                None => return module,
            }
        }
        path
    }
}

/// `path` (starting with `crate`, `super` or `self`) from the module `at`, `inline` levels
/// deep in inline modules of its file, as a path from the crate root. A bare path in a
/// folder's `pub use` is relative to the folder.
fn absolute(
    at: &ModPath,
    inline: usize,
    path: &[String],
    modules: &BTreeSet<ModPath>,
) -> Option<ModPath> {
    let mut base = at.clone();
    let mut inline = inline;
    let mut rest = path;
    match rest.first().map(String::as_str) {
        Some("crate") => {
            base.clear();
            rest = &rest[1..];
        }
        Some("self") => rest = &rest[1..],
        Some("super") => {
            while rest.first().map(String::as_str) == Some("super") {
                if inline > 0 {
                    inline -= 1;
                } else {
                    base.pop()?;
                }
                rest = &rest[1..];
            }
        }
        Some(first) => {
            let mut child = at.clone();
            child.push(first.to_string());
            if !modules.contains(&child) {
                return None; // an outside crate
            }
        }
        None => return None,
    }
    base.extend_from_slice(rest);
    Some(base)
}

/// One edge: from a file's module to the module defining what it names, with where.
#[derive(Clone, Debug)]
struct Edge {
    from: ModPath,
    to: ModPath,
    file: PathBuf,
    line: usize,
    /// Named from test or generated code (a `tests.rs` file, an inline `mod tests`, a
    /// generated file).
    exempt: bool,
}

fn edges(krate: &Crate) -> Vec<Edge> {
    let mut out = Vec::new();
    for f in &krate.files {
        let mods = inline_mods(&f.code);
        for (at, p) in raw_paths(&f.code) {
            let around: Vec<&String> = mods
                .iter()
                .filter(|(s, e, _)| *s <= at && at < *e)
                .map(|(_, _, name)| name)
                .collect();
            let inline = around.len();
            let Some(abs) = absolute(&f.module, inline, &p, &krate.modules) else {
                continue;
            };
            if abs.last().map(String::as_str) == Some("*") {
                continue; // `use super::*` in a test module: the file itself
            }
            let to = krate.defining(&abs);
            if to != f.module {
                out.push(Edge {
                    from: f.module.clone(),
                    to,
                    file: f.rel.clone(),
                    line: f.code[..at].matches('\n').count() + 1,
                    exempt: f.exempt || around.iter().any(|m| *m == "tests"),
                });
            }
        }
    }
    out
}

/// The graph of each folder: its direct children (files and sub-folders), an edge where a
/// file under one child names something defined under another.
fn folder_graphs(edges: &[Edge]) -> BTreeMap<ModPath, BTreeMap<(String, String), Edge>> {
    let mut out: BTreeMap<ModPath, BTreeMap<(String, String), Edge>> = BTreeMap::new();
    for e in edges {
        let common = e.from.iter().zip(&e.to).take_while(|(a, b)| a == b).count();
        let (Some(a), Some(b)) = (e.from.get(common), e.to.get(common)) else {
            continue; // one is the other's folder
        };
        out.entry(e.from[..common].to_vec())
            .or_default()
            .entry((a.clone(), b.clone()))
            .or_insert_with(|| e.clone());
    }
    out
}

/// The first cycle in a graph, as the nodes along it.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        g: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match state.get(n) {
            Some(1) => {
                let at = path.iter().position(|p| p == n).unwrap_or(0);
                let mut cycle = path[at..].to_vec();
                cycle.push(n.to_string());
                return Some(cycle);
            }
            Some(2) => return None,
            _ => {}
        }
        state.insert(n.to_string(), 1);
        path.push(n.to_string());
        for m in g.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, g, state, path) {
                return Some(c);
            }
        }
        path.pop();
        state.insert(n.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    graph
        .keys()
        .find_map(|n| visit(n, graph, &mut state, &mut Vec::new()))
}

/// The strongly connected components of a graph with more than one node: each is a set of
/// files that import each other around at least one circle.
fn tangles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<BTreeSet<String>> {
    // Tarjan's algorithm.
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        out: Vec<BTreeSet<String>>,
    }
    fn visit<'g>(w: &mut Walk<'g>, n: &'g str) {
        let i = w.index.len();
        w.index.insert(n, i);
        w.low.insert(n, i);
        w.stack.push(n);
        for m in w.graph.get(n).into_iter().flatten() {
            if !w.index.contains_key(m.as_str()) {
                visit(w, m);
                let low = w.low[n].min(w.low[m.as_str()]);
                w.low.insert(n, low);
            } else if w.stack.contains(&m.as_str()) {
                let low = w.low[n].min(w.index[m.as_str()]);
                w.low.insert(n, low);
            }
        }
        if w.low[n] == w.index[n] {
            let mut part = BTreeSet::new();
            while let Some(m) = w.stack.pop() {
                part.insert(m.to_string());
                if m == n {
                    break;
                }
            }
            if part.len() > 1 {
                w.out.push(part);
            }
        }
    }
    let mut w = Walk {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        out: Vec::new(),
    };
    for n in graph.keys() {
        if !w.index.contains_key(n.as_str()) {
            visit(&mut w, n);
        }
    }
    w.out
}

/// Every tangle between the children of a folder, one line each: its files, and one circle
/// through them naming an import per edge.
fn cycles(src: &Path) -> Vec<String> {
    let krate = Crate::read(src);
    let mut out = Vec::new();
    for (folder, edges) in folder_graphs(&edges(&krate)) {
        let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        for (a, b) in edges.keys() {
            graph.entry(a.clone()).or_default().insert(b.clone());
        }
        for part in tangles(&graph) {
            let inner: BTreeMap<String, BTreeSet<String>> = part
                .iter()
                .map(|n| {
                    let next = graph[n].intersection(&part).cloned().collect();
                    (n.clone(), next)
                })
                .collect();
            let Some(c) = find_cycle(&inner) else {
                continue;
            };
            let shown: Vec<String> = c
                .windows(2)
                .map(|w| {
                    let e = &edges[&(w[0].clone(), w[1].clone())];
                    format!("{} -> {} ({}:{})", w[0], w[1], e.file.display(), e.line)
                })
                .collect();
            let name = if folder.is_empty() {
                "src".to_string()
            } else {
                format!("src/{}", folder.join("/"))
            };
            let files: Vec<&str> = part.iter().map(String::as_str).collect();
            out.push(format!(
                "{name}: {{{}}} import each other, e.g. {}",
                files.join(", "),
                shown.join(", ")
            ));
        }
    }
    out
}

/// Every place a file names what the `mod.rs` of a folder holding it defines (the crate
/// root's `lib.rs` excepted), one line each. A folder's `mod.rs` declares its files, so that
/// is an arrow back up; a re-export of a sibling file is followed to the sibling and is
/// fine. Test and generated code is exempt.
fn arrows_up(src: &Path) -> Vec<String> {
    let krate = Crate::read(src);
    let folders: BTreeSet<&ModPath> = krate
        .files
        .iter()
        .filter(|f| f.folder && !f.module.is_empty())
        .map(|f| &f.module)
        .collect();
    let mut out = BTreeSet::new();
    for e in edges(&krate) {
        let up = folders.contains(&e.to) && e.from.len() > e.to.len() && e.from.starts_with(&e.to);
        if up && !e.exempt {
            out.insert(format!(
                "src/{}:{} names what src/{}/mod.rs defines",
                e.file.display(),
                e.line,
                e.to.join("/")
            ));
        }
    }
    out.into_iter().collect()
}

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

#[test]
fn every_import_points_down_the_written_layering() {
    let layers = layers();
    assert!(
        layers.len() >= 3,
        "the code map's layering block: {layers:?}"
    );
    let rank: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| l.iter().map(move |m| (m.as_str(), i)))
        .collect();
    let krate = Crate::read(&src_dir());
    let top: BTreeSet<&str> = krate
        .modules
        .iter()
        .filter_map(|m| m.first().map(String::as_str))
        .collect();
    let unplaced: Vec<_> = top.iter().filter(|m| !rank.contains_key(*m)).collect();
    assert!(
        unplaced.is_empty(),
        "modules missing from the code map's layering: {unplaced:?}"
    );
    let edges = edges(&krate);
    assert!(
        edges
            .iter()
            .any(|e| e.from.first().is_some_and(|m| m == "stages")
                && e.to.first().is_some_and(|m| m == "bus")),
        "the edge reader found no stages -> bus import"
    );
    let mut wrong = BTreeSet::new();
    for e in &edges {
        let (Some(from), Some(to)) = (e.from.first(), e.to.first()) else {
            continue; // lib.rs, or an item of lib.rs (a macro)
        };
        let (Some(&a), Some(&b)) = (rank.get(from.as_str()), rank.get(to.as_str())) else {
            continue;
        };
        if from != to && b <= a {
            wrong.insert(format!(
                "src/{}:{} imports `{to}` (layer {b}) from `{from}` (layer {a})",
                e.file.display(),
                e.line
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layering (a module imports only from layers below its own):\n{}",
        wrong.into_iter().collect::<Vec<_>>().join("\n")
    );
}

#[test]
fn no_folder_has_a_circle_at_any_depth() {
    let found = cycles(&src_dir());
    assert!(
        found.is_empty(),
        "import cycles between the files of a folder (break each by moving what both sides \
         need into a file of its own):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_edge_reader_sees_groups_and_skips_comments() {
    let code = code_only(
        "use crate::{bus::{A, B}, model, schema::X};\n// crate::commands\nlet s = \"crate::cli\";\nfn f() { crate::metrics::x(); super::super::y::Z::<u8>::new(); }\npub(super) fn g(&self) {}",
    );
    let paths: Vec<Vec<String>> = raw_paths(&code).into_iter().map(|(_, p)| p).collect();
    let want: Vec<Vec<&str>> = vec![
        vec!["crate", "bus", "A"],
        vec!["crate", "bus", "B"],
        vec!["crate", "model"],
        vec!["crate", "schema", "X"],
        vec!["crate", "metrics", "x"],
        vec!["super", "super", "y", "Z"],
    ];
    assert_eq!(paths, want);
}

#[test]
fn no_file_names_what_its_folders_mod_rs_defines() {
    let found = arrows_up(&src_dir());
    assert!(
        found.is_empty(),
        "files naming what a folder above them defines in its mod.rs (move it into a file \
         of its own, which mod.rs may re-export: docs/code-map.md, \"Layering\"):\n{}",
        found.join("\n")
    );
}

/// Every type name declared public (`pub`, `pub(crate)`, `pub(super)`: a struct, enum,
/// trait, type alias or union) in more than one file, with the files; test and generated
/// code left out. Alternatives of one type under `cfg` in one file count once.
fn shared_type_names(src: &Path) -> Vec<String> {
    let krate = Crate::read(src);
    let mut names: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in krate.files.iter().filter(|f| !f.exempt) {
        let tests: Vec<(usize, usize)> = inline_mods(&f.code)
            .into_iter()
            .filter(|(_, _, name)| name == "tests")
            .map(|(s, e, _)| (s, e))
            .collect();
        for (at, _) in f.code.match_indices("pub") {
            if tests.iter().any(|&(s, e)| s <= at && at < e)
                || f.code[..at].chars().next_back().is_some_and(is_ident)
            {
                continue;
            }
            let mut c = Cursor {
                s: &f.code,
                at: at + 3,
            };
            if c.eat("(") {
                while c.ident().is_some_and(|w| w != ")") && !c.eat(")") {}
            }
            let kind = c.ident();
            if !matches!(
                kind.as_deref(),
                Some("struct" | "enum" | "trait" | "type" | "union")
            ) {
                continue;
            }
            if let Some(name) = c.ident() {
                names
                    .entry(name)
                    .or_default()
                    .insert(format!("src/{}", f.rel.display()));
            }
        }
    }
    names
        .into_iter()
        .filter(|(_, files)| files.len() > 1)
        .map(|(name, files)| {
            let files: Vec<String> = files.into_iter().collect();
            format!("{name}: {}", files.join(", "))
        })
        .collect()
}

#[test]
fn no_two_public_types_share_a_name() {
    let shared = shared_type_names(&src_dir());
    assert!(
        shared.is_empty(),
        "public types that share a name (give each a name that says which it is):\n{}",
        shared.join("\n")
    );
}

/// The test of the test: two files declaring one public name are found, at any
/// visibility; `cfg` alternatives in one file, private types and test code are not.
#[test]
fn the_shared_name_check_finds_public_twins_only() {
    let twins = scratch_crate(&[
        ("lib.rs", "pub mod a;\npub mod b;\npub mod c;\nmod tests;\n"),
        (
            "a.rs",
            "pub struct Twin;\n#[cfg(x)]\npub type Alt = u8;\n#[cfg(not(x))]\npub type Alt = u16;\nstruct Quiet;\npub(crate) enum Scoped {}\n",
        ),
        (
            "b.rs",
            "pub(super) struct Twin(u8);\nstruct Quiet;\npub fn Scoped() {}\n#[cfg(test)]\nmod tests { pub struct Alt; }\n",
        ),
        ("c.rs", "pub trait Scoped {}\n"),
        ("tests.rs", "pub struct Twin;\n"),
    ]);
    assert_eq!(
        shared_type_names(twins.path()),
        ["Scoped: src/a.rs, src/c.rs", "Twin: src/a.rs, src/b.rs"]
    );
}

/// Writes a small crate to a scratch directory.
fn scratch_crate(files: &[(&str, &str)]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("a scratch directory");
    for (path, text) in files {
        let p = dir.path().join(path);
        std::fs::create_dir_all(p.parent().expect("a parent")).expect("mkdir");
        std::fs::write(p, text).expect("write");
    }
    dir
}

/// The test of the test: a cycle is found at any depth, through `super::`, `self::`,
/// `crate::` paths and a folder's re-exports; what a folder's `mod.rs` declares or defines
/// is no edge.
#[test]
fn the_cycle_check_finds_circles_at_any_depth_and_only_those() {
    let clean = scratch_crate(&[
        ("lib.rs", "pub mod a;\npub mod b;\n"),
        (
            "a/mod.rs",
            "pub mod x;\npub mod y;\npub use x::X;\npub use self::y::*;\npub struct Shared;\nfn f() { x::X; y::Y; }\n",
        ),
        ("a/x.rs", "use super::Shared;\npub struct X;\n"),
        (
            "a/y.rs",
            "use super::{Shared, X};\npub struct Y;\n#[cfg(test)]\nmod tests { use super::*; use super::super::Shared; }\n",
        ),
        ("b.rs", "use crate::a::Y;\n"),
    ]);
    assert_eq!(cycles(clean.path()), Vec::<String>::new());

    // y uses X through the folder's re-export, and x uses y: a circle inside `a`.
    let reexported = scratch_crate(&[
        ("lib.rs", "pub mod a;\n"),
        (
            "a/mod.rs",
            "pub mod x;\npub mod y;\npub use x::X;\npub use y::*;\n",
        ),
        ("a/x.rs", "pub struct X;\nfn f() -> super::Y { todo!() }\n"),
        ("a/y.rs", "use super::X;\npub struct Y;\n"),
    ]);
    let found = cycles(reexported.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(
        found[0].starts_with("src/a: {x, y} import each other, e.g. x -> y"),
        "{found:?}"
    );

    // Three files deep, through `crate::` and `super::super::`, in a test module too.
    let deep = scratch_crate(&[
        ("lib.rs", "pub mod a;\n"),
        ("a/mod.rs", "pub mod b;\n"),
        ("a/b/mod.rs", "pub mod p;\npub mod q;\npub mod r;\n"),
        ("a/b/p.rs", "use crate::a::b::q::Q;\npub struct P;\n"),
        (
            "a/b/q.rs",
            "pub struct Q;\nfn f() { self::inner(); super::r::R; }\nfn inner() {}\n",
        ),
        (
            "a/b/r.rs",
            "pub struct R;\n#[cfg(test)]\nmod tests { fn t() { super::super::p::P; } }\n",
        ),
    ]);
    let found = cycles(deep.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert!(found[0].starts_with("src/a/b: {p, q, r}"), "{found:?}");
    for hop in ["p -> q", "q -> r", "r -> p"] {
        assert!(found[0].contains(hop), "{hop} in {found:?}");
    }

    // Between two sub-folders of the root, and with the lines that make it.
    let top = scratch_crate(&[
        ("lib.rs", "pub mod m;\npub mod n;\n"),
        ("m/mod.rs", "pub mod inner;\n"),
        ("m/inner.rs", "use crate::n::N;\npub struct M;\n"),
        ("n.rs", "pub struct N;\n\nfn f() { crate::m::inner::M; }\n"),
    ]);
    let found = cycles(top.path());
    assert_eq!(
        found,
        [
            "src: {m, n} import each other, e.g. m -> n (m/inner.rs:1), n -> m (n.rs:3)"
                .to_string()
        ]
    );

    // The folder rule: a child naming what its folder's mod.rs defines, at any depth, is an
    // arrow back up; a re-export of a sibling, test code and generated code are not.
    let up = scratch_crate(&[
        ("lib.rs", "pub mod a;\npub struct Root;\n"),
        (
            "a/mod.rs",
            "pub mod b;\npub mod s;\nmod tests;\npub use s::Shared;\npub struct Own;\n",
        ),
        ("a/s.rs", "pub struct Shared;\nfn f() { crate::Root; }\n"),
        ("a/tests.rs", "use super::Own;\n"),
        ("a/b/mod.rs", "pub mod c;\npub mod g;\n"),
        (
            "a/b/c.rs",
            "use super::super::Shared;\nfn f() { crate::a::Own; }\n#[cfg(test)]\nmod tests { use crate::a::Own; }\n",
        ),
        (
            "a/b/g.rs",
            "//! Generated by a script.\nuse crate::a::Own;\n",
        ),
    ]);
    assert_eq!(
        arrows_up(up.path()),
        ["src/a/b/c.rs:2 names what src/a/mod.rs defines".to_string()]
    );
    assert!(cycles(up.path()).is_empty());

    // Two separate circles in one folder are both reported.
    let two = scratch_crate(&[
        ("lib.rs", "pub mod a;\n"),
        (
            "a/mod.rs",
            "pub mod w;\npub mod x;\npub mod y;\npub mod z;\n",
        ),
        ("a/w.rs", "use super::x::X;\npub struct W;\n"),
        ("a/x.rs", "use super::w::W;\npub struct X;\n"),
        ("a/y.rs", "use super::z::Z;\npub struct Y;\n"),
        ("a/z.rs", "use super::y::Y;\npub struct Z;\n"),
    ]);
    let found = cycles(two.path());
    assert_eq!(found.len(), 2, "{found:?}");
    assert!(found[0].starts_with("src/a: {w, x}") && found[1].starts_with("src/a: {y, z}"));
}
