"""Display plans: table, JSON and HTML."""
