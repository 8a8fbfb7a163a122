//! The index model: the file ids of a session (`FileIndex`, `FileRecord`) and what their
//! stored versions may cost (`StorageBudget`).

use serde::{Deserialize, Serialize};
use std::collections::HashMap;

/// One file id: a version of a file in the workspace.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct FileRecord {
    /// The 21-character id clients download it by.
    pub(crate) id: String,
    /// Path relative to `/mnt/data`, `/`-separated.
    pub(crate) name: String,
    /// Size in bytes when it was recorded.
    pub(crate) size: u64,
    /// SHA-256 of the content, hex: how changes are told apart (not mtime, which the
    /// sandbox controls).
    pub(crate) sha256: String,
    /// Milliseconds since the epoch when this version was recorded.
    pub(crate) created_ms: u64,
    /// Inode and change time when recorded: a cheap "unchanged" check before hashing.
    /// The sandbox cannot set ctime.
    #[serde(default)]
    pub(crate) stamp: Stamp,
    /// Whether this is the newest version of `name` (older ids are kept for clients
    /// that still hold them).
    pub(crate) current: bool,
    /// How the file came to be: its kind of origin decides whether it is reported.
    #[serde(default)]
    pub(crate) origin: Origin,
    /// Uploaded read-only (or as kind `skill`/`agent`): never reported as generated,
    /// whatever the code does to it.
    #[serde(default)]
    pub(crate) read_only: bool,
    /// The uploader's `kind` (`user`, `agent`, `skill`), for listings.
    #[serde(default)]
    pub(crate) kind: Option<String>,
    /// The id of the version this one replaced.
    #[serde(default)]
    pub(crate) modified_from: Option<String>,
}

/// Where a file version came from.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Origin {
    /// Written by code in the sandbox.
    #[default]
    Generated,
    /// Uploaded by a client.
    Uploaded,
    /// Copied in from another session as an exec's input.
    Input,
}

/// What a cheap look at a file tells: enough to know it was not touched. The runner's
/// protocol type, so a stamp taken through the runner and one taken on the host are the
/// same value.
pub(crate) use sandbox_runner::FileStamp as Stamp;

/// Stored versions are counted in whole blocks of this many bytes (what a file takes on
/// disk), at least one each.
const BLOCK: u64 = 4096;

/// What each version costs against a storage budget on top of its bytes: its entry in
/// `index.json`, which is rewritten at every harvest. Without it, versions of empty files
/// would be free and the index could grow without bound.
pub(super) const RECORD_COST: u64 = 1024;

/// What a blob of `size` bytes costs against a storage budget.
pub(crate) fn blob_cost(size: u64) -> u64 {
    size.div_ceil(BLOCK).max(1).saturating_mul(BLOCK)
}

/// What the copy of `record` that the broker wrote into `/mnt/data` costs: an upload or an
/// input ref is placed there as a full copy of its blob, outside the workspace quota (the
/// runner only watches what code writes), so each current one is charged again. Code's
/// own files are under the quota, and old versions have no copy.
pub(super) fn placed_cost(record: &FileRecord) -> u64 {
    if record.current && record.origin != Origin::Generated {
        blob_cost(record.size)
    } else {
        0
    }
}

/// The file ids of one session, persisted as `index.json` so ids survive a restart.
///
/// Lookups by id and by name, and the bytes the versions take, are kept in maps beside
/// the list (rebuilt from it on load), so a harvest costs O(files) instead of
/// O(files x versions). Change records only through the methods here, which keep the
/// maps in step.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(from = "StoredIndex")]
pub(crate) struct FileIndex {
    /// Every recorded version, oldest first.
    pub(crate) files: Vec<FileRecord>,
    /// Position in `files` of each id.
    #[serde(skip)]
    by_id: HashMap<String, usize>,
    /// Position in `files` of the current version of each name.
    #[serde(skip)]
    current: HashMap<String, usize>,
    /// Each blob the records need: its cost and how many records share it.
    #[serde(skip)]
    blobs: HashMap<String, BlobUse>,
    /// What the versions cost against the storage budget: blobs, records, and the copies
    /// the broker placed in `/mnt/data` ([`placed_cost`]).
    #[serde(skip)]
    stored: u64,
    /// Files the last harvest did not keep (over the size limit or the storage budget), by
    /// a hash of the name, with their stamp: unchanged, they are left out again without a
    /// note, instead of being noted at every exec. Kept in memory only; after a restart
    /// they are noted once more. At most `harvest::MAX_NOTED` entries.
    #[serde(skip)]
    pub(super) noted: HashMap<u64, Stamp>,
}

