//! The compile cache of one sandbox: rerunning a program skips its compiler.
//!
//! An entry holds what the compiler left in the per-exec directory (the binary, Java's
//! class files), under the SHA-256 of the language, the source file name, the compiler
//! command with its flags and the code. Entries live in a private directory under the
//! temp dir (a tmpfs, never the workspace: the user does not see them and the harvest
//! does not collect them), die with the container, and are bounded in count and bytes,
//! least recently used going first.
//!
//! Only entries this runner stored are ever restored: a directory user code plants under
//! the cache's name is not in the index and is never read.

use sandbox_runner::Language;
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::io;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

/// Entries kept at most.
const MAX_ENTRIES: usize = 64;
/// Bytes kept at most, all entries together: the tmpfs is charged to the sandbox's memory.
const MAX_TOTAL_BYTES: u64 = 96 * 1024 * 1024;
/// A compile whose output is larger than this is not cached.
const MAX_ENTRY_BYTES: u64 = 48 * 1024 * 1024;

/// Whether `lang` compiles to something worth caching (the language table says).
pub fn caches(lang: Language) -> bool {
    lang.spec().cache_compile
}

/// The cache key of one compile: everything that decides what the compiler produces.
/// The compiler itself is fixed by the image, which a cache never outlives.
pub fn key(lang: Language, source: &str, compile: &[String], code: &str) -> String {
    let mut h = Sha256::new();
    h.update(b"codebroker compile cache 1\0");
    h.update(env!("CARGO_PKG_VERSION").as_bytes());
    h.update(b"\0");
    h.update(lang.as_str().as_bytes());
    h.update(b"\0");
    h.update(source.as_bytes());
    h.update(b"\0");
    for arg in compile {
        h.update((arg.len() as u64).to_le_bytes());
        h.update(arg.as_bytes());
    }
    h.update(b"\0");
    h.update(code.as_bytes());
    h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
}

/// One stored compile.
#[derive(Debug)]
struct Entry {
    /// Its size, for the byte bound.
    bytes: u64,
    /// When it was last stored or restored (a counter), for eviction.
    used: u64,
}

/// The cache: an index in memory over entry directories on the temp dir.
#[derive(Debug)]
pub struct CompileCache {
    /// The temp dir the cache directory is made in.
    tmp: PathBuf,
    /// The cache directory, once made.
    dir: Option<PathBuf>,
    /// The entries stored by this runner, by key.
    entries: HashMap<String, Entry>,
    /// Ticks on every use, ordering entries by recency.
    clock: u64,
}

impl CompileCache {
    /// An empty cache whose directory will be made under `tmp` when first needed.
    pub fn new(tmp: &Path) -> CompileCache {
        CompileCache {
            tmp: tmp.to_path_buf(),
            dir: None,
            entries: HashMap::new(),
            clock: 0,
        }
    }

    /// Copies the entry `key` into `dir`; `false` (a miss) if there is none or it cannot
    /// be copied whole.
    pub fn restore(&mut self, key: &str, dir: &Path) -> bool {
        let (Some(cache), true) = (&self.dir, self.entries.contains_key(key)) else {
            return false;
        };
        let entry_dir = cache.join(key);
        let copied = (|| -> io::Result<()> {
            for file in std::fs::read_dir(&entry_dir)? {
                let file = file?;
                if file.file_type()?.is_file() {
                    std::fs::copy(file.path(), dir.join(file.file_name()))?;
                }
            }
            Ok(())
        })();
        match copied {
            Ok(()) => {
                self.clock += 1;
                if let Some(e) = self.entries.get_mut(key) {
                    e.used = self.clock;
                }
                true
            }
            Err(_) => {
                // Removed or damaged (by user code, or a full tmpfs): forget it.
                self.forget(key);
                false
            }
        }
    }

    /// Stores what a successful compile left in `dir`, apart from the source file.
    /// Failures only mean the next run compiles again.
    pub fn store(&mut self, key: &str, dir: &Path, source: &str) {
        if self.entries.contains_key(key) {
            return;
        }
        let Ok(cache) = self.cache_dir() else {
            return;
        };
        let staging = cache.join(format!("{key}.partial"));
        let _ = std::fs::remove_dir_all(&staging);
        let stored = (|| -> io::Result<u64> {
            std::fs::DirBuilder::new().mode(0o700).create(&staging)?;
            let mut bytes = 0;
            for file in std::fs::read_dir(dir)? {
                let file = file?;
                let meta = file.metadata()?;
                if !file.file_type()?.is_file() || file.file_name() == source {
                    continue;
                }
                bytes += meta.len();
                if bytes > MAX_ENTRY_BYTES {
                    return Err(io::Error::other("too large to cache"));
                }
                std::fs::copy(file.path(), staging.join(file.file_name()))?;
            }
            std::fs::rename(&staging, cache.join(key))?;
            Ok(bytes)
        })();
        match stored {
            Ok(bytes) => {
                self.clock += 1;
                let used = self.clock;
                self.entries.insert(key.to_string(), Entry { bytes, used });
                self.evict();
            }
            Err(_) => {
                let _ = std::fs::remove_dir_all(&staging);
            }
        }
    }

