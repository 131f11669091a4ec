//! What the fuzz targets share: the readers that only take a path get the input through a
//! file in a per-process scratch directory.

use std::path::PathBuf;
use std::sync::OnceLock;

/// A scratch directory of this process, made once: under `$LEAP_FUZZ_SCRATCH` (`make fuzz`
/// sets it and removes it afterwards), else under `/dev/shm` (no disk writes for each of
/// millions of inputs) or the temporary directory.
fn scratch_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = std::path::Path::new("/dev/shm");
        let base = match std::env::var_os("LEAP_FUZZ_SCRATCH") {
            Some(d) => PathBuf::from(d),
            None if shm.is_dir() => shm.to_path_buf(),
            None => std::env::temp_dir(),
        };
        let dir = base.join(format!("leap-fuzz-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("creating the fuzz scratch directory");
        dir
    })
}

/// `data` written to the scratch file `name` (overwritten by the next input); its path.
pub fn scratch(name: &str, data: &[u8]) -> PathBuf {
    let path = scratch_dir().join(name);
    std::fs::write(&path, data).expect("writing a fuzz input");
    path
}

/// The path of the scratch file `name` (not written).
pub fn scratch_path(name: &str) -> PathBuf {
    scratch_dir().join(name)
}
