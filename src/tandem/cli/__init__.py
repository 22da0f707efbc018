"""The `tandem` command line."""
