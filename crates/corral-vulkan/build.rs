//! Compiles every compute shader of `src/ops` (`*.comp`, beside the host half of its op;
//! `*.glsl` holds what they include) to SPIR-V with `glslc` (Debian's `glslc`,
//! or the one `$GLSLC` names) and generates the table of them. Without `glslc` the crate
//! still builds, with no shaders: opening the backend then says so. Shaders that multiply in
//! tiles (they include `tiles.glsl`) are compiled a second time with `COOPMAT` defined, as
//! `<name>_coopmat`, where the `glslc` knows `GL_KHR_cooperative_matrix` (Debian trixie's does;
//! bookworm's does not, and the backend then multiplies with its portable kernels alone).

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
    let coopmat = found && knows_cooperative_matrix(&glslc, &out);
    if found {
        if !coopmat {
            println!(
                "cargo::warning=this glslc lacks GL_KHR_cooperative_matrix: corral-vulkan is \
                 built without its cooperative-matrix kernels"
            );
        }
        for source in &sources {
            let name = source
                .file_stem()
                .expect("a shader name")
                .to_string_lossy()
                .into_owned();
            let text = std::fs::read_to_string(source).expect("read a shader");
            let tiled = text.contains("#include \"tiles.glsl\"");
            let variants: &[(&str, &[&str])] = if coopmat && tiled {
                &[("", &[]), ("_coopmat", &["-DCOOPMAT"])]
            } else {
                &[("", &[])]
            };
            for (suffix, defines) in variants {
                let spv = out.join(format!("{name}{suffix}.spv"));
                let status = Command::new(&glslc)
                    .args(["--target-env=vulkan1.3", "-O", "-Werror"])
                    .args(*defines)
                    .arg("-I")
                    .arg(dir)
                    .arg(source)
                    .arg("-o")
                    .arg(&spv)
                    .status()
                    .expect("run glslc");
                assert!(status.success(), "glslc failed on {}", source.display());
                let _ = writeln!(
                    table,
                    "    (\"{name}{suffix}\", include_bytes!({:?})),",
                    spv.display().to_string()
                );
            }
        }
    } else {
        println!("cargo::warning=no glslc: corral-vulkan is built without its shaders");
    }
    table.push_str("];\n");
    let _ = writeln!(
        table,
        "/// Whether the build compiled the shaders (it found `glslc`).\npub(crate) const SHADERS_BUILT: bool = {found};"
    );
    let _ = writeln!(
        table,
        "/// Whether the build compiled the cooperative-matrix variants (`<name>_coopmat`).\npub(crate) const COOPMAT_BUILT: bool = {coopmat};"
    );
    std::fs::write(out.join("shaders.rs"), table).expect("write shaders.rs");
}

/// Whether `glslc` compiles a shader that uses `GL_KHR_cooperative_matrix`.
fn knows_cooperative_matrix(glslc: &str, out: &Path) -> bool {
    let probe = out.join("coopmat_probe.comp");
    let source = "#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
layout(local_size_x = 32) in;
shared float16_t s[256];
void main() {
    coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> a;
    coopMatLoad(a, s, 0, 16, gl_CooperativeMatrixLayoutRowMajor);
}
";
    std::fs::write(&probe, source).expect("write the probe shader");
    Command::new(glslc)
        .args(["--target-env=vulkan1.3", "-o"])
        .arg(out.join("coopmat_probe.spv"))
        .arg(&probe)
        .output()
        .is_ok_and(|o| o.status.success())
}
