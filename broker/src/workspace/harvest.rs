//! Over 600 lines with its tests: the harvest rules and the cases that pin them read together.
//!
//! The harvest: finding the files an exec created or changed, through a [`HarvestSource`]
//! (the mounted directory here, or the sandbox's runner), and giving each a new id.

use super::fs::{copy_hashing, open_regular};
use super::index::{blob_cost, human_bytes, placed_cost, RECORD_COST};
use super::{FileIndex, FileRecord, Origin, Stamp, StorageBudget, Workspace};
use crate::clock::now_ms;
use crate::ids::new_id;
use cap_fs_ext::DirExt;
use cap_std::fs::{Dir, MetadataExt};
use sandbox_runner::files::is_listed_name;
use std::collections::{HashMap, HashSet};
use std::io;
use std::path::Path;

/// Directories whose contents are never reported as generated files; shared with the
/// runner, which lists files by the same rules.
const SKIPPED_DIRS: &[&str] = sandbox_runner::HARVEST_SKIPPED_DIRS;

/// How deep the harvest walks, and how many entries it looks at, so that a sandbox that
/// creates millions of files cannot stall the broker.
const MAX_DEPTH: usize = sandbox_runner::HARVEST_MAX_DEPTH;
pub(crate) const MAX_ENTRIES: usize = sandbox_runner::HARVEST_MAX_ENTRIES;

/// A file the harvest found new or changed.
#[derive(Debug, Clone)]
pub(crate) struct Harvested {
    pub(crate) record: FileRecord,
}

/// What one harvest found.
#[derive(Debug, Default)]
pub(crate) struct HarvestReport {
    /// New or changed files, each with a new id.
    pub(crate) files: Vec<Harvested>,
    /// Notes for stderr: files left out and why, one bounded line per reason.
    pub(crate) notes: Vec<String>,
    /// Whether the index changed beyond `files` (versions dropped), so it must be saved.
    pub(crate) index_changed: bool,
    /// Blobs to delete once the index is saved: those of dropped versions, and of new
    /// versions that were not kept. The caller checks each is still unused.
    pub(crate) unused_blobs: Vec<String>,
    /// New or changed files this harvest found but did not keep (over the file cap, the
    /// size cap or the storage budget, or unreadable): with `files`, what clients are
    /// told could not be delivered. Files left out unchanged since the last harvest said
    /// so are not counted again.
    pub(crate) not_kept: usize,
    /// Current versions whose files are gone from `/mnt/data` (the code deleted, moved
    /// or replaced them), by name; the index no longer has them as current, so a later
    /// input ref to one places it again. Empty when the walk stopped at [`MAX_ENTRIES`]
    /// (what it did not see is not taken for gone).
    pub(crate) vanished: Vec<FileRecord>,
}

/// Caps on what one harvest reports.
#[derive(Debug, Clone, Copy)]
pub(crate) struct HarvestLimits {
    /// Most files reported.
    pub(crate) max_files: usize,
    /// Largest file reported, in bytes.
    pub(crate) max_file_bytes: u64,
    /// What the session's stored versions may take.
    pub(crate) storage: StorageBudget,
}

/// Names shown in a note; the rest are counted.
const NOTE_NAMES: usize = 3;

/// Longest name shown in a note, in bytes; longer ones are cut.
const NOTE_NAME_BYTES: usize = 80;

/// Files left out for one reason (by a harvest, or among an exec's inputs): counted, a
/// few named, so that the note saying so is one bounded line whatever the number.
#[derive(Debug, Default)]
pub(crate) struct LeftOut {
    /// How many.
    pub(crate) count: usize,
    /// The first few, cut to [`NOTE_NAME_BYTES`].
    names: Vec<String>,
}

impl LeftOut {
    pub(crate) fn add(&mut self, name: &str) {
        self.count += 1;
        if self.names.len() < NOTE_NAMES {
            self.names.push(shorten(name, NOTE_NAME_BYTES));
        }
    }

