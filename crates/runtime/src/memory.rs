//! How much memory this process may use: physical memory, what is available now, and the limit of the cgroup it
//! runs in (Linux, v1 and v2), or `sysctl hw.memsize` and `host_statistics64` on macOS (type-checked in CI, not run:
//! nothing here runs macOS; [`macos_memory`], the arithmetic over what those calls return, is tested on Linux).
//!
//! The engine's default RAM budget is a share of the smaller of physical memory and the cgroup limit, and a
//! budget larger than that is refused with a message rather than left for the kernel's OOM killer. The parsing
//! is separate from the reading so that it can be tested on given texts on any platform.

use std::path::{Path, PathBuf};

/// What the machine (or the container) gives this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SystemMemory {
    /// Physical memory in bytes.
    pub total: u64,
    /// Memory available for new allocations now (reclaimable page cache included), when the system says.
    pub available: Option<u64>,
    /// The tightest memory limit of the cgroups this process is in, when one is set below `total`.
    pub limit: Option<MemoryLimit>,
}

/// A cgroup memory limit and the file it was read from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    /// The limit in bytes.
    pub bytes: u64,
    /// `memory.max` (v2) or `memory.limit_in_bytes` (v1).
    pub file: PathBuf,
}

impl SystemMemory {
    /// The memory this process may use: physical memory, or the cgroup limit when that is smaller.
    pub fn usable(&self) -> u64 {
        self.limit
            .as_ref()
            .map_or(self.total, |l| l.bytes.min(self.total))
    }

    /// Where [`Self::usable`] comes from, for messages: `physical memory` or `the cgroup limit (FILE)`.
    pub fn usable_source(&self) -> String {
        match &self.limit {
            Some(l) if l.bytes < self.total => {
                format!("the cgroup memory limit ({})", l.file.display())
            }
            _ => "physical memory".to_string(),
        }
    }

    /// This machine's memory, or `None` where the platform gives no figure.
    pub fn detect() -> Option<Self> {
        platform::detect()
    }
}

/// `MemTotal` or `MemAvailable` (any field) of a `/proc/meminfo` text, in bytes.
pub fn meminfo_field(text: &str, field: &str) -> Option<u64> {
    let line = text
        .lines()
        .find(|l| l.strip_prefix(field).is_some_and(|r| r.starts_with(':')))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// A cgroup hierarchy mounted somewhere: where, and which part of the hierarchy the mount shows.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CgroupMount {
    /// `true` for the unified (v2) hierarchy, `false` for a v1 hierarchy with the memory controller.
    v2: bool,
    /// The path inside the hierarchy that the mount point shows (`/` unless a namespace or bind mount cut it).
    root: String,
    /// Where it is mounted.
    point: PathBuf,
}

/// The cgroup mounts that can carry a memory limit, from a `/proc/self/mountinfo` text.
fn memory_mounts(mountinfo: &str) -> Vec<CgroupMount> {
    let mut mounts = Vec::new();
    for line in mountinfo.lines() {
        // `ID PARENT MAJ:MIN ROOT POINT OPTIONS [OPTIONAL...] - FSTYPE SOURCE SUPER_OPTIONS`
        let Some((left, right)) = line.split_once(" - ") else {
            continue;
        };
        let fields: Vec<&str> = left.split(' ').collect();
        let after: Vec<&str> = right.split(' ').collect();
        let (Some(root), Some(point), Some(fstype)) = (fields.get(3), fields.get(4), after.first())
        else {
            continue;
        };
        let v2 = match *fstype {
            "cgroup2" => true,
            "cgroup" => {
                let supers = after.get(2).copied().unwrap_or("");
                if !supers.split(',').any(|o| o == "memory") {
                    continue;
                }
                false
            }
            _ => continue,
        };
        mounts.push(CgroupMount {
            v2,
            root: unescape_mount_path(root),
            point: PathBuf::from(unescape_mount_path(point)),
        });
    }
    mounts
}

