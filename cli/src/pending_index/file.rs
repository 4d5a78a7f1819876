//! The index's files: they hold every tenant's headers and kept bodies, so they are private to
//! the user that runs the tool. The database file is made 0600 before SQLite opens it (SQLite
//! gives its `-wal` and `-shm` files the database file's mode), files left readable by others
//! (an index made by an older version) are narrowed to 0600, and a directory the tool makes is
//! 0700. A symbolic link at any of the three paths is refused, dangling or not: nothing is
//! created through it (`O_NOFOLLOW` here, `SQLITE_OPEN_NOFOLLOW` when SQLite opens the file).

use std::fs::{DirBuilder, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The mode of the index's files.
pub const FILE_MODE: u32 = 0o600;
/// The mode of a directory the tool makes for its index.
pub const DIR_MODE: u32 = 0o700;
/// What `open` fails with on a symbolic link under `O_NOFOLLOW`.
const LOOP: i32 = rustix::io::Errno::LOOP.raw_os_error();

/// Opens the index at `path` as SQLite, made private first ([`prepare`]).
pub fn open(path: &Path) -> super::Result<rusqlite::Connection> {
    prepare(path).map_err(super::Error::Invalid)?;
    let flags = rusqlite::OpenFlags::default() | rusqlite::OpenFlags::SQLITE_OPEN_NOFOLLOW;
    Ok(rusqlite::Connection::open_with_flags(path, flags)?)
}

/// The files SQLite keeps beside the database at `path`.
pub fn companions(path: &Path) -> [PathBuf; 2] {
    ["-wal", "-shm"].map(|ext| {
        let mut p = path.as_os_str().to_owned();
        p.push(ext);
        PathBuf::from(p)
    })
}

/// Makes the database file at `path` (and its directory) private before SQLite opens it, and
/// narrows `-wal` and `-shm` files that exist; `Err` says what is wrong with the path. An
/// in-memory index (`:memory:`) has no files.
pub fn prepare(path: &Path) -> Result<(), String> {
    if path.as_os_str().is_empty() || path == Path::new(":memory:") {
        return Ok(());
    }
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty())
        && std::fs::symlink_metadata(dir).is_err()
    {
        DirBuilder::new()
            .recursive(true)
            .mode(DIR_MODE)
            .create(dir)
            .map_err(|e| format!("making the directory {}: {e}", dir.display()))?;
    }
    // the companions first: a link planted at one of them leaves nothing made
    for p in companions(path) {
        open_private(&p, false)?;
    }
    open_private(path, true)
}

/// Opens `path` without following a symbolic link (made 0600 when `create` and missing) and
/// narrows its mode to 0600.
fn open_private(path: &Path, create: bool) -> Result<(), String> {
    let opened = OpenOptions::new()
        .read(true)
        .write(true)
        .create(create)
        .mode(FILE_MODE)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(path);
    let file = match opened {
        Ok(f) => f,
        Err(e) if !create && e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) if is_symlink(path) || e.raw_os_error() == Some(LOOP) => {
            return Err(format!(
                "{} is a symbolic link: the index is never opened through one (give the path \
                 of the file itself, in a directory only its user can write)",
                path.display()
            ));
        }
        Err(e) => return Err(format!("opening {}: {e}", path.display())),
    };
    narrow(&file, path)
}

fn is_symlink(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink())
}

/// Sets `file`'s mode to 0600 unless it is already no wider.
fn narrow(file: &File, path: &Path) -> Result<(), String> {
    let meta = file
        .metadata()
        .map_err(|e| format!("reading {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("{} is not a regular file", path.display()));
    }
    if meta.permissions().mode() & 0o777 & !FILE_MODE != 0 {
        file.set_permissions(std::fs::Permissions::from_mode(FILE_MODE))
            .map_err(|e| format!("making {} private (0600): {e}", path.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pending_index::{Destination, Entry, Options, PendingIndex, Scheduled};

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("ix-file-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
    }

    fn entry(i: u32) -> Entry {
        Entry::Scheduled(Scheduled {
            id: format!("m-{i}"),
            owner: "alice".into(),
            destination: Destination::Queue("q".into()),
            due_at_ms: 1_000,
            scheduled_at_ms: 1,
            size: 1,
            content_type: None,
            headers: vec![("tenant".into(), "secret".into())],
            body: None,
            confirmed: true,
        })
    }

    #[test]
    fn the_index_and_its_wal_and_shm_are_private_under_umask_022() {
        rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o022));
        let d = dir();
        let path = d.join("made").join("pending.db");
        let mut ix = PendingIndex::open(&path, Options::default()).unwrap();
        // a second connection, as the console's pages open the same file
        let reader = PendingIndex::open(&path, Options::default()).unwrap();
        ix.apply(&(0..100).map(entry).collect::<Vec<_>>()).unwrap();
        let [wal, shm] = companions(&path);
        for p in [&path, &wal, &shm] {
            assert_eq!(mode(p), 0o600, "{}", p.display());
        }
        assert_eq!(mode(&d.join("made")), 0o700, "the directory it made");
        drop((ix, reader));
        // an index an older version left readable by everyone is narrowed when opened
        for p in [&path, &wal, &shm] {
            if p.exists() {
                std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o644)).unwrap();
            }
        }
        let _ix = PendingIndex::open(&path, Options::default()).unwrap();
        for p in [&path, &wal, &shm] {
            if p.exists() {
                assert_eq!(mode(p), 0o600, "{}", p.display());
            }
        }
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_symlink_at_the_path_is_refused_and_nothing_is_made_through_it() {
        let d = dir();
        let existing = d.join("victim");
        std::fs::write(&existing, b"keep me").unwrap();
        let before = mode(&existing);
        let missing = d.join("would-be-made");
        for (link, target) in [("dangling.db", &missing), ("to-a-file.db", &existing)] {
            let path = d.join(link);
            std::os::unix::fs::symlink(target, &path).unwrap();
            let e = PendingIndex::open(&path, Options::default())
                .err()
                .unwrap()
                .to_string();
            assert!(e.contains("is a symbolic link"), "{e}");
            assert!(e.contains(link), "{e}");
        }
        assert!(!missing.exists(), "no target was made");
        assert_eq!(std::fs::read(&existing).unwrap(), b"keep me");
        assert_eq!(mode(&existing), before, "the target's mode is left alone");
        // a link planted where SQLite would make its write-ahead log
        let path = d.join("pending.db");
        std::os::unix::fs::symlink(&missing, companions(&path)[0].clone()).unwrap();
        let e = PendingIndex::open(&path, Options::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("pending.db-wal is a symbolic link"), "{e}");
        assert!(!missing.exists() && !path.exists(), "nothing made");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