    /// `a, b, c and 7 more`: bounded whatever the count.
    pub(crate) fn list(&self) -> String {
        let mut text = self.names.join(", ");
        let more = self.count - self.names.len();
        if more > 0 {
            text.push_str(&format!(" and {more} more"));
        }
        text
    }

    /// `1 file` / `2000 files`.
    pub(crate) fn files(&self) -> String {
        if self.count == 1 {
            "1 file".into()
        } else {
            format!("{} files", self.count)
        }
    }
}

/// `name` cut to about `max` bytes by leaving out its middle: the start and the end
/// (where names that share a long prefix differ) stay.
fn shorten(name: &str, max: usize) -> String {
    if name.len() <= max {
        return name.to_string();
    }
    let mut head = max / 2;
    while !name.is_char_boundary(head) {
        head -= 1;
    }
    let mut tail = name.len() - (max - max / 2);
    while !name.is_char_boundary(tail) {
        tail += 1;
    }
    format!("{}...{}", &name[..head], &name[tail..])
}

/// Most files a session remembers as noted ([`FileIndex::noted`]): past it, files left out
/// are noted again at the next harvest (in the same bounded lines), and the memory a
/// session holds for them stays small.
pub(super) const MAX_NOTED: usize = 1024;

/// Remembers that the file of `key` was noted with `stamp`, while fewer than
/// [`MAX_NOTED`] are.
fn remember(noted: &mut HashMap<u64, Stamp>, key: u64, stamp: Stamp) {
    if noted.len() < MAX_NOTED || noted.contains_key(&key) {
        noted.insert(key, stamp);
    }
}

/// A key for [`FileIndex::noted`]: a hash of the name, so that thousands of long names
/// do not stay in memory.
fn note_key(name: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    name.hash(&mut hasher);
    hasher.finish()
}

