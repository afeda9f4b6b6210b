//! Reads of block files that bypass the page cache (`O_DIRECT`), into reused aligned buffers.
//!
//! A short-circuit read of whole pages goes straight from the disk into the reply buffer:
//! no copy out of the page cache (a fifth of the daemon's CPU on a warm sequential read),
//! no second cached copy of bytes the mount's own page cache keeps, and a steady disk rate
//! where buffered reads of the block file moved 2× with the kernel's read-ahead state.
//! Anything a direct read cannot do (a file system without `O_DIRECT`, an unaligned range,
//! an error) is left to the caller's buffered read.

use std::cell::RefCell;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;

/// Direct transfers start at, and span, multiples of the device's logical block size;
/// 4 KiB covers every device.
pub const ALIGN: u64 = 4096;

/// Opens `path` for direct reads; `None` where its file system refuses `O_DIRECT`.
pub fn open(path: &Path) -> Option<File> {
    open_for_reading(path, nix::fcntl::OFlag::O_DIRECT.bits()).ok()
}

/// Opens a block file for reading (with `flags` added) without updating its access time:
/// reading cached pages should not dirty the worker's inodes. Where that is not allowed (a
/// reader that neither owns the file nor has `CAP_FOWNER`), it opens it as usual. The path
/// comes from a worker's lease: a link, a FIFO or a device there is refused (opened
/// without blocking and without following a link, then checked to be a regular file).
pub fn open_for_reading(path: &Path, flags: i32) -> std::io::Result<File> {
    use nix::fcntl::OFlag;
    let flags = flags | (OFlag::O_NONBLOCK | OFlag::O_NOFOLLOW).bits();
    let open = |flags: i32| OpenOptions::new().read(true).custom_flags(flags).open(path);
    let file = match open(flags | OFlag::O_NOATIME.bits()) {
        Err(e) if e.raw_os_error() == Some(nix::libc::EPERM) => open(flags),
        opened => opened,
    }?;
    if !file.metadata()?.file_type().is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("{} is not a regular file", path.display()),
        ));
    }
    Ok(file)
}

/// A buffer with an aligned window in it; the bytes handed out are `buf[off..off + len]`.
struct Window {
    buf: Arc<Vec<u8>>,
    off: usize,
    len: usize,
}

impl AsRef<[u8]> for Window {
    fn as_ref(&self) -> &[u8] {
        &self.buf[self.off..self.off + self.len]
    }
}

/// Reads up to this long use the calling thread's reused buffer (longer ones get their own).
const REUSED: usize = 4 << 20;

thread_local! {
    /// The calling thread's buffer: reused once every `Bytes` made from it is dropped (a FUSE
    /// reply is written before its thread reads again), so a sequential reader allocates,
    /// zeroes and faults in its buffer once.
    static BUFFER: RefCell<Option<Arc<Vec<u8>>>> = const { RefCell::new(None) };
}

/// `len` bytes that `fill` writes, handed out as `Bytes`. `fill` gets a slice aligned to
/// [`ALIGN`] of `len` rounded up to it (bytes past `len` are not handed out); its error
/// comes back as is. The memory is the calling thread's reused buffer when the bytes handed
/// out from it before are all dropped: every read of block files (direct or not) goes
/// through here, so a reader costs no allocation, zeroing or page faults per read.
pub fn filled<E>(len: usize, fill: impl FnOnce(&mut [u8]) -> Result<(), E>) -> Result<Bytes, E> {
    let align = ALIGN as usize;
    let span = len.next_multiple_of(align);
    let need = span + align;
    BUFFER.with(|slot| {
        let mut slot = slot.borrow_mut();
        let unshared = |b: &Arc<Vec<u8>>| Arc::strong_count(b) == 1 && Arc::weak_count(b) == 0;
        let mut buf = match slot.take() {
            Some(b) if unshared(&b) && b.len() >= need => b,
            other => {
                *slot = other;
                Arc::new(vec![0u8; need])
            }
        };
        let off = buf.as_ptr().align_offset(align);
        // Unshared here (checked above, or new): no copy is made.
        let v = Arc::make_mut(&mut buf);
        fill(&mut v[off..off + span])?;
        let out = Bytes::from_owner(Window {
            buf: buf.clone(),
            off,
            len,
        });
        if need <= REUSED + align {
            *slot = Some(buf);
        }
        Ok(out)
    })
}

