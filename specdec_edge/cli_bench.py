"""`bench`: speculative vs plain decoding per task category (being written)."""

import click


@click.command()
def bench():
    """Benchmark methods against plain decoding (being written)."""
    raise click.UsageError("bench is not available yet")
