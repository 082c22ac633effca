-- One wake-up function for every table of due rows. The payload now names the kind of
-- row and carries the earliest new due time in epoch microseconds, "<kind>:<micros>"
-- ("<kind>:" alone for an infinite one), so that the active node can tell whether the
-- new row falls into a window of rows it already holds (see README, "Firing on the
-- dot") instead of probing both tables. Nodes of the previous version only wake on a
-- notification and never read its payload, so a rolling upgrade is safe.
--
-- The arguments: the kind ('expectation', 'delayed') and the table's deadline column.
CREATE OR REPLACE FUNCTION notify_due() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
BEGIN
    EXECUTE format('SELECT min(greatest(%I, retry_at)) FROM new_rows', TG_ARGV[1])
        INTO earliest;
    IF earliest IS NOT NULL THEN
        PERFORM pg_notify(
            left('timeoutd_' || TG_TABLE_SCHEMA, 63),
            TG_ARGV[0] || ':' ||
            CASE WHEN isfinite(earliest)
                 THEN (extract(epoch FROM earliest) * 1000000)::bigint::text
                 ELSE '' END);
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS expected_messages_notify_insert ON expected_messages;
CREATE TRIGGER expected_messages_notify_insert
    AFTER INSERT ON expected_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_due('expectation', 'timeout_at');

DROP TRIGGER IF EXISTS expected_messages_notify_update ON expected_messages;
CREATE TRIGGER expected_messages_notify_update
    AFTER UPDATE ON expected_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_due('expectation', 'timeout_at');

DROP TRIGGER IF EXISTS delayed_messages_notify_insert ON delayed_messages;
CREATE TRIGGER delayed_messages_notify_insert
    AFTER INSERT ON delayed_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_due('delayed', 'deliver_at');

DROP TRIGGER IF EXISTS delayed_messages_notify_update ON delayed_messages;
CREATE TRIGGER delayed_messages_notify_update
    AFTER UPDATE ON delayed_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_due('delayed', 'deliver_at');

DROP FUNCTION IF EXISTS notify_expected_messages();
DROP FUNCTION IF EXISTS notify_delayed_messages();
