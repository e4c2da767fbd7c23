//! Compiles every compute shader of `src/ops` (`*.comp`, beside the host half of its op;
//! `*.glsl` holds what they include) to SPIR-V with `glslc` (Debian's `glslc`,
//! or the one `$GLSLC` names) and generates the table of them. Without `glslc` the crate
//! still builds, with no shaders: opening the backend then says so.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let dir = Path::new("src/ops");
    println!("cargo::rerun-if-changed=src/ops");
    println!("cargo::rerun-if-env-changed=GLSLC");
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let glslc = std::env::var("GLSLC").unwrap_or_else(|_| "glslc".to_string());
    let found = Command::new(&glslc)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success());
    let mut sources: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read src/ops")
        .map(|e| e.expect("a shader").path())
        .filter(|p| p.extension().is_some_and(|e| e == "comp"))
        .collect();
    sources.sort();
    let mut table = String::from(
        "/// Every compute shader of `src/ops`, by name, as SPIR-V (none where the build had\n\
         /// no `glslc`).\npub(crate) const SHADERS: &[(&str, &[u8])] = &[\n",
    );
    if found {
        for source in &sources {
            let name = source
                .file_stem()
                .expect("a shader name")
                .to_string_lossy()
                .into_owned();
            let spv = out.join(format!("{name}.spv"));
            let status = Command::new(&glslc)
                .args(["--target-env=vulkan1.3", "-O", "-Werror", "-I"])
                .arg(dir)
                .arg(source)
                .arg("-o")
                .arg(&spv)
                .status()
                .expect("run glslc");
            assert!(status.success(), "glslc failed on {}", source.display());
            let _ = writeln!(
                table,
                "    ({name:?}, include_bytes!({:?})),",
                spv.display().to_string()
            );
        }
    } else {
        println!("cargo::warning=no glslc: corral-vulkan is built without its shaders");
    }
    table.push_str("];\n");
    let _ = writeln!(
        table,
        "/// Whether the build compiled the shaders (it found `glslc`).\npub(crate) const SHADERS_BUILT: bool = {found};"
    );
    std::fs::write(out.join("shaders.rs"), table).expect("write shaders.rs");
}
