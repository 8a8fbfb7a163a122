//! File moves through the sandbox's runner (`CODEBROKER_FILE_TRANSFER=runner`): the
//! broker never opens the sandbox's workspace directory; the runner lists, reads, writes
//! and removes files at its request (see `sandbox_runner::files`).
//!
//! Nothing the runner says is trusted: every name it reports is checked by the rules its
//! listing claims to follow (plain, relative, bounded, nothing hidden or skipped), names are
//! counted and deduplicated, each chunk must be no longer than asked for, the bytes are
//! hashed here as they come and counted against the same limits as on the host path. A
//! hostile runner can only spoil its own session's files.
//!
//! These functions block (each request waits on the runtime): call them off the async
//! threads, as the host path's file moves are.
//!
//! Files a session gets while it has no live sandbox (an upload, an input file, a
//! deletion) cannot reach one: they are recorded in the session's `pending-files.json`
//! and carried out by [`apply_pending`] once a sandbox is attached.

use super::{ChannelError, Sandbox};
use crate::workspace::{FileIndex, FileRecord, HarvestSource, Stamp, Workspace, MAX_ENTRIES};
use sandbox_runner::files::{
    is_listed_name, is_plain_name, FileChunk, FileWritten, ListFilesRequest, ReadFileRequest,
    RemoveFileRequest, WriteFileRequest, MAX_CHUNK_BYTES,
};
use sandbox_runner::Request;
use sha2::{Digest, Sha256};
use std::collections::HashSet;
use std::io::{self, Read, Write};
use std::path::Path;
use std::time::Duration;

/// How long one file request may take before the runner is taken for broken.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

/// Where a session keeps the file moves that wait for a sandbox.
const PENDING_FILE: &str = "pending-files.json";

/// A file move that waits for the session's next sandbox.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
enum Pending {
    /// Place the blob `sha256` at `name`.
    Place {
        /// Where it goes below `/mnt/data`.
        name: String,
        /// The stored blob to place.
        sha256: String,
        /// Whether it is placed read-only.
        read_only: bool,
    },
    /// Remove `name` if it is still the version `stamp` describes.
    Remove {
        /// The file below `/mnt/data`.
        name: String,
        /// The version placed.
        stamp: Stamp,
    },
}

/// Sends one file request and waits for its answer, from a blocking thread.
fn request<R: Request>(sandbox: &Sandbox, req: R) -> io::Result<R::Response> {
    request_within(sandbox, req, REQUEST_TIMEOUT)
}

/// Sends one request and waits up to `timeout` for its answer, from a blocking thread.
pub(super) fn request_within<R: Request>(
    sandbox: &Sandbox,
    req: R,
    timeout: Duration,
) -> io::Result<R::Response> {
    let handle = tokio::runtime::Handle::try_current().map_err(io::Error::other)?;
    handle
        .block_on(async { tokio::time::timeout(timeout, sandbox.file_request(req)).await })
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "the runner did not answer"))?
        .map_err(channel_error)
}

fn channel_error(err: ChannelError) -> io::Error {
    match err {
        // The runner's own words for a missing or refused file.
        ChannelError::Refused(why) => io::Error::new(io::ErrorKind::NotFound, why),
        other => io::Error::other(other),
    }
}

/// Reads the file `name` from the sandbox into `out`, hashing it: its hash and size, or
/// `None` once more than `max_bytes` came.
fn read_hashing(
    sandbox: &Sandbox,
    name: &str,
    max_bytes: u64,
    out: &mut impl Write,
) -> io::Result<Option<(String, u64)>> {
    if !is_plain_name(name) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad file name"));
    }
    let fetch = |offset, len| {
        let req = ReadFileRequest {
            name: name.to_string(),
            offset,
            len,
        };
        request(sandbox, req)
    };
    read_chunks(fetch, max_bytes, out)
}

/// Reads a file through `fetch(offset, len)`, one chunk at a time, into `out`, hashing
/// it: its hash and size, or `None` once more than `max_bytes` came. A chunk longer than
/// asked for is an error. Shared by workspace files and the Python state file.
pub(super) fn read_chunks(
    mut fetch: impl FnMut(u64, u32) -> io::Result<FileChunk>,
    max_bytes: u64,
    out: &mut impl Write,
) -> io::Result<Option<(String, u64)>> {
    let mut hasher = Sha256::new();
    let mut total = 0u64;
    loop {
        // One byte more than allowed tells an oversized file from one that just fits.
        let want = (max_bytes.saturating_add(1) - total).min(u64::from(MAX_CHUNK_BYTES)) as u32;
        let chunk = fetch(total, want)?;
        if chunk.data.len() > want as usize {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the runner sent more than asked for",
            ));
        }
        total += chunk.data.len() as u64;
        if total > max_bytes {
            return Ok(None);
        }
        hasher.update(&chunk.data);
        out.write_all(&chunk.data)?;
        if chunk.eof || chunk.data.is_empty() {
            return Ok(Some((hex::encode(hasher.finalize()), total)));
        }
    }
}

