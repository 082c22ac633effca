/// Server confirmation that the exchange has been declared.