impl Workspace {
    /// Finds files created or changed since `index` was last updated, gives each a new id,
    /// and updates `index` (the caller saves it, then deletes `unused_blobs`). New
    /// versions that do not fit the storage budget first drop versions that are no longer
    /// current, oldest first; what still does not fit is not kept. Blocking: run it off
    /// the async threads.
    pub(crate) fn harvest(
        &self,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport> {
        let mut host = HostFiles {
            dir: self.open_files()?,
        };
        self.harvest_from(&mut host, index, limits)
    }

    /// [`Workspace::harvest`] of the files `source` finds, into this workspace's blob
    /// store and index: the same rules whichever way the files are reached.
    pub(crate) fn harvest_from(
        &self,
        source: &mut dyn HarvestSource,
        index: &mut FileIndex,
        limits: HarvestLimits,
    ) -> io::Result<HarvestReport> {
        let (mut found, truncated) = source.list()?;
        let mut report = HarvestReport::default();
        if truncated {
            report.notes.push(format!(
                "Only the first {MAX_ENTRIES} entries of /mnt/data were checked for new files"
            ));
        }
        found.sort_by(|a, b| a.0.cmp(&b.0));
        if !truncated {
            report.vanished = retire_vanished(index, &found);
            report.index_changed |= !report.vanished.is_empty();
        }
        let now = now_ms();
        let room = limits.storage.room;
        let mut left_out = 0usize;
        let mut oversize = LeftOut::default();
        let mut refused = LeftOut::default();
        let mut unreadable = LeftOut::default();
        let (mut dropped, mut dropped_bytes) = (0usize, 0u64);
        // Files noted this time; those noted last time and unchanged since are passed over
        // without a word.
        let mut noted = HashMap::new();
        let mut floor = index.floor_bytes();
        for (name, stamp) in found {
            let previous = index.current(&name).cloned();
            if previous.as_ref().map(|p| p.stamp) == Some(stamp) {
                continue;
            }
            if let Some(prev) = previous.as_ref().filter(|p| p.read_only) {
                // A read-only input is never reported as generated. It cannot change while
                // the broker's uid is not the sandbox's; if it did anyway (the broker runs
                // as the sandbox uid), say so once: its file id still serves the upload.
                let same = source
                    .hash(&name, limits.max_file_bytes)
                    .is_ok_and(|sha| sha.as_deref() == Some(prev.sha256.as_str()));
                if !same {
                    report.notes.push(format!(
                        "{name} is a read-only upload but was changed in /mnt/data; \
                         its file id still serves the uploaded content"
                    ));
                }
                index.set_stamp(&prev.id, stamp);
                continue;
            }
            let key = note_key(&name);
            // Noted at the last harvest and unchanged since: left out again without a word.
            let quiet = index.noted.get(&key) == Some(&stamp);
            if stamp.size > limits.max_file_bytes {
                if !quiet {
                    oversize.add(&name);
                }
                remember(&mut noted, key, stamp);
                continue;
            }
            if report.files.len() >= limits.max_files {
                // Checked before hashing: a flood of files must not cost a copy of each
                // at every exec (files left out are looked at again next time).
                left_out += 1;
                continue;
            }
            // Checked before copying too: a version that cannot fit is not written. The
            // floor (all old versions dropped) answers most cases without a look at each.
            let extra = index.cost_of(None, stamp.size);
            let replaced = previous
                .as_ref()
                .map_or(0, |p| RECORD_COST + blob_cost(p.size) + placed_cost(p));
            if floor.saturating_add(extra) > room.saturating_add(replaced)
                || !index.could_fit(extra, room, Some(&name))
            {
                if !quiet {
                    refused.add(&name);
                }
                remember(&mut noted, key, stamp);
                continue;
            }
            let (sha256, size) = match source.store_blob(self, &name, limits.max_file_bytes) {
                Ok(Some(stored)) => stored,
                Ok(None) => {
                    if !quiet {
                        oversize.add(&name);
                    }
                    remember(&mut noted, key, stamp);
                    continue;
                }
                // Gone or swapped for something that is not a regular file, or refused by
                // the runner: not kept, and looked at again next time.
                Err(_) => {
                    unreadable.add(&name);
                    continue;
                }
            };
            if let Some(prev) = &previous {
                if prev.sha256 == sha256 {
                    // Touched but not changed: remember the new stamp, report nothing.
                    index.set_stamp(&prev.id, stamp);
                    continue;
                }
            }
            let extra = index.cost_of(Some(&sha256), size);
            match index.make_room(extra, room, Some(&name), Some(&sha256)) {
                Some(gone) => {
                    dropped += gone.records.len();
                    dropped_bytes += gone.records.iter().map(|r| r.size).sum::<u64>();
                    report.index_changed |= !gone.records.is_empty();
                    report.unused_blobs.extend(gone.blobs);
                }
                None => {
                    // It grew between the look and the copy: not kept after all.
                    if !quiet {
                        refused.add(&name);
                    }
                    remember(&mut noted, key, stamp);
                    report.unused_blobs.push(sha256);
                    continue;
                }
            }
            let record = FileRecord {
                id: new_id(),
                name,
                size,
                sha256,
                created_ms: now,
                stamp,
                current: true,
                origin: Origin::Generated,
                read_only: false,
                kind: None,
                modified_from: previous.map(|p| p.id),
            };
            index.push_current(record.clone());
            floor = index.floor_bytes();
            report.files.push(Harvested { record });
        }
        index.noted = noted;
        report.not_kept = oversize.count + left_out + refused.count + unreadable.count;
        // One line per reason, each bounded whatever the number of files: a flood of
        // files must not flood stderr too.
        if oversize.count > 0 {
            report.notes.push(format!(
                "{} over the limit of {} per file {} left out of the generated files: {}",
                oversize.files(),
                human_bytes(limits.max_file_bytes),
                if oversize.count == 1 { "was" } else { "were" },
                oversize.list()
            ));
        }
        if unreadable.count > 0 {
            report.notes.push(format!(
                "{} could not be read and {} left out of the generated files: {}",
                unreadable.files(),
                if unreadable.count == 1 { "was" } else { "were" },
                unreadable.list()
            ));
        }
        if left_out > 0 {
            report.notes.push(format!(
                "{left_out} more new or changed files were left out of the generated files: \
                 more than {} files changed",
                limits.max_files
            ));
        }
        if dropped > 0 || refused.count > 0 {
            let mut parts = Vec::new();
            if dropped > 0 {
                let (versions, were, ids) = if dropped == 1 {
                    ("version", "was", "its id now answers")
                } else {
                    ("versions", "were", "their ids now answer")
                };
                parts.push(format!(
                    "{dropped} older {versions} ({}) {were} dropped and {ids} 404",
                    human_bytes(dropped_bytes),
                ));
            }
            if refused.count > 0 {
                parts.push(format!(
                    "{} new or changed {} not kept: {}",
                    refused.count,
                    if refused.count == 1 {
                        "file was"
                    } else {
                        "files were"
                    },
                    refused.list()
                ));
            }
            report.notes.push(format!(
                "File versions over {}: {}",
                limits.storage.describe(),
                parts.join("; ")
            ));
        }
        Ok(report)
    }
}

/// Retires the current versions of `index` whose files are not among `found` (the whole
/// listing), and returns them sorted by name. Names a listing never reports (hidden,
/// cache directories, too deep) are not taken for gone.
fn retire_vanished(index: &mut FileIndex, found: &[(String, Stamp)]) -> Vec<FileRecord> {
    let present: HashSet<&str> = found.iter().map(|(name, _)| name.as_str()).collect();
    let mut gone: Vec<String> = index
        .current_records()
        .filter(|r| is_listed_name(&r.name) && !present.contains(r.name.as_str()))
        .map(|r| r.name.clone())
        .collect();
    gone.sort();
    gone.iter().filter_map(|name| index.retire(name)).collect()
}

/// Where a harvest finds the sandbox's files: the mounted directory on this host
/// ([`HostFiles`]), or the sandbox's runner (`crate::sandbox::runner_files`).
pub(crate) trait HarvestSource {
    /// The regular files below `/mnt/data` with their stamps (hidden and cache entries,
    /// symlinks and special files left out), and whether the walk stopped at
    /// [`MAX_ENTRIES`].
    fn list(&mut self) -> io::Result<(Vec<(String, Stamp)>, bool)>;

