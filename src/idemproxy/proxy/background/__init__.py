"""Work that outlives a request: late store writes, takeovers and the sweeper (SPEC §3.5, §11)."""
