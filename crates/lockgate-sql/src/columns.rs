//! Column expressions shared by the statements that read rows a producer or an operator may
//! have written by hand.

/// `column`, a timestamptz, as a value every reader can decode, else NULL. PostgreSQL holds
/// `infinity` and years up to 294276, which sqlx's chrono decoding does not fail on but panics
/// at (an overflow past year 262142): a row written by hand with such a time took down a worker
/// pool at claim, and `lockgate jobs` for everyone. lockgate's own writes stay far below.
pub(crate) fn readable_time(column: &str) -> String {
    format!("CASE WHEN isfinite({column}) AND {column} < '100000-01-01' THEN {column} END")
}
