// The Go (pgx v5) example of docs/integrating/languages.md: the code between the
// `docs:` markers is the doc's, character for character (tests/recipes/run.py checks
// it); ../main.go runs it against a real timeoutd (the sql-api-go recipe, not in CI).

// docs: begin go
package orders

import (
	"context"
	"encoding/json"
	"strconv"

	"github.com/jackc/pgx/v5"
)

// The role's search_path holds timeoutd's schema (see "The role" above): the functions
// are called by name. Each takes the caller's transaction.
var (
	OrdersExchange     = "orders"          // delay.target_exchange or delay.allowed_exchanges
	TimeoutsExchange   = "orders.timeouts" // TimeOuts: an exchange timeouts.allowed_exchanges allows
	TimeoutsRoutingKey = "payment.timeout" // bound there to the process manager's queue
	PaymentTimeout     = "30 minutes"      // a Postgres interval
)

// ExpectTimeout starts waiting: the TimeOut (message_id = the returned id) goes to
// exchange/routingKey after timeout (a Postgres interval) from now, unless cancelled
// first.
func ExpectTimeout(ctx context.Context, tx pgx.Tx, processID, messageType, exchange,
	routingKey, timeout string, payload any, traceparent *string) (string, error) {
	p, err := json.Marshal(payload)
	if err != nil {
		return "", err
	}
	var id string
	err = tx.QueryRow(ctx, `SELECT expect(process_id => $1, message_type => $2,
		exchange => $3, routing_key => $4, timeout_at => now() + $5::interval,
		payload => $6::jsonb, traceparent => $7)::text`,
		processID, messageType, exchange, routingKey, timeout, string(p), traceparent).Scan(&id)
	return id, err
}

// CancelTimeout stops waiting. true: cancelled in time; false: it fired already.
func CancelTimeout(ctx context.Context, tx pgx.Tx, expectationID string) (bool, error) {
	var done bool
	err := tx.QueryRow(ctx, "SELECT cancel_expectation($1::uuid)", expectationID).Scan(&done)
	return done, err
}

// PublishAtCommit is the transactional outbox: published when the transaction commits,
// never if it rolls back. Returns the message_id.
func PublishAtCommit(ctx context.Context, tx pgx.Tx, exchange, routingKey string,
	body []byte, headers map[string]any) (string, error) {
	if headers == nil {
		headers = map[string]any{} // null is refused: no headers is {}
	}
	props, err := json.Marshal(map[string]any{"content_type": "application/json", "headers": headers})
	if err != nil {
		return "", err
	}
	var id string
	err = tx.QueryRow(ctx, "SELECT publish_at_commit($1, $2, $3, $4::jsonb)",
		exchange, routingKey, body, string(props)).Scan(&id)
	return id, err
}

// Beginner is a *pgx.Conn or a *pgxpool.Pool.
type Beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// PlaceOrder is an application transaction: its own writes, an expectation and an
// outbox message commit together or not at all. Returns the expectation's id.
func PlaceOrder(ctx context.Context, db Beginner, orderID int, traceparent *string) (string, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(ctx) // a no-op after Commit
	// ... the application's own writes, on tx
	body, _ := json.Marshal(map[string]int{"order": orderID})
	id, err := ExpectTimeout(ctx, tx, "order-"+strconv.Itoa(orderID), "PaymentReceived",
		TimeoutsExchange, TimeoutsRoutingKey, PaymentTimeout, map[string]int{"order": orderID},
		traceparent)
	if err != nil {
		return "", err
	}
	headers := map[string]any{}
	if traceparent != nil {
		headers["traceparent"] = *traceparent
	}
	if _, err := PublishAtCommit(ctx, tx, OrdersExchange, "orders.placed", body, headers); err != nil {
		return "", err
	}
	return id, tx.Commit(ctx)
}

// docs: end
