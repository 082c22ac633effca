-- The wake-up payload tells the two infinities apart: "<kind>:-" for a row due at
-- '-infinity' (due before everything: the active node looks from the start of the due
-- index at once), "<kind>:" for 'infinity' (held: nothing to wake for), as before.
-- Nodes of the previous version read "-" as an unknown due time and look from the
-- start too, so a rolling upgrade is safe.
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
                 WHEN earliest = '-infinity' THEN '-'
                 ELSE '' END);
    END IF;
    RETURN NULL;
END
$$;
