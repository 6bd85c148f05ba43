"""The client-facing side: listener, request bodies, response writing and the request record."""
