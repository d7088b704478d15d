//! The data directory: its format version, its lock, and the harness identities bound to it.
//!
//! ```text
//! <data>/FORMAT                                   the format version
//! <data>/brain.lock                               held (flock) for the life of the process
//! <data>/journal/                                 the journal's segments
//! <data>/agentloops/<registration>/harness.json   identity name + state version
//! <data>/agentloops/<registration>/<session_id>/  native state (harness-owned)
//! ```

use crate::protocol::harness::InitializeResult;
use crate::session::{InstanceName, SessionId};
use nix::fcntl::{Flock, FlockArg};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// The data-directory format this Brain reads and writes.
pub const FORMAT: &str = "brain-data 1";

/// Why the data directory cannot be used.
#[derive(Debug)]
pub enum DataDirError {
    /// Another process holds `brain.lock`.
    Locked(PathBuf),
    /// The directory was written by another format version (or is not a Brain data directory).
    WrongFormat {
        /// The data directory.
        path: PathBuf,
        /// What its `FORMAT` says (or why there is none).
        found: String,
    },
    /// A harness's identity or state version differs from the one bound to the directory.
    IdentityMismatch {
        /// The registration.
        registration: String,
        /// The identity bound to the directory.
        bound: String,
        /// The identity its workers declare.
        found: String,
    },
    /// The directory was first started under another instance name (or without one).
    InstanceMismatch {
        /// The data directory.
        path: PathBuf,
        /// The name recorded at first start (`None`: started without `--instance`).
        recorded: Option<String>,
        /// The name given now (`None`: no `--instance`).
        given: Option<String>,
    },
    /// An operating-system error, with what Brain was doing.
    Io(String, io::Error),
}

impl DataDirError {
    /// Whether the operator's configuration is at fault (exit 78) rather than the system.
    pub fn is_configuration(&self) -> bool {
        !matches!(self, DataDirError::Io(..))
    }
}

impl fmt::Display for DataDirError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DataDirError::Locked(path) => write!(
                f,
                "the data directory {} is in use by another Brain (its brain.lock is held)",
                path.display()
            ),
            DataDirError::WrongFormat { path, found } => write!(
                f,
                "{} holds data of format {found:?}, not {FORMAT:?}: start with a new data directory",
                path.display()
            ),
            DataDirError::IdentityMismatch {
                registration,
                bound,
                found,
            } => write!(
                f,
                "registration {registration:?}: the data directory is bound to harness {bound}, \
                 but the workers declare {found}: a new state version needs a new data directory \
                 or an explicit migration"
            ),
            DataDirError::InstanceMismatch {
                path,
                recorded,
                given,
            } => {
                let show = |name: &Option<String>| match name {
                    Some(name) => format!("instance {name:?}"),
                    None => "no instance name".to_owned(),
                };
                write!(
                    f,
                    "{} belongs to {}, but this Brain was started with {}: the name is part of \
                     every session id, so an instance keeps its data directory and its name",
                    path.display(),
                    show(recorded),
                    show(given)
                )
            }
            DataDirError::Io(what, error) => write!(f, "{what}: {error}"),
        }
    }
}

impl std::error::Error for DataDirError {}

fn io(what: impl Into<String>) -> impl FnOnce(io::Error) -> DataDirError {
    let what = what.into();
    move |error| DataDirError::Io(what, error)
}

/// The identity a registration's harness is bound to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Binding {
    identity: String,
    state_version: String,
}

impl fmt::Display for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} state version {:?}",
            self.identity, self.state_version
        )
    }
}

/// An open, locked data directory. The lock is released when this is dropped.
#[derive(Debug)]
pub struct DataDir {
    root: PathBuf,
    _lock: Flock<File>,
}

