/// Client request to open a virtual host, completing the connection handshake.
