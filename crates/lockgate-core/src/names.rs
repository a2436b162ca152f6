//! Validated identifiers. A queue name becomes part of PGMQ table names (`pgmq.q_<queue>`), so it
//! is checked here, and again by the SQL functions, before it can reach any statement.

use std::fmt;

use crate::ValidationError;

/// PGMQ limits queue names to 47 bytes so that its longest derived identifier fits in 63.
const MAX_QUEUE_NAME_LEN: usize = 47;
/// Job type names are stored, logged and shown in the CLI; 128 is generous and bounded.
const MAX_JOB_TYPE_LEN: usize = 128;

/// A queue name: lowercase ASCII letter first, then lowercase letters, digits or `_`; at most 47.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueName(String);

impl QueueName {
    pub fn new(name: impl Into<String>) -> Result<Self, ValidationError> {
        let name = name.into();
        let allowed = "a lowercase letter followed by lowercase letters, digits or '_', at most 47 characters";
        let mut chars = name.chars();
        let first_ok = chars.next().is_some_and(|c| c.is_ascii_lowercase());
        let rest_ok = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !first_ok || !rest_ok || name.len() > MAX_QUEUE_NAME_LEN {
            return Err(ValidationError::new("queue", name, allowed));
        }
        Ok(Self(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for QueueName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A job type name: an ASCII letter first, then letters, digits, `_`, `.`, `:` or `-`; at most 128.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobTypeName(String);

impl JobTypeName {
    pub fn new(name: impl Into<String>) -> Result<Self, ValidationError> {
        let name = name.into();
        let allowed = "an ASCII letter followed by letters, digits, '_', '.', ':' or '-', at most 128 characters";
        let mut chars = name.chars();
        let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic());
        let rest_ok = chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
        if !first_ok || !rest_ok || name.len() > MAX_JOB_TYPE_LEN {
            return Err(ValidationError::new("job_type", name, allowed));
        }
        Ok(Self(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobTypeName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queue_names_follow_pgmq_rules() {
        assert!(QueueName::new("default").is_ok());
        assert!(QueueName::new("mail_2").is_ok());
        for bad in ["", "Default", "1abc", "a-b", "a;drop", &"q".repeat(48)] {
            let err = QueueName::new(bad).unwrap_err();
            assert_eq!(err.field, "queue", "{bad:?} should be rejected");
        }
        assert!(QueueName::new("q".repeat(47)).is_ok());
    }

    #[test]
    fn job_type_names_allow_namespaces_but_not_spaces() {
        assert!(JobTypeName::new("mail.send").is_ok());
        assert!(JobTypeName::new("Billing::Charge").is_ok());
        for bad in ["", "send mail", "_x", "x'y", &"j".repeat(129)] {
            assert!(JobTypeName::new(bad).is_err(), "{bad:?} should be rejected");
        }
    }
}
