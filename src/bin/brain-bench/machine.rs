//! The machine a run measured: CPUs, memory, kernel, the data directory's filesystem, and the
//! CPU time the bench and other processes used, from /proc.

use serde_json::{Value, json};
use std::path::Path;

/// The machine: CPUs, memory, kernel, and the filesystem holding the data directory.
pub(crate) fn machine(data_dir: &Path) -> Value {
    let cpus = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let cpuinfo = read("/proc/cpuinfo");
    let model = cpuinfo
        .lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split(':').nth(1))
        .map(str::trim)
        .unwrap_or("unknown")
        .to_owned();
    let meminfo = read("/proc/meminfo");
    let memory_kib = meminfo
        .lines()
        .find(|line| line.starts_with("MemTotal:"))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    let kernel = read("/proc/sys/kernel/osrelease").trim().to_owned();
    let load = loadavg();
    // The mount with the longest mount point that contains the data directory.
    let mut filesystem = json!(null);
    let mut best = 0;
    for line in read("/proc/self/mountinfo").lines() {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let Some(dash) = fields.iter().position(|f| *f == "-") else {
            continue;
        };
        let (Some(mount), Some(fstype), Some(source)) =
            (fields.get(4), fields.get(dash + 1), fields.get(dash + 2))
        else {
            continue;
        };
        if data_dir.starts_with(mount) && mount.len() >= best {
            best = mount.len();
            filesystem = json!({"mount": mount, "type": fstype, "source": source});
        }
    }
    json!({
        "cpus": cpus,
        "cpu_model": model,
        "memory_mib": memory_kib / 1024,
        "kernel": kernel,
        "load_average_at_start": load,
        "data_dir": data_dir,
        "filesystem": filesystem,
    })
}

/// Clock ticks per second of `/proc/stat` and `/proc/<pid>/stat` (`USER_HZ`, 100 on Linux).
pub(crate) const TICKS_PER_SECOND: f64 = 100.0;

/// CPU time counters, in clock ticks: the whole machine's busy and total time, and this
/// process's own plus that of its reaped children (the harness workers and the probes); and how
/// often the threads of this process and of its reaped children blocked.
pub(crate) struct CpuCounters {
    busy: u64,
    total: u64,
    pub(crate) own: u64,
    /// Voluntary context switches (`getrusage`'s `ru_nvcsw`, of this process's threads and of
    /// its reaped children's).
    pub(crate) sleeps: u64,
}

pub(crate) fn cpu_counters() -> CpuCounters {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let fields: Vec<u64> = stat
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .skip(1)
        .filter_map(|n| n.parse().ok())
        .collect();
    let at = |i: usize| fields.get(i).copied().unwrap_or(0);
    // user nice system idle iowait irq softirq steal
    let busy = at(0) + at(1) + at(2) + at(5) + at(6) + at(7);
    let total = busy + at(3) + at(4);
    let own_stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = own_stat.rsplit(')').next().unwrap_or_default();
    // After the name: state ppid pgrp session tty_nr tpgid flags minflt cminflt majflt cmajflt
    // utime stime cutime cstime.
    let own = after_name
        .split_whitespace()
        .skip(11)
        .take(4)
        .filter_map(|n| n.parse::<u64>().ok())
        .sum();
    CpuCounters {
        busy,
        total,
        own,
        sleeps: voluntary_switches(libc::RUSAGE_SELF) + voluntary_switches(libc::RUSAGE_CHILDREN),
    }
}

/// `ru_nvcsw` of `who` (0 when `getrusage` fails, which it does only for a bad `who`).
fn voluntary_switches(who: libc::c_int) -> u64 {
    // SAFETY: `usage` is a plain C struct for which all zeros is a valid value; getrusage only
    // writes into it, and `who` is one of the two constants it documents.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `usage` is a valid, writable `rusage` for the duration of the call.
    if unsafe { libc::getrusage(who, &mut usage) } != 0 {
        return 0;
    }
    u64::try_from(usage.ru_nvcsw).unwrap_or(0)
}

impl CpuCounters {
    /// The share of the machine's CPU time since `start` spent by anything but this process and
    /// its reaped children (kernel threads doing this process's I/O count as other).
    pub(crate) fn other_share_since(&self, start: &CpuCounters) -> f64 {
        let total = self.total.saturating_sub(start.total).max(1) as f64;
        let busy = self.busy.saturating_sub(start.busy) as f64;
        let own = self.own.saturating_sub(start.own) as f64;
        ((busy - own) / total).max(0.0)
    }
}

