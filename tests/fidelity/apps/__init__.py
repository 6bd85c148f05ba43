"""Small apps on frameworks nobody on this project wrote, in their production settings: what a
new user puts behind the proxy. Each one appends the `Idempotency-Key` of every request it
executes to its ledger file (`LEDGER`), so that a test counts executions per intent."""