    /// Number of entries stored.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.entries.len()
    }

    /// Drops least recently used entries until the cache is within its bounds.
    fn evict(&mut self) {
        loop {
            let total: u64 = self.entries.values().map(|e| e.bytes).sum();
            if self.entries.len() <= MAX_ENTRIES && total <= MAX_TOTAL_BYTES {
                return;
            }
            let Some(oldest) = self
                .entries
                .iter()
                .min_by_key(|(_, e)| e.used)
                .map(|(k, _)| k.clone())
            else {
                return;
            };
            self.forget(&oldest);
        }
    }

    fn forget(&mut self, key: &str) {
        self.entries.remove(key);
        if let Some(cache) = &self.dir {
            let _ = std::fs::remove_dir_all(cache.join(key));
        }
    }

    /// The cache directory, made on first use under a name nothing else holds (user code
    /// shares the temp dir and may have planted names).
    fn cache_dir(&mut self) -> io::Result<PathBuf> {
        if let Some(dir) = &self.dir {
            return Ok(dir.clone());
        }
        for n in 0..100u32 {
            let dir = self
                .tmp
                .join(format!(".compile-cache-{}-{n}", std::process::id()));
            match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
                Ok(()) => {
                    self.dir = Some(dir.clone());
                    return Ok(dir);
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(io::Error::other("no free name for the compile cache"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn the_key_covers_code_compiler_flags_and_language() {
        let cc = args(&["gcc", "-O2", "-o", "prog", "main.c"]);
        let k = key(Language::C, "main.c", &cc, "int main(){}");
        assert_eq!(k.len(), 64);
        assert_eq!(k, key(Language::C, "main.c", &cc, "int main(){}"));
        assert_ne!(k, key(Language::C, "main.c", &cc, "int main(){return 1;}"));
        assert_ne!(k, key(Language::Cpp, "main.c", &cc, "int main(){}"));
        let o0 = args(&["gcc", "-O0", "-o", "prog", "main.c"]);
        assert_ne!(k, key(Language::C, "main.c", &o0, "int main(){}"));
        // Arguments are delimited: ["ab", "c"] is not ["a", "bc"].
        assert_ne!(
            key(Language::C, "s", &args(&["ab", "c"]), ""),
            key(Language::C, "s", &args(&["a", "bc"]), "")
        );
        assert!(caches(Language::Java) && caches(Language::Rs) && !caches(Language::Py));
        assert!(!caches(Language::Bash) && !caches(Language::Ts));
    }

    #[test]
    fn stores_restores_and_evicts() {
        let tmp = tempdir("store");
        let exec = tmp.join("exec-1");
        std::fs::create_dir(&exec).unwrap();
        std::fs::write(exec.join("main.c"), "src").unwrap();
        std::fs::write(exec.join("prog"), "binary").unwrap();
        let mut cache = CompileCache::new(&tmp);
        assert!(!cache.restore("k1", &exec));
        cache.store("k1", &exec, "main.c");
        assert_eq!(cache.len(), 1);

        let again = tmp.join("exec-2");
        std::fs::create_dir(&again).unwrap();
        assert!(cache.restore("k1", &again));
        assert_eq!(std::fs::read(again.join("prog")).unwrap(), b"binary");
        assert!(!again.join("main.c").exists(), "the source is not cached");

        // A planted directory under a key the runner never stored is not read.
        let planted = cache.dir.clone().unwrap().join("k2");
        std::fs::create_dir(&planted).unwrap();
        std::fs::write(planted.join("prog"), "evil").unwrap();
        let third = tmp.join("exec-3");
        std::fs::create_dir(&third).unwrap();
        assert!(!cache.restore("k2", &third));
        assert!(!third.join("prog").exists());

        // Past the entry bound, the least recently used goes first.
        for i in 0..MAX_ENTRIES + 1 {
            cache.store(&format!("n{i}"), &exec, "main.c");
            if i == 2 {
                assert!(cache.restore("k1", &third), "k1 is now recent");
            }
        }
        assert_eq!(cache.len(), MAX_ENTRIES);
        assert!(cache.entries.contains_key("k1"));
        assert!(!cache.entries.contains_key("n0") && !cache.entries.contains_key("n1"));
        assert!(!cache.dir.clone().unwrap().join("n0").exists());
        let _ = std::fs::remove_dir_all(&tmp);
    }

    fn tempdir(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("compile-cache-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
