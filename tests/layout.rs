//! The shape of the code, as the book describes it: no two modules of a crate refer to each
//! other (a folder and a file in it included), no files or folders import each other in a
//! loop of any length, no library function is over 100 lines, idem-core names no database,
//! every inbox transaction ends in one place, and the files of the book's delivery path exist.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const CRATES: [&str; 7] = [
    "idem-core",
    "idem-sqlx",
    "idem-rabbitmq",
    "idem-nats",
    "idem-macros",
    "idem-http",
    "idem-cli",
];

/// Every module file of a crate's `src/`, by module path (`["pipeline", "batch"]`).
fn modules(src: &Path) -> BTreeMap<Vec<String>, PathBuf> {
    let mut found = BTreeMap::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let relative = path.strip_prefix(src).unwrap().with_extension("");
            let mut module: Vec<String> = relative
                .components()
                .map(|c| c.as_os_str().to_string_lossy().into_owned())
                .collect();
            if matches!(
                module.last().map(String::as_str),
                Some("mod" | "lib" | "main")
            ) {
                module.pop();
            }
            found.insert(module, path);
        }
    }
    found
}

/// The code of a file without its comments.
fn code(path: &Path) -> String {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|line| line.split("//").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every path of `code` with at least two segments (`crate::a::B`, `super::x`, `child::f`,
/// `std::time`), grouped imports expanded.
fn paths(code: &str) -> BTreeSet<Vec<String>> {
    let chars: Vec<char> = code.chars().collect();
    let word = |c: char| c.is_alphanumeric() || c == '_';
    let ident_at = |i: usize| -> usize {
        let mut end = i;
        while end < chars.len() && word(chars[end]) {
            end += 1;
        }
        end
    };
    let mut found = BTreeSet::new();
    let mut i = 0;
    while i < chars.len() {
        let starts_path = word(chars[i])
            && !chars[i].is_ascii_digit()
            && (i == 0 || !(word(chars[i - 1]) || chars[i - 1] == ':'));
        if !starts_path {
            i += 1;
            continue;
        }
        let mut segments = Vec::new();
        loop {
            let end = ident_at(i);
            segments.push(chars[i..end].iter().collect::<String>());
            i = end;
            if chars.get(i) != Some(&':') || chars.get(i + 1) != Some(&':') {
                break;
            }
            i += 2;
            if chars.get(i) == Some(&'{') {
                let close = (i..chars.len())
                    .find(|&j| chars[j] == '}')
                    .unwrap_or(chars.len());
                let group: String = chars[i + 1..close].iter().collect();
                for item in group.split(',') {
                    let item = item.split(" as ").next().unwrap_or("").trim();
                    let mut path = segments.clone();
                    path.extend(
                        item.split("::")
                            .filter(|s| !s.is_empty())
                            .map(str::to_owned),
                    );
                    found.insert(path);
                }
                i = close;
                break;
            }
            if !chars.get(i).is_some_and(|&c| word(c)) {
                break;
            }
        }
        if segments.len() > 1 {
            found.insert(segments);
        }
    }
    found
}

/// The module a path in module `from` refers to: the longest prefix of it that is a module
/// other than `from` (a relative path counts only through a child module of `from`).
fn target(
    from: &[String],
    path: &[String],
    modules: &BTreeMap<Vec<String>, PathBuf>,
) -> Option<Vec<String>> {
    let parent = from[..from.len().saturating_sub(1)].to_vec();
    let (mut base, mut rest, absolute) = match path[0].as_str() {
        "crate" => (Vec::new(), &path[1..], true),
        "self" => (from.to_vec(), &path[1..], true),
        "super" => (parent, &path[1..], true),
        _ => (from.to_vec(), path, false),
    };
    while rest.first().is_some_and(|s| s == "super") {
        base.pop();
        rest = &rest[1..];
    }
    let mut best = (absolute && modules.contains_key(&base)).then(|| base.clone());
    for segment in rest {
        base.push(segment.clone());
        if modules.contains_key(&base) {
            best = Some(base.clone());
        } else {
            break;
        }
    }
    best.filter(|t| !t.is_empty() && t != from)
}

#[test]
fn no_two_modules_refer_to_each_other() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut cycles = Vec::new();
    for krate in CRATES {
        let modules = modules(&root.join(krate).join("src"));
        let mut edges: BTreeMap<&Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (module, file) in &modules {
            for path in paths(&code(file)) {
                if let Some(target) = target(module, &path, &modules) {
                    edges.entry(module).or_default().insert(target);
                }
            }
        }
        for (a, targets) in &edges {
            for b in targets {
                if *a < b && edges.get(b).is_some_and(|back| back.contains(*a)) {
                    cycles.push(format!(
                        "{} <-> {}",
                        modules[*a].display(),
                        modules[b].display()
                    ));
                }
            }
        }
        assert!(modules.len() > 3, "{krate}: no modules found");
    }
    assert!(
        cycles.is_empty(),
        "modules that refer to each other:\n{}",
        cycles.join("\n")
    );
}

#[test]
fn the_cycle_check_sees_a_cycle() {
    let module = |path: &[&str]| path.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    let modules: BTreeMap<Vec<String>, PathBuf> = [
        module(&[]),
        module(&["a"]),
        module(&["a", "c"]),
        module(&["b"]),
    ]
    .into_iter()
    .map(|m| (m, PathBuf::new()))
    .collect();
    let refers = |from: &[&str], code: &str| -> BTreeSet<Vec<String>> {
        paths(code)
            .iter()
            .filter_map(|p| target(&module(from), p, &modules))
            .collect()
    };
    assert_eq!(
        refers(
            &["a", "c"],
            "use crate::b::{Thing, other::Deep};\nfn f() { super::super::b::g() }"
        ),
        BTreeSet::from([module(&["b"])])
    );
    assert_eq!(
        refers(&["a", "c"], "use super::X;"),
        BTreeSet::from([module(&["a"])])
    );
    assert_eq!(
        refers(&["a"], "use c::Y; use std::fmt;"),
        BTreeSet::from([module(&["a", "c"])])
    );
}

#[test]
fn idem_core_names_no_database() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("idem-core/src");
    for file in modules(&root).values() {
        let code = code(file);
        let code = code.split("#[cfg(test)]").next().unwrap_or("");
        for name in [
            "Postgres", "Sqlite", "SQLite", "MySql", "MySQL", "MariaDB", "SQLSTATE",
        ] {
            assert!(!code.contains(name), "{} names {name}", file.display());
        }
    }
}

