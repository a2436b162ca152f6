-- Attempts count runs that started (H32). A message's last_read_at now records when its current
-- delivery started running: a claim leaves it NULL on the deliveries it returns beyond the ones
-- that start at once (claimed ahead), and the completer's next statement records a
-- claimed-ahead delivery's start; a claim that finds a delivered message whose last_read_at is
-- still NULL counts that delivery as a return, not an attempt. claim gains an argument and a
-- result column, complete two arguments, so sql/ recreates them.
DROP FUNCTION IF EXISTS lockgate.claim(text, integer, double precision, bigint);
DROP FUNCTION IF EXISTS lockgate.complete(text, bigint[], integer[]);
-- A claimed delivery as lockgate.claim holds it while it decides a limited job, now with
-- whether it was claimed ahead.
ALTER TYPE lockgate._claimed ADD ATTRIBUTE ahead boolean;
