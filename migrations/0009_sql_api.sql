-- The SQL API (docs/integrating/sql-api.md): functions in this schema that a process
-- manager in any language calls inside its own transaction, instead of writing the
-- tables. Version 1 (api_version()). Within a version, functions only gain parameters
-- with defaults at the end; a change of meaning gets a new name, and the old one stays
-- for at least one release.
--
-- Every function is SECURITY DEFINER with search_path pinned to this schema (and
-- pg_temp last, so that a caller's temporary table never stands in for ours), and
-- EXECUTE is revoked from PUBLIC: a role may call them only when granted. The role
-- <schema>_api (created here when the migrating role may create roles) holds EXECUTE on
-- every API function and USAGE on the schema, nothing else: a process manager's login
-- role granted it needs no right on the tables.
--
-- Delayed messages written here belong to the owner 'sql:' || session_user (the login
-- role, whatever SET ROLE did): a caller acts on its own messages only, unless it may
-- delete from delayed_messages directly (an operator, the daemon's own role).

-- Expectations: an optional key that makes expect() idempotent, and the W3C trace
-- context the TimeOut carries.
ALTER TABLE expected_messages ADD COLUMN IF NOT EXISTS idempotency_key text NULL;
ALTER TABLE expected_messages ADD COLUMN IF NOT EXISTS traceparent text NULL
    CONSTRAINT expected_messages_traceparent_check
    CHECK (traceparent ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$');
CREATE UNIQUE INDEX IF NOT EXISTS expected_messages_idempotency_key_key
    ON expected_messages (idempotency_key) WHERE idempotency_key IS NOT NULL;
-- cancel_expectations(process_id, message_type), and the console's search.
CREATE INDEX IF NOT EXISTS expected_messages_process_id_idx
    ON expected_messages (process_id, message_type);

-- A held delayed message whose body was over delay.max_body was stored without it: it
-- can never be delivered (release refuses it, and the firing path holds it again).
ALTER TABLE delayed_messages ADD COLUMN IF NOT EXISTS body_dropped boolean NOT NULL DEFAULT false;
UPDATE delayed_messages SET body_dropped = true
    WHERE retry_at = 'infinity' AND octet_length(body) = 0
      AND last_error LIKE '%larger than delay.max_body%not stored%';
-- The console's search by message_id across owners.
CREATE INDEX IF NOT EXISTS delayed_messages_message_id_idx ON delayed_messages (message_id);

CREATE OR REPLACE FUNCTION api_version() RETURNS integer
LANGUAGE sql IMMUTABLE AS 'SELECT 1';

-- The owner of the caller's delayed messages.
CREATE OR REPLACE FUNCTION api_owner() RETURNS text
LANGUAGE sql STABLE AS $$ SELECT 'sql:' || session_user $$;

-- The owner a delayed-message function acts for: the caller's own (NULL or its own
-- name), or another only for a caller that may delete from the table directly.
CREATE OR REPLACE FUNCTION api_acting_owner(owner text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF owner IS NULL OR owner = api_owner() THEN
        RETURN api_owner();
    END IF;
    IF NOT has_table_privilege(session_user, 'delayed_messages', 'DELETE') THEN
        RAISE EXCEPTION 'role % may act only on its own delayed messages (owner %)',
            session_user, api_owner()
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN owner;
END
$$;

-- A W3C trace context header (https://www.w3.org/TR/trace-context/), or NULL.
CREATE OR REPLACE FUNCTION api_traceparent(value text) RETURNS text
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NOT NULL
       AND value !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$' THEN
        RAISE EXCEPTION 'traceparent % is not a W3C traceparent (00-<32 hex>-<16 hex>-<2 hex>)',
            quote_literal(value) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN value;
END
$$;

-- AMQP properties as a caller writes them (plain JSON: headers an object of strings,
-- integers, booleans and nulls) in the stored form (header values with their AMQP type,
-- as the ingress stores them). Persistent (delivery_mode 2) unless asked otherwise.
CREATE OR REPLACE FUNCTION api_properties(given jsonb, message_id text) RETURNS jsonb
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    key text;
    value jsonb;
    out jsonb := '{}';
    headers jsonb := '[]';
BEGIN
    IF given IS NULL THEN
        given := '{}';
    END IF;
    IF jsonb_typeof(given) <> 'object' THEN
        RAISE EXCEPTION 'properties must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    FOR key, value IN SELECT * FROM jsonb_each(given) LOOP
        CASE
        WHEN key IN ('type', 'correlation_id', 'content_type', 'content_encoding',
                     'reply_to', 'expiration', 'app_id') THEN
            IF jsonb_typeof(value) <> 'string' THEN
                RAISE EXCEPTION 'property % must be a string', key
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            out := out || jsonb_build_object(key, value);
        WHEN key IN ('delivery_mode', 'priority', 'timestamp') THEN
            IF jsonb_typeof(value) <> 'number' OR value::numeric <> trunc(value::numeric)
               OR value::numeric < 0 OR (key <> 'timestamp' AND value::numeric > 255)
               OR value::numeric > 9223372036854775807 THEN
                RAISE EXCEPTION 'property % must be a whole number in range', key
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            out := out || jsonb_build_object(key, value);
        WHEN key = 'message_id' THEN
            NULL; -- the message_id argument, or the property given, is set below
        WHEN key = 'headers' THEN
            IF jsonb_typeof(value) NOT IN ('object', 'null') THEN
                RAISE EXCEPTION 'headers must be a JSON object' USING ERRCODE = 'invalid_parameter_value';
            END IF;
        ELSE
            RAISE EXCEPTION 'unknown property % (user_id is the calling role''s own)', key
                USING ERRCODE = 'invalid_parameter_value';
        END CASE;
    END LOOP;
    -- "headers": null (a nil map, as some languages serialise it) is no headers.
    FOR key, value IN SELECT * FROM jsonb_each(coalesce(nullif(given->'headers', 'null'), '{}'))
                      ORDER BY 1 LOOP
        headers := headers || jsonb_build_array(jsonb_build_array(key,
            CASE jsonb_typeof(value)
            WHEN 'string' THEN jsonb_build_object('t', 'str', 'v', value)
            WHEN 'boolean' THEN jsonb_build_object('t', 'bool', 'v', value)
            WHEN 'null' THEN jsonb_build_object('t', 'void')
            WHEN 'number' THEN
                CASE WHEN value::numeric = trunc(value::numeric)
                      AND value::numeric BETWEEN -9223372036854775808 AND 9223372036854775807
                     THEN jsonb_build_object('t', 'i64', 'v', value)
                END
            END));
        IF headers->-1->1 = 'null'::jsonb THEN
            RAISE EXCEPTION 'header % must be a string, a whole number, a boolean or null', key
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
    END LOOP;
    IF jsonb_array_length(headers) > 0 THEN
        out := out || jsonb_build_object('headers', headers);
    END IF;
    IF NOT out ? 'delivery_mode' THEN
        out := out || '{"delivery_mode": 2}';
    END IF;
    RETURN out || jsonb_build_object('message_id', message_id);
END
$$;

-- Expect a message: the TimeOut fires at timeout_at unless the row is cancelled first.
-- With an idempotency_key, a second call with the same key while the first is pending
-- changes nothing and returns the same id. id: the expectation's id (the TimeOut's
-- message_id), when the caller chose it; a new uuid by default.
CREATE OR REPLACE FUNCTION expect(
    process_id text,
    message_type text,
    routing_key text,
    timeout_at timestamptz,
    exchange text DEFAULT '',
    payload jsonb DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    traceparent text DEFAULT NULL,
    id uuid DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER AS $$
#variable_conflict use_column
DECLARE
    new_id uuid;
BEGIN
    -- Twice at most: a row found by its key may fire (and go) between the two statements.
    FOR attempt IN 1..2 LOOP
        INSERT INTO expected_messages AS m (id, process_id, message_type, timeout_at, exchange,
            routing_key, payload, idempotency_key, traceparent)
        VALUES (coalesce(expect.id, gen_random_uuid()), expect.process_id, expect.message_type, expect.timeout_at, expect.exchange,
            expect.routing_key, expect.payload, expect.idempotency_key,
            api_traceparent(expect.traceparent))
        ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING m.id INTO new_id;
        IF new_id IS NOT NULL THEN
            RETURN new_id;
        END IF;
        SELECT m.id INTO new_id FROM expected_messages AS m
            WHERE m.idempotency_key = expect.idempotency_key;
        IF new_id IS NOT NULL THEN
            RETURN new_id;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'idempotency_key % keeps changing hands', quote_literal(expect.idempotency_key)
        USING ERRCODE = 'serialization_failure';
END
$$;

-- true: cancelled in time; false: its TimeOut fired already (or it never existed). A row
-- being fired at this moment is waited for, so false is only said once it is gone.
CREATE OR REPLACE FUNCTION cancel_expectation(id uuid) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    DELETE FROM expected_messages AS m WHERE m.id = cancel_expectation.id;
    RETURN FOUND;
END
$$;

-- Every pending expectation of a process (of one message type, or all): how many.
CREATE OR REPLACE FUNCTION cancel_expectations(process_id text, message_type text DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    n integer;
BEGIN
    DELETE FROM expected_messages AS m
        WHERE m.process_id = cancel_expectations.process_id
          AND (cancel_expectations.message_type IS NULL
               OR m.message_type = cancel_expectations.message_type);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- A new deadline (later or earlier): a new intent, so the backoff of a failed publish
-- starts over; a parked row stays parked (see release_expectation).
CREATE OR REPLACE FUNCTION reschedule_expectation(id uuid, timeout_at timestamptz) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    IF reschedule_expectation.timeout_at IS NULL THEN
        RAISE EXCEPTION 'timeout_at must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE expected_messages AS m SET timeout_at = reschedule_expectation.timeout_at,
        retry_at = CASE WHEN m.retry_at = 'infinity' THEN m.retry_at END
        WHERE m.id = reschedule_expectation.id;
    RETURN FOUND;
END
$$;

-- A parked row (its TimeOut was confirmed but the row could not be deleted) fires
-- again now: a second TimeOut, by the caller's decision. false: not parked.
CREATE OR REPLACE FUNCTION release_expectation(id uuid) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    UPDATE expected_messages AS m SET retry_at = NULL
        WHERE m.id = release_expectation.id AND m.retry_at = 'infinity';
    RETURN FOUND;
END
$$;

-- A row waiting for its next attempt after a failed publish is tried now (never before
-- its timeout_at). false: it was not waiting for a retry.
CREATE OR REPLACE FUNCTION retry_expectation(id uuid) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
BEGIN
    UPDATE expected_messages AS m SET retry_at = NULL
        WHERE m.id = retry_expectation.id AND m.retry_at IS NOT NULL
          AND m.retry_at <> 'infinity';
    RETURN FOUND;
END
$$;

-- Deliver a message at deliver_at (to an exchange the daemons allow for delayed
-- messages: delay.target_exchange, delay.allowed_exchanges; any other is held when it
-- falls due). Returns its message_id (given, from properties, or a new uuid); a second
-- call with a message_id the caller has pending changes nothing.
CREATE OR REPLACE FUNCTION schedule_delayed(
    exchange text,
    routing_key text,
    body bytea,
    deliver_at timestamptz,
    properties jsonb DEFAULT '{}',
    message_id text DEFAULT NULL
) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER AS $$
#variable_conflict use_column
DECLARE
    new_id text := coalesce(schedule_delayed.message_id, schedule_delayed.properties->>'message_id',
                        gen_random_uuid()::text);
BEGIN
    IF schedule_delayed.deliver_at IS NULL OR schedule_delayed.body IS NULL
       OR schedule_delayed.exchange IS NULL OR schedule_delayed.routing_key IS NULL THEN
        RAISE EXCEPTION 'exchange, routing_key, body and deliver_at must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    INSERT INTO delayed_messages (owner, message_id, deliver_at, exchange, routing_key,
        properties, body)
    VALUES (api_owner(), new_id, schedule_delayed.deliver_at, schedule_delayed.exchange,
        schedule_delayed.routing_key, api_properties(schedule_delayed.properties, new_id),
        schedule_delayed.body)
    ON CONFLICT (owner, message_id) DO NOTHING;
    RETURN new_id;
END
$$;

-- The transactional outbox: delivered as soon as the caller's transaction commits,
-- never if it rolls back.
CREATE OR REPLACE FUNCTION publish_at_commit(
    exchange text,
    routing_key text,
    body bytea,
    properties jsonb DEFAULT '{}',
    message_id text DEFAULT NULL
) RETURNS text
LANGUAGE sql SECURITY DEFINER AS $$
    SELECT schedule_delayed(exchange, routing_key, body, now(), properties, message_id)
$$;

-- true: cancelled before delivery; false: delivered already, or unknown.
CREATE OR REPLACE FUNCTION cancel_delayed(message_id text, owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_acting_owner(cancel_delayed.owner);
BEGIN
    DELETE FROM delayed_messages AS m
        WHERE m.owner = acting
          AND m.message_id = cancel_delayed.message_id;
    RETURN FOUND;
END
$$;

CREATE OR REPLACE FUNCTION reschedule_delayed(message_id text, deliver_at timestamptz,
    owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_acting_owner(reschedule_delayed.owner);
BEGIN
    IF reschedule_delayed.deliver_at IS NULL THEN
        RAISE EXCEPTION 'deliver_at must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE delayed_messages AS m SET deliver_at = reschedule_delayed.deliver_at,
        retry_at = CASE WHEN m.retry_at = 'infinity' THEN m.retry_at END
        WHERE m.owner = acting
          AND m.message_id = reschedule_delayed.message_id;
    RETURN FOUND;
END
$$;

-- A held message (bad input, an exchange not allowed, or delivered but not deletable)
-- is judged again and delivered now if it may be. One stored without its body cannot.
CREATE OR REPLACE FUNCTION release_delayed(message_id text, owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_acting_owner(release_delayed.owner);
BEGIN
    IF EXISTS (SELECT 1 FROM delayed_messages AS m WHERE m.owner = acting
               AND m.message_id = release_delayed.message_id AND m.body_dropped) THEN
        RAISE EXCEPTION 'delayed message % was stored without its body (larger than delay.max_body): it cannot be delivered; cancel it',
            quote_literal(release_delayed.message_id) USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    UPDATE delayed_messages AS m SET retry_at = NULL
        WHERE m.owner = acting AND m.message_id = release_delayed.message_id
          AND m.retry_at = 'infinity';
    RETURN FOUND;
END
$$;

CREATE OR REPLACE FUNCTION retry_delayed(message_id text, owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_acting_owner(retry_delayed.owner);
BEGIN
    UPDATE delayed_messages AS m SET retry_at = NULL
        WHERE m.owner = acting
          AND m.message_id = retry_delayed.message_id
          AND m.retry_at IS NOT NULL AND m.retry_at <> 'infinity';
    RETURN FOUND;
END
$$;

-- Pin search_path, revoke from PUBLIC, grant to <schema>_api.
DO $$
DECLARE
    f regprocedure;
    api text := left(current_schema(), 59) || '_api';
    helpers regprocedure[] := ARRAY[
        'api_owner()'::regprocedure,
        'api_acting_owner(text)'::regprocedure,
        'api_traceparent(text)'::regprocedure,
        'api_properties(jsonb, text)'::regprocedure];
    functions regprocedure[] := ARRAY[
        'api_version()'::regprocedure,
        'expect(text, text, text, timestamptz, text, jsonb, text, text, uuid)'::regprocedure,
        'cancel_expectation(uuid)'::regprocedure,
        'cancel_expectations(text, text)'::regprocedure,
        'reschedule_expectation(uuid, timestamptz)'::regprocedure,
        'release_expectation(uuid)'::regprocedure,
        'retry_expectation(uuid)'::regprocedure,
        'schedule_delayed(text, text, bytea, timestamptz, jsonb, text)'::regprocedure,
        'publish_at_commit(text, text, bytea, jsonb, text)'::regprocedure,
        'cancel_delayed(text, text)'::regprocedure,
        'reschedule_delayed(text, timestamptz, text)'::regprocedure,
        'release_delayed(text, text)'::regprocedure,
        'retry_delayed(text, text)'::regprocedure];
    grantable boolean := false;
BEGIN
    FOREACH f IN ARRAY helpers || functions LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = api) THEN
        grantable := true;
    ELSE
        BEGIN
            EXECUTE format('CREATE ROLE %I NOLOGIN', api);
            grantable := true;
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'role % not created (the migrating role may not create roles): grant EXECUTE on the API functions yourself (docs/integrating/sql-api.md)', api;
        END;
    END IF;
    IF grantable THEN
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), api);
        FOREACH f IN ARRAY functions LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, api);
        END LOOP;
    END IF;
END
$$;