/// Every inbox transaction of idem-core and idem-http ends in one place, `end_transaction`
/// (`idem-core/src/store/inbox.rs`): no other library code commits or rolls one back.
#[test]
fn inbox_transactions_end_in_one_place() {
    let owner = Path::new("idem-core/src/store/inbox.rs");
    let mut ends = Vec::new();
    for krate in ["idem-core", "idem-http"] {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join(krate)
            .join("src");
        for file in modules(&root).values() {
            let code = code(file);
            let code = code.split("#[cfg(test)]").next().unwrap_or("");
            for (n, line) in code.lines().enumerate() {
                if line.contains(".commit(") || line.contains(".rollback(") {
                    ends.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
                }
            }
        }
    }
    let elsewhere: Vec<&String> = ends
        .iter()
        .filter(|end| !end.contains(owner.to_str().unwrap()))
        .collect();
    assert!(
        elsewhere.is_empty(),
        "transactions ended outside end_transaction:\n{elsewhere:#?}"
    );
    assert_eq!(
        ends.len(),
        2,
        "end_transaction commits once and rolls back once: {ends:#?}"
    );
}

#[test]
fn the_books_delivery_path_is_six_files_that_exist() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let chapter = std::fs::read_to_string(root.join("docs/src/guarantee.md")).unwrap();
    let section = chapter
        .split("One delivery, from the broker to its ack, passes through six files:")
        .nth(1)
        .expect("the book's delivery path");
    let rows: Vec<&str> = section
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .filter(|l| l.starts_with("| ") && l.chars().nth(2).is_some_and(|c| c.is_ascii_digit()))
        .collect();
    assert_eq!(rows.len(), 6, "{rows:#?}");
    for row in rows {
        let file = row.split('`').nth(1).unwrap();
        assert!(root.join(file).is_file(), "{file} does not exist");
    }
}

