/// Acknowledgement of a `connection.close` request; the TCP connection may now be closed.
