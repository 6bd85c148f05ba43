"""Storage: one interface (`base.Store`), real implementations chosen by DSN (`factory`)."""
