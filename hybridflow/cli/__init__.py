"""The `hf` command-line interface (typer + rich)."""
