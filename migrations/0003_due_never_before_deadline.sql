-- A row is due when its deadline has passed AND any retry time the daemon set after a
-- failed publish has passed too. greatest() ignores NULL, so greatest(timeout_at,
-- retry_at) is exactly that instant: a process manager that moves timeout_at later with
-- a plain UPDATE (leaving an old retry_at behind) is never fired early. The previous
-- expression, coalesce(retry_at, timeout_at), let an old retry_at win over a later
-- deadline. retry_at = 'infinity' parks a row: its TimeOut was confirmed but the row
-- could not be deleted (see README, "Failure modes").
--
-- Building the index locks the table for writes while it runs (about a second per
-- million rows); migrate before a deploy when the table is large. The previous index
-- (on coalesce(retry_at, timeout_at)) stays for now: during a rolling upgrade the nodes
-- of the previous version still scan with it. A later release drops it.

CREATE INDEX IF NOT EXISTS expected_messages_due_at_idx
    ON expected_messages ((greatest(timeout_at, retry_at)));

CREATE OR REPLACE FUNCTION notify_expected_messages() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
BEGIN
    SELECT min(greatest(timeout_at, retry_at)) INTO earliest FROM new_rows;
    IF earliest IS NOT NULL THEN
        PERFORM pg_notify(
            left('timeoutd_' || TG_TABLE_SCHEMA, 63),
            CASE WHEN isfinite(earliest)
                 THEN (extract(epoch FROM earliest) * 1000)::bigint::text
                 ELSE '0' END);
    END IF;
    RETURN NULL;
END
$$;