/// The files of a live sandbox, as a harvest reaches them through its runner.
pub(crate) struct RunnerFiles<'a> {
    /// The sandbox whose runner answers.
    pub(crate) sandbox: &'a Sandbox,
}

impl HarvestSource for RunnerFiles<'_> {
    fn list(&mut self) -> io::Result<(Vec<(String, Stamp)>, bool)> {
        let listing = request(self.sandbox, ListFilesRequest::default())?;
        let mut truncated = listing.truncated;
        let mut seen = HashSet::new();
        let mut found = Vec::new();
        let mut refused = 0usize;
        for file in listing.files {
            if found.len() >= MAX_ENTRIES {
                truncated = true;
                break;
            }
            if !is_listed_name(&file.name) {
                refused += 1;
                continue;
            }
            if seen.insert(file.name.clone()) {
                found.push((file.name, file.stamp));
            }
        }
        if refused > 0 {
            tracing::warn!(
                container = %super::short(&self.sandbox.container_id),
                refused,
                "the runner listed names no listing holds; left out"
            );
        }
        Ok((found, truncated))
    }

    fn hash(&mut self, name: &str, max_bytes: u64) -> io::Result<Option<String>> {
        Ok(read_hashing(self.sandbox, name, max_bytes, &mut io::sink())?.map(|(sha, _)| sha))
    }

    fn store_blob(
        &mut self,
        workspace: &Workspace,
        name: &str,
        max_bytes: u64,
    ) -> io::Result<Option<(String, u64)>> {
        let (temp, mut out) = workspace.blob_temp()?;
        let copied = read_hashing(self.sandbox, name, max_bytes, &mut out);
        drop(out);
        match copied {
            Ok(Some((sha, size))) => {
                workspace.commit_blob(&temp, &sha)?;
                Ok(Some((sha, size)))
            }
            other => {
                let _ = std::fs::remove_file(&temp);
                other
            }
        }
    }
}

/// Reads the file `name` of the sandbox; `None` when it has more than `max_bytes`.
pub(crate) fn read_file(
    sandbox: &Sandbox,
    name: &str,
    max_bytes: u64,
) -> io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    Ok(read_hashing(sandbox, name, max_bytes, &mut bytes)?.map(|_| bytes))
}

/// Writes the stored `blob` at `name` in the sandbox, in chunks: whatever was at the name
/// (but a directory) is replaced. Returns the stamp of the written file.
fn write_blob(sandbox: &Sandbox, blob: &Path, name: &str, read_only: bool) -> io::Result<Stamp> {
    if !is_plain_name(name) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "bad file name"));
    }
    let put = |offset, data, last| {
        let req = WriteFileRequest {
            name: name.to_string(),
            offset,
            data,
            create: offset == 0,
            // 0444 only at the end: the runner could not write the rest after it.
            read_only: read_only && last,
        };
        request(sandbox, req)
    };
    Ok(write_chunks(blob, put)?.stamp)
}

/// Sends the file `src` through `put(offset, bytes, last)`, one chunk at a time (the first
/// at offset 0 creates the file); the last chunk's answer. Shared by workspace files and
/// the Python state file.
pub(super) fn write_chunks(
    src: &Path,
    mut put: impl FnMut(u64, Vec<u8>, bool) -> io::Result<FileWritten>,
) -> io::Result<FileWritten> {
    let mut src = std::fs::File::open(src)?;
    let size = src.metadata()?.len();
    let mut offset = 0u64;
    let mut buf = vec![0u8; MAX_CHUNK_BYTES as usize];
    loop {
        let want = (size - offset).min(u64::from(MAX_CHUNK_BYTES)) as usize;
        src.read_exact(&mut buf[..want])?;
        let last = offset + want as u64 >= size;
        let written = put(offset, buf[..want].to_vec(), last)?;
        offset += want as u64;
        if last {
            return Ok(written);
        }
    }
}

