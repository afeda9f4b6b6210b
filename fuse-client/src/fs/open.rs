//! Opens in passthrough mode: when a file is opened so, and how.

use super::*;

/// Whether an open of `s`, a file smaller than the passthrough minimum with no backing
/// file parked or kept, takes a lease to open it in passthrough now (its block file is then
/// parked for its next opens): a one-page file not being written here, opened out of name
/// order, in a folder where such a lease did not just find its file uncached. A reader
/// going through a folder in name order is served by pushes into the page cache and leases
/// taken ahead instead.
pub(super) fn small_via_lease(
    client: &FileSystem,
    writes: &crate::write::Writes,
    s: &pb::FileStatus,
) -> bool {
    s.length > 0
        && s.length <= client.short_circuit.page_size()
        && writes.size_of(s.inode).is_none()
        && !client.open_lease_paused(s.parent)
        && !client.small_open_in_name_order(s)
}

/// What an open needs to try passthrough.
#[derive(Clone)]
pub(super) struct Passthrough {
    pub(super) on: Arc<AtomicBool>,
    pub(super) backings: Arc<Mutex<crate::backing::Backings>>,
    pub(super) fhs: Arc<Mutex<HashMap<u64, u64>>>,
    /// The mount's open handles: a handle opened here is entered before the kernel has
    /// it, since the kernel may release it as soon as it has the reply.
    pub(super) files: Arc<OpenFiles>,
}

impl Passthrough {
    /// Opens `s` in passthrough mode when it is wholly cached on this node's worker; gives
    /// the reply and the status back (`Some`) when it is not, or the kernel refuses.
    pub(super) async fn try_open(
        &self,
        client: &Arc<FileSystem>,
        s: pb::FileStatus,
        fh: u64,
        reply: ReplyOpen,
    ) -> Option<(ReplyOpen, pb::FileStatus)> {
        let fh = tagged(fh, s.version);
        // A backing file parked since an earlier open.
        let parked =
            lock(&self.backings).open(&self.on, (s.inode, s.version), &reply, (fh, 0), || {
                None::<(std::fs::File, Option<granary_client::local::Parkable>)>
            });
        if let Some(id) = parked {
            client.count_passthrough_open(&s, None);
            self.opened(fh, s);
            reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, &id);
            return None;
        }
        tracing::debug!(
            inode = s.inode,
            "no parked backing file: a lease for passthrough"
        );
        let Some(pf) = client.open_passthrough(&s).await else {
            return Some((reply, s));
        };
        let id = lock(&self.backings).open(
            &self.on,
            (s.inode, s.version),
            &reply,
            (fh, pf.handle),
            || Some((&pf.file, pf.park.clone())),
        );
        let Some(id) = id else {
            client.close_passthrough(pf.handle);
            return Some((reply, s));
        };
        client.count_passthrough_open(&s, Some(pf.worker_id));
        self.opened(fh, s);
        reply.opened_passthrough(FileHandle(fh), FopenFlags::FOPEN_NOFLUSH, &id);
        None
    }

    fn opened(&self, fh: u64, s: pb::FileStatus) {
        enter_passthrough(&self.fhs, &self.files, fh, s);
    }
}

/// Enters a handle about to be answered in passthrough, in both tables (before the reply:
/// a RELEASE the kernel sends right after must find it, or the entry would outlive the
/// handle and a successor would take it for one still reading the file through the
/// daemon).
pub(super) fn enter_passthrough(
    fhs: &Mutex<HashMap<u64, u64>>,
    files: &OpenFiles,
    fh: u64,
    s: pb::FileStatus,
) {
    lock(fhs).insert(fh, s.inode);
    files.insert(fh, Arc::new(s));
}