    /// SHA-256 of the file `name`; `None` when it has more than `max_bytes`.
    fn hash(&mut self, name: &str, max_bytes: u64) -> io::Result<Option<String>>;

    /// Copies the file `name` into the blob store of `workspace`, hashing it on the way:
    /// its hash and size, or `None` (nothing kept) when it has more than `max_bytes`.
    fn store_blob(
        &mut self,
        workspace: &Workspace,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<(String, u64)>>;
}

/// The sandbox's files read beneath-only from the mounted directory.
struct HostFiles {
    /// The opened `files/` directory.
    dir: Dir,
}

impl HarvestSource for HostFiles {
    fn list(&mut self) -> io::Result<(Vec<(String, Stamp)>, bool)> {
        let mut found = Vec::new();
        let mut budget = MAX_ENTRIES;
        walk(&self.dir, "", 0, &mut budget, &mut found)?;
        Ok((found, budget == 0))
    }

    fn hash(&mut self, name: &str, max_bytes: u64) -> io::Result<Option<String>> {
        let mut file = open_regular(&self.dir, Path::new(name))?;
        copy_hashing(&mut file, &mut io::sink(), max_bytes)
    }

    fn store_blob(
        &mut self,
        workspace: &Workspace,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<(String, u64)>> {
        workspace.store_blob_from(&self.dir, name, max_bytes)
    }
}

/// Collects regular files below `dir` with their stamps; skips hidden and cache entries,
/// symlinks and special files.
fn walk(
    dir: &Dir,
    prefix: &str,
    depth: usize,
    budget: &mut usize,
    found: &mut Vec<(String, Stamp)>,
) -> io::Result<()> {
    if depth > MAX_DEPTH {
        return Ok(());
    }
    for entry in dir.entries()? {
        if *budget == 0 {
            return Ok(());
        }
        *budget -= 1;
        let Ok(entry) = entry else { continue };
        let file_name = entry.file_name();
        let Some(name) = file_name.to_str() else {
            continue;
        };
        if name.starts_with('.') || SKIPPED_DIRS.contains(&name) {
            continue;
        }
        let Ok(file_type) = entry.file_type() else {
            continue;
        };
        let path = if prefix.is_empty() {
            name.to_string()
        } else {
            format!("{prefix}/{name}")
        };
        if file_type.is_dir() {
            if let Ok(sub) = dir.open_dir_nofollow(name) {
                walk(&sub, &path, depth + 1, budget, found)?;
            }
        } else if file_type.is_file() {
            if let Ok(meta) = entry.metadata() {
                found.push((
                    path,
                    Stamp {
                        ino: meta.ino(),
                        size: meta.len(),
                        ctime: meta.ctime(),
                        ctime_nsec: meta.ctime_nsec(),
                    },
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workspace::tests::{limits, workspace};
    use sha2::{Digest, Sha256};

    #[test]
    fn new_and_changed_files_get_new_ids() {
        let (_tmp, ws) = workspace();
        let files = ws.files_dir();
        std::fs::create_dir_all(files.join("charts")).unwrap();
        std::fs::write(files.join("a.txt"), "one").unwrap();
        std::fs::write(files.join("charts/b.png"), "png").unwrap();
        let mut index = FileIndex::default();
        let first = ws.harvest(&mut index, limits()).unwrap();
        let names: Vec<_> = first.files.iter().map(|f| f.record.name.clone()).collect();
        assert_eq!(names, ["a.txt", "charts/b.png"]);

        let again = ws.harvest(&mut index, limits()).unwrap();
        assert!(
            again.files.is_empty(),
            "unchanged files are not reported again"
        );

        std::fs::write(files.join("a.txt"), "one").unwrap();
        assert!(
            ws.harvest(&mut index, limits()).unwrap().files.is_empty(),
            "same bytes"
        );

        std::fs::write(files.join("a.txt"), "two").unwrap();
        let changed = ws.harvest(&mut index, limits()).unwrap();
        assert_eq!(changed.files.len(), 1);
        assert_ne!(changed.files[0].record.id, first.files[0].record.id);
        assert!(!index.get(&first.files[0].record.id).unwrap().current);
    }

    #[test]
    fn skips_hidden_caches_symlinks_and_fifos() {
        let (_tmp, ws) = workspace();
        let files = ws.files_dir();
        std::fs::create_dir_all(files.join("__pycache__")).unwrap();
        std::fs::write(files.join("__pycache__/x.pyc"), "x").unwrap();
        std::fs::write(files.join(".hidden"), "x").unwrap();
        std::os::unix::fs::symlink("/etc/passwd", files.join("link")).unwrap();
        std::os::unix::fs::symlink("/", files.join("rootlink")).unwrap();
        let fifo = std::ffi::CString::new(files.join("fifo").to_str().unwrap()).unwrap();
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        let mut index = FileIndex::default();
        let report = ws.harvest(&mut index, limits()).unwrap();
        assert!(report.files.is_empty(), "{:?}", report.files);
        assert!(ws.open_file("link").is_err());
        assert!(ws.open_file("rootlink/etc/passwd").is_err());
        assert!(ws.open_file("fifo").is_err());
        assert!(ws.open_file("../../etc/passwd").is_err());
    }

    #[test]
    fn a_changed_read_only_file_is_said_once_and_never_reported_as_generated() {
        let (_tmp, ws) = workspace();
        let path = ws.files_dir().join("SKILL.md");
        std::fs::write(&path, "# skill").expect("write");
        let mut index = FileIndex::default();
        let first = ws.harvest(&mut index, limits()).expect("harvest");
        let mut record = first.files[0].record.clone();
        record.read_only = true;
        index = FileIndex::default();
        index.push_current(record);
        std::fs::write(&path, "# injected").expect("write");
        let report = ws.harvest(&mut index, limits()).expect("harvest");
        assert!(report.files.is_empty());
        assert_eq!(report.notes.len(), 1, "{:?}", report.notes);
        assert!(report.notes[0].contains("SKILL.md is a read-only upload"));
        let again = ws.harvest(&mut index, limits()).expect("harvest");
        assert!(
            again.notes.is_empty() && again.files.is_empty(),
            "{again:?}"
        );
    }

    #[test]
    fn caps_are_reported() {
        let (_tmp, ws) = workspace();
        std::fs::write(ws.files_dir().join("big.bin"), vec![0u8; 2 << 20]).unwrap();
        for i in 0..3 {
            std::fs::write(ws.files_dir().join(format!("f{i}")), "x").unwrap();
        }
        let mut index = FileIndex::default();
        let report = ws
            .harvest(
                &mut index,
                HarvestLimits {
                    max_files: 2,
                    max_file_bytes: 1 << 20,
                    storage: StorageBudget::UNLIMITED,
                },
            )
            .unwrap();
        assert_eq!(report.files.len(), 2);
        assert_eq!(report.notes.len(), 2, "{:?}", report.notes);
        assert!(report.notes.iter().any(|n| n.contains("big.bin")));
        assert_eq!(report.not_kept, 2, "big.bin and the third small file");
    }

    #[test]
    fn harvest_keeps_within_the_budget_and_notes_once() {
        let (_tmp, ws) = workspace();
        let files = ws.files_dir();
        for name in ["a", "b", "c"] {
            std::fs::write(files.join(name), vec![name.as_bytes()[0]; 300_000]).unwrap();
        }
        let budget = StorageBudget {
            room: 700_000,
            limit: 700_000,
            per_user: false,
        };
        let limits = HarvestLimits {
            storage: budget,
            ..limits()
        };
        let mut index = FileIndex::default();
        let report = ws.harvest(&mut index, limits).unwrap();
        let kept: Vec<_> = report
            .files
            .iter()
            .map(|f| f.record.name.as_str())
            .collect();
        assert_eq!(kept, ["a", "b"]);
        assert_eq!(report.notes.len(), 1, "{:?}", report.notes);
        assert!(report.notes[0].contains("1 new or changed file was not kept: c"));
        assert_eq!(report.not_kept, 1);
        assert!(
            !ws.blob_path(&sha_of(&files.join("c"))).exists(),
            "never copied"
        );
        // Unchanged: not noted, nor counted, again.
        let again = ws.harvest(&mut index, limits).unwrap();
        assert!(
            again.files.is_empty() && again.notes.is_empty(),
            "{:?}",
            again.notes
        );
        assert_eq!(again.not_kept, 0);
        // A new version of a replaces the old one, whose blob goes once the index is saved.
        let old = index.current("a").unwrap().sha256.clone();
        std::fs::write(files.join("a"), vec![b'z'; 300_000]).unwrap();
        let changed = ws.harvest(&mut index, limits).unwrap();
        assert_eq!(changed.files.len(), 1);
        assert!(changed.index_changed);
        assert!(
            changed.notes[0].contains("1 older version (293 KiB) was dropped"),
            "{:?}",
            changed.notes
        );
        ws.delete_unused_blobs(&index, &changed.unused_blobs);
        assert!(!ws.blob_path(&old).exists());
        assert!(index.stored_bytes() <= budget.room);
    }

    #[test]
    fn files_the_code_removed_are_retired_and_said_once() {
        let (_tmp, ws) = workspace();
        let files = ws.files_dir();
        std::fs::create_dir_all(files.join("in")).unwrap();
        for name in ["a.txt", "in/b.csv", "kept.txt"] {
            std::fs::write(files.join(name), name).unwrap();
        }
        let mut index = FileIndex::default();
        let first = ws.harvest(&mut index, limits()).unwrap();
        assert_eq!(first.files.len(), 3);
        assert!(first.vanished.is_empty());
        // A current version the listing never shows (hidden) is not taken for gone.
        let mut hidden = first.files[0].record.clone();
        hidden.id = "h".repeat(21);
        hidden.name = ".env".into();
        index.push_current(hidden);

        std::fs::remove_file(files.join("a.txt")).unwrap();
        std::fs::rename(files.join("in/b.csv"), files.join("moved.csv")).unwrap();
        let report = ws.harvest(&mut index, limits()).unwrap();
        let gone: Vec<_> = report.vanished.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(gone, ["a.txt", "in/b.csv"]);
        assert!(report.index_changed);
        assert!(index.current("a.txt").is_none());
        assert!(
            index.get(&first.files[0].record.id).is_some(),
            "the id stays"
        );
        assert!(index.current(".env").is_some());
        assert!(index.current("kept.txt").is_some());
        let moved: Vec<_> = report
            .files
            .iter()
            .map(|f| f.record.name.as_str())
            .collect();
        assert_eq!(moved, ["moved.csv"]);

        let again = ws.harvest(&mut index, limits()).unwrap();
        assert!(again.vanished.is_empty(), "{:?}", again.vanished);
    }

    #[test]
    fn the_files_remembered_as_noted_are_bounded() {
        let mut noted = HashMap::new();
        for key in 0..(MAX_NOTED as u64 * 3) {
            remember(&mut noted, key, Stamp::default());
        }
        assert_eq!(noted.len(), MAX_NOTED);
        // One already remembered gets its new stamp.
        let stamp = Stamp {
            ino: 9,
            ..Stamp::default()
        };
        remember(&mut noted, 0, stamp);
        assert_eq!(noted.get(&0), Some(&stamp));
        assert_eq!(noted.len(), MAX_NOTED);
    }

    #[test]
    fn a_file_that_cannot_be_read_is_counted_and_noted() {
        struct Flaky;
        impl HarvestSource for Flaky {
            fn list(&mut self) -> io::Result<(Vec<(String, Stamp)>, bool)> {
                let stamp = Stamp {
                    ino: 1,
                    size: 3,
                    ctime: 1,
                    ctime_nsec: 0,
                };
                Ok((vec![("swapped.bin".into(), stamp)], false))
            }
            fn hash(&mut self, _: &str, _: u64) -> io::Result<Option<String>> {
                Err(io::ErrorKind::NotFound.into())
            }
            fn store_blob(
                &mut self,
                _: &Workspace,
                _: &str,
                _: u64,
            ) -> io::Result<Option<(String, u64)>> {
                Err(io::ErrorKind::NotFound.into())
            }
        }
        let (_tmp, ws) = workspace();
        let mut index = FileIndex::default();
        let report = ws.harvest_from(&mut Flaky, &mut index, limits()).unwrap();
        assert!(report.files.is_empty());
        assert_eq!(report.not_kept, 1);
        assert_eq!(
            report.notes,
            ["1 file could not be read and was left out of the generated files: swapped.bin"]
        );
    }

    fn sha_of(path: &Path) -> String {
        hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
    }

    #[test]
    fn oversized_files_make_one_bounded_note() {
        let (_tmp, ws) = workspace();
        for i in 0..300 {
            let name = format!("{}{i}", "N".repeat(240));
            let f = std::fs::File::create(ws.files_dir().join(name)).unwrap();
            f.set_len(2 << 20).unwrap();
        }
        let mut index = FileIndex::default();
        let report = ws.harvest(&mut index, limits()).unwrap();
        assert_eq!(report.notes.len(), 1, "{:?}", report.notes);
        assert!(
            report.notes[0].starts_with("300 files over"),
            "{}",
            report.notes[0]
        );
        assert!(
            report.notes[0].ends_with("and 297 more"),
            "{}",
            report.notes[0]
        );
        assert!(report.notes[0].len() < 512, "{}", report.notes[0].len());
        assert!(
            report.notes[0].contains("N...N") && report.notes[0].contains("N0, "),
            "{}",
            report.notes[0]
        );
        assert_eq!(shorten("ab\u{e9}cdef", 4), "ab...ef");
        assert_eq!(shorten("\u{e9}\u{e9}\u{e9}\u{e9}", 4), "\u{e9}...\u{e9}");
        let again = ws.harvest(&mut index, limits()).unwrap();
        assert!(again.notes.is_empty(), "{:?}", again.notes);
    }
}
