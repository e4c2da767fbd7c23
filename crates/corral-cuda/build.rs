//! Derives the table of plain kernels (each defined once at the top level of a kernel
//! source, not instantiated by a macro) from the sources themselves: a field a kernel, named
//! as the kernel, and the lookup that fills it. A new kernel needs no line in Rust to be
//! loaded; the macro-made families (one kernel per weight type, row count or head dim) are
//! gathered by hand in `kernels.rs`.

use std::fmt::Write as _;
use std::path::Path;

fn main() {
    let dir = Path::new("src/ops");
    println!("cargo::rerun-if-changed=src/ops");
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .expect("read src/ops")
        .map(|e| e.expect("a kernel source").path())
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .collect();
    files.sort();
    let mut kernels = Vec::new();
    for path in &files {
        let source = std::fs::read_to_string(path).expect("read a kernel source");
        for name in plain_kernels(&source) {
            let file = path.file_name().unwrap_or_default().to_string_lossy();
            kernels.push((name, file.into_owned()));
        }
    }
    let mut out = String::new();
    out.push_str(
        "/// Every plain kernel of the sources (derived by the build script), by its name.\n\
         #[derive(Debug)]\n\
         #[allow(dead_code)]\n\
         pub(crate) struct PlainKernels {\n",
    );
    for (name, file) in &kernels {
        let _ = writeln!(
            out,
            "    /// `{name}` of {file}.\n    pub(crate) {name}: Kernel,"
        );
    }
    out.push_str(
        "}\n\nimpl PlainKernels {\n    \
         /// Each kernel by `find`.\n    \
         pub(crate) fn find_all(find: &dyn Fn(&'static str) -> Result<Kernel>) -> Result<Self> {\n        \
         Ok(Self {\n",
    );
    for (name, _) in &kernels {
        let _ = writeln!(out, "            {name}: find(\"{name}\")?,");
    }
    out.push_str("        })\n    }\n}\n");
    let target = Path::new(&std::env::var("OUT_DIR").expect("OUT_DIR")).join("plain_kernels.rs");
    std::fs::write(target, out).expect("write plain_kernels.rs");
}

/// The names of the kernels defined at the start of a line (`extern "C" __global__ void`,
/// launch bounds allowed), which a macro's body (indented, continued lines) never is.
fn plain_kernels(source: &str) -> Vec<String> {
    const HEAD: &str = "extern \"C\" __global__ void";
    let mut names = Vec::new();
    for (at, _) in source.match_indices(HEAD) {
        if at > 0 && !source[..at].ends_with('\n') {
            continue;
        }
        let mut rest = source[at + HEAD.len()..].trim_start();
        if let Some(bounds) = rest.strip_prefix("__launch_bounds__") {
            let mut depth = 0usize;
            let mut end = bounds.len();
            for (i, c) in bounds.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            rest = bounds[end..].trim_start();
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        assert!(!name.is_empty(), "a kernel without a name near byte {at}");
        names.push(name);
    }
    names
}
