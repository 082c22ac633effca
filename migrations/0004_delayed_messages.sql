-- Delayed messages (contract section 7): any AMQP message published to the ingress
-- exchange is stored here until it is due, then delivered as it was. Rows live only
-- while pending: delivery deletes them, like expectations.

CREATE TABLE IF NOT EXISTS delayed_messages (
    id            uuid        PRIMARY KEY DEFAULT gen_random_uuid(),
    -- The publisher's message_id, or a uuid given at ingest. Unique: a redelivery of a
    -- message already stored adds nothing (and a cancel names exactly one row).
    message_id    text        NOT NULL,
    deliver_at    timestamptz NOT NULL,
    exchange      text        NOT NULL,
    routing_key   text        NOT NULL,
    -- The AMQP properties, header values with their AMQP types (see README).
    properties    jsonb       NOT NULL DEFAULT '{}',
    body          bytea       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    attempts      integer     NOT NULL DEFAULT 0,
    last_error    text        NULL,
    -- As for expectations: the next attempt after a failed publish; 'infinity' holds a
    -- row for an operator (bad input, or delivered but not deletable).
    retry_at      timestamptz NULL
);

CREATE UNIQUE INDEX IF NOT EXISTS delayed_messages_message_id_key
    ON delayed_messages (message_id);

-- The scan's due expression, as for expectations (migration 0003).
CREATE INDEX IF NOT EXISTS delayed_messages_due_at_idx
    ON delayed_messages ((greatest(deliver_at, retry_at)));

CREATE OR REPLACE FUNCTION notify_delayed_messages() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    earliest timestamptz;
BEGIN
    SELECT min(greatest(deliver_at, retry_at)) INTO earliest FROM new_rows;
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

DROP TRIGGER IF EXISTS delayed_messages_notify_insert ON delayed_messages;
CREATE TRIGGER delayed_messages_notify_insert
    AFTER INSERT ON delayed_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_delayed_messages();

DROP TRIGGER IF EXISTS delayed_messages_notify_update ON delayed_messages;
CREATE TRIGGER delayed_messages_notify_update
    AFTER UPDATE ON delayed_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION notify_delayed_messages();
