"""The `ampkit` command: `main` parses the subcommand, `args` checks flags, one module per subcommand."""