impl DataDir {
    /// Opens (creating, mode 0700) and locks the data directory, and checks its format. Refuses a
    /// directory locked by another process, of another format, or non-empty without a `FORMAT`.
    pub fn open(root: &Path) -> Result<DataDir, DataDirError> {
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(root)
            .map_err(io(format!("creating {}", root.display())))?;
        let lock_path = root.join("brain.lock");
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .open(&lock_path)
            .map_err(io(format!("opening {}", lock_path.display())))?;
        let lock = match Flock::lock(lock_file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => {
                return Err(DataDirError::Locked(root.to_path_buf()));
            }
            Err((_, errno)) => {
                return Err(DataDirError::Io(
                    format!("locking {}", lock_path.display()),
                    io::Error::from(errno),
                ));
            }
        };
        let format_path = root.join("FORMAT");
        match fs::read_to_string(&format_path) {
            Ok(found) if found.trim() == FORMAT => {}
            Ok(found) => {
                return Err(DataDirError::WrongFormat {
                    path: root.to_path_buf(),
                    found: found.trim().chars().take(64).collect(),
                });
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let foreign = fs::read_dir(root)
                    .map_err(io(format!("listing {}", root.display())))?
                    .filter_map(Result::ok)
                    .any(|entry| entry.file_name() != "brain.lock");
                if foreign {
                    return Err(DataDirError::WrongFormat {
                        path: root.to_path_buf(),
                        found: "no FORMAT file".to_owned(),
                    });
                }
                write_durably(&format_path, format!("{FORMAT}\n").as_bytes())?;
            }
            Err(error) => return Err(io(format!("reading {}", format_path.display()))(error)),
        }
        for sub in ["journal", "agentloops"] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(root.join(sub))
                .map_err(io(format!("creating {}", root.join(sub).display())))?;
        }
        sync_dir(root)?;
        Ok(DataDir {
            root: root.to_path_buf(),
            _lock: lock,
        })
    }

    /// The directory the journal keeps its segments in.
    pub fn journal_dir(&self) -> PathBuf {
        self.root.join("journal")
    }

    /// Removes the native state directories (`agentloops/<registration>/<session id>/`) and the
    /// workspaces (`workspaces/<session id>/`) of sessions the journal does not hold, and returns how many it removed. Such a directory is
    /// left when Brain stops between a session's durable deletion and the removal of its state
    /// (the deletion is made durable first, so that a crash never brings back a session without
    /// its state), or when a session's creation never became durable. Entries whose names are
    /// not session ids (`harness.json`, anything an operator put there) are left alone.
    ///
    /// For startup, before any session can be created: `live` must be every session the journal
    /// holds, readable or not. A directory that cannot be listed or removed is logged and kept.
    pub(crate) fn remove_orphaned_state(&self, live: &HashSet<SessionId>) -> usize {
        let states = read_dirs(&self.root.join("agentloops"))
            .into_iter()
            .flat_map(|registration| read_dirs(&registration));
        // A session's workspaces (`workspaces/<id>`) go with it, like its native state.
        let workspaces = read_dirs(&self.root.join("workspaces"));
        let mut removed = 0;
        for state in states.chain(workspaces) {
            let orphan = state
                .file_name()
                .and_then(|name| name.to_str())
                .and_then(|name| SessionId::parse(name).ok())
                .is_some_and(|id| !live.contains(&id));
            if !orphan {
                continue;
            }
            match fs::remove_dir_all(&state) {
                Ok(()) => {
                    log::warn!(
                        "removed {}: the state of a session the journal does not hold \
                         (deleted, or never durably created)",
                        state.display()
                    );
                    removed += 1;
                }
                Err(error) => log::error!(
                    "removing {}, the state of a session the journal does not hold: {error}",
                    state.display()
                ),
            }
        }
        removed
    }

    /// Records the instance name (`--instance`) on first start in `INSTANCE`, or checks it
    /// against the recorded one: a data directory keeps the name its session ids carry. A
    /// directory first started without a name records that too (an empty `INSTANCE`) once it
    /// is checked here, so a name cannot be added later to ids that lack it.
    pub fn bind_instance(&self, given: Option<&InstanceName>) -> Result<(), DataDirError> {
        let path = self.root.join("INSTANCE");
        let given_text = given.map(|name| name.as_str().to_owned());
        match fs::read_to_string(&path) {
            Ok(found) => {
                let found = found.trim();
                let recorded = (!found.is_empty()).then(|| found.to_owned());
                if recorded != given_text {
                    return Err(DataDirError::InstanceMismatch {
                        path: self.root.clone(),
                        recorded,
                        given: given_text,
                    });
                }
                Ok(())
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let text = format!("{}\n", given_text.as_deref().unwrap_or(""));
                write_durably(&path, text.as_bytes())
            }
            Err(error) => Err(io(format!("reading {}", path.display()))(error)),
        }
    }

    /// Binds a registration's harness identity to the directory, or checks it against the bound
    /// one: the identity name and state version must match; on first use they are written
    /// atomically and durably.
    pub fn bind_identity(
        &self,
        registration: &str,
        declared: &InitializeResult,
    ) -> Result<(), DataDirError> {
        let dir = self.root.join("agentloops").join(registration);
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io(format!("creating {}", dir.display())))?;
        let path = dir.join("harness.json");
        let found = Binding {
            identity: declared.identity.name.clone(),
            state_version: declared.state_version.clone(),
        };
        match fs::read(&path) {
            Ok(bytes) => {
                let bound: Binding = serde_json::from_slice(&bytes).map_err(|error| {
                    DataDirError::Io(
                        format!("reading {}", path.display()),
                        io::Error::new(io::ErrorKind::InvalidData, error),
                    )
                })?;
                if bound != found {
                    return Err(DataDirError::IdentityMismatch {
                        registration: registration.to_owned(),
                        bound: bound.to_string(),
                        found: found.to_string(),
                    });
                }
                Ok(())
            }
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                let json = serde_json::to_vec_pretty(&found).map_err(|error| {
                    DataDirError::Io("encoding harness.json".to_owned(), io::Error::other(error))
                })?;
                write_durably(&path, &json)
            }
            Err(error) => Err(io(format!("reading {}", path.display()))(error)),
        }
    }
}

