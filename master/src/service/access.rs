//! Which namespace paths a principal may touch. A principal limited to a subtree (from its
//! certificate) reaches the subtree and everything below it; the folders above it can be
//! looked up and listed, but a listing shows only the way down; anything else is refused
//! with `PERMISSION_DENIED` (`EACCES` through FUSE).

use granary_common::paths::is_within;
use granary_common::tls::Principal;
use tonic::Status;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Inside the principal's subtree (or it has none).
    Full,
    /// A folder above the subtree: visible as the way down only.
    Ancestor,
}

fn denied(who: &Principal, path: &str) -> Status {
    Status::permission_denied(format!(
        "{path} is outside the subtree {} of {}",
        who.subtree.as_deref().unwrap_or("/"),
        who.name
    ))
}

/// The refusal of an entry a caller confined to a subtree named by inode id: the same for
/// an inode outside the subtree and for one that does not exist, naming no path (ids are
/// easy to guess; paths outside the subtree are not the caller's to learn).
pub fn denied_id(who: &Principal, id: u64) -> Status {
    denied(who, &format!("inode {id}"))
}

/// How far `who` reaches `path` (a normalised Granary path); an error when not at all.
pub fn reach(who: &Principal, path: &str) -> Result<Reach, Status> {
    let Some(top) = who.subtree.as_deref() else {
        return Ok(Reach::Full);
    };
    if is_within(path, top) {
        Ok(Reach::Full)
    } else if is_within(top, path) {
        Ok(Reach::Ancestor)
    } else {
        Err(denied(who, path))
    }
}

/// The name of the entry of folder `dir` (a normalised path above the principal's
/// subtree) on the way down to the subtree; `None` when `dir` is not above it.
pub fn way_down(who: &Principal, dir: &str) -> Option<String> {
    let top = who.subtree.as_deref()?;
    if top == dir || !is_within(top, dir) {
        return None;
    }
    let rest = if dir == "/" {
        &top[1..]
    } else {
        &top[dir.len() + 1..]
    };
    rest.split('/')
        .next()
        .filter(|n| !n.is_empty())
        .map(str::to_string)
}

/// Refuses unless `path` lies in the principal's subtree (changes, reads of file data).
pub fn full(who: &Principal, path: &str) -> Result<(), Status> {
    match reach(who, path)? {
        Reach::Full => Ok(()),
        Reach::Ancestor => Err(denied(who, path)),
    }
}

/// A change to the whole cluster (its workers, its masters): refused to a caller confined
/// to a subtree, whatever its role.
pub fn whole_cluster(who: &Principal, what: &str) -> Result<(), Status> {
    match who.subtree.as_deref() {
        None => Ok(()),
        Some(top) => Err(Status::permission_denied(format!(
            "{what} changes the whole cluster, and {} is confined to the subtree {top}",
            who.name
        ))),
    }
}

/// [`full`] for a path as a request gives it (normalised first; a malformed path is left
/// to the namespace's own error).
pub fn full_raw(who: &Principal, path: &str) -> Result<(), Status> {
    if who.subtree.is_none() {
        return Ok(());
    }
    let p = granary_common::paths::normalize(path)
        .map_err(|e| Status::invalid_argument(e.to_string()))?;
    full(who, &p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use granary_common::tls::Role;

    #[test]
    fn a_subtree_principal_reaches_its_subtree_and_sees_the_way_down() {
        let p = Principal::new("a", &[Role::User], Some("/data/team-a".into()));
        assert_eq!(reach(&p, "/data/team-a").unwrap(), Reach::Full);
        assert_eq!(reach(&p, "/data/team-a/x/y").unwrap(), Reach::Full);
        assert_eq!(reach(&p, "/data").unwrap(), Reach::Ancestor);
        assert_eq!(reach(&p, "/").unwrap(), Reach::Ancestor);
        assert!(reach(&p, "/data/team-b").is_err());
        assert!(reach(&p, "/data/team-ab").is_err());
        assert!(full(&p, "/data").is_err());
        assert!(full_raw(&p, "//data/./team-a/z").is_ok());
        assert_eq!(
            full_raw(&p, "/data/team-a/../team-b").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
        let all = Principal::new("b", &[Role::User], None);
        assert_eq!(reach(&all, "/anything").unwrap(), Reach::Full);
    }
}

/// The local user a FUSE mount acts for (uid and gid from the request's metadata). Like
/// NFS's AUTH_SYS it is the mount's word, bounded by what the mount's certificate reaches;
/// it keeps the users of one mount from each other's files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
}

impl Caller {
    pub fn of<T>(req: &tonic::Request<T>) -> Option<Caller> {
        let id = |key: &str| {
            req.metadata()
                .get(key)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u32>().ok())
        };
        Some(Caller {
            uid: id(granary_proto::CALLER_UID_KEY)?,
            gid: id(granary_proto::CALLER_GID_KEY)?,
        })
    }

    pub fn owner(self) -> crate::state::Owner {
        crate::state::Owner {
            uid: self.uid,
            gid: self.gid,
        }
    }
}

pub const READ: u32 = 4;
pub const WRITE: u32 = 2;
pub const EXEC: u32 = 1;

/// Refuses `caller` unless the entry `s` (owner and mode as shown) grants it `want`
/// (`READ`, `WRITE`, `EXEC` or'ed), as the kernel would: the owner's bits for the owner,
/// the group's for its group, the others' for the rest; root may do anything. No caller
/// (not a mount), or an entry with no owner, is not checked here.
pub fn posix(
    caller: Option<Caller>,
    s: &granary_proto::FileStatus,
    want: u32,
    what: &str,
) -> Result<(), Status> {
    let Some(c) = caller else { return Ok(()) };
    if c.uid == 0 || !s.has_owner {
        return Ok(());
    }
    let shift = if c.uid == s.uid {
        6
    } else if c.gid == s.gid {
        3
    } else {
        0
    };
    if (s.mode >> shift) & want == want {
        return Ok(());
    }
    Err(Status::permission_denied(format!(
        "uid {} may not {what} {} (owner {}:{}, mode {:o})",
        c.uid,
        s.path,
        s.uid,
        s.gid,
        s.mode & 0o7777
    )))
}

#[cfg(test)]
mod posix_tests {
    use super::*;

    #[test]
    fn modes_are_checked_as_the_kernel_would() {
        let s = granary_proto::FileStatus {
            path: "/d".into(),
            uid: 1000,
            gid: 100,
            has_owner: true,
            mode: 0o750,
            ..Default::default()
        };
        let c = |uid, gid| Some(Caller { uid, gid });
        let ok = |caller, want| posix(caller, &s, want, "touch").is_ok();
        assert!(ok(c(1000, 1), READ | WRITE | EXEC));
        assert!(ok(c(2000, 100), READ | EXEC) && !ok(c(2000, 100), WRITE));
        assert!(!ok(c(3000, 3000), READ) && !ok(c(3000, 3000), EXEC));
        assert!(ok(c(0, 0), WRITE), "root");
        assert!(ok(None, WRITE), "not a mount");
        let e = posix(c(3000, 3000), &s, READ, "list").unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied);
        assert_eq!(
            e.message(),
            "uid 3000 may not list /d (owner 1000:100, mode 750)"
        );
        let unowned = granary_proto::FileStatus {
            has_owner: false,
            ..s.clone()
        };
        assert!(posix(c(3000, 3000), &unowned, WRITE, "x").is_ok());
    }
}
