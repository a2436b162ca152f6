-- An empty table the functions install builds one index on, to read how PostgreSQL shows the
-- claim index create_queue builds now (lockgate._install_claim_indexes, sql/001_queues.sql):
-- the text depends on PostgreSQL's version, not on how the expression was written, so it is read
-- from an index, not written down. A table of lockgate's own, not a temporary one, so that a
-- role without the TEMP privilege can migrate. It never holds a row.
CREATE TABLE IF NOT EXISTS lockgate.claim_index_probe (
    headers jsonb,
    vt      timestamptz,
    msg_id  bigint,
    CONSTRAINT claim_index_probe_empty CHECK (false) NO INHERIT
);
