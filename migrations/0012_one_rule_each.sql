-- Each rule of the SQL door in one place (docs/integrating/sql-api.md):
-- * the destination rule is the daemons' own list of steps, written to api_rules by
--   every node from its settings and walked here as it is walked at firing;
-- * the per-owner quota of delayed messages is delayed_usage_admit(), which the ingest
--   calls too;
-- * expectations are bounded at the door: the payload by timeouts.max_payload, names
--   that travel as AMQP short strings by their 255 bytes. Delayed messages' names too,
--   and a delayed message cannot be rescheduled past delay.max_delay.
--
-- Rolling upgrade: safe. The door refuses (55000) until a node of this version has
-- written the new columns, which `timeoutd migrate` and every node's start do right
-- after migrating. Nodes of the previous version still write the 0011 columns, which
-- nothing reads any more.

ALTER TABLE api_rules ADD COLUMN IF NOT EXISTS destinations jsonb NULL;
ALTER TABLE api_rules ADD COLUMN IF NOT EXISTS max_payload bigint NULL;
ALTER TABLE api_rules ADD COLUMN IF NOT EXISTS max_short integer NULL;
COMMENT ON COLUMN api_rules.destinations IS
    'Per kind (expectation, delayed): the destination rule''s steps in order, each '
    '{pattern: POSIX regular expression, refuse: why not, or null when allowed}';

-- The rules as written by a node of this version, or an error saying to write them.
CREATE OR REPLACE FUNCTION api_rules_written() RETURNS api_rules
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r api_rules;
BEGIN
    SELECT * INTO r FROM api_rules;
    IF r.destinations IS NULL OR r.max_payload IS NULL OR r.max_short IS NULL THEN
        RAISE EXCEPTION 'the SQL API has no rules yet: run timeoutd migrate, or start a node'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    RETURN r;
END
$$;

-- The destination rule, of the rules a caller read: the first step whose pattern
-- matches decides.
DROP FUNCTION IF EXISTS api_destination(text, text);
CREATE OR REPLACE FUNCTION api_destination(rules api_rules, kind text, exchange text)
RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    steps jsonb := rules.destinations -> kind;
    why text;
BEGIN
    IF exchange IS NULL THEN
        RAISE EXCEPTION 'exchange must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    FOR i IN 0 .. coalesce(jsonb_array_length(steps), 0) - 1 LOOP
        IF exchange ~ (steps -> i ->> 'pattern') THEN
            why := steps -> i ->> 'refuse';
            IF why IS NULL THEN
                RETURN exchange;
            END IF;
            RAISE EXCEPTION 'exchange % %', quote_literal(exchange), why
                USING ERRCODE = 'insufficient_privilege';
        END IF;
    END LOOP;
    RAISE EXCEPTION 'exchange % is allowed by no rule', quote_literal(exchange)
        USING ERRCODE = 'insufficient_privilege';
END
$$;

-- Values that travel as AMQP short strings: refused here rather than held at firing.
CREATE OR REPLACE FUNCTION api_short(what text, value text, max_short integer) RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF octet_length(value) > max_short THEN
        RAISE EXCEPTION '% of % bytes is longer than an AMQP short string (% bytes)',
            what, octet_length(value), max_short USING ERRCODE = 'program_limit_exceeded';
    END IF;
END
$$;

-- The per-owner quota of delayed messages: which of these messages (owners[i], of
-- sizes[i] bytes, in order) their owners have room for, the first ones fitting. Folds
-- the ledger of owners it finds long. A caller that does not act for others may ask
-- about itself only. One plain aggregate per owner: a GROUP BY over all of them costs
-- several times more when the batch has one owner, as it mostly has.
CREATE OR REPLACE FUNCTION delayed_usage_admit(owners text[], sizes bigint[],
    max_messages bigint, max_bytes bigint) RETURNS boolean[]
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    u_owner text[] := '{}';
    u_messages bigint[] := '{}';
    u_bytes bigint[] := '{}';
    m bigint;
    b bigint;
    ledger_rows bigint;
    admitted boolean[] := '{}';
    j int;
