"""Several proxy processes on one port: the supervisor and its workers (`server.workers`)."""