/// Writes a file atomically and durably: a temporary file, fsync, rename, directory fsync.
fn write_durably(path: &Path, contents: &[u8]) -> Result<(), DataDirError> {
    let temporary = path.with_extension("tmp");
    let mut file = OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&temporary)
        .map_err(io(format!("creating {}", temporary.display())))?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .map_err(io(format!("writing {}", temporary.display())))?;
    fs::rename(&temporary, path).map_err(io(format!("renaming to {}", path.display())))?;
    match path.parent() {
        Some(parent) => sync_dir(parent),
        None => Ok(()),
    }
}

fn sync_dir(dir: &Path) -> Result<(), DataDirError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io(format!("syncing {}", dir.display())))
}

/// The subdirectories of `dir` (not following symbolic links); none when it does not exist yet
/// (no session has made one), or when it cannot be listed, which is logged.
fn read_dirs(dir: &Path) -> Vec<PathBuf> {
    match fs::read_dir(dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .filter(|entry| entry.file_type().is_ok_and(|kind| kind.is_dir()))
            .map(|entry| entry.path())
            .collect(),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(error) => {
            log::error!("listing {}: {error}", dir.display());
            Vec::new()
        }
    }
}

/// A session's two directories under the data directory `root`: its native state
/// (`agentloops/<registration>/<id>/`) and its workspaces (`workspaces/<id>/`).
pub(crate) fn session_dirs(root: &Path, registration: &str, id: &SessionId) -> [PathBuf; 2] {
    [
        root.join("agentloops").join(registration).join(id.as_str()),
        root.join("workspaces").join(id.as_str()),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::harness::{Capabilities, Identity, PROTOCOL};
    use std::os::unix::fs::PermissionsExt;

    fn temp(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("brain-datadir-{}-{tag}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn declared(name: &str, version: &str) -> InitializeResult {
        InitializeResult {
            protocol: PROTOCOL.to_owned(),
            identity: Identity {
                name: name.to_owned(),
                version: "1.0.0".to_owned(),
            },
            state_version: version.to_owned(),
            capabilities: Capabilities::default(),
            configuration_keys: None,
            required_model_metadata: Vec::new(),
        }
    }

    #[test]
    fn creates_a_private_directory_and_locks_it() {
        let root = temp("lock");
        let first = DataDir::open(&root).unwrap();
        let mode = fs::metadata(&root).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        assert_eq!(
            fs::read_to_string(root.join("FORMAT")).unwrap().trim(),
            FORMAT
        );
        assert!(matches!(DataDir::open(&root), Err(DataDirError::Locked(_))));
        drop(first);
        DataDir::open(&root).unwrap();
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn refuses_another_format_and_foreign_directories() {
        let root = temp("format");
        fs::create_dir_all(&root).unwrap();
        fs::write(root.join("FORMAT"), "brain-data 0\n").unwrap();
        let error = DataDir::open(&root).unwrap_err();
        assert!(error.is_configuration());
        assert!(error.to_string().contains("new data directory"), "{error}");
        fs::remove_file(root.join("FORMAT")).unwrap();
        fs::write(root.join("sessions.db"), "old").unwrap();
        assert!(matches!(
            DataDir::open(&root),
            Err(DataDirError::WrongFormat { .. })
        ));
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn records_the_instance_name_and_refuses_another() {
        let root = temp("instance");
        let b1 = InstanceName::parse("b1").unwrap();
        {
            let dir = DataDir::open(&root).unwrap();
            dir.bind_instance(Some(&b1)).unwrap();
            dir.bind_instance(Some(&b1)).unwrap();
        }
        let dir = DataDir::open(&root).unwrap();
        dir.bind_instance(Some(&b1)).unwrap();
        for other in [Some(InstanceName::parse("b2").unwrap()), None] {
            let error = dir.bind_instance(other.as_ref()).unwrap_err();
            assert!(error.is_configuration());
            assert!(error.to_string().contains("\"b1\""), "{error}");
        }
        drop(dir);
        fs::remove_dir_all(&root).unwrap();
        let root = temp("unnamed");
        let dir = DataDir::open(&root).unwrap();
        dir.bind_instance(None).unwrap();
        let error = dir.bind_instance(Some(&b1)).unwrap_err();
        assert!(error.to_string().contains("no instance name"), "{error}");
        drop(dir);
        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn binds_the_identity_on_first_use_and_refuses_a_change() {
        let root = temp("identity");
        let dir = DataDir::open(&root).unwrap();
        dir.bind_identity("pi", &declared("agentloop-pi", "3"))
            .unwrap();
        dir.bind_identity("pi", &declared("agentloop-pi", "3"))
            .unwrap();
        let error = dir
            .bind_identity("pi", &declared("agentloop-pi", "4"))
            .unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("\"3\"") && message.contains("\"4\""),
            "{message}"
        );
        assert!(error.is_configuration());
        fs::remove_dir_all(&root).unwrap();
    }
}
