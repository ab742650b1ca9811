"""The ``quantship`` command line: one module per subcommand, heavy imports inside commands."""