/// mountinfo escapes space, tab, newline and backslash as three octal digits.
fn unescape_mount_path(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 3 < b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// This process's cgroup path in the v2 hierarchy and in the v1 memory hierarchy, from a `/proc/self/cgroup` text.
fn cgroup_paths(text: &str) -> (Option<String>, Option<String>) {
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        if id == "0" && controllers.is_empty() {
            v2 = Some(path.to_string());
        } else if controllers.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    (v2, v1)
}

/// A limit file's value: `max` (v2) or a number; v1 writes "no limit" as a number near `i64::MAX`.
fn parse_limit(text: &str) -> Option<u64> {
    let t = text.trim();
    if t == "max" {
        return None;
    }
    t.parse::<u64>().ok().filter(|&b| b < (1u64 << 62))
}

/// The tightest memory limit over this process's cgroup and its ancestors, reading files through `read`.
///
/// `mountinfo` and `self_cgroup` are the texts of `/proc/self/mountinfo` and `/proc/self/cgroup`. For each memory
/// hierarchy, the cgroup path is taken relative to the mount's root (inside a cgroup namespace or a container the
/// mount shows only part of the hierarchy), and every directory from the cgroup up to the mount point is checked:
/// a parent's limit binds its children.
fn cgroup_limit(
    mountinfo: &str,
    self_cgroup: &str,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<MemoryLimit> {
    let (v2_path, v1_path) = cgroup_paths(self_cgroup);
    let mut best: Option<MemoryLimit> = None;
    for m in memory_mounts(mountinfo) {
        let (path, file) = if m.v2 {
            (v2_path.as_deref(), "memory.max")
        } else {
            (v1_path.as_deref(), "memory.limit_in_bytes")
        };
        let Some(path) = path else { continue };
        let rel = if m.root == "/" {
            path
        } else {
            // A path outside the mount's root (another namespace's view) cannot be followed; check the mount itself.
            path.strip_prefix(m.root.as_str()).unwrap_or("")
        };
        let mut dir = m.point.clone();
        let mut dirs = vec![dir.clone()];
        for part in rel.split('/').filter(|p| !p.is_empty()) {
            dir.push(part);
            dirs.push(dir.clone());
        }
        for d in dirs {
            let f = d.join(file);
            if let Some(bytes) = read(&f).as_deref().and_then(parse_limit)
                && best.as_ref().is_none_or(|b| bytes < b.bytes)
            {
                best = Some(MemoryLimit { bytes, file: f });
            }
        }
    }
    best
}

/// Page counts from macOS's `host_statistics64` (`HOST_VM_INFO64`) and the page size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VmPages {
    /// `free_count`: pages on the free list.
    pub free: u64,
    /// `inactive_count`: pages not referenced lately (file cache among them), reclaimed without writing anything.
    pub inactive: u64,
    /// Bytes per page (16 KiB on Apple Silicon).
    pub page_size: u64,
}

/// The memory figures of a macOS machine: `hw.memsize` bytes of physical memory and, when `host_statistics64`
/// answered, the free and inactive pages as available memory (psutil's definition). macOS has no cgroup limit.
/// `None` for a zero memory size.
pub fn macos_memory(memsize: u64, pages: Option<VmPages>) -> Option<SystemMemory> {
    if memsize == 0 {
        return None;
    }
    let available = pages.map(|p| {
        p.free
            .saturating_add(p.inactive)
            .saturating_mul(p.page_size)
            .min(memsize)
    });
    Some(SystemMemory {
        total: memsize,
        available,
        limit: None,
    })
}

/// Reads the memory figures from the texts of `/proc/meminfo`, `/proc/self/mountinfo` and `/proc/self/cgroup`.
pub fn linux_memory(
    meminfo: &str,
    mountinfo: &str,
    self_cgroup: &str,
    read: &dyn Fn(&Path) -> Option<String>,
) -> Option<SystemMemory> {
    let total = meminfo_field(meminfo, "MemTotal")?;
    let limit = cgroup_limit(mountinfo, self_cgroup, read).filter(|l| l.bytes < total);
    Some(SystemMemory {
        total,
        available: meminfo_field(meminfo, "MemAvailable"),
        limit,
    })
}

#[cfg(target_os = "linux")]
mod platform {
    use super::*;

    pub(super) fn detect() -> Option<SystemMemory> {
        let read = |p: &Path| std::fs::read_to_string(p).ok();
        let meminfo = read(Path::new("/proc/meminfo"))?;
        let mountinfo = read(Path::new("/proc/self/mountinfo")).unwrap_or_default();
        let cgroup = read(Path::new("/proc/self/cgroup")).unwrap_or_default();
        linux_memory(&meminfo, &mountinfo, &cgroup, &read)
    }
}

#[cfg(target_os = "macos")]
mod platform {
    use super::*;

    /// `sysctl hw.memsize` and the page counts of `host_statistics64`, through [`macos_memory`].
    pub(super) fn detect() -> Option<SystemMemory> {
        let mut total: u64 = 0;
        let mut len = std::mem::size_of::<u64>();
        // SAFETY: the name is NUL-terminated, `total` is a u64 and `len` holds its size, as sysctlbyname expects.
        let rc = unsafe {
            libc::sysctlbyname(
                c"hw.memsize".as_ptr(),
                (&mut total as *mut u64).cast(),
                &mut len,
                std::ptr::null_mut(),
                0,
            )
        };
        if rc != 0 || len != std::mem::size_of::<u64>() {
            return None;
        }
        macos_memory(total, vm_pages())
    }

    /// The free and inactive page counts, or `None` when the kernel does not answer.
    fn vm_pages() -> Option<VmPages> {
        // SAFETY: a zeroed vm_statistics64 is a valid value of this plain C struct.
        let mut stats: libc::vm_statistics64 = unsafe { std::mem::zeroed() };
        let mut count = libc::HOST_VM_INFO64_COUNT;
        // libc marks its Mach bindings deprecated in favour of the mach2 crate, which has no host_statistics64;
        // this declaration is the C one.
        #[allow(deprecated)]
        // SAFETY: no arguments; returns a send right to this task's host port.
        let host = unsafe { libc::mach_host_self() };
        // SAFETY: `stats` has room for HOST_VM_INFO64_COUNT integers, which `count` says; the host port is ours.
        let rc = unsafe {
            libc::host_statistics64(
                host,
                libc::HOST_VM_INFO64,
                (&mut stats as *mut libc::vm_statistics64).cast(),
                &mut count,
            )
        };
        if rc != libc::KERN_SUCCESS {
            return None;
        }
        // SAFETY: sysconf has no preconditions.
        let page_size = u64::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).ok()?;
        Some(VmPages {
            free: u64::from(stats.free_count),
            inactive: u64::from(stats.inactive_count),
            page_size,
        })
    }
}

