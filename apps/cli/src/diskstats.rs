//! Bytes a block device delivered, from Linux's `/proc/diskstats`: the kernel's own count for the device a model lies
//! on, which the benchmarks hold the engine's read counters and `/proc/self/io` against (issue 19 asks all three to
//! agree). The count is the device's, not the process's: every process's reads of that device are in it, so it
//! agrees with the engine's only on an otherwise quiet machine.

use std::path::Path;

/// The `/proc/diskstats` line of one block device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiskCounter {
    major: u64,
    minor: u64,
    /// The device's name in `/proc/diskstats` (`vda`, `nvme0n1p2`).
    name: String,
}

/// Where Linux lists block devices' counters.
const DISKSTATS: &str = "/proc/diskstats";

/// Bytes in a `/proc/diskstats` sector, whatever the device's own sector size (the kernel counts 512-byte units).
const SECTOR_BYTES: u64 = 512;

impl DiskCounter {
    /// The device holding `path`; `None` where it has no line in `/proc/diskstats` (not Linux; a filesystem with an
    /// anonymous device number, such as an overlay, btrfs or a network filesystem) or `path` cannot be read.
    pub fn for_path(path: &Path) -> Option<Self> {
        let dev = device_number(path)?;
        let (major, minor) = split_device_number(dev);
        let text = std::fs::read_to_string(DISKSTATS).ok()?;
        let (name, _) = read_sectors(&text, major, minor)?;
        Some(Self { major, minor, name })
    }

    /// The device's name in `/proc/diskstats`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes read from the device since boot; `None` if its line has gone (the device was removed).
    pub fn read_bytes(&self) -> Option<u64> {
        let text = std::fs::read_to_string(DISKSTATS).ok()?;
        read_sectors(&text, self.major, self.minor).map(|(_, sectors)| sectors * SECTOR_BYTES)
    }
}

/// `st_dev` of `path`.
#[cfg(unix)]
fn device_number(path: &Path) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).ok().map(|m| m.dev())
}

/// No device numbers off Unix.
#[cfg(not(unix))]
fn device_number(_path: &Path) -> Option<u64> {
    None
}

/// Major and minor numbers of a Linux device number (glibc's `gnu_dev_major` / `gnu_dev_minor` encoding: 12 bits of
/// major and 20 of minor, split across the 64 bits).
fn split_device_number(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

/// The name and sectors read of device `major:minor` in the text of `/proc/diskstats` (per line: major, minor, name,
/// reads completed, reads merged, sectors read, …); `None` where no well-formed line has those numbers.
fn read_sectors(text: &str, major: u64, minor: u64) -> Option<(String, u64)> {
    text.lines().find_map(|line| {
        let mut fields = line.split_whitespace();
        let ma: u64 = fields.next()?.parse().ok()?;
        let mi: u64 = fields.next()?.parse().ok()?;
        if (ma, mi) != (major, minor) {
            return None;
        }
        let name = fields.next()?.to_string();
        let sectors = fields.nth(2)?.parse().ok()?;
        Some((name, sectors))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two lines of a real `/proc/diskstats` (a virtio disk and its partition) and a malformed one.
    const SAMPLE: &str = "\
 253       0 vda 120437 2712 24137442 61822 95212 64023 9311514 124305 0 92764 196880 0 0 0 0 8861 10752
 253       1 vda1 120301 2712 24130122 61780 95212 64023 9311514 124305 0 92716 186085 0 0 0 0 0 0
 259       0 nvme0n1 12 x
";

    #[test]
    fn a_devices_line_gives_its_sectors_read() {
        assert_eq!(
            read_sectors(SAMPLE, 253, 0),
            Some(("vda".to_string(), 24_137_442))
        );
        assert_eq!(
            read_sectors(SAMPLE, 253, 1),
            Some(("vda1".to_string(), 24_130_122))
        );
        // A line too short or not numbers where the count should be is no answer, not a panic.
        assert_eq!(read_sectors(SAMPLE, 259, 0), None);
        assert_eq!(read_sectors(SAMPLE, 8, 0), None);
        assert_eq!(read_sectors("", 253, 0), None);
    }

    #[test]
    fn device_numbers_split_as_glibc_splits_them() {
        // makedev(253, 1) and makedev(259, 0x12345) in glibc's encoding.
        assert_eq!(split_device_number(0xfd01), (253, 1));
        let dev = (0x12345u64 & 0xff) | ((259u64 & 0xfff) << 8) | ((0x12345u64 & !0xff) << 12);
        assert_eq!(split_device_number(dev), (259, 0x12345));
    }

    /// On Linux, a file on a block device finds that device's line and reads it; elsewhere (or on a filesystem
    /// without one) there is no counter, never a panic.
    #[test]
    fn a_files_device_is_found_or_reported_absent() {
        let dir = tempfile::tempdir().expect("a temporary directory");
        match DiskCounter::for_path(dir.path()) {
            Some(counter) => {
                assert!(!counter.name().is_empty());
                assert!(counter.read_bytes().is_some());
            }
            None => {
                let dev = device_number(dir.path()).map(split_device_number);
                let listed = std::fs::read_to_string(DISKSTATS)
                    .ok()
                    .zip(dev)
                    .and_then(|(text, (ma, mi))| read_sectors(&text, ma, mi));
                assert_eq!(
                    listed,
                    None,
                    "the device of {} is listed",
                    dir.path().display()
                );
            }
        }
    }
}