/// The README's quick start is the crate CI builds on its own (`tests/quickstart`), unchanged.
#[test]
fn the_quick_start_crate_is_the_readme_block() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let from = readme
        .find("A handler and its runtime, with the default features")
        .expect("the quick start's heading");
    let start = readme[from..].find("```rust,no_run\n").unwrap() + from + "```rust,no_run\n".len();
    let end = readme[start..].find("```\n").unwrap() + start;
    let crate_main = std::fs::read_to_string(root.join("tests/quickstart/src/main.rs")).unwrap();
    assert_eq!(
        crate_main,
        &readme[start..end],
        "tests/quickstart/src/main.rs must be the README's quick start block"
    );
}

/// The items of `trait` in `source`: `(name, required)` for each method, associated type and
/// constant, `required` when it has no default.
fn trait_items(source: &str, name: &str) -> Vec<(String, bool)> {
    let start = source
        .find(&format!("pub trait {name}"))
        .unwrap_or_else(|| panic!("trait {name}"));
    let body = &source[start..];
    let end = body.find("\n}\n").unwrap();
    let mut items = Vec::new();
    for (i, line) in body[..end].lines().enumerate() {
        let item = line.strip_prefix("    ").unwrap_or("");
        let Some(rest) = ["fn ", "type ", "const "]
            .iter()
            .find_map(|kw| item.strip_prefix(kw))
        else {
            continue;
        };
        let ident: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        // Required: the item ends with `;` before any body opens.
        let after: String = body[..end].lines().skip(i).collect::<Vec<_>>().join("\n");
        let required = match item.starts_with("const ") {
            true => !item.contains(" = "),
            false => after.find(';').unwrap_or(usize::MAX) < after.find('{').unwrap_or(usize::MAX),
        };
        items.push((ident, required));
    }
    items
}

/// The "Adding a store" chapter against the store contract: its table has a row for each role
/// `RuntimeStore` is made of, no role has a required item, and the chapter names every
/// required item of `InboxStore`; so a newcomer who follows it implements what is asked.
#[test]
fn the_adding_a_store_chapter_matches_the_store_contract() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let chapter = std::fs::read_to_string(root.join("docs/src/adding-a-store.md")).unwrap();
    let inbox = std::fs::read_to_string(root.join("idem-core/src/store/inbox.rs")).unwrap();
    let roles = std::fs::read_to_string(root.join("idem-core/src/store/roles.rs")).unwrap();

    let runtime_store = roles
        .split("pub trait RuntimeStore:")
        .nth(1)
        .and_then(|rest| rest.split('{').next())
        .expect("RuntimeStore");
    let parts: Vec<&str> = runtime_store.split('+').map(str::trim).collect();
    assert_eq!(parts.len(), 6, "{parts:?}");
    let rows: Vec<&str> = chapter.lines().filter(|l| l.starts_with("| `")).collect();
    let tabled: Vec<&str> = rows.iter().map(|r| r.split('`').nth(1).unwrap()).collect();
    assert_eq!(
        tabled, parts,
        "the chapter's table against RuntimeStore's roles"
    );

    for role in &parts[1..] {
        let required: Vec<_> = trait_items(&roles, role)
            .into_iter()
            .filter(|(_, required)| *required)
            .collect();
        assert!(
            required.is_empty(),
            "{role} requires {required:?}: the chapter says it has defaults"
        );
    }
    let required: Vec<String> = trait_items(&inbox, "InboxStore")
        .into_iter()
        .filter_map(|(name, required)| required.then_some(name))
        .collect();
    for name in [
        "Tx",
        "Held",
        "KIND",
        "begin",
        "claim",
        "commit",
        "savepoint",
    ] {
        assert!(
            required.contains(&name.to_owned()),
            "{name} missing from {required:?}"
        );
    }
    for name in &required {
        assert!(
            chapter.contains(&format!("`{name}`")) || chapter.contains(&format!("`type {name}")),
            "the chapter does not name InboxStore's required `{name}`"
        );
    }
}

