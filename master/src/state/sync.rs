//! The namespace's side of metadata sync: folders loaded from an under-store listing,
//! entries probed or refreshed one by one, fingerprints recorded (commands applied by
//! [`Txn::apply`]).

use super::*;

impl Txn<'_> {
    pub(super) fn load_dir(
        &mut self,
        dir: u64,
        mount_id: u64,
        entries: &[UfsEntry],
        now_ms: i64,
        block_size: u64,
    ) -> Result<ApplyOutput, MasterError> {
        let mut d = self.mount_dir(dir, mount_id)?;
        if d.children_loaded {
            return Ok(ApplyOutput::Inode(d));
        }
        for e in entries {
            if paths::validate_name(&e.name).is_err() || self.child(dir, &e.name)?.is_some() {
                continue;
            }
            self.add_ufs_child(&d, mount_id, e, now_ms, block_size)?;
        }
        d.children_loaded = true;
        d.listed_ms = now_ms;
        self.put_inode(&d)?;
        Ok(ApplyOutput::Inode(d))
    }

    /// Directory `dir` of mount `mount_id`, as a listing or lookup proposed it; it may have
    /// been removed (e.g. unmounted) or replaced while the under-store answered.
    pub(super) fn mount_dir(&self, dir: u64, mount_id: u64) -> Result<Inode, MasterError> {
        let Some(d) = self.inode(dir)? else {
            return Err(MasterError::not_found(format!("inode {dir}")));
        };
        if d.mount_id != Some(mount_id) || d.kind != Kind::Directory {
            return Err(MasterError::precondition(format!(
                "inode {dir} is no longer a directory of mount {mount_id}"
            )));
        }
        Ok(d)
    }

    /// A new inode for a listed under-store entry, linked under `d`.
    pub(super) fn add_ufs_child(
        &mut self,
        d: &Inode,
        mount_id: u64,
        e: &UfsEntry,
        now_ms: i64,
        block_size: u64,
    ) -> Result<Inode, MasterError> {
        let fp = e.fingerprint.clone();
        let (length, mtime, version) = match (&e.kind, &fp) {
            (Kind::File, Some(fp)) => (fp.size, fp.mtime_ms, version_of(&fp.to_proto())),
            _ => (0, now_ms, 0),
        };
        let inode = Inode {
            id: self.alloc_inode()?,
            parent: d.id,
            name: e.name.clone(),
            kind: e.kind,
            // The mount's file_mode/dir_mode (or the defaults) when shown.
            mode: 0,
            mtime_ms: mtime,
            length,
            block_size: if e.kind == Kind::File { block_size } else { 0 },
            fingerprint: fp,
            version,
            mount_id: Some(mount_id),
            ufs_path: child_ufs_path(d, &e.name),
            is_mount_point: false,
            children_loaded: false,
            complete: true,
            persist: Persist::Persisted,
            persist_worker: 0,
            created: false,
            owner: None,
            creator: None,
            listed_ms: 0,
        };
        self.link(&inode)?;
        Ok(inode)
    }

    pub(super) fn add_probed_child(
        &mut self,
        dir: u64,
        mount_id: u64,
        e: &UfsEntry,
        now_ms: i64,
        block_size: u64,
    ) -> Result<ApplyOutput, MasterError> {
        let d = self.mount_dir(dir, mount_id)?;
        paths::validate_name(&e.name)?;
        if let Some(c) = self.child(dir, &e.name)? {
            return Ok(ApplyOutput::Inode(c));
        }
        Ok(ApplyOutput::Inode(
            self.add_ufs_child(&d, mount_id, e, now_ms, block_size)?,
        ))
    }

    /// Gives a file a new fingerprint (and so a new version); true when it changed.
    pub(super) fn set_fingerprint(
        &mut self,
        inode: &mut Inode,
        fp: &Fingerprint,
    ) -> Result<bool, MasterError> {
        // The same object seen through another API (listing vs HEAD) keeps its version, so
        // its cached pages stay valid.
        if inode
            .fingerprint
            .as_ref()
            .is_some_and(|f| f.same_object(fp))
        {
            return Ok(false);
        }
        inode.fingerprint = Some(fp.clone());
        inode.length = fp.size;
        inode.mtime_ms = fp.mtime_ms;
        inode.version = version_of(&fp.to_proto());
        self.put_inode(inode)?;
        Ok(true)
    }

    pub(super) fn sync_dir(
        &mut self,
        dir: u64,
        mount_id: u64,
        entries: &[UfsEntry],
        now_ms: i64,
        block_size: u64,
        seen: Option<&BTreeMap<String, u64>>,
    ) -> Result<ApplyOutput, MasterError> {
        let d = self.mount_dir(dir, mount_id)?;
        let listed: BTreeMap<&str, &UfsEntry> = entries
            .iter()
            .filter(|e| paths::validate_name(&e.name).is_ok())
            .map(|e| (e.name.as_str(), e))
            .collect();
        for id in self.child_ids(dir)? {
            let Some(mut child) = self.inode(id)? else {
                continue;
            };
            // Added or changed after the listing started (a newer lookup): keep it.
            if let Some(seen) = seen {
                if seen.get(child.name.as_str()) != Some(&child.version) {
                    continue;
                }
            }
            match listed.get(child.name.as_str()) {
                _ if child.being_written() => {}
                Some(e) if e.kind == child.kind => {
                    if let (Kind::File, Some(fp)) = (e.kind, &e.fingerprint) {
                        self.set_fingerprint(&mut child, fp)?;
                    }
                }
                None if child.kept_when_unlisted(now_ms) => {}
                // Gone from the store, or a file became a directory (or back).
                _ => self.remove_subtree(&child, true)?,
            }
        }
        for e in listed.values() {
            if self.child(dir, &e.name)?.is_none() {
                self.add_ufs_child(&d, mount_id, e, now_ms, block_size)?;
            }
        }
        let mut d = d;
        self.listed(&mut d, now_ms)?;
        Ok(ApplyOutput::Inode(d))
    }

    /// One batch of a re-listing: upserts, removals, and (last batch) the listed mark.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn sync_batch(
        &mut self,
        dir: u64,
        mount_id: u64,
        upserts: &[UfsEntry],
        batch: &SyncBatch,
        now_ms: i64,
        block_size: u64,
        seen: Option<&BTreeMap<String, u64>>,
    ) -> Result<ApplyOutput, MasterError> {
        let mut d = self.mount_dir(dir, mount_id)?;
        // An entry changed or added since the listing started (a newer lookup) is kept.
        let moved_on = |child: &Inode| {
            seen.is_some_and(|s| s.get(child.name.as_str()) != Some(&child.version))
        };
        for e in upserts {
            if paths::validate_name(&e.name).is_err() {
                continue;
            }
            match self.child(dir, &e.name)? {
                Some(c) if moved_on(&c) || c.being_written() => {}
                Some(mut c) if c.kind == e.kind => {
                    if let (Kind::File, Some(fp)) = (e.kind, &e.fingerprint) {
                        self.set_fingerprint(&mut c, fp)?;
                    }
                }
                Some(c) => {
                    self.remove_subtree(&c, true)?;
                    self.add_ufs_child(&d, mount_id, e, now_ms, block_size)?;
                }
                None => {
                    self.add_ufs_child(&d, mount_id, e, now_ms, block_size)?;
                }
            }
        }
        for name in &batch.removed {
            if let Some(c) = self.child(dir, name)? {
                if !moved_on(&c) && !c.kept_when_unlisted(now_ms) {
                    self.remove_subtree(&c, true)?;
                }
            }
        }
        if batch.last {
            self.listed(&mut d, now_ms)?;
        }
        Ok(ApplyOutput::Inode(d))
    }

    /// Marks folder `d` listed at `now_ms`: loaded (a folder listed for the first time may
    /// hold entries found by lookups), and when. The time alone changes nothing anyone
    /// sees, so it is not announced to watchers.
    fn listed(&mut self, d: &mut Inode, now_ms: i64) -> Result<(), MasterError> {
        d.listed_ms = now_ms;
        if d.children_loaded {
            self.put_inode_quietly(d)
        } else {
            d.children_loaded = true;
            self.put_inode(d)
        }
    }

    pub(super) fn refresh_file(
        &mut self,
        id: u64,
        fp: &Fingerprint,
        seen_version: Option<u64>,
    ) -> Result<ApplyOutput, MasterError> {
        let Some(mut inode) = self.inode(id)? else {
            return Err(MasterError::not_found(format!("inode {id}")));
        };
        if seen_version.is_some_and(|v| v != inode.version) {
            // Changed since the proposer looked: its HEAD is older than what is recorded.
            return Ok(ApplyOutput::Inode(inode));
        }
        if inode.kind != Kind::File || inode.mount_id.is_none() {
            return Err(MasterError::precondition(format!(
                "inode {id} is not a file of a mount"
            )));
        }
        self.set_fingerprint(&mut inode, fp)?;
        Ok(ApplyOutput::Inode(inode))
    }
}
