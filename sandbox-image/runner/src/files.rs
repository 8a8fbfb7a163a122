//! Moving workspace files over the channel, for a broker that cannot (or is told not to)
//! see the sandbox's disk: the runner lists `/mnt/data`, sends a file's bytes in bounded
//! chunks, writes files the broker sends and removes files. The rules of what a listing
//! holds are here, so that both ends apply the same ones; the broker checks every name
//! the runner reports against them, as it trusts nothing a sandbox says.

use serde::{Deserialize, Serialize};

/// Directories whose contents are never reported as generated files.
pub const HARVEST_SKIPPED_DIRS: &[&str] = &[
    "__pycache__",
    "node_modules",
    ".venv",
    "venv",
    ".cache",
    ".git",
    ".ipython",
    ".local",
    ".config",
    ".npm",
    ".matplotlib",
];

/// How deep a listing walks below the workspace (directories entered).
pub const HARVEST_MAX_DEPTH: usize = 16;

/// How many directory entries a listing looks at, so that a sandbox that creates millions
/// of files cannot stall the broker.
pub const HARVEST_MAX_ENTRIES: usize = 20_000;

/// Longest file name (path below the workspace) either end accepts, in bytes.
pub const MAX_NAME_BYTES: usize = 1024;

/// Longest component of a name, in bytes (the kernel's own limit).
pub const MAX_COMPONENT_BYTES: usize = 255;

/// Most file bytes in one [`FileChunk`] or [`WriteFileRequest`]: with base64 and JSON
/// around them well within a frame.
pub const MAX_CHUNK_BYTES: u32 = 4 * 1024 * 1024;

/// Whether `name` is a plain relative path below the workspace: not empty, not absolute,
/// no NUL, no empty, `.` or `..` component, within the length caps. Names either end
/// sends are checked with it before anything is done with them.
pub fn is_plain_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.contains('\0')
        && name.split('/').all(|part| {
            !part.is_empty() && part != "." && part != ".." && part.len() <= MAX_COMPONENT_BYTES
        })
}

/// Whether a listing may report `name`: a plain name no deeper than the walk goes, with
/// no hidden component and none of the skipped directories on its way.
pub fn is_listed_name(name: &str) -> bool {
    is_plain_name(name)
        && name.split('/').count() <= HARVEST_MAX_DEPTH + 1
        && name
            .split('/')
            .all(|part| !part.starts_with('.') && !HARVEST_SKIPPED_DIRS.contains(&part))
}

/// What a cheap look at a file tells (see the broker's `Stamp`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileStamp {
    /// Inode number.
    pub ino: u64,
    /// Size in bytes.
    pub size: u64,
    /// Change time, seconds.
    pub ctime: i64,
    /// Nanoseconds part of the change time.
    pub ctime_nsec: i64,
}

/// List the regular files of the workspace, as the harvest sees them: hidden entries and
/// [`HARVEST_SKIPPED_DIRS`] left out, symlinks and special files too, never followed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ListFilesRequest {
    /// Also hash files of at most this many bytes (0: no hashes).
    #[serde(default)]
    pub hash_up_to: u64,
}

/// The regular files of the workspace.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FileList {
    /// Each file, in no particular order.
    pub files: Vec<ListedFile>,
    /// The walk stopped at [`HARVEST_MAX_ENTRIES`] entries (or a byte cap on the frame).
    pub truncated: bool,
}

/// One regular file of the workspace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ListedFile {
    /// Path below the workspace, `/`-separated.
    pub name: String,
    /// What `lstat` said about it.
    pub stamp: FileStamp,
    /// SHA-256 of its content, hex, when asked for and it is small enough.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// Send up to `len` bytes of the file `name` from `offset`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadFileRequest {
    /// Path below the workspace; a symlink anywhere on it is refused.
    pub name: String,
    /// Where to start reading.
    pub offset: u64,
    /// How many bytes at most (capped at [`MAX_CHUNK_BYTES`]).
    pub len: u32,
}

/// A piece of a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileChunk {
    /// The bytes from the requested offset.
    #[serde(with = "base64")]
    pub data: Vec<u8>,
    /// The file's size when this piece was read.
    pub size: u64,
    /// Nothing follows this piece.
    pub eof: bool,
}