/// The "Adding a transport" chapter against the transport contract: it names every item of
/// `Transport`, `Settle`, `Outbound` and `DeadLetterReader`, and marks as optional exactly those
/// with a default.
#[test]
fn the_adding_a_transport_chapter_matches_the_transport_contract() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let chapter = std::fs::read_to_string(root.join("docs/src/adding-a-transport.md")).unwrap();
    let contract =
        std::fs::read_to_string(root.join("idem-core/src/transport/contract.rs")).unwrap();
    let outbound =
        std::fs::read_to_string(root.join("idem-core/src/transport/outbound.rs")).unwrap();
    let dead_letters =
        std::fs::read_to_string(root.join("idem-core/src/transport/dead_letters.rs")).unwrap();
    let mut named = 0;
    for (source, name) in [
        (&contract, "Transport"),
        (&contract, "Settle"),
        (&outbound, "Outbound"),
        (&dead_letters, "DeadLetterReader"),
    ] {
        assert!(
            chapter.contains(&format!("**`{name}`**")),
            "no section for {name}"
        );
        for (item, required) in trait_items(source, name) {
            let row = chapter
                .lines()
                .find(|l| l.starts_with(&format!("| `{item}` |")))
                .unwrap_or_else(|| panic!("the chapter has no row for {name}::{item}"));
            assert_eq!(
                !row.contains("| optional"),
                required,
                "{name}::{item}: the chapter's row says the opposite of the code: {row}"
            );
            named += 1;
        }
    }
    assert!(named >= 20, "{named} items");
}

/// Loops of any length among the modules of each crate, where a folder's modules count as the
/// folder: for an import from `a::x` to `b::y`, the edge is between the children of their
/// common folder (`a` and `b` at the root; `p` and `q` for `f::p::x` and `f::q`). Any strongly
/// connected set of siblings is a loop of files or folders.
#[test]
fn no_files_or_folders_import_each_other_in_a_loop() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut loops = Vec::new();
    for krate in CRATES {
        let modules = modules(&root.join(krate).join("src"));
        let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (module, file) in &modules {
            for path in paths(&code(file)) {
                if let Some(target) = target(module, &path, &modules)
                    && let Some((a, b)) = siblings(module, &target)
                {
                    edges.entry(a).or_default().insert(b);
                }
            }
        }
        for component in strongly_connected(&edges) {
            let within: Vec<String> = component
                .iter()
                .flat_map(|a| {
                    edges[a]
                        .iter()
                        .filter(|b| component.contains(b))
                        .map(move |b| format!("{} -> {}", a.join("::"), b.join("::")))
                })
                .collect();
            loops.push(format!("{krate}: {}", within.join(", ")));
        }
    }
    assert!(loops.is_empty(), "import loops:\n{}", loops.join("\n"));
}

/// The children of `from`'s and `to`'s common folder that hold them, when they differ and
/// neither holds the other.
fn siblings(from: &[String], to: &[String]) -> Option<(Vec<String>, Vec<String>)> {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    if common >= from.len() || common >= to.len() {
        return None; // one holds the other: a parent and its child
    }
    Some((from[..=common].to_vec(), to[..=common].to_vec()))
}

/// The strongly connected components of more than one node (Tarjan's algorithm).
fn strongly_connected(
    edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
) -> Vec<Vec<Vec<String>>> {
    #[derive(Default)]
    struct State<'a> {
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on_stack: BTreeSet<&'a Vec<String>>,
        found: Vec<Vec<Vec<String>>>,
    }
    fn visit<'a>(
        node: &'a Vec<String>,
        edges: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        state: &mut State<'a>,
    ) {
        let n = state.index.len();
        state.index.insert(node, n);
        state.low.insert(node, n);
        state.stack.push(node);
        state.on_stack.insert(node);
        for next in edges.get(node).into_iter().flatten() {
            if !state.index.contains_key(next) {
                visit(next, edges, state);
                let low = state.low[node].min(state.low[next]);
                state.low.insert(node, low);
            } else if state.on_stack.contains(next) {
                let low = state.low[node].min(state.index[next]);
                state.low.insert(node, low);
            }
        }
        if state.low[node] == state.index[node] {
            let mut component = Vec::new();
            while let Some(member) = state.stack.pop() {
                state.on_stack.remove(member);
                component.push(member.clone());
                if member == node {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                state.found.push(component);
            }
        }
    }
    let mut state = State::default();
    let nodes: BTreeSet<&Vec<String>> = edges
        .iter()
        .flat_map(|(from, to)| std::iter::once(from).chain(to))
        .collect();
    for node in nodes {
        if !state.index.contains_key(node) {
            visit(node, edges, &mut state);
        }
    }
    state.found
}

