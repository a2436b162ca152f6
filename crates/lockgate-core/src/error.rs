//! Validation errors: every one names the field, the value and what is allowed (SPEC §4).

/// A value a caller supplied that lockgate refuses before it reaches the database.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {field} {value:?}: {allowed}")]
pub struct ValidationError {
    /// The field or argument that was rejected (`queue`, `job_type`, `max_attempts`, …).
    pub field: &'static str,
    /// The rejected value, rendered for the message.
    pub value: String,
    /// What would have been accepted.
    pub allowed: String,
}

impl ValidationError {
    pub fn new(field: &'static str, value: impl ToString, allowed: impl Into<String>) -> Self {
        Self { field, value: value.to_string(), allowed: allowed.into() }
    }
}