/// One blob as the index uses it.
#[derive(Debug, Clone, Copy)]
struct BlobUse {
    /// What it costs against the budget.
    cost: u64,
    /// Records that name it.
    records: usize,
}

/// `index.json` as written; the maps are rebuilt from it.
#[derive(Deserialize)]
struct StoredIndex {
    /// Every recorded version, oldest first.
    #[serde(default)]
    files: Vec<FileRecord>,
}

impl From<StoredIndex> for FileIndex {
    fn from(stored: StoredIndex) -> FileIndex {
        let mut index = FileIndex {
            files: stored.files,
            ..FileIndex::default()
        };
        index.reindex();
        index
    }
}

/// Versions dropped to make room for new ones.
#[derive(Debug, Default)]
pub(crate) struct Dropped {
    /// The dropped records.
    pub(crate) records: Vec<FileRecord>,
    /// Blobs no record named once they were dropped; deleted after the index is saved
    /// (and only if no record names them by then).
    pub(crate) blobs: Vec<String>,
}

impl FileIndex {
    /// Rebuilds the maps from `files`. Should two records of a name both claim to be
    /// current, the newer one is.
    fn reindex(&mut self) {
        self.by_id.clear();
        self.current.clear();
        self.blobs.clear();
        let mut stale = Vec::new();
        for (pos, r) in self.files.iter().enumerate() {
            self.by_id.insert(r.id.clone(), pos);
            if r.current {
                if let Some(old) = self.current.insert(r.name.clone(), pos) {
                    stale.push(old);
                }
            }
            self.blobs
                .entry(r.sha256.clone())
                .or_insert(BlobUse {
                    cost: blob_cost(r.size),
                    records: 0,
                })
                .records += 1;
        }
        for pos in stale {
            self.files[pos].current = false;
        }
        self.stored = self.blobs.values().map(|b| b.cost).sum::<u64>()
            + RECORD_COST * self.files.len() as u64
            + self.files.iter().map(placed_cost).sum::<u64>();
    }

    /// The record of file id `id`.
    pub(crate) fn get(&self, id: &str) -> Option<&FileRecord> {
        self.by_id.get(id).map(|&pos| &self.files[pos])
    }

    /// The newest record of `name`.
    pub(crate) fn current(&self, name: &str) -> Option<&FileRecord> {
        self.current.get(name).map(|&pos| &self.files[pos])
    }

    /// Adds `record` as the newest version of its name.
    pub(crate) fn push_current(&mut self, record: FileRecord) {
        if let Some(&old) = self.current.get(&record.name) {
            self.stored = self.stored.saturating_sub(placed_cost(&self.files[old]));
            self.files[old].current = false;
        }
        let pos = self.files.len();
        let blob = self.blobs.entry(record.sha256.clone()).or_insert(BlobUse {
            cost: blob_cost(record.size),
            records: 0,
        });
        if blob.records == 0 {
            self.stored += blob.cost;
        }
        blob.records += 1;
        self.stored += RECORD_COST + placed_cost(&record);
        self.by_id.insert(record.id.clone(), pos);
        if record.current {
            self.current.insert(record.name.clone(), pos);
        }
        self.files.push(record);
    }