#[test]
fn the_loop_check_sees_a_loop_of_three_and_no_loop_in_a_chain() {
    let node = |name: &str| vec![name.to_owned()];
    let graph = |edges: &[(&str, &str)]| {
        let mut graph: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
        for (a, b) in edges {
            graph.entry(node(a)).or_default().insert(node(b));
        }
        graph
    };
    assert_eq!(
        strongly_connected(&graph(&[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")])),
        vec![vec![node("a"), node("b"), node("c")]]
    );
    assert!(strongly_connected(&graph(&[("a", "b"), ("b", "c"), ("a", "c")])).is_empty());
    assert_eq!(
        siblings(
            &["f".into(), "p".into(), "x".into()],
            &["f".into(), "q".into()]
        ),
        Some((vec!["f".into(), "p".into()], vec!["f".into(), "q".into()]))
    );
    assert_eq!(siblings(&["f".into(), "p".into()], &["f".into()]), None);
}

/// Every library function's length in lines, from its `fn` line to its closing brace (test
/// modules left out): `(lines, file, line, name)`.
fn function_lengths(file: &Path) -> Vec<(usize, String, usize, String)> {
    let text = std::fs::read_to_string(file).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let mut found = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let line = lines[i];
        let indent = line.len() - line.trim_start().len();
        let closing = format!("{}}}", " ".repeat(indent));
        let trimmed = line.trim_start();
        if trimmed.starts_with("mod tests {") {
            // Past the test module.
            i += lines[i..]
                .iter()
                .position(|l| *l == closing)
                .unwrap_or(lines.len() - i);
            continue;
        }
        let signature = ["pub(crate) ", "pub(super) ", "pub ", ""]
            .iter()
            .find_map(|vis| trimmed.strip_prefix(vis))
            .map(|rest| {
                rest.trim_start_matches("async ")
                    .trim_start_matches("const ")
            });
        if let Some(rest) = signature.and_then(|s| s.strip_prefix("fn ")) {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            // A declaration without a body (a trait's required method) ends at its `;`
            // before any `{`.
            let opens = lines[i..]
                .iter()
                .position(|l| l.contains('{') || l.trim_end().ends_with(';'));
            let has_body = opens.is_some_and(|at| lines[i + at].contains('{'));
            let end = lines[i..].iter().position(|l| *l == closing);
            if let (true, Some(end)) = (has_body, end) {
                found.push((end + 1, file.display().to_string(), i + 1, name));
            }
        }
        i += 1;
    }
    found
}

/// No library function is longer than 100 lines: a long one is split into steps named for
/// what they do.
#[test]
fn no_library_function_is_longer_than_100_lines() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut long = Vec::new();
    for krate in CRATES.iter().copied().chain(["."]) {
        for file in modules(&root.join(krate).join("src")).values() {
            for (lines, file, line, name) in function_lengths(file) {
                if lines > 100 {
                    long.push(format!("{file}:{line} {name}: {lines} lines"));
                }
            }
        }
    }
    assert!(
        long.is_empty(),
        "functions over 100 lines:\n{}",
        long.join("\n")
    );
}

#[test]
fn the_length_check_measures_a_function() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f.rs");
    let body = "    let x = 1;\n".repeat(101);
    std::fs::write(
        &file,
        format!(
            "trait T {{\n    fn required(&self);\n}}\n\npub(crate) async fn long() {{\n{body}}}\n\n#[cfg(test)]\nmod tests {{\n    fn ignored() {{\n{body}    }}\n}}\n"
        ),
    )
    .unwrap();
    let found = function_lengths(&file);
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!((found[0].0, found[0].3.as_str()), (103, "long"));
}