#[cfg(not(any(target_os = "linux", target_os = "macos")))]
mod platform {
    use super::*;

    pub(super) fn detect() -> Option<SystemMemory> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const MEMINFO: &str =
        "MemTotal:       24576000 kB\nMemFree:        1000 kB\nMemAvailable:   20000000 kB\n";

    /// This project's machine kind: v1 controllers beside a unified mount, the process in a v1 memory cgroup.
    const MOUNTS_HYBRID: &str = "\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
";
    const CGROUP_HYBRID: &str = "4:memory:/process_api/abc\n1:cpu:/\n0::/\n";

    fn files(entries: &[(&str, &str)]) -> impl Fn(&Path) -> Option<String> {
        let map: HashMap<PathBuf, String> = entries
            .iter()
            .map(|(p, v)| (PathBuf::from(p), v.to_string()))
            .collect();
        move |p: &Path| map.get(p).cloned()
    }

    #[test]
    fn v1_limit_of_the_process_cgroup_and_its_parents() {
        let read = files(&[
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            (
                "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes",
                "8589934592\n",
            ),
            (
                "/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
                "4294967296\n",
            ),
            ("/sys/fs/cgroup/unified/memory.max", "max\n"),
        ]);
        let m = linux_memory(MEMINFO, MOUNTS_HYBRID, CGROUP_HYBRID, &read).expect("meminfo parses");
        assert_eq!(m.total, 24_576_000 * 1024);
        assert_eq!(m.available, Some(20_000_000 * 1024));
        let limit = m.limit.clone().expect("a limit is set");
        assert_eq!(limit.bytes, 4 << 30);
        assert_eq!(
            limit.file,
            PathBuf::from("/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes")
        );
        assert_eq!(m.usable(), 4 << 30);
        assert!(m.usable_source().contains("cgroup"));
        // A parent's tighter limit binds the child.
        let read = files(&[
            (
                "/sys/fs/cgroup/memory/process_api/memory.limit_in_bytes",
                "1073741824\n",
            ),
            (
                "/sys/fs/cgroup/memory/process_api/abc/memory.limit_in_bytes",
                "4294967296\n",
            ),
        ]);
        let m = linux_memory(MEMINFO, MOUNTS_HYBRID, CGROUP_HYBRID, &read).expect("parses");
        assert_eq!(m.usable(), 1 << 30);
    }