/// Write `data` into the file `name` at `offset`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WriteFileRequest {
    /// Path below the workspace; directories on the way are made, a symlink anywhere on
    /// it is refused.
    pub name: String,
    /// Where the bytes go.
    pub offset: u64,
    /// The bytes (at most [`MAX_CHUNK_BYTES`]).
    #[serde(with = "base64")]
    pub data: Vec<u8>,
    /// The first piece: whatever is at `name` (not a directory) is replaced by a new file.
    pub create: bool,
    /// Make the file read-only (mode 0444) once written.
    #[serde(default)]
    pub read_only: bool,
}

/// A piece was written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileWritten {
    /// The file as it is now, so the next harvest sees it unchanged.
    pub stamp: FileStamp,
}

/// Remove the file `name` if it is still the version `stamp` describes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RemoveFileRequest {
    /// Path below the workspace.
    pub name: String,
    /// Inode and change time it must still have (its size is not compared).
    pub stamp: FileStamp,
}

/// Whether a file was removed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileRemoved {
    /// False when it was changed, replaced or gone.
    pub removed: bool,
}

/// Bytes as standard base64 in JSON: a quarter larger rather than the four times of a
/// number array.
pub mod base64 {
    use serde::{Deserialize, Deserializer, Serializer};

    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

    /// `bytes` as base64 with padding.
    pub fn encode(bytes: &[u8]) -> String {
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let b = [
                chunk[0],
                chunk.get(1).copied().unwrap_or(0),
                chunk.get(2).copied().unwrap_or(0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..4 {
                if i <= chunk.len() {
                    out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
                } else {
                    out.push('=');
                }
            }
        }
        out
    }

    /// The bytes of padded base64 text; `None` when it is not that.
    pub fn decode(text: &str) -> Option<Vec<u8>> {
        let text = text.as_bytes();
        if text.len() % 4 != 0 {
            return None;
        }
        let value = |c: u8| -> Option<u32> {
            Some(match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                _ => return None,
            } as u32)
        };
        let mut out = Vec::with_capacity(text.len() / 4 * 3);
        let quads = text.len() / 4;
        for (i, quad) in text.chunks(4).enumerate() {
            let pad = if i + 1 == quads {
                quad.iter().rev().take_while(|&&c| c == b'=').count()
            } else {
                0
            };
            if pad > 2 {
                return None;
            }
            let mut n = 0u32;
            for &c in &quad[..4 - pad] {
                n = (n << 6) | value(c)?;
            }
            n <<= 6 * pad as u32;
            let bytes = [(n >> 16) as u8, (n >> 8) as u8, n as u8];
            out.extend_from_slice(&bytes[..3 - pad]);
        }
        Some(out)
    }

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&encode(bytes))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        decode(&text).ok_or_else(|| serde::de::Error::custom("not base64"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for n in 0..10 {
            let bytes: Vec<u8> = (0..n).map(|i| (i * 37 + 200) as u8).collect();
            assert_eq!(base64::decode(&base64::encode(&bytes)), Some(bytes));
        }
        assert_eq!(base64::encode(b"foobar"), "Zm9vYmFy");
        assert_eq!(base64::encode(b"fo"), "Zm8=");
        assert_eq!(base64::decode("Zm8="), Some(b"fo".to_vec()));
        assert_eq!(base64::decode("Zm8"), None);
        assert_eq!(base64::decode("Zm=8"), None);
        assert_eq!(base64::decode("Z==="), None);
        assert_eq!(base64::decode("Zm9v!mFy"), None);
    }

    #[test]
    fn names_are_plain_relative_paths() {
        for good in ["a", "a/b.txt", "dir/sub/x", ".hidden", "é"] {
            assert!(is_plain_name(good), "{good}");
        }
        let long = "x".repeat(MAX_NAME_BYTES + 1);
        let long_part = format!("a/{}", "y".repeat(MAX_COMPONENT_BYTES + 1));
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a/./b",
            "a//b",
            "a/",
            ".",
            "a\0b",
            long.as_str(),
            long_part.as_str(),
        ] {
            assert!(!is_plain_name(bad), "{bad:?}");
        }
    }

    #[test]
    fn listings_leave_out_what_the_harvest_skips() {
        assert!(is_listed_name("out/plot.png"));
        for skipped in [
            ".env",
            "a/.git/x",
            "node_modules/x.js",
            "x/__pycache__/y.pyc",
        ] {
            assert!(!is_listed_name(skipped), "{skipped}");
        }
        let deep = vec!["d"; HARVEST_MAX_DEPTH + 1].join("/");
        assert!(is_listed_name(&deep));
        assert!(!is_listed_name(&format!("{deep}/x")));
    }
}
