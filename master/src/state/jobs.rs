//! Jobs (`granary load`) in the replicated state: the job record, the files it has finished
//! and those that failed. The leader runs a job and records its progress through Raft, so
//! after a failover the next leader resumes it where the last recorded progress left off
//! and `granary job status` never goes backwards.
//!
//! Keys: `J` + id → [`Job`]; `j` + id + inode → length (a file whose every block is cached,
//! dropped when the job ends); `f` + id + inode → [`FailedFile`].

use super::keys;
use serde::{Deserialize, Serialize};

use super::{decode_record, encode_record, StateMachine, Txn};
use crate::error::MasterError;

/// Finished jobs older than this many job ids are forgotten (with their failed lists).
pub const JOBS_KEPT: u64 = 200;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Files not enumerated yet.
    Planning,
    Running,
    /// Every requested byte is cached.
    Succeeded,
    /// Finished; some files could not be cached (see the failed list) or the job could not
    /// run at all (`error`).
    Failed,
    Cancelled,
}

impl JobState {
    pub fn as_str(self) -> &'static str {
        self.code().text()
    }

    pub fn finished(self) -> bool {
        !matches!(self, Self::Planning | Self::Running)
    }

    /// The state on the wire.
    pub fn code(self) -> granary_proto::JobState {
        use granary_proto::JobState as Wire;
        match self {
            Self::Planning => Wire::Planning,
            Self::Running => Wire::Running,
            Self::Succeeded => Wire::Succeeded,
            Self::Failed => Wire::Failed,
            Self::Cancelled => Wire::Cancelled,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: u64,
    /// "load".
    pub kind: String,
    pub path: String,
    pub replicas: u32,
    pub state: JobState,
    pub created_ms: i64,
    #[serde(default)]
    pub finished_ms: i64,
    #[serde(default)]
    pub total_files: u64,
    #[serde(default)]
    pub total_bytes: u64,
    #[serde(default)]
    pub done_files: u64,
    #[serde(default)]
    pub done_bytes: u64,
    #[serde(default)]
    pub failed_files: u64,
    #[serde(default)]
    pub fetched_bytes: u64,
    #[serde(default)]
    pub error: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedFile {
    pub inode: u64,
    pub path: String,
    pub reason: String,
}

/// A file a job finished: every block cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DoneFile {
    pub inode: u64,
    pub length: u64,
}

impl StateMachine {
    pub fn job(&self, id: u64) -> Result<Option<Job>, MasterError> {
        self.get(&keys::job(id))?
            .map(|v| decode_record(&v))
            .transpose()
    }

    /// Every job kept, oldest first.
    pub fn jobs(&self) -> Result<Vec<Job>, MasterError> {
        let mut out = Vec::new();
        self.scan(&[keys::JOB], |_, v| {
            out.push(decode_record(v)?);
            Ok(true)
        })?;
        Ok(out)
    }

    /// Whether job `id` recorded file `inode` done or failed (a new runner of the job
    /// leaves it out): two point reads, so a resumed job holds no set of its files.
    pub fn job_settled(&self, id: u64, inode: u64) -> Result<bool, MasterError> {
        Ok(self
            .get(&keys::job_file(keys::JOB_DONE, id, inode))?
            .is_some()
            || self
                .get(&keys::job_file(keys::JOB_FAILED, id, inode))?
                .is_some())
    }

    /// Up to `max` of the files job `id` could not cache, in inode order.
    pub fn job_failed(&self, id: u64, max: usize) -> Result<Vec<FailedFile>, MasterError> {
        let mut out = Vec::new();
        let mut prefix = vec![keys::JOB_FAILED];
        prefix.extend_from_slice(&id.to_be_bytes());
        self.scan(&prefix, |_, v| {
            if out.len() >= max {
                return Ok(false);
            }
            out.push(decode_record(v)?);
            Ok(true)
        })?;
        Ok(out)
    }

    /// Calls `f` with each record whose key starts with `prefix`, in key order, until it
    /// returns false.
    pub(super) fn scan(
        &self,
        prefix: &[u8],
        f: impl FnMut(&[u8], &[u8]) -> Result<bool, MasterError>,
    ) -> Result<(), MasterError> {
        self.scan_from(prefix, prefix, f)
    }

    /// [`StateMachine::scan`] from the key `start` on (a key with the prefix).
    pub(super) fn scan_from(
        &self,
        start: &[u8],
        prefix: &[u8],
        mut f: impl FnMut(&[u8], &[u8]) -> Result<bool, MasterError>,
    ) -> Result<(), MasterError> {
        let mut it = self.db.raw_iterator_cf(self.cf()?);
        it.seek(start);
        while it.valid() {
            let (Some(k), Some(v)) = (it.key(), it.value()) else {
                break;
            };
            if !k.starts_with(prefix) || !f(k, v)? {
                break;
            }
            it.next();
        }
        it.status()?;
        Ok(())
    }
}

impl Txn<'_> {
    fn job(&self, id: u64) -> Result<Job, MasterError> {
        match self.get(&keys::job(id))? {
            Some(v) => decode_record(&v),
            None => Err(MasterError::NoSuchJob { id }),
        }
    }

    fn put_job(&mut self, job: &Job) -> Result<(), MasterError> {
        let v = encode_record(job)?;
        self.put(keys::job(job.id), v);
        Ok(())
    }

    /// Deletes every record of job `id` with key prefix `tag` + id.
    fn delete_job_files(&mut self, tag: u8, id: u64) -> Result<(), MasterError> {
        let mut prefix = vec![tag];
        prefix.extend_from_slice(&id.to_be_bytes());
        self.delete_prefix(&prefix)
    }

    pub(super) fn create_job(
        &mut self,
        kind: &str,
        path: &str,
        replicas: u32,
        now_ms: i64,
    ) -> Result<Job, MasterError> {
        let id = self.get_u64(keys::NEXT_JOB)?.max(1);
        self.put_u64(keys::NEXT_JOB, id + 1);
        // Forget the job that falls out of the kept window, if it finished.
        if id > JOBS_KEPT {
            let old = id - JOBS_KEPT;
            if let Ok(j) = self.job(old) {
                if j.state.finished() {
                    self.delete(keys::job(old));
                    self.delete_job_files(keys::JOB_FAILED, old)?;
                    self.delete_job_files(keys::JOB_DONE, old)?;
                }
            }
        }
        let job = Job {
            id,
            kind: kind.to_string(),
            path: path.to_string(),
            replicas,
            state: JobState::Planning,
            created_ms: now_ms,
            finished_ms: 0,
            total_files: 0,
            total_bytes: 0,
            done_files: 0,
            done_bytes: 0,
            failed_files: 0,
            fetched_bytes: 0,
            error: String::new(),
        };
        self.put_job(&job)?;
        Ok(job)
    }

    pub(super) fn job_planned(
        &mut self,
        id: u64,
        total_files: u64,
        total_bytes: u64,
    ) -> Result<Job, MasterError> {
        let mut job = self.job(id)?;
        if job.state == JobState::Planning {
            job.state = JobState::Running;
        }
        job.total_files = total_files;
        job.total_bytes = total_bytes;
        self.put_job(&job)?;
        Ok(job)
    }

    pub(super) fn job_progress(
        &mut self,
        id: u64,
        done: &[DoneFile],
        failed: &[FailedFile],
        fetched_bytes: u64,
    ) -> Result<Job, MasterError> {
        let mut job = self.job(id)?;
        if job.state.finished() {
            return Ok(job); // a late report of a cancelled job changes nothing
        }
        job.fetched_bytes = job.fetched_bytes.saturating_add(fetched_bytes);
        for d in done {
            let key = keys::job_file(keys::JOB_DONE, id, d.inode);
            if self.get(&key)?.is_some() {
                continue;
            }
            let fkey = keys::job_file(keys::JOB_FAILED, id, d.inode);
            if self.get(&fkey)?.is_some() {
                self.delete(fkey);
                job.failed_files = job.failed_files.saturating_sub(1);
            }
            self.put(key, d.length.to_be_bytes().to_vec());
            job.done_files = job.done_files.saturating_add(1);
            job.done_bytes = job.done_bytes.saturating_add(d.length);
        }
        for f in failed {
            let fkey = keys::job_file(keys::JOB_FAILED, id, f.inode);
            if self
                .get(&keys::job_file(keys::JOB_DONE, id, f.inode))?
                .is_some()
                || self.get(&fkey)?.is_some()
            {
                continue;
            }
            self.put(fkey, encode_record(f)?);
            job.failed_files = job.failed_files.saturating_add(1);
        }
        self.put_job(&job)?;
        Ok(job)
    }

    /// Ends a job (`state` finished) unless it already ended; its done markers go.
    pub(super) fn finish_job(
        &mut self,
        id: u64,
        state: JobState,
        error: &str,
        now_ms: i64,
    ) -> Result<Job, MasterError> {
        let mut job = self.job(id)?;
        if job.state.finished() {
            return Ok(job);
        }
        if !state.finished() {
            return Err(MasterError::invalid(format!(
                "a job cannot finish as {}",
                state.as_str()
            )));
        }
        job.state = state;
        job.finished_ms = now_ms;
        job.error = error.to_string();
        self.delete_job_files(keys::JOB_DONE, id)?;
        self.put_job(&job)?;
        Ok(job)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{ApplyOutput, Command};

    fn job_of(out: Result<ApplyOutput, MasterError>) -> Job {
        match out.unwrap() {
            ApplyOutput::Job(j) => j,
            o => panic!("not a job: {o:?}"),
        }
    }

    #[test]
    fn progress_counts_each_file_once_and_the_end_keeps_only_failures() {
        let (_d, sm) = crate::state::tests::open();
        let create = |i| {
            sm.apply(
                i,
                &Command::CreateJob {
                    kind: "load".into(),
                    path: "/data".into(),
                    replicas: 1,
                    now_ms: 5,
                },
            )
        };
        let j = job_of(create(1));
        assert_eq!((j.id, j.state), (1, JobState::Planning));
        let planned = Command::JobPlanned {
            id: 1,
            total_files: 3,
            total_bytes: 30,
        };
        assert_eq!(job_of(sm.apply(2, &planned)).state, JobState::Running);
        let done = |inode, length| DoneFile { inode, length };
        let failed = |inode: u64| FailedFile {
            inode,
            path: format!("/data/f{inode}"),
            reason: "gone".into(),
        };
        let progress = Command::JobProgress {
            id: 1,
            done: vec![done(10, 10), done(10, 10)],
            failed: vec![failed(12)],
            fetched_bytes: 10,
        };
        let j = job_of(sm.apply(3, &progress));
        assert_eq!((j.done_files, j.done_bytes, j.failed_files), (1, 10, 1));
        // The same report again (a resumed runner) changes no count; a failed file that
        // is cached later moves from failed to done.
        let j = job_of(sm.apply(4, &progress));
        assert_eq!((j.done_files, j.done_bytes, j.failed_files), (1, 10, 1));
        let later = Command::JobProgress {
            id: 1,
            done: vec![done(12, 10)],
            failed: vec![failed(10)],
            fetched_bytes: 0,
        };
        let j = job_of(sm.apply(5, &later));
        assert_eq!((j.done_files, j.done_bytes, j.failed_files), (2, 20, 0));
        assert!(sm.job_settled(1, 10).unwrap() && sm.job_settled(1, 12).unwrap());
        assert!(!sm.job_settled(1, 11).unwrap() && !sm.job_settled(2, 10).unwrap());
        let p = Command::JobProgress {
            id: 1,
            done: vec![],
            failed: vec![failed(11)],
            fetched_bytes: 0,
        };
        job_of(sm.apply(6, &p));
        let finish = |state| Command::FinishJob {
            id: 1,
            state,
            error: String::new(),
            now_ms: 9,
        };
        let j = job_of(sm.apply(7, &finish(JobState::Failed)));
        assert_eq!((j.state, j.finished_ms), (JobState::Failed, 9));
        assert!(
            !sm.job_settled(1, 10).unwrap() && !sm.job_settled(1, 12).unwrap(),
            "done markers are dropped"
        );
        assert!(sm.job_settled(1, 11).unwrap(), "failures are kept");
        assert_eq!(sm.job_failed(1, 10).unwrap(), vec![failed(11)]);
        // A finished job stays as it ended; unknown jobs are refused.
        assert_eq!(
            job_of(sm.apply(8, &finish(JobState::Cancelled))).state,
            JobState::Failed
        );
        assert_eq!(
            sm.apply(
                9,
                &Command::JobPlanned {
                    id: 7,
                    total_files: 1,
                    total_bytes: 1
                }
            ),
            Err(MasterError::NoSuchJob { id: 7 })
        );
        assert!(sm.apply(10, &finish(JobState::Running)).is_ok());
        // Ids keep increasing; old finished jobs fall out of the kept window.
        for i in 0..JOBS_KEPT {
            job_of(create(11 + i));
        }
        assert!(sm.job(1).unwrap().is_none());
        assert!(sm.job_failed(1, 10).unwrap().is_empty());
        assert_eq!(sm.jobs().unwrap().len() as u64, JOBS_KEPT);
    }

    #[test]
    fn a_prefix_deletion_removes_every_record_before_it_and_none_written_after() {
        let (_dir, sm) = crate::state::tests::open();
        let key = |tag, id, inode| keys::job_file(tag, id, inode);
        let mut txn = Txn::new(&sm);
        for inode in 0..1000 {
            txn.put(key(keys::JOB_DONE, 3, inode), vec![1]);
        }
        txn.put(key(keys::JOB_DONE, 4, 1), vec![1]);
        txn.put(key(keys::JOB_DONE, 2, u64::MAX), vec![1]);
        txn.commit().unwrap();
        let mut txn = Txn::new(&sm);
        txn.put(key(keys::JOB_DONE, 3, 5), vec![2]); // written before the deletion: goes with it
        txn.delete_job_files(keys::JOB_DONE, 3).unwrap();
        txn.put(key(keys::JOB_DONE, 3, 7), vec![3]); // written after: stays
        assert_eq!(txn.get(&key(keys::JOB_DONE, 3, 5)).unwrap(), None);
        assert_eq!(txn.get(&key(keys::JOB_DONE, 3, 6)).unwrap(), None);
        assert_eq!(txn.get(&key(keys::JOB_DONE, 3, 7)).unwrap(), Some(vec![3]));
        txn.commit().unwrap();
        let mut left = Vec::new();
        sm.scan(b"j", |k, v| {
            left.push((k.to_vec(), v.to_vec()));
            Ok(true)
        })
        .unwrap();
        assert_eq!(
            left,
            vec![
                (key(keys::JOB_DONE, 2, u64::MAX), vec![1]),
                (key(keys::JOB_DONE, 3, 7), vec![3]),
                (key(keys::JOB_DONE, 4, 1), vec![1]),
            ]
        );
        let mut txn = Txn::new(&sm);
        assert!(txn.delete_prefix(&[keys::INODE]).is_err() && txn.delete_prefix(b"").is_err());
    }
}
