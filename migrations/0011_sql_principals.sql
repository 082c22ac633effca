-- SQL roles are principals (docs/integrating/sql-api.md, SECURITY.md): a role granted
-- the API acts on its own expectations only, and everything it makes timeoutd publish
-- obeys the destination rule and the bounds the daemons are configured with.
--
-- Rolling upgrade: safe. Earlier nodes fire rows with an owner as before; they do not
-- judge a TimeOut's exchange at firing (nodes of this version do) and do not write
-- api_rules (the SQL door then keeps the defaults below until a node of this version
-- starts).

-- Expectations have owners: 'sql:' || the login role that wrote the row (through the
-- API or, for a role granted the table, directly). Rows written before have the owner
-- '' and stay open to every API caller, as they were; an operator gives them an owner
-- with UPDATE expected_messages SET owner = 'sql:<role>' WHERE owner = '' AND ...
ALTER TABLE expected_messages ADD COLUMN IF NOT EXISTS owner text NOT NULL DEFAULT '';
ALTER TABLE expected_messages ALTER COLUMN owner SET DEFAULT 'sql:' || session_user;

-- Idempotency keys are each owner's own.
CREATE UNIQUE INDEX IF NOT EXISTS expected_messages_owner_idempotency_key_key
    ON expected_messages (owner, idempotency_key) WHERE idempotency_key IS NOT NULL;
DROP INDEX IF EXISTS expected_messages_idempotency_key_key;

-- What the daemons allow, as they last wrote it from their settings (one row; each
-- node writes it at start when it differs). Exchanges are POSIX regular expressions
-- made from the configured glob patterns.
CREATE TABLE IF NOT EXISTS api_rules (
    one                    boolean     PRIMARY KEY DEFAULT true CHECK (one),
    -- timeouts.allowed_exchanges
    timeout_exchanges      text        NOT NULL,
    -- Names refused by default that timeouts.allowed_exchanges lists exactly ('' or amq.*).
    timeout_explicit       text[]      NOT NULL,
    -- delay.target_exchange and delay.allowed_exchanges
    delayed_exchanges      text        NOT NULL,
    -- The announcement exchange and every group's ingress exchange.
    never_exchanges        text        NOT NULL,
    max_body               bigint      NOT NULL,
    max_delay              interval    NOT NULL,
    max_pending_per_owner  bigint      NOT NULL,
    max_bytes_per_owner    bigint      NOT NULL,
    -- Properties as stored (JSON text), and their headers.
    max_properties         integer     NOT NULL,
    max_headers            integer     NOT NULL,
    written_at             timestamptz NULL,
    written_by             text        NULL
);

-- The defaults of config/default.toml.
INSERT INTO api_rules (timeout_exchanges, timeout_explicit, delayed_exchanges,
    never_exchanges, max_body, max_delay, max_pending_per_owner, max_bytes_per_owner,
    max_properties, max_headers)
VALUES ('^.*$', '{}', '^timeoutd\.delayed$',
    '^timeoutd\.announcements$|^timeoutd\.delay\..*$', 16777216,
    interval '4294967295 milliseconds', 1000000, 1073741824, 65536, 256)
ON CONFLICT (one) DO NOTHING;