BEGIN
    IF NOT (owners <@ ARRAY[api_owner()]) AND NOT api_acts_for_others('delayed_messages') THEN
        RAISE EXCEPTION 'role % may ask only about its own delayed messages', session_user
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    FOR i IN 1 .. coalesce(array_length(owners, 1), 0) LOOP
        j := array_position(u_owner, owners[i]);
        IF j IS NULL THEN
            SELECT greatest(coalesce(sum(u.messages), 0), 0), greatest(coalesce(sum(u.bytes), 0), 0),
                   count(*)
                INTO m, b, ledger_rows
                FROM delayed_usage AS u WHERE u.owner = owners[i];
            IF ledger_rows > 32 THEN
                PERFORM delayed_usage_fold(ARRAY[owners[i]]);
            END IF;
            u_owner := u_owner || owners[i];
            u_messages := u_messages || m;
            u_bytes := u_bytes || b;
            j := array_length(u_owner, 1);
        END IF;
        IF u_messages[j] + 1 > max_messages OR u_bytes[j] + sizes[i] > max_bytes THEN
            admitted := admitted || false;
        ELSE
            u_messages[j] := u_messages[j] + 1;
            u_bytes[j] := u_bytes[j] + sizes[i];
            admitted := admitted || true;
        END IF;
    END LOOP;
    RETURN admitted;
END
$$;

