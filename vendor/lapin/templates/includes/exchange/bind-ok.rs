/// Server confirmation that the exchange-to-exchange binding has been created.
