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

/// Refuses unless `path` lies in the principal's subtree (changes, reads of file data).
pub fn full(who: &Principal, path: &str) -> Result<(), Status> {
    match reach(who, path)? {
        Reach::Full => Ok(()),
        Reach::Ancestor => Err(denied(who, path)),
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
