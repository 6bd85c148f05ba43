"""The PostgreSQL store (asyncpg) and its connections, change feed and error mapping."""
