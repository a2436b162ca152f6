-- Promotion sends its messages in one statement per queue instead of one per job: _promote
-- returns what to send (lockgate.promotion rows) and _send_promotions sends them.
DROP FUNCTION IF EXISTS lockgate._promote(text);

CREATE TYPE lockgate.promotion AS (
    queue       text,
    vt          timestamptz,
    args        jsonb,
    headers     jsonb,
    key         text,      -- NULL: the type is no longer limited, no lease
    duration_ms bigint
);
