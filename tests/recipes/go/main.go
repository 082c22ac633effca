// The sql-api-go recipe's driver (tests/recipes/run.py): one order committed (its
// outbox message arrives, its expectation is cancelled in time), one rolled back
// (nothing arrives), through the example code in orders/, printing what run.py judges.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"timeoutd.test/sqlapi/orders"
)

func emit(fields map[string]any) {
	line, _ := json.Marshal(fields)
	fmt.Println(string(line))
}

func now() float64 { return float64(time.Now().UnixNano()) / 1e9 }

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run() error {
	ctx := context.Background()
	orders.OrdersExchange = os.Getenv("OUT_EXCHANGE")
	orders.TimeoutsExchange = os.Getenv("TIMEOUTS_EXCHANGE")
	orders.PaymentTimeout = "3 seconds"
	conn, err := pgx.Connect(ctx, os.Getenv("APP_PG_URL"))
	if err != nil {
		return err
	}
	defer conn.Close(ctx)
	tp := fmt.Sprintf("00-%032x-00f067aa0ba902b7-01", time.Now().UnixNano())
	begun := now()
	id, err := orders.PlaceOrder(ctx, conn, 8001, &tp)
	if err != nil {
		return err
	}
	emit(map[string]any{"event": "fires-body", "kind": "outbox", "what": "outbox order-8001",
		"body": map[string]int{"order": 8001}, "not_before": begun, "committed": now(),
		"traceparent": tp})
	tx, err := conn.Begin(ctx)
	if err != nil {
		return err
	}
	cancelled, err := orders.CancelTimeout(ctx, tx, id)
	if err != nil {
		return err
	}
	if err := tx.Commit(ctx); err != nil {
		return err
	}
	emit(map[string]any{"event": "returned", "what": "cancel_expectation in time", "got": cancelled, "want": true})
	emit(map[string]any{"event": "never", "id": id, "what": "cancelled expectation"})
	tx, err = conn.Begin(ctx)
	if err != nil {
		return err
	}
	rolled, err := orders.ExpectTimeout(ctx, tx, "order-8002", "PaymentReceived",
		orders.TimeoutsExchange, orders.TimeoutsRoutingKey, "1 second", nil, nil)
	if err != nil {
		return err
	}
	message, err := orders.PublishAtCommit(ctx, tx, orders.OrdersExchange, "orders.placed",
		[]byte(`{"order": 8002}`), nil)
	if err != nil {
		return err
	}
	if err := tx.Rollback(ctx); err != nil {
		return err
	}
	emit(map[string]any{"event": "never", "id": rolled, "what": "rolled-back expectation order-8002"})
	emit(map[string]any{"event": "never", "id": message, "what": "rolled-back outbox order-8002"})
	emit(map[string]any{"event": "done"})
	return nil
}