-- The ledger read as a plain index scan (see 0011's api_admit_delayed).
ALTER FUNCTION delayed_usage_admit(text[], bigint[], bigint, bigint)
    SET enable_bitmapscan = off;

-- A delayed message written through the API, within every bound the ingress applies
-- (see 0011), its routing key and message id within AMQP short strings. Returns the
-- stored properties.
DROP FUNCTION IF EXISTS api_admit_delayed(text, bytea, timestamptz, jsonb, text);
CREATE OR REPLACE FUNCTION api_admit_delayed(exchange text, routing_key text, body bytea,
    deliver_at timestamptz, properties jsonb, message_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    r api_rules := api_rules_written();
    stored jsonb;
    size bigint;
BEGIN
    PERFORM api_destination(r, 'delayed', exchange);
    PERFORM api_short('routing_key', routing_key, r.max_short);
    PERFORM api_short('message_id', message_id, r.max_short);
    IF octet_length(body) > r.max_body THEN
        RAISE EXCEPTION 'body of % bytes is larger than delay.max_body (% bytes)',
            octet_length(body), r.max_body USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF deliver_at > now() + r.max_delay THEN
        RAISE EXCEPTION 'deliver_at % is later than delay.max_delay (%) allows', deliver_at, r.max_delay
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    -- Before anything is built from them: a bound on what the caller handed over.
    IF octet_length(properties::text) > r.max_properties THEN
        RAISE EXCEPTION 'properties of % bytes are larger than % bytes',
            octet_length(properties::text), r.max_properties USING ERRCODE = 'program_limit_exceeded';
    END IF;
    stored := api_properties(properties, message_id);
    IF jsonb_array_length(coalesce(stored->'headers', '[]')) > r.max_headers THEN
        RAISE EXCEPTION '% headers are more than %', jsonb_array_length(stored->'headers'), r.max_headers
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF octet_length(stored::text) > r.max_properties THEN
        RAISE EXCEPTION 'properties of % bytes as stored are larger than % bytes',
            octet_length(stored::text), r.max_properties USING ERRCODE = 'program_limit_exceeded';
    END IF;
    -- As the ingest counts a message: its body and its properties as JSON text.
    size := octet_length(body) + octet_length(stored::text);
    IF NOT (delayed_usage_admit(ARRAY[api_owner()], ARRAY[size], r.max_pending_per_owner,
            r.max_bytes_per_owner))[1] THEN
        RAISE EXCEPTION 'owner % has no room for one more message of % bytes under delay.max_pending_per_owner (%) and delay.max_bytes_per_owner (% bytes)',
            api_owner(), size, r.max_pending_per_owner, r.max_bytes_per_owner
            USING ERRCODE = 'configuration_limit_exceeded';
    END IF;
    RETURN stored;
END
$$;

-- An expectation written through the API: to an allowed exchange, its names within
-- AMQP short strings, its payload within timeouts.max_payload.
CREATE OR REPLACE FUNCTION api_admit_expectation(exchange text, routing_key text,
    process_id text, message_type text, idempotency_key text, payload jsonb) RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r api_rules := api_rules_written();
BEGIN
    PERFORM api_destination(r, 'expectation', exchange);
    PERFORM api_short('routing_key', routing_key, r.max_short);
    PERFORM api_short('process_id', process_id, r.max_short);
    PERFORM api_short('message_type', message_type, r.max_short);
    PERFORM api_short('idempotency_key', idempotency_key, r.max_short);
    IF octet_length(payload::text) > r.max_payload THEN
        RAISE EXCEPTION 'payload of % bytes is larger than timeouts.max_payload (% bytes)',
            octet_length(payload::text), r.max_payload USING ERRCODE = 'program_limit_exceeded';
    END IF;
END
$$;

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
    me text := api_owner();
BEGIN
    PERFORM api_admit_expectation(expect.exchange, expect.routing_key, expect.process_id,
        expect.message_type, expect.idempotency_key, expect.payload);
    -- Twice at most: a row found by its key may fire (and go) between the two statements.
    FOR attempt IN 1..2 LOOP
        INSERT INTO expected_messages AS m (id, owner, process_id, message_type, timeout_at,
            exchange, routing_key, payload, idempotency_key, traceparent)
        VALUES (coalesce(expect.id, gen_random_uuid()), me, expect.process_id,
            expect.message_type, expect.timeout_at, expect.exchange, expect.routing_key,
            expect.payload, expect.idempotency_key, api_traceparent(expect.traceparent))
        ON CONFLICT (owner, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
        RETURNING m.id INTO new_id;
        IF new_id IS NOT NULL THEN
            RETURN new_id;
        END IF;
        SELECT m.id INTO new_id FROM expected_messages AS m
            WHERE m.owner = me AND m.idempotency_key = expect.idempotency_key;
        IF new_id IS NOT NULL THEN
            RETURN new_id;
        END IF;
    END LOOP;
    RAISE EXCEPTION 'idempotency_key % keeps changing hands', quote_literal(expect.idempotency_key)
        USING ERRCODE = 'serialization_failure';
END
$$;

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
    me text := api_owner();
BEGIN
    IF schedule_delayed.deliver_at IS NULL OR schedule_delayed.body IS NULL
       OR schedule_delayed.exchange IS NULL OR schedule_delayed.routing_key IS NULL THEN
        RAISE EXCEPTION 'exchange, routing_key, body and deliver_at must not be null'
            USING ERRCODE = 'null_value_not_allowed';
    END IF;
    INSERT INTO delayed_messages (owner, message_id, deliver_at, exchange, routing_key,
        properties, body)
    VALUES (me, new_id, schedule_delayed.deliver_at, schedule_delayed.exchange,
        schedule_delayed.routing_key,
        api_admit_delayed(schedule_delayed.exchange, schedule_delayed.routing_key,
            schedule_delayed.body,
            schedule_delayed.deliver_at, schedule_delayed.properties, new_id),
        schedule_delayed.body)
    ON CONFLICT (owner, message_id) DO NOTHING;
    RETURN new_id;
END
$$;

-- Rescheduling keeps within delay.max_delay, as scheduling does.
CREATE OR REPLACE FUNCTION reschedule_delayed(message_id text, deliver_at timestamptz,
    owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_acting_owner(reschedule_delayed.owner);
    r api_rules := api_rules_written();
BEGIN
    IF reschedule_delayed.deliver_at IS NULL THEN
        RAISE EXCEPTION 'deliver_at must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF reschedule_delayed.deliver_at > now() + r.max_delay THEN
        RAISE EXCEPTION 'deliver_at % is later than delay.max_delay (%) allows',
            reschedule_delayed.deliver_at, r.max_delay USING ERRCODE = 'program_limit_exceeded';
    END IF;
    UPDATE delayed_messages AS m SET deliver_at = reschedule_delayed.deliver_at,
        retry_at = CASE WHEN m.retry_at = 'infinity' THEN m.retry_at END
        WHERE m.owner = acting
          AND m.message_id = reschedule_delayed.message_id;
    RETURN FOUND;
END
$$;

-- Replacing a function resets its settings: pin the replaced API functions' search_path
-- again. New helpers run only inside them; the quota is the ingest's too.
DO $$
DECLARE
    f regprocedure;
    api text := api_role();
BEGIN
    FOREACH f IN ARRAY ARRAY[
            'api_rules_written()'::regprocedure,
            'api_destination(api_rules, text, text)'::regprocedure,
            'api_admit_delayed(text, text, bytea, timestamptz, jsonb, text)'::regprocedure,
            'api_short(text, text, integer)'::regprocedure,
            'api_admit_expectation(text, text, text, text, text, jsonb)'::regprocedure] LOOP
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    FOREACH f IN ARRAY ARRAY[
            'expect(text, text, text, timestamptz, text, jsonb, text, text, uuid)'::regprocedure,
            'schedule_delayed(text, text, bytea, timestamptz, jsonb, text)'::regprocedure,
            'reschedule_delayed(text, timestamptz, text)'::regprocedure,
            'delayed_usage_admit(text[], bigint[], bigint, bigint)'::regprocedure] LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    IF EXISTS (SELECT 1 FROM pg_roles WHERE rolname = api) THEN
        EXECUTE format('GRANT EXECUTE ON FUNCTION delayed_usage_admit(text[], bigint[], bigint, bigint) TO %I', api);
    END IF;
END
$$;
