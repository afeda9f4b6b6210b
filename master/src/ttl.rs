//! Acting on TTLs (`granary ttl set PATH DURATION --action free|delete`): the leader checks
//! the TTLs every tick (0.5 s) and, for each one due, frees the path's cached copies or
//! deletes the entry (in the under-store too, for mounted paths), then removes the TTL. A
//! free that is refused (pinned data, files not persisted yet) is retried every tick and
//! logged once a minute; the TTL stays until it succeeds.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::core::MasterCore;
use crate::error::MasterError;
use crate::state::ttl::{Ttl, TtlAction};
use crate::state::{ApplyOutput, Command, Inode, Kind};

/// How often a refused TTL action is logged again.
const WARN_EVERY: Duration = Duration::from_secs(60);

#[derive(Default)]
pub struct TtlRunner {
    busy: AtomicBool,
    warned: Mutex<HashMap<u64, Instant>>,
    /// TTLs set by this master (each makes the next tick read them all again).
    sets: AtomicU64,
    /// `(term, sets, ms)`: with this leader's term and no TTL set since, none is due before
    /// `ms`. Reading every TTL each tick cost a decode per TTL twice a second.
    next_due: Mutex<Option<(u64, u64, i64)>>,
}

impl MasterCore {
    /// Sets the TTL of `path` to `ttl_ms` from now (0: removes it).
    pub async fn set_ttl(
        &self,
        path: &str,
        ttl_ms: u64,
        action: granary_proto::TtlAction,
        request_id: u64,
    ) -> Result<(Inode, Option<Ttl>), MasterError> {
        let action = match action {
            granary_proto::TtlAction::Free => TtlAction::Free,
            granary_proto::TtlAction::Delete => TtlAction::Delete,
            granary_proto::TtlAction::Unspecified => {
                return Err(MasterError::invalid("no TTL action given (free or delete)"))
            }
        };
        self.ensure_leader()?;
        let path = granary_common::paths::normalize(path)?;
        if path == "/" {
            return Err(MasterError::invalid("the root cannot have a TTL"));
        }
        self.namespace().resolve(&path).await?;
        let ttl = (ttl_ms > 0).then(|| Ttl {
            expires_ms: granary_common::now_ms().saturating_add(ttl_ms.min(i64::MAX as u64) as i64),
            action,
        });
        let out = self
            .propose_request(Command::SetTtl { path, ttl }, request_id)
            .await;
        // Also when the answer is an error: the entry may have been applied all the same.
        self.ttl_runner().sets.fetch_add(1, Ordering::AcqRel);
        match out? {
            ApplyOutput::Inode(i) => Ok((i, ttl)),
            _ => Err(MasterError::corrupt("unexpected result of SetTtl")),
        }
    }

    /// Deletes `path` (in the under-store first for mounted paths), as `granary fs rm`.
    pub async fn delete_path(
        &self,
        path: &str,
        recursive: bool,
        request_id: u64,
    ) -> Result<(), MasterError> {
        self.ensure_leader()?;
        let normal = granary_common::paths::normalize(path)?;
        // A folder holding a mount point is refused before anything changes (the store,
        // or a purge of what is beside the mount).
        if let Some(m) = self
            .namespace()
            .sm
            .mounts()?
            .into_iter()
            .find(|m| m.path != normal && granary_common::paths::is_within(&m.path, &normal))
        {
            return Err(MasterError::Busy {
                path: normal,
                mount: m.path,
            });
        }
        let sm = &self.namespace().sm;
        // A retried request that was done already must not delete what was made at its
        // path since, in the store or by a purge (the final command alone would be
        // recognised).
        let replayed = self.replayed_cheaply(request_id).await?;
        if let Some(first) = replayed {
            return first.map(drop);
        }
        let inode = self.namespace().delete_in_store(path, recursive).await?;
        // A folder not listed before is listed by `delete_in_store`: it may be big only now.
        if recursive && inode.kind == Kind::Directory {
            // Again while entries arrive faster than they go (a move into the folder).
            for _ in 0..3 {
                if self.namespace().purge_below(&inode, &normal, None).await? == 0 {
                    break;
                }
            }
            if sm.count_below(inode.id, crate::purge::PURGE_PAGE)? > crate::purge::PURGE_PAGE {
                return Err(MasterError::precondition(format!(
                    "entries keep arriving below {} faster than they are removed; ask again",
                    granary_common::paths::shown(&normal)
                )));
            }
        }
        self.propose_request(
            Command::Delete {
                path: path.to_string(),
                recursive,
            },
            request_id,
        )
        .await?;
        // Workers drop the removed file's cached pages (pinned ones of a pending write too).
        if inode.kind == Kind::File {
            self.fleet().note_stale(inode.id, 0);
        }
        Ok(())
    }

    /// Acts on the TTLs that are due (leader only; every tick, one pass at a time).
    pub fn expire_ttls(self: &Arc<Self>) {
        if !self.is_leader() {
            return;
        }
        let now = granary_common::now_ms();
        let term = self.raft().status.term.load(Ordering::Relaxed);
        let sets = self.ttl_runner().sets.load(Ordering::Acquire);
        let mut next_due = match self.ttl_runner().next_due.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if next_due.is_some_and(|(t, s, next)| t == term && s == sets && now < next) {
            return;
        }
        let Ok(ttls) = self.namespace().sm.ttls() else {
            return;
        };
        let (due, later): (Vec<_>, Vec<_>) =
            ttls.into_iter().partition(|(_, t)| t.expires_ms <= now);
        // Due ones are looked at again next tick (done: gone; refused: retried).
        let next = if due.is_empty() {
            later
                .iter()
                .map(|(_, t)| t.expires_ms)
                .min()
                .unwrap_or(i64::MAX)
        } else {
            now
        };
        *next_due = Some((term, sets, next));
        drop(next_due);
        if due.is_empty() || self.ttl_runner().busy.swap(true, Ordering::AcqRel) {
            return;
        }
        let core = self.clone();
        tokio::spawn(async move {
            for (inode, ttl) in due {
                if let Err(e) = core.act_on_ttl(inode, &ttl).await {
                    let mut w = match core.ttl_runner().warned.lock() {
                        Ok(g) => g,
                        Err(p) => p.into_inner(),
                    };
                    if w.get(&inode).is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                        tracing::warn!(inode, action = ttl.action.as_str(), error = %e, "a TTL is due but its action failed; retrying");
                        w.insert(inode, Instant::now());
                    }
                }
            }
            core.ttl_runner().busy.store(false, Ordering::Release);
        });
    }

    async fn act_on_ttl(&self, inode: u64, ttl: &Ttl) -> Result<(), MasterError> {
        let Some(node) = self.namespace().sm.inode(inode)? else {
            return Ok(()); // gone already (its TTL went with it)
        };
        let path = self.namespace().sm.path_of(&node)?;
        match ttl.action {
            TtlAction::Free => {
                let r = self.free(&path, true, false).await?;
                tracing::info!(path = %path, files = r.files, cached = r.cached_files, "TTL expired: freed");
            }
            TtlAction::Delete => {
                self.delete_path(&path, true, 0).await?;
                tracing::info!(path = %path, "TTL expired: deleted");
            }
        }
        self.propose(Command::EndTtl { inode, was: *ttl }).await?;
        Ok(())
    }
}