/// Reads exactly `len` bytes at `offset` (a multiple of [`ALIGN`]) of `file`, opened by
/// [`open`]. `None` when the file ends before, the range is unaligned or the read fails.
pub fn read_at(file: &File, offset: u64, len: usize) -> Option<Bytes> {
    if !offset.is_multiple_of(ALIGN) || len == 0 {
        return None;
    }
    filled(len, |dst| {
        let mut got = 0;
        while got < len {
            match file.read_at(&mut dst[got..], offset + got as u64) {
                Ok(0) => return Err(()),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(_) => return Err(()),
            }
        }
        Ok(())
    })
    .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file opened for direct reads, or `None` where the temporary folder's file system
    /// refuses `O_DIRECT`.
    fn direct_file(data: &[u8]) -> Option<(tempfile::TempDir, File)> {
        let dir = tempfile::tempdir().ok()?;
        let path = dir.path().join("block");
        std::fs::write(&path, data).ok()?;
        let f = open(&path)?;
        Some((dir, f))
    }

    /// A lease naming a FIFO (which would block the opening thread until a writer comes),
    /// a device or a link is refused at once; a regular file opens.
    #[test]
    fn a_leased_path_opens_only_as_a_regular_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("block");
        std::fs::write(&file, b"pages").unwrap();
        let fifo = dir.path().join("fifo");
        nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        assert!(open_for_reading(&file, 0).is_ok());
        for bad in [fifo.as_path(), link.as_path(), Path::new("/dev/zero")] {
            assert!(
                open_for_reading(bad, 0).is_err(),
                "{} opened",
                bad.display()
            );
        }
    }

    #[test]
    fn reads_aligned_ranges_and_a_short_tail_exactly() {
        let data: Vec<u8> = (0..3 * 4096 + 100).map(|i| (i * 7 % 251) as u8).collect();
        let Some((_dir, f)) = direct_file(&data) else {
            eprintln!("skipped: no O_DIRECT on the test's file system");
            return;
        };
        assert_eq!(&read_at(&f, 0, 4096).unwrap()[..], &data[..4096]);
        // The tail: 100 bytes past the last full block, read with an aligned span.
        assert_eq!(&read_at(&f, 3 * 4096, 100).unwrap()[..], &data[3 * 4096..]);
        assert_eq!(
            &read_at(&f, 4096, 2 * 4096 + 100).unwrap()[..],
            &data[4096..]
        );
        // Past the end, or unaligned: refused (the caller reads buffered).
        assert!(read_at(&f, 3 * 4096, 101).is_none());
        assert!(read_at(&f, 10, 100).is_none());
    }

    #[test]
    fn bytes_handed_out_stay_intact_while_their_thread_reads_on() {
        let a = vec![0xAAu8; 8192];
        let b = vec![0xBBu8; 8192];
        let Some((_da, fa)) = direct_file(&a) else {
            return;
        };
        let Some((_db, fb)) = direct_file(&b) else {
            return;
        };
        let first = read_at(&fa, 0, 8192).unwrap();
        let second = read_at(&fb, 0, 8192).unwrap();
        assert!(first.iter().all(|&x| x == 0xAA));
        assert!(second.iter().all(|&x| x == 0xBB));
        drop(first);
        // The first buffer is free again; the second still held.
        let third = read_at(&fa, 0, 4096).unwrap();
        assert!(third.iter().all(|&x| x == 0xAA));
        assert!(second.iter().all(|&x| x == 0xBB));
    }
}
