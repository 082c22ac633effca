-- Wake the active node when a deadline is added or moved, so it need not wait for its
-- next tick. One notification per statement (not per row): a bulk insert costs the
-- inserting transaction one extra query over its own rows. The payload is the earliest
-- new deadline in epoch milliseconds ("0" for '-infinity'/'infinity'); NOTIFY is sent at
-- commit, so the woken scanner sees the rows.

CREATE OR REPLACE FUNCTION notify_expected_messages() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
BEGIN
    SELECT min(coalesce(retry_at, timeout_at)) INTO earliest FROM new_rows;
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

DROP TRIGGER IF EXISTS expected_messages_notify_insert ON expected_messages;
CREATE TRIGGER expected_messages_notify_insert
    AFTER INSERT ON expected_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_expected_messages();

DROP TRIGGER IF EXISTS expected_messages_notify_update ON expected_messages;
CREATE TRIGGER expected_messages_notify_update
    AFTER UPDATE ON expected_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_expected_messages();