    #[test]
    fn v2_limit_inside_a_container_namespace() {
        // A container: the unified hierarchy mounted at its own cgroup, which /proc/self/cgroup calls `/`.
        let mounts = "600 500 0:30 / /sys/fs/cgroup ro,nosuid - cgroup2 cgroup rw,nsdelegate\n";
        let read = files(&[("/sys/fs/cgroup/memory.max", "4294967296\n")]);
        let m = linux_memory(MEMINFO, mounts, "0::/\n", &read).expect("parses");
        assert_eq!(m.usable(), 4 << 30);
        // Without a namespace: the process's own cgroup under the mount, `max` above it.
        let read = files(&[
            ("/sys/fs/cgroup/memory.max", "max\n"),
            (
                "/sys/fs/cgroup/user.slice/app.scope/memory.max",
                "3221225472\n",
            ),
        ]);
        let m = linux_memory(MEMINFO, mounts, "0::/user.slice/app.scope\n", &read).expect("parses");
        assert_eq!(m.usable(), 3 << 30);
        // A mount that shows only part of the hierarchy: the path is taken relative to the mount's root.
        let mounts = "600 500 0:30 /docker/xyz /sys/fs/cgroup ro - cgroup2 cgroup rw\n";
        let read = files(&[("/sys/fs/cgroup/memory.max", "2147483648\n")]);
        let m = linux_memory(MEMINFO, mounts, "0::/docker/xyz\n", &read).expect("parses");
        assert_eq!(m.usable(), 2 << 30);
    }

    #[test]
    fn no_limit_means_physical_memory() {
        let read = files(&[
            (
                "/sys/fs/cgroup/memory/memory.limit_in_bytes",
                "9223372036854771712\n",
            ),
            ("/sys/fs/cgroup/unified/memory.max", "max\n"),
        ]);
        let m = linux_memory(MEMINFO, MOUNTS_HYBRID, "4:memory:/\n0::/\n", &read).expect("parses");
        assert_eq!(m.limit, None);
        assert_eq!(m.usable(), m.total);
        assert_eq!(m.usable_source(), "physical memory");
        // A limit above physical memory does not count either.
        let read = files(&[(
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "107374182400\n",
        )]);
        let m = linux_memory(MEMINFO, MOUNTS_HYBRID, "4:memory:/\n", &read).expect("parses");
        assert_eq!(m.limit, None);
        assert!(linux_memory("garbage", MOUNTS_HYBRID, "", &read).is_none());
    }

    #[test]
    fn mount_paths_are_unescaped() {
        assert_eq!(unescape_mount_path(r"/a\040b"), "/a b");
        assert_eq!(unescape_mount_path(r"/a\\"), r"/a\\");
        assert_eq!(unescape_mount_path("/plain"), "/plain");
    }

    #[test]
    fn macos_figures_from_the_memory_size_and_page_counts() {
        let pages = VmPages {
            free: 100_000,
            inactive: 300_000,
            page_size: 16384,
        };
        let m = macos_memory(64 << 30, Some(pages)).expect("a memory size");
        assert_eq!(m.total, 64 << 30);
        assert_eq!(m.available, Some(400_000 * 16384));
        assert_eq!((m.usable(), m.limit.clone()), (64 << 30, None));
        assert_eq!(m.usable_source(), "physical memory");
        // Counts sampled while memory moves may add up past physical memory: capped.
        let racing = VmPages {
            free: 5_000_000,
            ..pages
        };
        let m = macos_memory(64 << 30, Some(racing)).expect("a memory size");
        assert_eq!(m.available, Some(64 << 30));
        // No page statistics: no available figure; no memory size: no figures at all.
        assert_eq!(macos_memory(8 << 30, None).map(|m| m.available), Some(None));
        assert_eq!(macos_memory(0, Some(pages)), None);
    }

    #[test]
    fn this_machine_reports_its_memory() {
        let m = SystemMemory::detect().expect("Linux has /proc/meminfo");
        assert!(m.total > 0 && m.usable() <= m.total);
    }
}
