-- Publishers own their ids (contract section 8). A delayed message belongs to its owner:
-- the AMQP user_id it was published with (the broker refuses a user_id that is not the
-- publishing connection's own user), or '' (anonymous) without one. Uniqueness of
-- message_id among pending rows, the dedupe of redeliveries and cancels are scoped to
-- (owner, message_id): nobody can cancel, replace or pre-empt another owner's message.
--
-- BREAKING for a rolling upgrade: the previous version stores with
-- ON CONFLICT (message_id), which needs the single-column unique index dropped here; a
-- node of the previous version still running would fail to store, and drop, every
-- delayed message it takes. Replace all nodes at once, or set delay.enabled = false on
-- the old nodes before the first new one starts (see CHANGELOG.md).

ALTER TABLE delayed_messages ADD COLUMN IF NOT EXISTS owner text NOT NULL DEFAULT '';

-- Rows stored before: the previous version kept the publisher's user_id in properties.
UPDATE delayed_messages SET owner = properties->>'user_id'
    WHERE owner = '' AND jsonb_typeof(properties->'user_id') = 'string';

CREATE UNIQUE INDEX IF NOT EXISTS delayed_messages_owner_message_id_key
    ON delayed_messages (owner, message_id);
DROP INDEX IF EXISTS delayed_messages_message_id_key;

-- Cancels remembered before this version named no owner: they stay anonymous.
ALTER TABLE delayed_cancels ADD COLUMN IF NOT EXISTS owner text NOT NULL DEFAULT '';
ALTER TABLE delayed_cancels DROP CONSTRAINT IF EXISTS delayed_cancels_pkey;
ALTER TABLE delayed_cancels ADD CONSTRAINT delayed_cancels_pkey PRIMARY KEY (owner, message_id);

-- What each owner has stored (bounded by delay.max_pending_per_owner and
-- delay.max_bytes_per_owner): a ledger of changes, one row per owner per statement
-- that inserts, deletes or resizes rows, written by the statement-level triggers below.
-- Only ever inserted into by the triggers, so writers never wait for each other on a
-- counter row; the ingest sums an owner's rows and folds them into one now and then.
CREATE TABLE IF NOT EXISTS delayed_usage (
    owner     text   NOT NULL,
    messages  bigint NOT NULL,
    -- Body plus properties, as stored (pg_column_size: compressed, without detoasting).
    bytes     bigint NOT NULL
);

-- Without deduplication: the entries of one owner would share posting lists, which a
-- scan can mark dead only once every row in them is dead, so usage reads would walk the
-- rows folds deleted until the next vacuum; one entry per row is marked dead by the
-- first read that finds its row gone.
CREATE INDEX IF NOT EXISTS delayed_usage_owner_idx
    ON delayed_usage (owner) INCLUDE (messages, bytes) WITH (deduplicate_items = off);

-- SET search_path: the ledger is this schema's, whatever the session deleting a row
-- (a process manager's cancel) has on its own search_path.
CREATE OR REPLACE FUNCTION delayed_usage_count() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO delayed_usage (owner, messages, bytes)
        SELECT owner, count(*), sum(octet_length(body) + pg_column_size(properties))
        FROM new_rows GROUP BY owner;
    ELSIF TG_OP = 'DELETE' THEN
        INSERT INTO delayed_usage (owner, messages, bytes)
        SELECT owner, -count(*), -sum(octet_length(body) + pg_column_size(properties))
        FROM old_rows GROUP BY owner;
    ELSE
        -- Most updates (a failed delivery charged) change neither: nothing written.
        INSERT INTO delayed_usage (owner, messages, bytes)
        SELECT owner, sum(n), sum(b) FROM (
            SELECT owner, 1 AS n, octet_length(body) + pg_column_size(properties) AS b
            FROM new_rows
            UNION ALL
            SELECT owner, -1, -(octet_length(body) + pg_column_size(properties))
            FROM old_rows) AS d
        GROUP BY owner HAVING sum(n) <> 0 OR sum(b) <> 0;
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS delayed_messages_usage_insert ON delayed_messages;
CREATE TRIGGER delayed_messages_usage_insert
    AFTER INSERT ON delayed_messages
    REFERENCING NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION delayed_usage_count();

-- Never refuses a row (an insert into a table without constraints): the firing
-- transaction still deletes fired rows directly (see Writes::guard).
DROP TRIGGER IF EXISTS delayed_messages_usage_delete ON delayed_messages;
CREATE TRIGGER delayed_messages_usage_delete
    AFTER DELETE ON delayed_messages
    REFERENCING OLD TABLE AS old_rows
    FOR EACH STATEMENT EXECUTE FUNCTION delayed_usage_count();

DROP TRIGGER IF EXISTS delayed_messages_usage_update ON delayed_messages;
CREATE TRIGGER delayed_messages_usage_update
    AFTER UPDATE ON delayed_messages
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION delayed_usage_count();

CREATE OR REPLACE FUNCTION delayed_usage_truncate() RETURNS trigger
LANGUAGE plpgsql SET search_path FROM CURRENT AS $$
BEGIN
    DELETE FROM delayed_usage;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS delayed_messages_usage_truncate ON delayed_messages;
CREATE TRIGGER delayed_messages_usage_truncate
    AFTER TRUNCATE ON delayed_messages
    FOR EACH STATEMENT EXECUTE FUNCTION delayed_usage_truncate();

-- What is stored already (this migration holds the table's lock: nothing is written
-- meanwhile).
INSERT INTO delayed_usage (owner, messages, bytes)
SELECT owner, count(*), sum(octet_length(body) + pg_column_size(properties))
FROM delayed_messages GROUP BY owner;
