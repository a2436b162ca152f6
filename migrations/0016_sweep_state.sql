-- What the sweep keeps between passes (sql/080_sweep.sql), so that a pass costs the same with a
-- million parked jobs as with none: the last key its round-robin repair looked at, and a
-- fingerprint of the policies and queues that decide whether a parked job can be promoted (a
-- raised or removed limit, a type or queue gone); when that changes, passes look at every key
-- with parked jobs until one finds fewer than it can take. One row, written once per pass.
CREATE TABLE lockgate.sweep_state (
    singleton   boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    cursor_key  text,
    policies    text,
    full_scan   boolean NOT NULL DEFAULT true
);
INSERT INTO lockgate.sweep_state DEFAULT VALUES;

-- The sweep finds expired leases through this index again (dropped in 0008 so that renewals
-- would be HOT updates): without it, every pass read every lease twice, 30-70 ms per pass with
-- 100,000 permits held, while renewals are one per running limited job per heartbeat interval.
CREATE INDEX IF NOT EXISTS leases_expires_at_idx ON lockgate.leases (expires_at);
