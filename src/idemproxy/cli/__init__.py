"""The command line: `idemproxy serve`, the operator commands, the demo (SPEC §12)."""