/// The 1-minute load average: other work on the machine makes the figures provisional.
pub(crate) fn loadavg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

pub(crate) fn describe_machine(machine: &Value) -> String {
    format!(
        "{} CPUs ({}), {} MiB, Linux {}, data directory {} on {} ({}); load average {}",
        machine["cpus"],
        machine["cpu_model"].as_str().unwrap_or_default(),
        machine["memory_mib"],
        machine["kernel"].as_str().unwrap_or_default(),
        machine["data_dir"].as_str().unwrap_or_default(),
        machine["filesystem"]["type"].as_str().unwrap_or("?"),
        machine["filesystem"]["source"].as_str().unwrap_or("?"),
        machine["load_average_at_start"],
    )
}

/// `FS_TOPDIR_FL` (linux/fs.h): directories made in a directory with this flag are spread over
/// the file system's block groups, as top-level directories are.
const TOP_DIRECTORY_FLAG: libc::c_int = 0x0002_0000;

/// Marks `data_dir` as a top directory (ext4's `chattr +T`), so that each run's directory lands
/// in a block group of its own rather than beside the last run's. ext4 without a journal scans
/// past every inode freed in the last 60–360 s when it allocates one in that inode's group; a
/// text-turn run started right after another run's cleanup spent a quarter of the reference
/// harness's samples and nearly half of the client threads' in that scan when it shared the group. Best effort: `false` where the file
/// system has no such flag (tmpfs, others) or refuses it; `true` exactly when the flag is set.
pub(crate) fn spread_runs(data_dir: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let Ok(directory) = std::fs::File::open(data_dir) else {
        return false;
    };
    let fd = directory.as_raw_fd();
    let Some(mut flags) = inode_flags(fd) else {
        return false;
    };
    if flags & TOP_DIRECTORY_FLAG != 0 {
        return true;
    }
    flags |= TOP_DIRECTORY_FLAG;
    // SAFETY: `fd` is an open descriptor owned by `directory` for the whole call, and `flags` is
    // a valid int, the argument FS_IOC_SETFLAGS reads (the kernel reads an `int`, whatever the
    // ioctl number's size field says).
    unsafe { libc::ioctl(fd, libc::FS_IOC_SETFLAGS, &flags) == 0 }
}

/// The inode flags of the open file `fd` (`lsattr`), or `None` where the file system has none.
fn inode_flags(fd: std::os::fd::RawFd) -> Option<libc::c_int> {
    let mut flags: libc::c_int = 0;
    // SAFETY: the caller keeps `fd` open for the call, and `flags` is a valid, writable int, the
    // argument FS_IOC_GETFLAGS writes (an `int`, whatever the ioctl number's size field says).
    (unsafe { libc::ioctl(fd, libc::FS_IOC_GETFLAGS, &mut flags) } == 0).then_some(flags)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    /// Whatever the file system under the temporary directory: `spread_runs` says `true` exactly
    /// when the directory then carries the flag, and says it again for a directory that has it.
    /// On ext4 (where `scripts/test` puts the temporary directory on this project's machines) the
    /// flag must be set.
    #[test]
    fn spreading_runs_reports_whether_the_top_directory_flag_is_set() {
        let dir = std::env::temp_dir().join(format!("brain-bench-topdir-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let ext4 = nix::sys::statfs::statfs(&dir).unwrap().filesystem_type()
            == nix::sys::statfs::EXT4_SUPER_MAGIC;
        let spread = spread_runs(&dir);
        assert!(spread || !ext4, "ext4 refused the top-directory flag");
        let flags = inode_flags(std::fs::File::open(&dir).unwrap().as_raw_fd());
        let set = flags.is_some_and(|flags| flags & TOP_DIRECTORY_FLAG != 0);
        assert_eq!(spread, set, "spread_runs said {spread}; flags {flags:?}");
        assert_eq!(spread_runs(&dir), spread, "a second call agrees");
        std::fs::remove_dir(&dir).unwrap();
        assert!(
            !spread_runs(&dir),
            "a directory that is not there is not spread"
        );
    }
}