    /// Records a new stamp for the unchanged version `id`.
    pub(crate) fn set_stamp(&mut self, id: &str, stamp: Stamp) {
        if let Some(&pos) = self.by_id.get(id) {
            self.files[pos].stamp = stamp;
        }
    }

    /// Marks the current version of `name` as no longer current (its file is gone from
    /// `/mnt/data`); the id still serves its bytes. Returns that version.
    pub(crate) fn retire(&mut self, name: &str) -> Option<FileRecord> {
        let pos = self.current.remove(name)?;
        self.stored = self.stored.saturating_sub(placed_cost(&self.files[pos]));
        self.files[pos].current = false;
        Some(self.files[pos].clone())
    }

    /// Makes version `id` current again at its name, with the stamp of the file placed
    /// there anew; `false` (nothing changed) when the name has another current version.
    pub(crate) fn reinstate(&mut self, id: &str, stamp: Stamp) -> bool {
        let Some(&pos) = self.by_id.get(id) else {
            return false;
        };
        let name = self.files[pos].name.clone();
        if self.current.get(&name).is_some_and(|&p| p != pos) {
            return false;
        }
        if !self.files[pos].current {
            self.files[pos].current = true;
            self.stored += placed_cost(&self.files[pos]);
        }
        self.files[pos].stamp = stamp;
        self.current.insert(name, pos);
        true
    }

    /// The current versions, in no particular order.
    pub(crate) fn current_records(&self) -> impl Iterator<Item = &FileRecord> {
        self.current.values().map(|&pos| &self.files[pos])
    }

    /// Whether any record still needs the blob `sha256`.
    pub(crate) fn uses_blob(&self, sha256: &str) -> bool {
        self.blobs.contains_key(sha256)
    }

    /// What the stored versions cost against the storage budget, in bytes.
    pub(crate) fn stored_bytes(&self) -> u64 {
        self.stored
    }

