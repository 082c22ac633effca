/// Server confirmation that the transaction has been rolled back.
