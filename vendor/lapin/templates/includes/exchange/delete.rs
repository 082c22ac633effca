/// Delete an exchange