/// Places the stored `blob` at `name` in the session's sandbox, or records it for the
/// next sandbox when none is live (the stamp is then the empty one: nothing is there yet).
pub(crate) fn place_file(
    workspace: &Workspace,
    sandbox: Option<&Sandbox>,
    blob: &Path,
    name: &Path,
    read_only: bool,
) -> io::Result<Stamp> {
    let name = name.to_string_lossy().into_owned();
    match sandbox {
        Some(sandbox) => write_blob(sandbox, blob, &name, read_only),
        None => {
            let sha256 = blob
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| io::Error::other("a blob without a hash for a name"))?
                .to_string();
            let mut pending = load_pending(workspace)?;
            pending.push(Pending::Place {
                name,
                sha256,
                read_only,
            });
            workspace.save_meta(PENDING_FILE, &pending)?;
            Ok(Stamp::default())
        }
    }
}

/// Removes the sandbox's file of `record` if it is still that version, or records the
/// removal for the next sandbox when none is live.
pub(crate) fn remove_file(
    workspace: &Workspace,
    sandbox: Option<&Sandbox>,
    record: &FileRecord,
) -> io::Result<()> {
    match sandbox {
        Some(sandbox) => {
            let req = RemoveFileRequest {
                name: record.name.clone(),
                stamp: record.stamp,
            };
            match request(sandbox, req) {
                Ok(_) => Ok(()),
                // Gone already: nothing to remove.
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            }
        }
        None => {
            let mut pending = load_pending(workspace)?;
            // Never placed: the placement is dropped instead.
            let before = pending.len();
            pending.retain(|p| {
                !matches!(p, Pending::Place { name, sha256, .. }
                    if *name == record.name && *sha256 == record.sha256 && record.stamp == Stamp::default())
            });
            if pending.len() == before {
                pending.push(Pending::Remove {
                    name: record.name.clone(),
                    stamp: record.stamp,
                });
            }
            workspace.save_meta(PENDING_FILE, &pending)
        }
    }
}