-- May the caller act on rows that are not its own (an operator, the daemons' role)?
CREATE OR REPLACE FUNCTION api_acts_for_others(tbl regclass) RETURNS boolean
LANGUAGE sql STABLE AS $$ SELECT has_table_privilege(session_user, tbl, 'DELETE') $$;

-- The owner an expectation function acts for: the caller's own (NULL or its own
-- name), another's only for a caller that acts for others; NULL: every owner (a caller
-- that acts for others and named none).
CREATE OR REPLACE FUNCTION api_expectation_owner(owner text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
BEGIN
    IF owner IS NULL AND api_acts_for_others('expected_messages') THEN
        RETURN NULL;
    END IF;
    IF owner IS NULL OR owner = api_owner() THEN
        RETURN api_owner();
    END IF;
    IF NOT api_acts_for_others('expected_messages') THEN
        RAISE EXCEPTION 'role % may act only on its own expectations (owner %)',
            session_user, api_owner()
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN owner;
END
$$;

-- The one destination rule, at the SQL door (the daemons judge it again at firing):
-- never the default exchange, amq.*, the announcement exchange or an ingress exchange
-- (for TimeOuts, unless timeouts.allowed_exchanges names it exactly: '' or amq.*), and
-- otherwise only what the kind's setting allows.
CREATE OR REPLACE FUNCTION api_destination(kind text, exchange text) RETURNS text
LANGUAGE plpgsql STABLE AS $$
DECLARE
    r api_rules;
    why text;
BEGIN
    SELECT * INTO r FROM api_rules;
    IF exchange IS NULL THEN
        RAISE EXCEPTION 'exchange must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    IF exchange ~ r.never_exchanges THEN
        why := 'the announcement exchange or an ingress exchange';
    ELSIF kind = 'expectation' AND exchange = ANY (r.timeout_explicit) THEN
        RETURN exchange;
    ELSIF exchange = '' THEN
        why := 'the default exchange reaches every queue by name';
    ELSIF exchange LIKE 'amq.%' THEN
        why := 'amq.* exchanges are the broker''s';
    END IF;
    IF why IS NOT NULL THEN
        RAISE EXCEPTION 'exchange % never receives % messages (%)', quote_literal(exchange),
            CASE kind WHEN 'expectation' THEN 'TimeOut' ELSE 'delayed' END, why
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF kind = 'expectation' AND exchange !~ r.timeout_exchanges THEN
        RAISE EXCEPTION 'exchange % matches no timeouts.allowed_exchanges', quote_literal(exchange)
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF kind = 'delayed' AND exchange !~ r.delayed_exchanges THEN
        RAISE EXCEPTION 'exchange % is not delay.target_exchange and matches no delay.allowed_exchanges',
            quote_literal(exchange) USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN exchange;
END
$$;

-- Folds owners' ledger rows into one each; rows another fold holds are skipped, never
-- waited for. The ingest and the SQL door call it, as the schema owner: no role needs
-- a right on the ledger.
CREATE OR REPLACE FUNCTION delayed_usage_fold(owners text[]) RETURNS void
LANGUAGE sql SECURITY DEFINER AS $$
    WITH gone AS (DELETE FROM delayed_usage WHERE ctid = ANY (ARRAY(SELECT ctid FROM delayed_usage
        WHERE owner = ANY (owners) FOR UPDATE SKIP LOCKED)) RETURNING owner, messages, bytes)
    INSERT INTO delayed_usage (owner, messages, bytes)
    SELECT owner, sum(messages), sum(bytes) FROM gone GROUP BY owner
$$;

-- The ledger is kept by its triggers with the schema owner's rights: a role that writes
-- delayed_messages directly needs no right on delayed_usage (and should hold none).
ALTER FUNCTION delayed_usage_count() SECURITY DEFINER;
ALTER FUNCTION delayed_usage_truncate() SECURITY DEFINER;

-- A delayed message written through the API, within every bound the ingress applies:
-- refused here with a clear SQLSTATE (see docs/integrating/sql-api.md) rather than
-- stored held. Returns the stored properties. Folds the owner's ledger when it is long,
-- as the ingest does for its owners.
CREATE OR REPLACE FUNCTION api_admit_delayed(exchange text, body bytea, deliver_at timestamptz,
    properties jsonb, message_id text) RETURNS jsonb
LANGUAGE plpgsql AS $$
DECLARE
    r api_rules;
    stored jsonb;
    used_messages bigint;
    used_bytes bigint;
    ledger_rows bigint;
    size bigint;
BEGIN
    SELECT * INTO r FROM api_rules;
    PERFORM api_destination('delayed', exchange);
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
    SELECT coalesce(sum(u.messages), 0), coalesce(sum(u.bytes), 0), count(*)
        INTO used_messages, used_bytes, ledger_rows
        FROM delayed_usage AS u WHERE u.owner = api_owner();
    size := octet_length(body) + pg_column_size(stored);
    IF used_messages + 1 > r.max_pending_per_owner
       OR used_bytes + size > r.max_bytes_per_owner THEN
        RAISE EXCEPTION 'owner % has % messages of % bytes stored: one more of % bytes is over delay.max_pending_per_owner (%) or delay.max_bytes_per_owner (% bytes)',
            api_owner(), used_messages, used_bytes, size, r.max_pending_per_owner, r.max_bytes_per_owner
            USING ERRCODE = 'configuration_limit_exceeded';
    END IF;
    IF ledger_rows > 32 THEN
        PERFORM delayed_usage_fold(ARRAY[api_owner()]);
    END IF;
    RETURN stored;
END
$$;

-- The ledger read above as a plain index scan, which marks the entries of rows a fold
-- deleted as dead; a bitmap scan, which the planner prefers, walks them all every time
-- (measured: 1.7 ms a call after 8,000 calls, against 0.3 ms).
ALTER FUNCTION api_admit_delayed(text, bytea, timestamptz, jsonb, text)
    SET enable_bitmapscan = off;

-- Expect a message: the TimeOut fires at timeout_at unless the row is cancelled first.
-- With an idempotency_key, a second call by the same owner with the same key while the
-- first is pending changes nothing and returns the same id. id: the expectation's id
-- (the TimeOut's message_id), when the caller chose it; a new uuid by default. Ids are
-- one namespace across owners: a chosen id in use raises 23505, whoever's it is.
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
    PERFORM api_destination('expectation', expect.exchange);
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

-- The expectation functions gain an owner (last, with a default): a role acts on its
-- own rows (and on rows written before owners, owner ''), on another owner's only when
-- it acts for others. Another owner's row answers as a row that never existed.
DROP FUNCTION IF EXISTS cancel_expectation(uuid);
DROP FUNCTION IF EXISTS cancel_expectations(text, text);
DROP FUNCTION IF EXISTS reschedule_expectation(uuid, timestamptz);
DROP FUNCTION IF EXISTS release_expectation(uuid);
DROP FUNCTION IF EXISTS retry_expectation(uuid);

-- true: cancelled in time; false: its TimeOut fired already (or it never existed). A row
-- being fired at this moment is waited for, so false is only said once it is gone.
CREATE OR REPLACE FUNCTION cancel_expectation(id uuid, owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_expectation_owner(cancel_expectation.owner);
BEGIN
    DELETE FROM expected_messages AS m WHERE m.id = cancel_expectation.id
        AND (acting IS NULL OR m.owner IN (acting, ''));
    RETURN FOUND;
END
$$;

-- Every pending expectation of a process (of one message type, or all): how many.
CREATE OR REPLACE FUNCTION cancel_expectations(process_id text, message_type text DEFAULT NULL,
    owner text DEFAULT NULL) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_expectation_owner(cancel_expectations.owner);
    n integer;
BEGIN
    DELETE FROM expected_messages AS m
        WHERE m.process_id = cancel_expectations.process_id
          AND (cancel_expectations.message_type IS NULL
               OR m.message_type = cancel_expectations.message_type)
          AND (acting IS NULL OR m.owner IN (acting, ''));
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- A new deadline (later or earlier): a new intent, so the backoff of a failed publish
-- starts over; a parked or held row stays so (see release_expectation).
CREATE OR REPLACE FUNCTION reschedule_expectation(id uuid, timeout_at timestamptz,
    owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_expectation_owner(reschedule_expectation.owner);
BEGIN
    IF reschedule_expectation.timeout_at IS NULL THEN
        RAISE EXCEPTION 'timeout_at must not be null' USING ERRCODE = 'null_value_not_allowed';
    END IF;
    UPDATE expected_messages AS m SET timeout_at = reschedule_expectation.timeout_at,
        retry_at = CASE WHEN m.retry_at = 'infinity' THEN m.retry_at END
        WHERE m.id = reschedule_expectation.id
          AND (acting IS NULL OR m.owner IN (acting, ''));
    RETURN FOUND;
END
$$;

-- A parked or held row fires again now: a second TimeOut for a parked one, by the
-- caller's decision; a held one is judged again (its exchange) at firing. false: not
-- parked or held.
CREATE OR REPLACE FUNCTION release_expectation(id uuid, owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_expectation_owner(release_expectation.owner);
BEGIN
    UPDATE expected_messages AS m SET retry_at = NULL
        WHERE m.id = release_expectation.id AND m.retry_at = 'infinity'
          AND (acting IS NULL OR m.owner IN (acting, ''));
    RETURN FOUND;
END
$$;

-- A row waiting for its next attempt after a failed publish is tried now (never before
-- its timeout_at). false: it was not waiting for a retry.
CREATE OR REPLACE FUNCTION retry_expectation(id uuid, owner text DEFAULT NULL) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER AS $$
DECLARE
    acting text := api_expectation_owner(retry_expectation.owner);
BEGIN
    UPDATE expected_messages AS m SET retry_at = NULL
        WHERE m.id = retry_expectation.id AND m.retry_at IS NOT NULL
          AND m.retry_at <> 'infinity'
          AND (acting IS NULL OR m.owner IN (acting, ''));
    RETURN FOUND;
END
$$;

-- Deliver a message at deliver_at, to an exchange the daemons allow for delayed
-- messages, within their bounds (refused otherwise). Returns its message_id (given,
-- from properties, or a new uuid); a second call with a message_id the caller has
-- pending changes nothing.
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
        api_admit_delayed(schedule_delayed.exchange, schedule_delayed.body,
            schedule_delayed.deliver_at, schedule_delayed.properties, new_id),
        schedule_delayed.body)
    ON CONFLICT (owner, message_id) DO NOTHING;
    RETURN new_id;
END
$$;

-- The role <schema>_api (63 bytes at most: a longer schema name is shortened with a
-- hash, so two schemas never share it) is this schema's only if it says so: a role of
-- that name that another schema marked, or that can log in or act as more than a
-- group, is refused rather than granted the API.
CREATE OR REPLACE FUNCTION api_role() RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT CASE WHEN octet_length(current_schema()) <= 59 THEN current_schema() || '_api'
           ELSE left(current_schema(), 50) || '_' || left(md5(current_schema()), 8) || '_api' END
$$;

-- Pin search_path, revoke from PUBLIC, grant to <schema>_api.
DO $$
DECLARE
    f regprocedure;
    api text := api_role();
    mark text := 'timeoutd SQL API of schema ' || current_schema();
    found pg_roles;
    helpers regprocedure[] := ARRAY[
        'api_acts_for_others(regclass)'::regprocedure,
        'api_expectation_owner(text)'::regprocedure,
        'api_destination(text, text)'::regprocedure,
        'api_admit_delayed(text, bytea, timestamptz, jsonb, text)'::regprocedure,
        'api_role()'::regprocedure];
    functions regprocedure[] := ARRAY[
        'api_version()'::regprocedure,
        'expect(text, text, text, timestamptz, text, jsonb, text, text, uuid)'::regprocedure,
        'cancel_expectation(uuid, text)'::regprocedure,
        'cancel_expectations(text, text, text)'::regprocedure,
        'reschedule_expectation(uuid, timestamptz, text)'::regprocedure,
        'release_expectation(uuid, text)'::regprocedure,
        'retry_expectation(uuid, text)'::regprocedure,
        'schedule_delayed(text, text, bytea, timestamptz, jsonb, text)'::regprocedure,
        'publish_at_commit(text, text, bytea, jsonb, text)'::regprocedure,
        'cancel_delayed(text, text)'::regprocedure,
        'reschedule_delayed(text, timestamptz, text)'::regprocedure,
        'release_delayed(text, text)'::regprocedure,
        'retry_delayed(text, text)'::regprocedure];
    grantable boolean := false;
BEGIN
    -- The helpers run only inside the API's functions, whose search_path is pinned:
    -- without a SET of their own they cost no settings switch per call, and the SQL ones
    -- are inlined.
    FOREACH f IN ARRAY helpers || ARRAY['api_owner()'::regprocedure,
            'api_acting_owner(text)'::regprocedure, 'api_traceparent(text)'::regprocedure,
            'api_properties(jsonb, text)'::regprocedure] LOOP
        EXECUTE format('ALTER FUNCTION %s RESET search_path', f);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    FOREACH f IN ARRAY functions || 'delayed_usage_fold(text[])'::regprocedure LOOP
        EXECUTE format('ALTER FUNCTION %s SET search_path = %I, pg_temp', f, current_schema());
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
    SELECT * INTO found FROM pg_roles WHERE rolname = api;
    IF found.oid IS NOT NULL THEN
        IF coalesce(shobj_description(found.oid, 'pg_authid'), mark) <> mark THEN
            RAISE EXCEPTION 'role % belongs to another schema (%): drop it or use another postgres.schema',
                api, shobj_description(found.oid, 'pg_authid');
        END IF;
        IF found.rolcanlogin OR found.rolsuper OR found.rolcreaterole OR found.rolcreatedb
           OR found.rolbypassrls OR found.rolreplication THEN
            RAISE EXCEPTION 'role % exists and is more than a group role (LOGIN, SUPERUSER, CREATEROLE, CREATEDB, BYPASSRLS or REPLICATION): it is not granted the SQL API; drop it, or make it NOLOGIN NOSUPERUSER NOCREATEROLE NOCREATEDB NOBYPASSRLS NOREPLICATION',
                api;
        END IF;
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
        BEGIN
            EXECUTE format('COMMENT ON ROLE %I IS %L', api, mark);
        EXCEPTION WHEN insufficient_privilege THEN
            RAISE NOTICE 'role % not marked as this schema''s (the migrating role may not comment on roles)', api;
        END;
        EXECUTE format('GRANT USAGE ON SCHEMA %I TO %I', current_schema(), api);
        FOREACH f IN ARRAY functions LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, api);
        END LOOP;
        -- For the daemons' ingest (their role is granted the API): folding changes no
        -- owner's sums, whoever asks.
        EXECUTE format('GRANT EXECUTE ON FUNCTION delayed_usage_fold(text[]) TO %I', api);
    END IF;
END
$$;
