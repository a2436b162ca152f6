//! The outcome of a fenced completion (SPEC §2). Callers, logs and metrics keep the three apart.

use std::fmt;

/// What a fenced completion of one delivery `(queue, msg_id, read_ct)` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ArchiveOutcome {
    /// This delivery completed the job, and its bookkeeping committed in the same transaction.
    Archived,
    /// The message was gone or owned by a newer delivery: this delivery changed nothing.
    AlreadyArchived,
    /// The connection broke while committing and a retry found the message gone. Whoever removed
    /// it did the bookkeeping in that same transaction, so nothing is owed.
    Ambiguous,
}

impl ArchiveOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Archived => "archived",
            Self::AlreadyArchived => "already_archived",
            Self::Ambiguous => "ambiguous",
        }
    }
}

impl fmt::Display for ArchiveOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
