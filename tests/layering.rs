//! The crate's layering, as written in the README's "What is here": every `crate::` path in
//! `src/` is an edge from the top-level module that holds it to the top-level module it
//! names. An edge to a module of the same layer or of a higher one fails, and so does any
//! cycle, so a later change cannot bring an import loop back.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers from the README block between the two markers, top first.
fn layers() -> Vec<Vec<String>> {
    let readme = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("README.md"))
        .expect("README.md");
    let start = readme
        .find("<!-- layering -->")
        .expect("README has a <!-- layering --> block");
    let end = readme[start..]
        .find("<!-- /layering -->")
        .expect("the layering block is closed")
        + start;
    readme[start..end]
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- "))
        .map(|l| {
            l.split(['`', ',', ' '])
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

/// The source without comments or string and char literals, so a doc link or a message
/// that mentions `crate::x` is no edge.
fn code_only(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i..].starts_with(b"/*") {
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
        } else if b[i] == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) {
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
            while j < b.len() && !b[j..].starts_with(&close) {
                j += 1;
            }
            i = j + close.len();
            out.push_str("\"\"");
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                i += if b[i] == b'\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
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

fn ident_at(s: &str) -> &str {
    let end = s
        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .unwrap_or(s.len());
    &s[..end]
}

/// Top-level modules named after `crate::`, including each member of a `crate::{a, b::c}`
/// group.
fn targets(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut rest = code;
    while let Some(k) = rest.find("crate::") {
        rest = &rest[k + "crate::".len()..];
        let s = rest.trim_start();
        if let Some(group) = s.strip_prefix('{') {
            let mut depth = 1;
            let mut item_start = true;
            for (i, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => item_start = true,
                    c if item_start && depth == 1 && !c.is_whitespace() => {
                        out.insert(ident_at(&group[i..]).to_string());
                        item_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            out.insert(ident_at(s).to_string());
        }
    }
    out.retain(|m| !m.is_empty() && m != "self");
    out
}

/// Edges between top-level modules, with the file each comes from.
fn edges() -> BTreeMap<(String, String), PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut edges = BTreeMap::new();
    for f in files {
        let rel = f.strip_prefix(&src).expect("under src");
        let first = rel.components().next().expect("a path");
        let from = first
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if from == "lib" || from == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&f).expect("readable source");
        for to in targets(&code_only(&text)) {
            if to != from {
                edges
                    .entry((from.clone(), to))
                    .or_insert_with(|| rel.to_path_buf());
            }
        }
    }
    edges
}

#[test]
fn every_import_points_down_the_written_layering() {
    let layers = layers();
    assert!(layers.len() >= 3, "the README's layering block: {layers:?}");
    let rank: BTreeMap<&str, usize> = layers
        .iter()
        .enumerate()
        .flat_map(|(i, l)| l.iter().map(move |m| (m.as_str(), i)))
        .collect();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = BTreeSet::new();
    for e in std::fs::read_dir(&src).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().to_string();
        let m = name.trim_end_matches(".rs").to_string();
        if m != "lib" && m != "main" {
            modules.insert(m);
        }
    }
    let unplaced: Vec<_> = modules
        .iter()
        .filter(|m| !rank.contains_key(m.as_str()))
        .collect();
    assert!(
        unplaced.is_empty(),
        "modules missing from the README's layering: {unplaced:?}"
    );
    let edges = edges();
    assert!(
        edges.contains_key(&("stages".to_string(), "bus".to_string())),
        "the edge reader found no stages -> bus import: {:?}",
        edges.keys().collect::<Vec<_>>()
    );
    let mut wrong = Vec::new();
    for ((from, to), file) in edges {
        let (Some(&a), Some(&b)) = (rank.get(from.as_str()), rank.get(to.as_str())) else {
            continue; // `crate::` followed by an item of lib.rs (a macro), not a module
        };
        if b <= a {
            wrong.push(format!(
                "src/{} imports `{to}` (layer {b}) from `{from}` (layer {a})",
                file.display()
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "imports against the layering (a module imports only from layers below its own):\n{}",
        wrong.join("\n")
    );
}

#[test]
fn the_module_graph_has_no_cycle() {
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (from, to) in edges().into_keys() {
        graph.entry(from).or_default().insert(to);
    }
    // Depth-first search with colours; report the first cycle found.
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
    for n in graph.keys() {
        if let Some(c) = visit(n, &graph, &mut state, &mut Vec::new()) {
            panic!("import cycle: {}", c.join(" -> "));
        }
    }
}

#[test]
fn the_edge_reader_sees_groups_and_skips_comments() {
    let code = code_only(
        "use crate::{bus::{A, B}, model, schema::X};\n// crate::commands\nlet s = \"crate::cli\";\nfn f() { crate::metrics::x(); }",
    );
    let t: Vec<_> = targets(&code).into_iter().collect();
    assert_eq!(t, ["bus", "metrics", "model", "schema"]);
}