/// Carries out the file moves recorded while the session had no sandbox, now that
/// `sandbox` is attached: placed files get their stamps in `index`. Returns whether the
/// index changed, and a note per file that could not be placed.
pub(crate) fn apply_pending(
    workspace: &Workspace,
    sandbox: &Sandbox,
    index: &mut FileIndex,
) -> io::Result<(bool, Vec<String>)> {
    let pending = load_pending(workspace)?;
    if pending.is_empty() {
        return Ok((false, Vec::new()));
    }
    let mut changed = false;
    let mut notes = Vec::new();
    for op in pending {
        match op {
            Pending::Place {
                name,
                sha256,
                read_only,
            } => {
                // Only what is still the current version there: a later upload or a
                // deletion made it moot.
                let Some(id) = index
                    .current(&name)
                    .filter(|r| r.sha256 == sha256)
                    .map(|r| r.id.clone())
                else {
                    continue;
                };
                match write_blob(sandbox, &workspace.blob_path(&sha256), &name, read_only) {
                    Ok(stamp) => {
                        index.set_stamp(&id, stamp);
                        changed = true;
                    }
                    Err(err) => {
                        notes.push(format!("Input file {name:?} could not be placed: {err}"))
                    }
                }
            }
            Pending::Remove { name, stamp } => {
                let req = RemoveFileRequest { name, stamp };
                let _ = request(sandbox, req);
            }
        }
    }
    match std::fs::remove_file(workspace.root().join(PENDING_FILE)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    Ok((changed, notes))
}

/// Places every current file of `index` that the sandbox lacks, from the broker's store:
/// for a sandbox whose workspace starts empty (a new pod of a session that has files).
/// Placed files get their stamps in `index`. Returns whether the index changed, and a
/// note per file that could not be placed.
pub(crate) fn restore_missing(
    workspace: &Workspace,
    sandbox: &Sandbox,
    index: &mut FileIndex,
) -> io::Result<(bool, Vec<String>)> {
    let (listed, truncated) = RunnerFiles { sandbox }.list()?;
    if truncated {
        // Not every file was listed: whatever is missing cannot be told apart.
        return Ok((false, Vec::new()));
    }
    let present: HashSet<String> = listed.into_iter().map(|(name, _)| name).collect();
    let missing: Vec<FileRecord> = index
        .current_records()
        .filter(|r| !present.contains(&r.name))
        .cloned()
        .collect();
    let mut changed = false;
    let mut notes = Vec::new();
    for record in missing {
        let blob = workspace.blob_path(&record.sha256);
        match write_blob(sandbox, &blob, &record.name, record.read_only) {
            Ok(stamp) => {
                index.set_stamp(&record.id, stamp);
                changed = true;
            }
            Err(err) => notes.push(format!(
                "{:?} could not be put back in /mnt/data: {err}",
                record.name
            )),
        }
    }
    Ok((changed, notes))
}

fn load_pending(workspace: &Workspace) -> io::Result<Vec<Pending>> {
    match workspace.load_meta(PENDING_FILE) {
        Ok(pending) => Ok(pending),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sandbox::channel::AttachOutput;
    use crate::sandbox::RunnerChannel;
    use sandbox_runner::files::{FileChunk, FileList, ListedFile};
    use sandbox_runner::{CoordinatorMessage, Multiplexed, WorkerMessage};
    use std::sync::Arc;
    use tokio::io::AsyncBufReadExt;

    /// A sandbox whose runner is `answer`: each request frame gets the message it returns.
    fn fake_sandbox(
        answer: impl Fn(CoordinatorMessage) -> WorkerMessage + Send + 'static,
    ) -> Arc<Sandbox> {
        let (out_tx, mut out_rx) =
            tokio::sync::mpsc::unbounded_channel::<Result<AttachOutput, String>>();
        let (input, requests) = tokio::io::duplex(1 << 20);
        let output = futures::stream::poll_fn(move |cx| out_rx.poll_recv(cx));
        let channel = RunnerChannel::new("fake".into(), output, Box::pin(input));
        tokio::spawn(async move {
            let mut lines = tokio::io::BufReader::new(requests).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let Ok(Multiplexed(job, msg)) = serde_json::from_str(&line) else {
                    continue;
                };
                let mut frame = serde_json::to_vec(&Multiplexed(job, answer(msg))).expect("frame");
                frame.push(b'\n');
                let _ = out_tx.send(Ok(AttachOutput::Stdout(frame.into())));
            }
        });
        Arc::new(Sandbox::new("fake".into(), channel))
    }

    fn listed(name: &str) -> ListedFile {
        ListedFile {
            name: name.into(),
            stamp: Stamp::default(),
            sha256: None,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn names_a_hostile_runner_lists_are_checked() {
        let long = "x".repeat(2000);
        let names = [
            "../escape",
            "/etc/passwd",
            "a\0b",
            ".hidden",
            "ok.txt",
            "ok.txt",
            "node_modules/x.js",
            "a/./b",
            "a//b",
            "dir/",
            long.as_str(),
            "dir/ok.bin",
        ];
        let files: Vec<ListedFile> = names.iter().map(|n| listed(n)).collect();
        let sandbox = fake_sandbox(move |_| {
            WorkerMessage::FileList(FileList {
                files: files.clone(),
                truncated: false,
            })
        });
        let (found, truncated) =
            tokio::task::spawn_blocking(move || RunnerFiles { sandbox: &sandbox }.list())
                .await
                .expect("task")
                .expect("list");
        let found: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(found, ["ok.txt", "dir/ok.bin"]);
        assert!(!truncated);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_hostile_runner_cannot_send_more_than_asked_or_without_end() {
        // Always more bytes than asked for.
        let flood = fake_sandbox(|msg| match msg {
            CoordinatorMessage::ReadFile(req) => WorkerMessage::FileChunk(FileChunk {
                data: vec![0; req.len as usize + 1],
                size: 0,
                eof: false,
            }),
            _ => WorkerMessage::FileRemoved(sandbox_runner::FileRemoved { removed: false }),
        });
        let err = tokio::task::spawn_blocking(move || read_file(&flood, "a", 100))
            .await
            .expect("task")
            .expect_err("refused");
        assert_eq!(err.kind(), io::ErrorKind::InvalidData);
        // Chunks that never end: counted against the limit, then given up.
        let endless = fake_sandbox(|msg| match msg {
            CoordinatorMessage::ReadFile(req) => WorkerMessage::FileChunk(FileChunk {
                data: vec![7; req.len.min(1000) as usize],
                size: 1,
                eof: false,
            }),
            _ => WorkerMessage::FileRemoved(sandbox_runner::FileRemoved { removed: false }),
        });
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        std::fs::create_dir_all(ws.root()).expect("root");
        let stored = tokio::task::spawn_blocking(move || {
            RunnerFiles { sandbox: &endless }.store_blob(&ws, "a", 10_000)
        })
        .await
        .expect("task")
        .expect("read");
        assert_eq!(stored, None);
        // Nothing of it is left in the blob store.
        let left = std::fs::read_dir(dir.path().join("sessions/s/blobs"))
            .expect("blobs")
            .count();
        assert_eq!(left, 0);
        // An answer of the wrong kind is an error, not a file.
        let liar = fake_sandbox(|_| WorkerMessage::FileList(FileList::default()));
        assert!(
            tokio::task::spawn_blocking(move || read_file(&liar, "a", 10))
                .await
                .expect("task")
                .is_err()
        );
    }

    fn record(name: &str, sha256: &str, stamp: Stamp) -> FileRecord {
        FileRecord {
            id: "id".into(),
            name: name.into(),
            size: 1,
            sha256: sha256.into(),
            created_ms: 0,
            stamp,
            current: true,
            origin: crate::workspace::Origin::Uploaded,
            read_only: false,
            kind: None,
            modified_from: None,
        }
    }

    #[test]
    fn moves_without_a_sandbox_wait_and_a_removal_cancels_a_placement() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        std::fs::create_dir_all(ws.root()).expect("root");
        let blob = ws.blob_path("abc");
        let stamp = place_file(&ws, None, &blob, Path::new("in/a.txt"), true).expect("recorded");
        assert_eq!(stamp, Stamp::default());
        let pending = load_pending(&ws).expect("load");
        assert!(
            matches!(&pending[..], [Pending::Place { name, sha256, read_only: true }]
            if name == "in/a.txt" && sha256 == "abc")
        );
        // Deleted before any sandbox saw it: nothing is left to do.
        remove_file(&ws, None, &record("in/a.txt", "abc", Stamp::default())).expect("remove");
        assert!(load_pending(&ws).expect("load").is_empty());
        // A placed version is removed by the next sandbox.
        let placed = Stamp {
            ino: 7,
            size: 1,
            ctime: 1,
            ctime_nsec: 2,
        };
        remove_file(&ws, None, &record("b", "def", placed)).expect("remove");
        assert!(matches!(&load_pending(&ws).expect("load")[..],
            [Pending::Remove { name, stamp }] if name == "b" && *stamp == placed));
        // The broker never looked at the sandbox's directory.
        assert!(!ws.files_dir().exists());
    }

    /// A new pod's workspace starts empty: the session's current files it lacks are put
    /// back from the store, those it has are left alone, and old versions never go back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fresh_sandbox_gets_back_the_current_files_it_lacks() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        std::fs::create_dir_all(ws.blob_path("x").parent().expect("blobs")).expect("blobs");
        std::fs::write(ws.blob_path("aaa"), b"kept").expect("blob");
        std::fs::write(ws.blob_path("bbb"), b"gone from the pod").expect("blob");
        let mut index = FileIndex::default();
        let mut old = record("out/report.csv", "ccc", Stamp::default());
        old.id = "old".into();
        index.push_current(old);
        let mut kept = record("kept.txt", "aaa", Stamp::default());
        kept.id = "kept".into();
        index.push_current(kept);
        let mut gone = record("out/report.csv", "bbb", Stamp::default());
        gone.id = "gone".into();
        gone.read_only = true;
        index.push_current(gone);
        let written = Arc::new(std::sync::Mutex::new(Vec::new()));
        let log = written.clone();
        let sandbox = fake_sandbox(move |msg| match msg {
            CoordinatorMessage::ListFiles(_) => WorkerMessage::FileList(FileList {
                files: vec![listed("kept.txt")],
                truncated: false,
            }),
            CoordinatorMessage::WriteFile(req) => {
                log.lock()
                    .expect("log")
                    .push((req.name, req.data.len(), req.read_only));
                WorkerMessage::FileWritten(sandbox_runner::files::FileWritten {
                    stamp: Stamp {
                        ino: 42,
                        size: 17,
                        ctime: 1,
                        ctime_nsec: 0,
                    },
                })
            }
            _ => WorkerMessage::FileRemoved(sandbox_runner::FileRemoved { removed: false }),
        });
        let (changed, notes, index) = tokio::task::spawn_blocking(move || {
            let (changed, notes) = restore_missing(&ws, &sandbox, &mut index).expect("restored");
            (changed, notes, index)
        })
        .await
        .expect("task");
        assert!(changed);
        assert!(notes.is_empty(), "{notes:?}");
        assert_eq!(
            *written.lock().expect("written"),
            [("out/report.csv".to_string(), 17, true)]
        );
        assert_eq!(index.get("gone").map(|r| r.stamp.ino), Some(42));
        assert_eq!(index.get("kept").map(|r| r.stamp), Some(Stamp::default()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_truncated_listing_restores_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ws = Workspace::new(dir.path(), "s");
        let mut index = FileIndex::default();
        index.push_current(record("a.txt", "aaa", Stamp::default()));
        let sandbox = fake_sandbox(|_| {
            WorkerMessage::FileList(FileList {
                files: Vec::new(),
                truncated: true,
            })
        });
        let changed = tokio::task::spawn_blocking(move || {
            restore_missing(&ws, &sandbox, &mut index)
                .expect("listed")
                .0
        })
        .await
        .expect("task");
        assert!(!changed);
    }
}