    /// Removes the records whose ids `remove` accepts. Returns them, and the blobs no
    /// record needs any more (the caller deletes those once the index is saved).
    pub(crate) fn remove_where(&mut self, remove: impl Fn(&FileRecord) -> bool) -> Dropped {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.files)
            .into_iter()
            .partition(|r| remove(r));
        self.files = kept;
        self.reindex();
        let mut blobs: Vec<String> = gone
            .iter()
            .filter(|r| !self.uses_blob(&r.sha256))
            .map(|r| r.sha256.clone())
            .collect();
        blobs.sort();
        blobs.dedup();
        Dropped {
            records: gone,
            blobs,
        }
    }

    /// Removes the record `id`.
    pub(crate) fn remove(&mut self, id: &str) -> Dropped {
        self.remove_where(|r| r.id == id)
    }

    /// What the versions would cost with every version that is no longer current dropped.
    pub(crate) fn floor_bytes(&self) -> u64 {
        let mut named = std::collections::HashSet::new();
        let mut total = 0;
        for &pos in self.current.values() {
            let r = &self.files[pos];
            total += RECORD_COST + placed_cost(r);
            if named.insert(r.sha256.as_str()) {
                total += self.blobs.get(&r.sha256).map_or(0, |b| b.cost);
            }
        }
        total
    }

    /// How many names other than `except` hold a copy the broker placed of blob
    /// `sha256` (current uploads and input refs; code's own files are not copies).
    pub(crate) fn placed_names(&self, sha256: &str, except: &str) -> usize {
        if !self.uses_blob(sha256) {
            return 0;
        }
        self.current_records()
            .filter(|r| r.sha256 == sha256 && r.name != except && placed_cost(r) > 0)
            .count()
    }

    /// What one more version of `size` bytes costs; nothing for its bytes when a record
    /// already has them (`sha256` known).
    pub(crate) fn cost_of(&self, sha256: Option<&str>, size: u64) -> u64 {
        let shared = sha256.is_some_and(|h| self.uses_blob(h));
        RECORD_COST + if shared { 0 } else { blob_cost(size) }
    }

    /// What one more version costs that the broker places in `/mnt/data` (an upload, an
    /// input ref): [`FileIndex::cost_of`] plus its copy there, shared bytes or not.
    pub(crate) fn placed_cost_of(&self, sha256: &str, size: u64) -> u64 {
        self.cost_of(Some(sha256), size)
            .saturating_add(blob_cost(size))
    }

    /// The versions to drop, oldest first, so that `extra` more bytes fit within `limit`:
    /// versions that are no longer current, then the current version of `replacing` (the
    /// name about to get a new one). The blob `keep` (the new version's) is never counted
    /// as freed. `None` when dropping all of them would not make room.
    fn room_plan(
        &self,
        extra: u64,
        limit: u64,
        replacing: Option<&str>,
        keep: Option<&str>,
    ) -> Option<Vec<usize>> {
        let mut need = self.stored.saturating_add(extra).saturating_sub(limit);
        let mut plan = Vec::new();
        if need == 0 {
            return Some(plan);
        }
        let mut refs: HashMap<&str, usize> = HashMap::new();
        let old = self
            .files
            .iter()
            .enumerate()
            .filter(|(_, r)| !r.current)
            .map(|(pos, _)| pos);
        let replaced = replacing.and_then(|name| self.current.get(name).copied());
        for pos in old.chain(replaced) {
            let r = &self.files[pos];
            let blob = self.blobs.get(&r.sha256).copied().unwrap_or(BlobUse {
                cost: 0,
                records: 1,
            });
            let left = refs.entry(&r.sha256).or_insert(blob.records);
            *left = left.saturating_sub(1);
            // The current version of `replacing` takes its placed copy with it.
            let mut freed = RECORD_COST + placed_cost(r);
            if *left == 0 && keep != Some(r.sha256.as_str()) {
                freed += blob.cost;
            }
            plan.push(pos);
            need = need.saturating_sub(freed);
            if need == 0 {
                return Some(plan);
            }
        }
        None
    }

    /// Whether `extra` more bytes could be made to fit within `limit` (see
    /// [`FileIndex::make_room`]); nothing is dropped.
    pub(crate) fn could_fit(&self, extra: u64, limit: u64, replacing: Option<&str>) -> bool {
        self.room_plan(extra, limit, replacing, None).is_some()
    }

    /// Makes room for `extra` more bytes within `limit` by dropping versions that are no
    /// longer current, oldest first, and last the current version of `replacing`. `None`
    /// when that cannot make room; then nothing is dropped.
    pub(crate) fn make_room(
        &mut self,
        extra: u64,
        limit: u64,
        replacing: Option<&str>,
        keep: Option<&str>,
    ) -> Option<Dropped> {
        let plan = self.room_plan(extra, limit, replacing, keep)?;
        if plan.is_empty() {
            return Some(Dropped::default());
        }
        let ids: std::collections::HashSet<String> =
            plan.iter().map(|&pos| self.files[pos].id.clone()).collect();
        Some(self.remove_where(|r| ids.contains(&r.id)))
    }
}

/// What a session's stored versions may take: the smaller of its own budget and what its
/// user's budget leaves it (see `crate::core::files`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct StorageBudget {
    /// Bytes the session's versions may cost in all (`u64::MAX`: no budget).
    pub(crate) room: u64,
    /// The configured budget that sets `room`, for notes.
    pub(crate) limit: u64,
    /// Whether that is the user's budget, shared by all their sessions.
    pub(crate) per_user: bool,
}

impl StorageBudget {
    /// No budget at all.
    pub(crate) const UNLIMITED: StorageBudget = StorageBudget {
        room: u64::MAX,
        limit: 0,
        per_user: false,
    };

