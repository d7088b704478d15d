//! Containment: a turn of the OpenCode adapter writes nothing outside the session's state_dir.

use super::*;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Every file, directory and link under `dir` (not following links), with its size and
/// modification time: what a comparison before and after a turn looks at.
fn tree(dir: &Path) -> BTreeMap<PathBuf, (u64, Option<std::time::SystemTime>)> {
    fn walk(
        root: &Path,
        dir: &Path,
        out: &mut BTreeMap<PathBuf, (u64, Option<std::time::SystemTime>)>,
    ) {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let path = entry.path();
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            let relative = path.strip_prefix(root).unwrap_or(&path).to_path_buf();
            out.insert(relative, (meta.len(), meta.modified().ok()));
            if meta.is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// A git repository with one commit at `dir` (OpenCode names a project by its root commit).
fn git_repository(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    for args in [
        &["init", "-q"][..],
        &[
            "-c",
            "user.name=t",
            "-c",
            "user.email=t@t",
            "commit",
            "-q",
            "--allow-empty",
            "-m",
            "root",
        ],
    ] {
        let output = run_bounded(
            std::process::Command::new("git")
                .args(args)
                .current_dir(dir),
        );
        assert!(
            output.status.success(),
            "git {args:?} in {}: {}",
            dir.display(),
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// For each of `paths` beneath `dir` (both resolved through links), its first component there.
fn first_components_beneath(dir: &Path, paths: &[PathBuf]) -> Vec<PathBuf> {
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut names: Vec<PathBuf> = paths
        .iter()
        .filter_map(|path| {
            let path = std::fs::canonicalize(path).ok()?;
            let first = path.strip_prefix(&dir).ok()?.components().next()?;
            Some(PathBuf::from(first.as_os_str()))
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

/// The first `name` on PATH.
fn which(name: &str) -> PathBuf {
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .map(|dir| dir.join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("{name} is not on PATH"))
}

#[test]
fn a_turn_with_a_tool_call_writes_nothing_outside_state_dir() {
    // Unsandboxed (a sandboxed worker cannot write outside its state root at all, so it would
    // prove nothing): the worker runs with the whole file system writable, but through a
    // bubblewrap that mounts test-owned directories over the places a process writes to by
    // default (/tmp, /var/tmp, /dev/shm and HOME, where the XDG defaults are), so that whatever
    // the adapter or OpenCode wrote there shows up. Brain's data directory lies inside a git
    // repository, as it does in a checkout.
    let scratch = Scratch(temp_dir("oc-contained"));
    let places = ["tmp", "var-tmp", "shm", "home", "cwd"].map(|name| scratch.0.join(name));
    for place in &places {
        std::fs::create_dir(place).unwrap();
    }
    let [tmp, var_tmp, shm, home, cwd] = places.clone();
    let repository = scratch.0.join("repository");
    git_repository(&repository);
    let marker = tmp.join("made-by-the-test");
    std::fs::write(&marker, "the test's own file").unwrap();
    // The real home can be hidden only when neither the checkout nor node lives in it (a CI
    // runner's checkout often does); HOME then still names the test's directory.
    let node = which("node");
    let real_home = std::env::var("HOME")
        .ok()
        .filter(|h| h.starts_with('/') && h != "/" && Path::new(h).is_dir())
        .filter(|h| {
            let home = std::fs::canonicalize(h).unwrap_or_else(|_| PathBuf::from(h));
            let inside =
                |path: &Path| std::fs::canonicalize(path).is_ok_and(|path| path.starts_with(&home));
            !inside(Path::new(ROOT)) && !inside(&node)
        });
    let bwrap = ["/usr/bin/bwrap", "/bin/bwrap"]
        .into_iter()
        .find(|path| Path::new(path).exists())
        .expect("bwrap (Debian's bubblewrap, which scripts/test installs) is needed");
    let shown = |path: &Path| path.display().to_string();
    let mut args: Vec<String> = vec!["--dev-bind".into(), "/".into(), "/".into()];
    // What the worker needs may itself lie beneath one of those places (a checkout in /tmp, or
    // this test's own directory when TMPDIR is /tmp): it is bound back at its own path, on a
    // mount point bubblewrap makes in the test's directory, which is then all that may be there.
    let needed = [PathBuf::from(ROOT), node.clone(), scratch.0.clone()];
    let mut mount_points: BTreeMap<&str, Vec<PathBuf>> = BTreeMap::new();
    for (place, target) in [(&tmp, "/tmp"), (&var_tmp, "/var/tmp"), (&shm, "/dev/shm")] {
        args.extend(["--bind".into(), shown(place), target.into()]);
        for name in first_components_beneath(Path::new(target), &needed) {
            let path = Path::new(target).join(&name);
            args.extend(["--bind".into(), shown(&path), shown(&path)]);
            mount_points.entry(target).or_default().push(name);
        }
    }
    // HOME is the test's directory, at the user's real home path when there is one (so that a
    // home found through the password database is the test's too).
    let home_path = match &real_home {
        Some(real) => {
            args.extend(["--bind".into(), shown(&home), real.clone()]);
            real.clone()
        }
        None => shown(&home),
    };
    args.extend(["--setenv".into(), "HOME".into(), home_path]);
    for name in [
        "TMPDIR",
        "XDG_CONFIG_HOME",
        "XDG_DATA_HOME",
        "XDG_CACHE_HOME",
        "XDG_STATE_HOME",
        "XDG_RUNTIME_DIR",
    ] {
        args.extend(["--unsetenv".into(), name.into()]);
    }
    args.extend([
        "--die-with-parent".into(),
        "--".into(),
        shown(&node),
        format!("{ROOT}/adapters/opencode/harness.mjs"),
    ]);
    let registration = Registration::new("opencode", bwrap)
        .args(args)
        .cwd(&cwd)
        .sandbox(false);
    let mut options = adapter_options("unused");
    let unused = options.data_dir.parent().unwrap().to_path_buf();
    let _ = std::fs::remove_dir_all(unused);
    options.data_dir = repository.join("data");
    let package = Path::new(ROOT).join("adapters/opencode");
    let package_before = tree(&package);
    let git_before = tree(&repository.join(".git"));

    let brain = Running::start(vec![registration], options);
    let script = json!([
        asks_for("lookup", json!({"word": "pi"})),
        answers("pi is 3.14")
    ]);
    let session = create(&brain, with_lookup_tool(script, "echo found-314"));
    a_completed_turn(&session, "what is pi?");
    assert_eq!(records(&session, "tool_call_finished").len(), 1);
    let state_dir = session.info().unwrap().state_dir;
    // The control: OpenCode runs with the test's /tmp, and with its workspace as its project.
    let pids = opencode_processes(&state_dir);
    assert_eq!(pids.len(), 1, "{pids:?}");
    assert!(
        Path::new(&format!("/proc/{}/root/tmp/made-by-the-test", pids[0])).is_file(),
        "opencode {} does not see the test's /tmp",
        pids[0]
    );
    let system = model_requests(&session)[0]["system"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let workspace = state_dir.join("opencode/workspace");
    assert!(
        system.contains(&format!("Workspace root folder: {}", workspace.display())),
        "OpenCode took another project root than its workspace: {system}"
    );
    // OpenCode's own storage is in state_dir.
    assert!(state_dir.join("opencode/data/opencode").is_dir());
    session.close().unwrap();
    assert_no_opencode(&state_dir);

    for place in [&home, &cwd] {
        assert_eq!(
            tree(place),
            BTreeMap::new(),
            "written in {}",
            place.display()
        );
    }
    // Each of the others holds only its mount points, empty, and /tmp the test's own file.
    for (place, target) in [(&tmp, "/tmp"), (&var_tmp, "/var/tmp"), (&shm, "/dev/shm")] {
        let mut expected = mount_points.get(target).cloned().unwrap_or_default();
        if target == "/tmp" {
            expected.push(PathBuf::from("made-by-the-test"));
        }
        expected.sort();
        let left: Vec<_> = tree(place).into_keys().collect();
        assert_eq!(left, expected, "written in {target}");
    }
    assert_eq!(
        tree(&repository.join(".git")),
        git_before,
        "written in the git directory of the repository holding the data directory"
    );
    assert_eq!(
        tree(&package),
        package_before,
        "written in {}",
        package.display()
    );
    // Beside the session's state_dir, the registration's state root holds only Brain's file.
    let root = state_dir.parent().unwrap();
    let mut beside: Vec<_> = std::fs::read_dir(root)
        .unwrap()
        .flatten()
        .map(|entry| entry.file_name().to_string_lossy().into_owned())
        .collect();
    beside.sort();
    assert_eq!(beside, ["harness.json", session.id().as_str()]);
}
