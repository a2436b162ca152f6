//! Column expressions shared by the statements that read rows a producer or an operator may
//! have written by hand.

/// `column`, a timestamptz, as a value every reader can decode, else NULL. PostgreSQL holds
/// `infinity` and years up to 294276, which sqlx's chrono decoding does not fail on but panics
/// at (an overflow past year 262142): a row written by hand with such a time took down a worker
/// pool at claim, and `lockgate jobs` for everyone. lockgate's own writes stay far below.
pub(crate) fn readable_time(column: &str) -> String {
    format!("CASE WHEN isfinite({column}) AND {column} < '100000-01-01' THEN {column} END")
}

/// Column `at` of `row`, a jsonb, for an operator's listing: JSON the client cannot decode
/// (nested deeper than serde_json's 128 levels, which `lockgate.enqueue` accepts) is shown as a
/// note saying so, where `Row::get` panicked and took the whole listing with it.
pub(crate) fn shown_json(row: &sqlx::postgres::PgRow, at: usize) -> Option<serde_json::Value> {
    use sqlx::Row;
    row.try_get::<Option<serde_json::Value>, _>(at).unwrap_or_else(|e| {
        let cause = match e {
            sqlx::Error::ColumnDecode { source, .. } => source.to_string(),
            other => other.to_string(),
        };
        Some(serde_json::Value::String(format!("(not shown: {cause}; read it with SQL)")))
    })
}