    /// The budget in words, for notes and errors: `the storage budget (the session's
    /// 256.0 MiB, CODEBROKER_SESSION_STORAGE)`.
    pub(crate) fn describe(&self) -> String {
        if self.per_user {
            format!(
                "the storage budget (the user's {} for all their sessions, CODEBROKER_USER_STORAGE)",
                human_bytes(self.limit)
            )
        } else {
            format!(
                "the storage budget (the session's {}, CODEBROKER_SESSION_STORAGE)",
                human_bytes(self.limit)
            )
        }
    }
}

/// `bytes` for people: `512 KiB`, `5.0 MiB`, `1.0 GiB`.
pub(crate) fn human_bytes(bytes: u64) -> String {
    const KIB: f64 = 1024.0;
    let b = bytes as f64;
    if b < KIB {
        format!("{bytes} bytes")
    } else if b < KIB * KIB {
        format!("{:.0} KiB", b / KIB)
    } else if b < KIB * KIB * KIB {
        format!("{:.1} MiB", b / (KIB * KIB))
    } else {
        format!("{:.1} GiB", b / (KIB * KIB * KIB))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(id: &str, name: &str, sha: &str, size: u64) -> FileRecord {
        FileRecord {
            id: id.into(),
            name: name.into(),
            size,
            sha256: sha.into(),
            created_ms: 0,
            stamp: Stamp::default(),
            current: true,
            origin: Origin::Generated,
            read_only: false,
            kind: None,
            modified_from: None,
        }
    }

    #[test]
    fn the_budget_drops_old_versions_oldest_first_and_refuses_what_cannot_fit() {
        let mib = 1 << 20;
        let mut index = FileIndex::default();
        index.push_current(record("a1", "a", "ha1", mib));
        index.push_current(record("b1", "b", "hb1", mib));
        index.push_current(record("a2", "a", "ha2", mib));
        index.push_current(record("b2", "b", "hb2", mib));
        assert_eq!(index.stored_bytes(), 4 * mib + 4 * RECORD_COST);
        let limit = 4 * mib + 4 * RECORD_COST;
        // One more MiB for a new name: the oldest old version (a1) goes, b1 stays.
        let extra = index.cost_of(Some("hc1"), mib);
        let dropped = index
            .make_room(extra, limit, Some("c"), Some("hc1"))
            .unwrap();
        let ids = |d: &Dropped| d.records.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&dropped), ["a1"]);
        assert_eq!(dropped.blobs, ["ha1"]);
        index.push_current(record("c1", "c", "hc1", mib));
        assert!(index.get("a1").is_none());
        assert_eq!(index.current("a").unwrap().id, "a2");
        // Two MiB more for a new name cannot fit even without b1: nothing is dropped.
        let extra = index.cost_of(Some("hd1"), 2 * mib);
        assert!(!index.could_fit(extra, limit, Some("d")));
        assert!(index
            .make_room(extra, limit, Some("d"), Some("hd1"))
            .is_none());
        assert!(index.get("b1").is_some());
        // A new version of b: the oldest old version (b1) goes.
        let extra = index.cost_of(Some("hb3"), mib);
        let dropped = index
            .make_room(extra, limit, Some("b"), Some("hb3"))
            .unwrap();
        assert_eq!(ids(&dropped), ["b1"]);
        index.push_current(record("b3", "b", "hb3", mib));
        // Two MiB for a new version of c: b2, then c1 (the version it replaces) go.
        let extra = index.cost_of(Some("hc2"), 2 * mib);
        let dropped = index
            .make_room(extra, limit, Some("c"), Some("hc2"))
            .unwrap();
        assert_eq!(ids(&dropped), ["b2", "c1"]);
        index.push_current(record("c2", "c", "hc2", 2 * mib));
        assert!(index.stored_bytes() <= limit);
        // What is counted survives a save and a load.
        let loaded: FileIndex =
            serde_json::from_slice(&serde_json::to_vec(&index).unwrap()).unwrap();
        assert_eq!(loaded.stored_bytes(), index.stored_bytes());
        assert_eq!(loaded.current("b").unwrap().id, "b3");
        assert_eq!(loaded.get("c2").unwrap().name, "c");
    }

    #[test]
    fn a_retired_version_keeps_its_id_and_can_be_reinstated() {
        let mut index = FileIndex::default();
        index.push_current(record("a1", "a", "ha1", 10));
        let retired = index.retire("a").expect("a is current");
        assert_eq!(retired.id, "a1");
        assert!(index.current("a").is_none());
        assert!(!index.get("a1").unwrap().current);
        assert!(index.retire("a").is_none(), "retired once");
        let stamp = Stamp {
            ino: 7,
            ..Stamp::default()
        };
        assert!(index.reinstate("a1", stamp));
        assert_eq!(index.current("a").unwrap().stamp.ino, 7);
        // A newer version at the name wins over an old one.
        index.push_current(record("a2", "a", "ha2", 10));
        assert!(!index.reinstate("a1", stamp));
        assert_eq!(index.current("a").unwrap().id, "a2");
        let loaded: FileIndex =
            serde_json::from_slice(&serde_json::to_vec(&index).unwrap()).unwrap();
        assert_eq!(loaded.current("a").unwrap().id, "a2");
    }

    #[test]
    fn each_placed_copy_is_charged_until_it_is_gone() {
        let mib = 1 << 20;
        let placed = |id: &str, name: &str| FileRecord {
            origin: Origin::Input,
            ..record(id, name, "same", mib)
        };
        let mut index = FileIndex::default();
        index.push_current(placed("a1", "a"));
        // The blob once, and the copy at `a`.
        assert_eq!(index.stored_bytes(), 2 * mib + RECORD_COST);
        assert_eq!(index.placed_cost_of("same", mib), mib + RECORD_COST);
        for i in 0..3 {
            index.push_current(placed(&format!("c{i}"), &format!("c{i}")));
        }
        assert_eq!(index.stored_bytes(), 5 * mib + 4 * RECORD_COST);
        // 60 more copies of 1 MiB do not fit a budget of 8 MiB: the fifth is refused.
        let limit = 8 * mib + 16 * RECORD_COST;
        let mut fitted = 0;
        for i in 3..63 {
            let extra = index.placed_cost_of("same", mib);
            if index.could_fit(extra, limit, Some(&format!("c{i}"))) {
                index.push_current(placed(&format!("c{i}"), &format!("c{i}")));
                fitted += 1;
            }
        }
        assert_eq!(fitted, 3);
        assert!(index.stored_bytes() <= limit);
        // A copy the code deleted, or replaced by its own file, costs nothing more.
        let before = index.stored_bytes();
        index.retire("c0");
        assert_eq!(index.stored_bytes(), before - mib);
        index.push_current(record("g1", "c1", "mine", mib));
        // c1's copy goes, the code's file brings its blob.
        assert_eq!(index.stored_bytes(), before - 2 * mib + mib + RECORD_COST);
        assert!(index.reinstate("c0", Stamp::default()));
        assert_eq!(index.stored_bytes(), before + RECORD_COST);
        let loaded: FileIndex =
            serde_json::from_slice(&serde_json::to_vec(&index).unwrap()).unwrap();
        assert_eq!(loaded.stored_bytes(), index.stored_bytes());
        assert_eq!(loaded.floor_bytes(), index.floor_bytes());
    }

    #[test]
    fn a_shared_blob_is_counted_once_and_kept_while_named() {
        let mut index = FileIndex::default();
        index.push_current(record("a1", "a", "same", 10_000));
        index.push_current(record("b1", "b", "same", 10_000));
        assert_eq!(index.stored_bytes(), blob_cost(10_000) + 2 * RECORD_COST);
        assert_eq!(index.cost_of(Some("same"), 10_000), RECORD_COST);
        let dropped = index.remove("a1");
        assert!(dropped.blobs.is_empty(), "b1 still needs it");
        let dropped = index.remove("b1");
        assert_eq!(dropped.blobs, ["same"]);
        assert_eq!(index.stored_bytes(), 0);
    }
}
